"""run_threaded: rank order, errors and hangs reported like RankPool's, and no state left behind."""
import time

import pytest
import torch
import torch.distributed as dist

from stepfx.testing import RankError, RankTimeout, rank, run_threaded, world_size


def _whoami(tag):
    return (tag, rank(), world_size())


def _unhappy_after_all_reduce(bad):
    dist.all_reduce(torch.ones(1))
    if rank() == bad:
        raise ValueError(f"rank {bad} is unhappy")
    dist.all_reduce(torch.ones(1))   # the others wait here for the failed rank
    return rank()


def _hang_in_all_reduce(skipper):
    if rank() != skipper:
        dist.all_reduce(torch.ones(1))
    return rank()


def test_results_come_back_in_rank_order():
    assert run_threaded(_whoami, 4, "x") == [("x", r, 4) for r in range(4)]


def test_rank_error_names_the_rank_and_frees_the_waiting_ranks():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_threaded(_unhappy_after_all_reduce, 3, 1, timeout=30.0)
    assert time.monotonic() - start < 5.0, "the waiting ranks were not woken up"
    err = info.value
    assert type(err) is RankError
    assert "rank 1 raised ValueError: rank 1 is unhappy" in str(err)
    assert "in _unhappy_after_all_reduce" in str(err)
    assert {f.rank: f.kind for f in err.failures} == {0: "aborted", 1: "raised", 2: "aborted"}
    assert run_threaded(_whoami, 2, "after") == [("after", 0, 2), ("after", 1, 2)]


def test_hung_collective_times_out_and_names_the_rank():
    with pytest.raises(RankTimeout) as info:
        run_threaded(_hang_in_all_reduce, 2, 0, timeout=0.5)
    err = info.value
    assert err.ranks == [1]
    assert "did not finish: in all_reduce" in str(err)
    assert "_hang_in_all_reduce" in err.failures[0].traceback
    assert run_threaded(_whoami, 2, "after") == [("after", 0, 2), ("after", 1, 2)]


def test_leaves_no_process_group_behind():
    run_threaded(_whoami, 2, "x")
    assert not dist.is_initialized()


def test_is_not_reentrant():
    with pytest.raises(RankError, match="cannot be called from inside run_threaded"):
        run_threaded(run_threaded, 2, _whoami, 2, "inner")
