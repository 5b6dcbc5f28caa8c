"""Public testing helpers: run code on several local ranks, and check that a
stepfx step equals the eager step.

- `assert_step_equivalent(...)`: the central property, for any model and
  optimizer: outputs and all state after every step, within stated
  tolerances (bitwise with ``exact=True``).
- `RankPool(world_size)`: real rank processes (gloo or NCCL), started once and
  reused by every `pool.run(fn, ...)`; ~2 s to start, milliseconds per run.
- `run_threaded(fn, world_size)`: ranks as threads of this process with
  torch's threaded process group; milliseconds per call, for unit tests.
- `rank()`, `world_size()`, `seed_all(seed)`: helpers for code running on a rank.
- `bisect_divergence(...)`: when a step departs from the eager one, the
  first pass whose program computes something else, and the first node in it
  (stepfx/report/bisect.py).
- The pytest plugin `stepfx.testing.pytest_plugin` provides a session-scoped
  `rank_pool(world_size, backend="gloo")` fixture that shares pools across tests.

Both runners raise `RankError` (or its subclass `RankTimeout`) naming each
failing rank with its exception, remote traceback and output.
"""
from stepfx.testing.equivalence import (
    EquivalenceReport,
    assert_data_parallel_equivalent,
    assert_step_equivalent,
    compare_tensors,
    data_parallel_reference,
)
from stepfx.testing.errors import RankError, RankFailure, RankTimeout
from stepfx.testing.ranks import (
    RankPool,
    rank,
    seed_all,
    torchrun_env,
    world_size,
)
from stepfx.testing.threaded import run_threaded

__all__ = [
    "assert_step_equivalent",
    "bisect_divergence",
    "assert_data_parallel_equivalent",
    "data_parallel_reference",
    "EquivalenceReport",
    "compare_tensors",
    "RankError",
    "RankFailure",
    "RankPool",
    "RankTimeout",
    "rank",
    "run_threaded",
    "seed_all",
    "torchrun_env",
    "world_size",
]


def bisect_divergence(*args, **kwargs):
    """``stepfx.report.bisect_divergence`` (imported when called: the report
    package is not loaded with the test helpers)."""
    from stepfx.report.bisect import bisect_divergence as bisect

    return bisect(*args, **kwargs)
