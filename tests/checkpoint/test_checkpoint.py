"""save_checkpoint / load_checkpoint: a run saved and resumed, on the same
ranks (bitwise) and resharded to another world size, ZeRO stage or
precision (the loaded state bitwise equal to the saved one; the next step's
loss equal to the uninterrupted run's within fp32 reduction-order error)."""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import stepfx
from stepfx.checkpoint import UnsafeCheckpointError
from stepfx.checkpoint.checkpoint import CheckpointError, resolve_checkpoint
from tests.checkpoint import ckpt_workers as W
from tests.steps import lm_step, tiny_gpt, token_batches

BEFORE, AFTER = 3, 2


def _equal_states(a: dict, b: dict) -> None:
    assert set(a) == set(b), (set(a) ^ set(b))
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _run(pool_or_none, fn, *args, **kwargs):
    """Rank 0's result of ``fn`` on the pool's ranks, or in this process (one rank)."""
    return pool_or_none.run(fn, *args, **kwargs)[0] if pool_or_none is not None else fn(*args, **kwargs)


_SAVED: dict = {}
# tests that load the same saved run: one test process for them (it shares _saved's runs)
shares_saves = pytest.mark.xdist_group("checkpoint_saves")


def _saved(pool_or_none, tmp_path_factory, stage: int, precision: str):
    """(directory, train_then_save's result on rank 0) for the pool's world
    size, once per session: the run is deterministic (seeded inside) and
    the tests only load from the directory (2 ranks, stage 3, fp32 both
    for the resume on the same ranks and for a resharding)."""
    world = pool_or_none.world_size if pool_or_none is not None else 1
    key = (world, stage, precision)
    if key not in _SAVED:
        directory = tmp_path_factory.mktemp(f"saved-{world}-{stage}-{precision}")
        _SAVED[key] = directory, _run(pool_or_none, W.train_then_save, str(directory), stage, precision, BEFORE, AFTER)
    return _SAVED[key]


@shares_saves
@pytest.mark.parametrize("stage", [3])
def test_resume_on_the_same_ranks_is_bitwise(rank_pool, tmp_path_factory, stage):
    pool = rank_pool(2)
    tmp_path, (losses, _saved_state, end, _) = _saved(pool, tmp_path_factory, stage, "fp32")
    client, loaded, losses2, end2, _, plans = _run(pool, W.load_then_train, str(tmp_path), stage, "fp32", BEFORE, AFTER)
    assert client == {"batches_seen": BEFORE, "note": "x"}
    assert losses2 == losses
    assert plans == 1  # the loaded optimizer state is held by the ranks from the first capture on
    _equal_states(end, end2)
    assert open(tmp_path / "latest").read() == f"global_step{BEFORE}"


def test_load_into_the_running_step_keeps_its_plan(rank_pool, tmp_path):
    """Loading into a run that already holds ZeRO-2 pieces reads into them:
    the same steps again give the same losses, without a new capture."""
    first, again, plans = _run(rank_pool(2), W.resume_in_place, str(tmp_path), 2, "fp32", BEFORE, AFTER)
    assert again == first and plans == 1


# (saved by: world, stage, precision) -> (loaded by: world, stage, precision): every stage and world size 1/2/4
# among them, and a change of precision (bf16 -> fp16); the same ranks are covered above
RESHARDS = [
    ((2, 3, "fp32"), (4, 1, "fp32")),
    ((4, 2, "bf16"), (1, 2, "fp16")),
    ((1, 0, "fp16"), (2, 3, "fp16")),
]


@shares_saves
@pytest.mark.parametrize("saved_by,loaded_by", RESHARDS, ids=[f"{a}-to-{b}" for a, b in RESHARDS])
def test_resharding_reads_exactly_what_was_saved(rank_pool, tmp_path_factory, saved_by, loaded_by):
    (w1, s1, p1), (w2, s2, p2) = saved_by, loaded_by
    pool1 = rank_pool(w1) if w1 > 1 else None
    pool2 = rank_pool(w2) if w2 > 1 else None
    tmp_path, (losses, saved, _end, scale) = _saved(pool1, tmp_path_factory, s1, p1)
    client, loaded, losses2, _end2, scale2, _ = _run(pool2, W.load_then_train, str(tmp_path), s2, p2, BEFORE, AFTER)
    _equal_states(saved, loaded)  # every parameter and optimizer state, whatever the layouts
    assert client["batches_seen"] == BEFORE
    if p1 == p2 == "fp16":
        assert scale2 == scale  # the loss scaler resumes where it was
    if p1 == p2 == "fp32":
        # the next step from the same state: the same loss but for the order of the ranks' reductions
        assert losses2[0] == pytest.approx(losses[0], rel=1e-6, abs=0)


def test_async_save_completes_and_resumes_bitwise(rank_pool, tmp_path):
    """What the async save wrote is the state at the save, and the run that
    saved (training on while the write went on) and a run resumed from the
    checkpoint take the same steps after it, bitwise: the write neither
    read a later state nor disturbed the training."""
    pool = rank_pool(2)
    losses_a, saved_a, end_a, _ = pool.run(W.train_then_save, str(tmp_path), 1, "fp32", BEFORE, AFTER, async_save=True)[0]
    _, loaded, losses2, end2, _, _ = _run(pool, W.load_then_train, str(tmp_path), 1, "fp32", BEFORE, AFTER)
    _equal_states(saved_a, loaded)
    assert losses2 == losses_a
    _equal_states(end_a, end2)


# tensor parallelism: each rank writes its Megatron shards as boxes of the whole tensors (a fused q/k/v
# weight's shard is three blocks that lie apart in the whole; a row-parallel weight's a column block), its
# ZeRO pieces of them likewise; any layout reads them back.
# (saved by: world, TP degree, ZeRO stage) -> (loaded by: world, TP degree, ZeRO stage, into a running step)
TP_CASES = [
    ((2, 2, 0), (2, 2, 0, True)),
    ((4, 2, 3), (1, 1, 0, False)),  # ZeRO-3: pieces of each rank's shard of the parameters too
    ((1, 1, 0), (4, 2, 2, True)),
]


@pytest.mark.parametrize("saved_by,loaded_by", TP_CASES, ids=[f"{a}-to-{b}" for a, b in TP_CASES])
def test_tensor_parallel_shards_are_written_where_they_lie_in_the_whole(rank_pool, tmp_path, saved_by, loaded_by):
    (w1, t1, s1), (w2, t2, s2, in_place) = saved_by, loaded_by
    pool1 = rank_pool(w1) if w1 > 1 else None
    pool2 = rank_pool(w2) if w2 > 1 else None
    losses, saved, end, _ = _run(pool1, W.train_then_save, str(tmp_path), s1, "fp32", BEFORE, AFTER, tp=t1)
    if w1 > 1:
        files = [f for f in os.listdir(resolve_checkpoint(str(tmp_path))) if f.endswith(".distcp")]
        assert len(files) == w1  # every rank wrote its part
    _, loaded, losses2, end2, _, _ = _run(pool2, W.load_then_train, str(tmp_path), s2, "fp32", BEFORE, AFTER, tp=t2,
                                          after_first_call=in_place)
    _equal_states(saved, loaded)  # every parameter and optimizer state, whole, whatever the layouts
    if (w1, t1, s1) == (w2, t2, s2):
        assert losses2 == losses  # the same layout resumes bitwise
        _equal_states(end, end2)
    else:
        assert losses2[0] == pytest.approx(losses[0], rel=1e-6, abs=0)


# -- single process: bad input, crashes, tampered files --------------------------------
def _trained(steps: int = 2, config=None):
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize(config or {"gradient_clipping": 1.0})(lm_step)
    for (b,) in token_batches(steps):
        step(model, opt, b)
    return model, opt, step


def test_an_async_save_is_published_without_waiting(tmp_path):
    """The background write's completion publishes the checkpoint (the
    rename and ``latest``) while training goes on; nobody has to wait."""
    import time

    model, opt, step = _trained()
    pending = step.save_checkpoint(tmp_path, async_save=True)
    deadline = time.monotonic() + 60
    # (done() turns True right after ``latest`` is written: waiting for ``latest`` alone raced with it)
    while not pending.done() and time.monotonic() < deadline:
        step(model, opt, token_batches(1)[0][0])
        time.sleep(0.02)
    assert pending.done() and (tmp_path / "latest").read_text() == "global_step2"
    assert step.wait_checkpoint() == str(tmp_path / "global_step2")


def test_the_model_must_match(tmp_path):
    _, _, step = _trained()
    step.save_checkpoint(tmp_path)
    other = tiny_gpt(d_model=64)
    fresh = stepfx.parallelize({"gradient_clipping": 1.0})(lm_step)
    with pytest.raises(CheckpointError, match=r"model/.*shape"):
        fresh.load_checkpoint(tmp_path, model=other, optimizer=torch.optim.AdamW(other.parameters()))
    sgd_model = tiny_gpt()
    with pytest.raises(CheckpointError, match="optimizer is AdamW, the run's SGD"):
        fresh.load_checkpoint(tmp_path, model=sgd_model, optimizer=torch.optim.SGD(sgd_model.parameters(), lr=0.1))


def test_a_failed_load_changes_nothing(tmp_path):
    model, opt, step = _trained()
    step.save_checkpoint(tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = next(f for f in os.listdir(tmp_path / "global_step2") if f.endswith(".distcp"))
    with open(tmp_path / "global_step2" / data, "r+b") as f:
        f.truncate(100)  # a damaged data file
    model2, opt2, step2 = _trained(steps=1)
    before2 = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(CheckpointError, match="nothing was loaded"):
        step2.load_checkpoint(tmp_path)
    assert all(torch.equal(before2[k], v) for k, v in model2.state_dict().items())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_failed_first_call_after_loading_keeps_the_loaded_optimizer_state(tmp_path):
    """Under ZeRO 1-3 the first call moves the loaded state to the rank's
    held map; a call that fails puts it back in the optimizer."""
    config = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 1}}
    _, _, step = _trained(config=config)
    step.save_checkpoint(tmp_path)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh = stepfx.parallelize(config)(lm_step)
    fresh.load_checkpoint(tmp_path, model=model, optimizer=opt)
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    with pytest.raises(Exception):
        fresh(model, opt, torch.zeros(2, 9))  # float token ids: the capture fails
    assert {id(p): set(s) for p, s in opt.state.items()} == {k: set(v) for k, v in before.items()}
    assert all(torch.equal(before[id(p)][k], v) for p, s in opt.state.items() for k, v in s.items())
    fresh(model, opt, token_batches(1)[0][0])  # and the step then runs from it


def test_saving_in_the_middle_of_gradient_accumulation_is_refused(tmp_path):
    _, _, step = _trained(steps=3, config={"gradient_clipping": 1.0, "gradient_accumulation_steps": 2,
                                           "train_micro_batch_size_per_gpu": 2})
    with pytest.raises(CheckpointError, match="middle of gradient accumulation"):
        step.save_checkpoint(tmp_path)


def test_client_state_must_be_plain_data(tmp_path):
    _, _, step = _trained()
    with pytest.raises(CheckpointError, match=r"client_state\['fn'\].*function"):
        step.save_checkpoint(tmp_path, client_state={"fn": lambda: 1})


def test_a_tampered_index_is_refused_without_running_it(tmp_path):
    _, _, step = _trained()
    path = step.save_checkpoint(tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Payload(), f)
    model, opt, fresh = _trained(steps=1)
    with pytest.raises(CheckpointError, match="posix.system|os.system|refusing to unpickle"):
        fresh.load_checkpoint(tmp_path)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError):
        from stepfx.checkpoint import read_index
        read_index(path)


_CRASHING_SAVE = textwrap.dedent("""
    import os, signal, sys, torch
    import stepfx
    from stepfx.checkpoint import checkpoint as ck
    from tests.steps import lm_step, tiny_gpt, token_batches
    directory, point, tag = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize({"gradient_clipping": 1.0})(lm_step)
    batches = token_batches(3)
    for (b,) in batches[:2]:
        step(model, opt, b)
    step.save_checkpoint(directory, tag="good")
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(directory, "expected.pt"))
    step(model, opt, batches[2][0])
    def die(at):
        if at == point:
            os.kill(os.getpid(), signal.SIGKILL)
    ck._reached = die
    step.save_checkpoint(directory, tag=tag)
""")


@pytest.mark.parametrize("point,tag", [("data_written", "next"), ("renamed", "next"), ("old_moved", "good")])
def test_a_save_killed_at_any_point_leaves_the_last_checkpoint_loadable(tmp_path, point, tag):
    proc = subprocess.run([sys.executable, "-c", _CRASHING_SAVE, str(tmp_path), point, tag],
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    path = resolve_checkpoint(tmp_path)
    assert os.path.basename(path) in ("good", ".good.old")
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    model = tiny_gpt()
    fresh = stepfx.parallelize({"gradient_clipping": 1.0})(lm_step)
    fresh.load_checkpoint(tmp_path, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert all(torch.equal(expected[k], v) for k, v in model.state_dict().items())
