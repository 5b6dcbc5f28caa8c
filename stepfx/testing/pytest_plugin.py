"""pytest plugin: a session-scoped `rank_pool` fixture that shares rank processes across tests.

Load it from a conftest.py with `pytest_plugins = ["stepfx.testing.pytest_plugin"]`.

    def test_sum(rank_pool):
        assert rank_pool(2).run(all_reduce_rank) == [1, 1]

Each (world_size, backend) pool starts on first use and is closed when the
session ends; a pool whose run failed restarts its ranks by itself. Pools
use the "forkserver" start method: the first pays ~1.2 s to start a fork
server that has imported torch, every later start or restart 0.03-0.07 s
(against 1.5-3 s each with "spawn"), which keeps tests of failures cheap.
"""
from __future__ import annotations

from typing import Callable, Iterator

import pytest

from stepfx.testing.ranks import RankPool


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[Callable[..., RankPool]]:
    """Factory `rank_pool(world_size, backend="gloo") -> RankPool`, one pool per argument pair per session."""
    pools: dict[tuple[int, str], RankPool] = {}

    def get(world_size: int, backend: str = "gloo") -> RankPool:
        key = (world_size, backend)
        if key not in pools:
            pools[key] = RankPool(world_size, backend=backend, start_method="forkserver")
        return pools[key]

    yield get
    for pool in pools.values():
        pool.close()
