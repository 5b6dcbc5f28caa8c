"""Running compiled plans: bind state, run graphs, write results back.

The runtime runs plans; it never traces (no imports of stepfx.capture).
"""
from .binding import ModuleBinding
from .executor import LocalExecutor

__all__ = ["ModuleBinding", "LocalExecutor"]
