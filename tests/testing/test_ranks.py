"""RankPool: reuse, rank order, errors, timeouts, output capture, torchrun's environment."""
import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from stepfx.testing import RankError, RankPool, RankTimeout, rank, seed_all, world_size

TORCHRUN_KEYS = [   # what torchrun sets for its workers (checked against torchrun itself below)
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
]


def _whoami():
    return {"rank": rank(), "world_size": world_size(), "pid": os.getpid(),
            "threads": torch.get_num_threads(), "backend": dist.get_backend()}


def _env():
    return {k: os.environ.get(k) for k in TORCHRUN_KEYS}


def _unhappy_rank(bad: int):
    print(f"rank {rank()} says hello")
    if rank() == bad:
        raise ValueError(f"rank {bad} is unhappy")
    return rank()


def _hang_in_all_reduce(skipper: int):
    if rank() != skipper:   # the skipper never joins, so this all_reduce never completes
        dist.all_reduce(torch.ones(1))
    return rank()


def _unhappy_after_all_reduce(bad: int):
    dist.all_reduce(torch.ones(1))
    if rank() == bad:
        raise ValueError(f"rank {bad} is unhappy")
    dist.all_reduce(torch.ones(1))   # the others wait here for the failed rank
    return rank()


def _exit_abruptly(bad: int):
    if rank() == bad:
        os._exit(7)
    return rank()


def _crash_in_a_thread_among_many(bad: int):
    if rank() == bad:
        import ctypes
        import threading

        def crashing_frame_of_the_test():
            ctypes.string_at(0)   # SIGSEGV: faulthandler dumps this thread first, then the others

        stop = threading.Event()
        for _ in range(60):   # their stacks follow the crashed thread's in the dump, more than an error quotes
            threading.Thread(target=stop.wait, daemon=True).start()
        threading.Thread(target=crashing_frame_of_the_test).start()
        stop.wait(30)
    return rank()


def _chatty():
    print("chatty rank output on stdout")
    print("chatty rank output on stderr", file=sys.stderr)
    return rank()


def _non_leaf_tensor():
    x = torch.ones(2, requires_grad=True)
    return x * (rank() + 1)


def test_results_come_back_in_rank_order(rank_pool):
    results = rank_pool(4).run(_whoami)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert {r["world_size"] for r in results} == {4}
    assert {r["backend"] for r in results} == {"gloo"}
    assert {r["threads"] for r in results} == {1}


def test_pool_is_reused_across_runs(rank_pool):
    pool = rank_pool(2)
    assert rank_pool(2) is pool and rank_pool(4) is not pool
    first = [r["pid"] for r in pool.run(_whoami)]
    second = [r["pid"] for r in pool.run(_whoami)]
    assert first == second
    assert len(set(first)) == 2 and os.getpid() not in first


def test_rank_error_names_the_rank_and_the_pool_recovers(rank_pool):
    pool = rank_pool(2)
    before = [r["pid"] for r in pool.run(_whoami)]
    with pytest.raises(RankError) as info:
        pool.run(_unhappy_rank, 1)
    err = info.value
    assert type(err) is RankError and err.ranks == [1]
    text = str(err)
    assert "rank 1 raised ValueError: rank 1 is unhappy" in text
    assert "in _unhappy_rank" in text                # the remote traceback
    assert "rank 1 says hello" in text               # the rank's output
    assert "rank 0 says hello" in err.outputs[0]
    after = pool.run(_whoami)                        # restarted, not reused
    assert [r["rank"] for r in after] == [0, 1]
    assert {r["pid"] for r in after}.isdisjoint(before)


def test_hung_collective_times_out_and_the_pool_recovers(rank_pool):
    pool = rank_pool(2)
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        pool.run(_hang_in_all_reduce, 0, timeout=3.0)
    elapsed = time.monotonic() - start
    assert elapsed < 3.0 + 3.0, f"took {elapsed:.1f} s to give up"
    err = info.value
    assert err.ranks == [1]
    assert "rank 0 finished" in str(err)
    assert "rank 1 did not finish: in all_reduce" in str(err)
    assert "_hang_in_all_reduce" in err.failures[0].traceback
    assert [r["rank"] for r in pool.run(_whoami)] == [0, 1]


def test_ranks_stuck_waiting_for_a_failed_rank_are_given_up_after_the_grace():
    with RankPool(2, start_method="forkserver", failure_grace=1.0) as pool:
        start = time.monotonic()
        with pytest.raises(RankError) as info:
            pool.run(_unhappy_after_all_reduce, 1, timeout=60.0)
        assert time.monotonic() - start < 1.0 + 3.0
        err = info.value
        assert type(err) is RankError
        assert {f.rank: f.kind for f in err.failures} == {0: "unfinished", 1: "raised"}
        assert "rank 0 did not finish: in all_reduce" in str(err)
        assert pool.run(rank) == [0, 1]


def test_a_dying_rank_is_reported_with_its_exit_code(rank_pool):
    pool = rank_pool(2)
    with pytest.raises(RankError) as info:
        pool.run(_exit_abruptly, 1)
    assert info.value.ranks == [1]
    assert "rank 1 died: the rank process exited (exit code 7)" in str(info.value)
    assert pool.run(rank) == [0, 1]


def test_a_crashed_rank_quotes_the_thread_that_crashed(rank_pool):
    pool = rank_pool(2)
    with pytest.raises(RankError) as info:
        pool.run(_crash_in_a_thread_among_many, 1)
    text = str(info.value)
    assert "rank 1 died: the rank process exited (killed by SIGSEGV)" in text
    assert "-- the crash on rank 1 --" in text
    assert "crashing_frame_of_the_test" in text
    assert pool.run(rank) == [0, 1]


def test_unpicklable_fn_is_refused_before_reaching_the_ranks(rank_pool):
    pool = rank_pool(2)
    pids = [r["pid"] for r in pool.run(_whoami)]
    with pytest.raises(TypeError, match="module-level function"):
        pool.run(lambda: 0)
    assert [r["pid"] for r in pool.run(_whoami)] == pids


def test_tensors_come_back_detached(rank_pool):
    results = rank_pool(2).run(_non_leaf_tensor)
    for r, t in enumerate(results):
        assert not t.requires_grad
        torch.testing.assert_close(t, torch.full((2,), float(r + 1)))


def test_rank_output_stays_out_of_the_test_output(capfd):
    # A spawn pool started here inherits this test's captured fds: any output
    # the ranks did not redirect would show up in capfd.
    with RankPool(2, start_method="spawn") as pool:
        assert pool.run(_chatty) == [0, 1]
        assert pool.run(_whoami)[1]["rank"] == 1
    out, err = capfd.readouterr()
    assert "chatty" not in out and "chatty" not in err


def test_env_matches_torchrun(rank_pool):
    ours = rank_pool(2).run(_env)
    for r, env in enumerate(ours):
        assert None not in env.values(), env
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
    for key in ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        assert ours[0][key] == ours[1][key], key
    assert ours[0]["TORCHELASTIC_ERROR_FILE"] != ours[1]["TORCHELASTIC_ERROR_FILE"]


@pytest.mark.slow
def test_env_keys_and_values_match_a_real_torchrun(rank_pool, tmp_path):
    script = tmp_path / "dump_env.py"
    script.write_text("import json, os, sys\n"
                      "path = os.path.join(sys.argv[1], os.environ['RANK'] + '.json')\n"
                      "json.dump(dict(os.environ), open(path, 'w'))\n")
    parent = dict(os.environ)
    parent.pop("OMP_NUM_THREADS", None)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", str(script), str(tmp_path)],
                   check=True, capture_output=True, timeout=120, env=parent)
    ours = rank_pool(2).run(_env)
    # Values that differ from run to run (or, for MASTER_ADDR, from one rendezvous to another).
    volatile = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
                "TORCHELASTIC_RESTART_COUNT"}
    for r in range(2):
        theirs = json.loads((tmp_path / f"{r}.json").read_text())
        set_by_torchrun = {k for k, v in theirs.items() if parent.get(k) != v}
        assert set_by_torchrun == set(TORCHRUN_KEYS)
        for key in set(TORCHRUN_KEYS) - volatile:
            assert ours[r][key] == theirs[key], (r, key)


def test_seed_all_makes_python_and_torch_repeat():
    seed_all(1234)
    first = (random.random(), torch.rand(3))
    seed_all(1234)
    second = (random.random(), torch.rand(3))
    assert first[0] == second[0]
    torch.testing.assert_close(first[1], second[1], rtol=0, atol=0)
