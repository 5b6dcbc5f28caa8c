"""Running compiled plans: bind state, run graphs, write results back,
and keep data-parallel ranks in step.

The runtime runs plans; it never traces (no imports of stepfx.capture).
"""
from .binding import ModuleBinding, RankStore
from .distributed import DataParallel, RankMismatchError, collective_fingerprint, data_parallel, preflight
from .executor import LocalExecutor
from .graphs import PoolHolder
from .tp_state import gather_tensor_parallel
from .zero_state import gather_sharded_params, gather_sharded_state

__all__ = [
    "ModuleBinding",
    "RankStore",
    "LocalExecutor",
    "PoolHolder",
    "DataParallel",
    "RankMismatchError",
    "data_parallel",
    "collective_fingerprint",
    "preflight",
    "gather_sharded_params",
    "gather_tensor_parallel",
    "gather_sharded_state",
]
