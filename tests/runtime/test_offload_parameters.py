"""zero_optimization.offload_param: ZeRO-3's parameter pieces at rest on the host.

On CPU the host is the device, so these tests check what the offload changes
in the program (every device reader of a piece reads a fetched copy, started
``buffer_count`` fetches ahead; updated pieces go back into the host tensor;
the host update of offload_optimizer works on the host piece itself), where
the bytes are counted (host, not device), and that the step is bitwise the
one without offloading. tests/gpu/test_offload_cuda.py runs it on a GPU.
"""
from __future__ import annotations

import os

import pytest
import torch

import stepfx
from stepfx.config.errors import ConfigError
from stepfx.graph import HOST_STATE_KEY, Role, Storage
from stepfx.graph.accounting import estimate_memory
from stepfx.runtime.host_optimizer import host_adam_start
from stepfx.runtime.host_params import host_fetch_start, host_fetch_wait, host_store
from stepfx.testing.equivalence import assert_data_parallel_equivalent
from tests.steps import adamw, dp_batches, lm_step, tiny_gpt

pytestmark = pytest.mark.xdist_group("offload")


def _cfg(*, param=None, optimizer=None, bf16=False, clip=0.0):
    zero = {"stage": 3, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}
    if param is not None:
        zero["offload_param"] = {"device": "cpu", **param}
    if optimizer is not None:
        zero["offload_optimizer"] = {"device": "cpu", **optimizer}
    # the fp32 pieces on the device when offload_param is off (host_master_weights would put them on the host too)
    config = {"gradient_clipping": clip, "zero_optimization": zero,
              "stepfx": {"host_adam": "exact", "host_master_weights": False}}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def _single(config, steps=3):
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = adamw(model)
    step = stepfx.parallelize(config)(lm_step)
    losses = [float(step(model, opt, batch)) for (batch,) in dp_batches(1, steps=steps)[0]]
    return step, losses


def _same(a, b) -> bool:
    sa, sb = a.model_state_dict(), b.model_state_dict()
    oa, ob = a.optimizer_state(), b.optimizer_state()
    return all(torch.equal(sa[n], sb[n]) for n in sa) and all(torch.equal(oa[n][k], ob[n][k]) for n in oa for k in oa[n])


@pytest.mark.parametrize("optimizer, bf16, clip", [(None, False, 0.0), ({}, False, 1.0), (None, True, 1.0), ({}, True, 0.0)],
                         ids=["params", "params+optimizer-clipped", "params-bf16-clipped", "params+optimizer-bf16"])
def test_equals_the_step_without_offloading_bitwise(optimizer, bf16, clip):
    ref, ref_losses = _single(_cfg(optimizer=optimizer, bf16=bf16, clip=clip))
    step, losses = _single(_cfg(param={}, optimizer=optimizer, bf16=bf16, clip=clip))
    assert losses == ref_losses and _same(step, ref) and len(step.plans) == 1
    # the pieces are host memory now, and the device's peak is lower
    graph = step.plan.graph
    pieces = [n.meta["slot"] for n in graph.gm.graph.nodes if n.op == "placeholder"
              and n.meta["slot"].role is Role.PARAM and n.meta["slot"].storage is Storage.RANK]
    assert pieces and {s.ident for s in pieces} <= graph.signature.extra[HOST_STATE_KEY]
    ours, theirs = estimate_memory(graph), estimate_memory(ref.plan.graph)
    piece_bytes = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in graph.gm.graph.nodes
                      if n.op == "placeholder" and n.meta["slot"] in pieces)
    assert ours.host - theirs.host == piece_bytes
    assert ours.at_rest.get(Role.PARAM, 0) == theirs.at_rest[Role.PARAM] - piece_bytes
    assert ours.peak < theirs.peak
    summary = next(r.summary for r in step.plan.records if r.name == "offload_parameters")
    assert f"{len(pieces)} parameter pieces" in summary and "pinned host memory" in summary
    held = ("offload_optimizer: Adam's moments; " if optimizer is not None else "") + "offload_param: the parameters' pieces"
    assert f"({held}; not in the figures above)" in step.explain()
    if optimizer is not None:  # the host update reads and writes the host pieces themselves
        starts = [n for n in graph.gm.graph.nodes if n.target is host_adam_start]
        assert starts and all(n.kwargs["params_on_host"] for n in starts)
        assert "0 updated pieces copied back down" in summary
    else:
        assert f"{len(pieces)} updated pieces copied back down" in summary


def test_every_device_reader_reads_a_fetch_started_buffer_count_ahead():
    step, _ = _single(_cfg(param={"buffer_count": 2}), steps=1)
    nodes = list(step.plan.graph.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    host = {n for n in nodes if n.op == "placeholder" and n.meta["slot"].role is Role.PARAM
            and n.meta["slot"].storage is Storage.RANK}
    for piece in host:  # only fetches, the host update and the copy back read a host piece
        assert all(u.target in (host_fetch_start, host_adam_start, host_store) or u.op == "output" for u in piece.users)
    waits = sorted((n for n in nodes if n.target is host_fetch_wait), key=pos.__getitem__)
    starts = [w.args[0] for w in waits]
    assert len(waits) >= 4 and [pos[s] for s in starts] == sorted(pos[s] for s in starts)
    # fetch i starts before the reader of fetch i-2, after fetch i-3 was waited for: two in flight ahead
    readers = [min(pos[u] for u in w.users) for w in waits]
    for i in range(2, len(waits)):
        assert pos[starts[i]] < readers[i - 2]
        assert i < 3 or pos[starts[i]] > pos[waits[i - 3]]
    # each stored piece is written after the last reader of its old value, the last store waits for them all
    stores = [n for n in nodes if n.target is host_store]
    assert stores and sum(bool(n.kwargs.get("last")) for n in stores) == 1
    assert max(stores, key=pos.__getitem__).kwargs.get("last")
    for store in stores:
        piece = store.args[0]
        old_readers = [u for s in piece.users if s.target is host_fetch_start for w in s.users for u in w.users]
        assert all(pos[u] < pos[store] for u in old_readers)


def test_two_ranks_with_both_offloads_equal_the_reference_bitwise(rank_pool):
    report = assert_data_parallel_equivalent(rank_pool(2), lm_step, tiny_gpt, adamw, dp_batches(2, steps=3),
                                             config=_cfg(param={}, optimizer={}), exact=True)
    assert report.bitwise
    assert all("parameter pieces" in text and "at rest in pinned host memory" in text for text in report.explains)


def test_nvme_keeps_the_pieces_in_files_across_steps(tmp_path):
    nvme = tmp_path / "nvme"
    tier = {"device": "nvme", "nvme_path": str(nvme)}
    for optimizer in (None, tier):
        step, losses = _single(_cfg(param=tier, optimizer=optimizer))
        ref, ref_losses = _single(_cfg(optimizer={} if optimizer else None))
        assert losses == ref_losses and _same(step, ref)
        graph = step.plan.graph
        pieces = [n.meta["slot"].ident for n in graph.gm.graph.nodes if n.op == "placeholder"
                  and n.meta["slot"].role is Role.PARAM and n.meta["slot"].storage is Storage.RANK]
        held = [step._store.tensors[i] for i in pieces]  # after three steps: still the mapped files, updated in place
        assert held and all(str(t.untyped_storage().filename).startswith(str(nvme)) for t in held)
        assert os.listdir(nvme) == []


def test_a_checkpoint_of_host_held_pieces_resumes_bitwise(tmp_path):
    config = _cfg(param={}, optimizer={})
    step, _ = _single(config, steps=2)
    step.save_checkpoint(tmp_path)
    batches = [b for (b,) in dp_batches(1, steps=3, seed=5)[0]]
    model, opt = step._model, step._optimizer
    losses = [float(step(model, opt, b)) for b in batches]
    torch.manual_seed(1)
    fresh_model = tiny_gpt()
    fresh_opt = adamw(fresh_model)
    fresh = stepfx.parallelize(config)(lm_step)
    fresh.load_checkpoint(tmp_path, model=fresh_model, optimizer=fresh_opt)
    assert [float(fresh(fresh_model, fresh_opt, b)) for b in batches] == losses
    assert _same(fresh, step)


def test_refusals_name_the_key():
    with pytest.raises(ConfigError, match=r"zero_optimization\.offload_param: .*needs ZeRO stage 3"):
        _single({**_cfg(param={}), "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, steps=1)
    with pytest.raises(ConfigError, match=r"offload_param\.nvme_path"):
        _single(_cfg(param={"device": "nvme"}), steps=1)
    with pytest.raises(ConfigError, match=r"offload_param\.device: 'nvme' with offload_optimizer on 'cpu'"):
        _single(_cfg(param={"device": "nvme", "nvme_path": "/tmp/x"}, optimizer={}), steps=1)


class _Inline:
    """The host worker run in the caller's thread: a job's updates happen exactly where the graph starts it."""

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, as the thread pool does
            future.set_exception(exc)
        return future


def test_a_speculated_update_of_host_pieces_waits_for_their_last_reader(monkeypatch):
    # a speculating start comes as soon as its gradients exist, in the backward; Llama's layers read a weight
    # for their input gradient after its own gradient is made. Updated there (on a CPU device the fetched
    # piece is the host piece itself), that input gradient came out wrong: the validation restores the piece,
    # not what was computed from it. With the worker inline the update runs exactly at the start: the step
    # must still be the one without offloading, bit for bit. With DeepSpeed's "auto" bucket and persistence
    # sizes (as open-instruct's stage-3 offload config gives them) a group's start fell before such a reader:
    # 6e-4 relative in the second loss, one run in two with the worker on its own thread, every run inline
    from stepfx.runtime import host_optimizer as H
    from tests.steps import hf_llama, padded_rank_batches, padded_step

    monkeypatch.setattr(H, "_worker", lambda: _Inline())
    monkeypatch.setattr(H._Verdict, "known", lambda self: False)
    batches = padded_rank_batches(1, 3, seed=3)[0]

    def run(config):
        torch.manual_seed(0)
        model = hf_llama()
        opt = adamw(model)
        step = stepfx.parallelize(config)(padded_step)
        return [float(step(model, opt, b)) for (b,) in batches], step

    zero = {"stage": 3, "stage3_param_persistence_threshold": "auto", "reduce_bucket_size": "auto"}
    offloaded = {"gradient_clipping": 1e-3, "stepfx": {"host_adam": "exact", "host_update_speculation": True},
                 "zero_optimization": {**zero, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    losses, step = run(offloaded)
    plain, ref = run({"gradient_clipping": 1e-3, "zero_optimization": zero})
    assert losses == plain
    ours, theirs = step.model_state_dict(), ref.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    for plan in step.plans:
        nodes = list(plan.graph.gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        starts = [n for n in nodes if n.target is host_adam_start]
        assert starts and all(n.kwargs.get("params_on_host") and n.kwargs.get("speculative") for n in starts)
        for start in starts:  # after every fetch of its pieces and every reader of what was fetched
            for piece in start.args[1:1 + start.args[0]]:
                for fetch in (u for u in piece.users if u.target is host_fetch_start):
                    waits = [w for w in fetch.users if w.target is host_fetch_wait]
                    assert all(pos[r] < pos[start] for w in waits for r in w.users), start.name
