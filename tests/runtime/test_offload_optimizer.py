"""zero_optimization.offload_optimizer: Adam's state and update on the host.

On CPU the host is the device, so these tests check what offloading
changes in the program (the update runs as host jobs over the host-held
moments, with torch's fused CPU Adam) and that the results equal the step
without offloading: bitwise in fp32, where the arithmetic is the same
(torch's fused CPU Adam computes what the unfused ops compute), and against
the mixed-precision reference in bf16. Where the state really lives on a
GPU box is measured by benchmarks/offload.py.
"""
from __future__ import annotations

import functools

import os

import pytest
import torch

import stepfx
from stepfx.config.errors import ConfigError
from stepfx.graph import HOST_STATE_KEY, Role
from stepfx.runtime import host_optimizer as H
from stepfx.runtime.host_optimizer import host_adam_start
from stepfx.testing.equivalence import assert_data_parallel_equivalent
from tests import dp_workers as W
from tests.steps import adam, adamw, dp_batches, lm_step, mlp_batches, sgd_momentum, tiny_gpt


def _cfg(stage, *, offload=None, host_adam="exact", **extra):
    # "exact": the host computes the unfused ops' arithmetic, so the comparisons below are bitwise
    return {"gradient_clipping": 1.0, "stepfx": {"host_adam": host_adam}, **extra,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True, **(offload or {})}}}


@pytest.mark.parametrize("stage, opt", [(1, adamw), (3, adam)], ids=["stage1-adamw", "stage3-adam"])
def test_offloaded_stages_on_two_ranks_equal_the_reference_bitwise(rank_pool, stage, opt):
    # parameter sizes that do not divide by 2: some pieces are empty on a rank (stage 2: the clipped test below)
    report = assert_data_parallel_equivalent(rank_pool(2), lm_step, tiny_gpt, opt, dp_batches(2),
                                             config=_cfg(stage, gradient_clipping=0), exact=True)
    assert report.bitwise and report.steps == 3
    assert "run on the host" in report.explains[0]


def test_clipped_offload_on_two_ranks(rank_pool):
    # the factor (from the norm over both ranks' pieces) reaches the host jobs. The norm sums in another order
    # than the single process's, and AdamW carries that last bit further than SGD (measured 3.3e-6 relative on
    # one machine, under 1e-6 on another, with and without offloading alike): against the single process the
    # standard 1e-5; against the same two ranks updating on the device, the same differences at every step
    # (the host's "exact" kernel is the device's arithmetic). Without biases: the key bias's gradient is rounding
    # noise (softmax ignores it), which AdamW scales up to +-lr, so the summation order sets its sign
    config = _cfg(2, gradient_clipping=0.05)
    on_device = {**config, "zero_optimization": {k: v for k, v in config["zero_optimization"].items()
                                                 if k != "offload_optimizer"}}
    reports = [assert_data_parallel_equivalent(rank_pool(2), lm_step, functools.partial(tiny_gpt, bias=False), adamw,
                                               dp_batches(2), config=c,
                                               clip_norm=0.05, rtol=1e-5, atol=1e-7) for c in (config, on_device)]
    offloaded, device = reports
    assert "run on the host" in offloaded.explains[0] and "run on the host" not in device.explains[0]
    assert max(offloaded.state_rel) <= 1e-5
    assert (offloaded.state_abs, offloaded.output_abs) == (device.state_abs, device.output_abs), (offloaded, device)


@pytest.mark.parametrize("ratio, remat", [(0.5, None), (1.0, None), (1.0, 0.0)],
                         ids=["partial", "all-masters-on-the-host", "all-masters-on-the-host-recomputed"])
def test_bf16_with_partial_offload_equals_the_reference(rank_pool, ratio, remat):
    # ratio 1: every piece's update on the host, so the fp32 masters live there and the device keeps bf16 copies
    # (host_master_weights); 0.5: some pieces are updated on the device, the masters stay there. Recomputed:
    # backward casts each parameter again, and the gathers still take the bf16 copies (once refused: "reads the
    # fp32 piece on the device")
    from tests.steps import lm_step_bf16_reference

    config = _cfg(3, offload={"ratio": ratio}, bf16={"enabled": True}, gradient_clipping=0)
    if remat is not None:
        config["stepfx"]["activation_memory_budget"] = remat
    report = assert_data_parallel_equivalent(rank_pool(2), lm_step, tiny_gpt, adamw, dp_batches(2),
                                             config=config, reference_fn=lm_step_bf16_reference, exact=True)
    assert report.bitwise
    assert ("host as masters" in report.explains[0]) == (ratio == 1.0)


def _single(config, model=None, opt_fn=adamw, steps=3):
    torch.manual_seed(0)
    model = model or tiny_gpt()
    opt = opt_fn(model)
    step = stepfx.parallelize(config)(lm_step)
    losses = [step(model, opt, batch) for (batch,) in dp_batches(1, steps=steps)[0]]
    return step, model, opt, losses


def test_the_moments_live_in_host_jobs_and_the_rest_is_unchanged():
    step, model, _, losses = _single(_cfg(2))
    plain, plain_model, _, plain_losses = _single({**_cfg(2), "zero_optimization": {"stage": 2, "reduce_bucket_size": 500}})
    assert [l.item() for l in losses] == [l.item() for l in plain_losses]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    graph = step.plan.graph
    starts = [n for n in graph.gm.graph.nodes if n.target is host_adam_start]
    assert starts and all(n.kwargs["pin_memory"] for n in starts)
    host = graph.signature.extra[HOST_STATE_KEY]
    held = {(s.name, s.key) for s in graph.signature.inputs if s.ident in host}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert held == {(n, k) for n in trained for k in ("exp_avg", "exp_avg_sq")}
    # no optimizer op is left on the device: the host jobs read the gradients and pieces, nothing else updates
    assert not any(n.op == "call_function" and n.target is torch.ops.aten.lerp.Scalar for n in graph.gm.graph.nodes)
    state = step.optimizer_state()
    assert all(torch.equal(state[n]["exp_avg"], plain.optimizer_state()[n]["exp_avg"]) for n in state)
    # the accounting moves the moments out of the device's figures into the host's
    from stepfx.graph.accounting import estimate_memory

    ours, theirs = estimate_memory(graph), estimate_memory(plain.plan.graph)
    moments = 8 * sum(p.numel() for n, p in model.named_parameters() if n in trained)
    assert ours.host == moments
    assert ours.at_rest[Role.OPTIMIZER_STATE] == theirs.at_rest[Role.OPTIMIZER_STATE] - moments
    assert ours.peak <= theirs.peak - moments
    assert "host memory at rest" in step.explain()


def test_planning_with_kernels_starts_no_host_job(monkeypatch):
    # fuse_optimizer_update (codegen) runs after offload_optimizer and checks each update's ops on samples: it must
    # leave the host jobs alone. It once ran one on 13 sample elements (a real job, counted, validated against the
    # sample factor 0.75), found by the GPU speculation test as a rolled-back update no step made
    H.STATS.update(elements=0, speculated=0, rolled_back=0)
    step, model, _, _ = _single(_cfg(3, stepfx={"codegen": True, "host_adam": "exact"}), steps=1)
    starts = [n for n in step.plan.graph.gm.graph.nodes if n.target is host_adam_start]
    offloaded = sum(p.meta["val"].numel() for n in starts for p in n.args[1:1 + n.args[0]])
    assert starts and offloaded > 0
    # every element the plan's jobs update, once, and once more where a speculated update was undone (clipped)
    assert H.STATS["elements"] - H.STATS["rolled_back"] == offloaded


@pytest.mark.parametrize("stage, bf16, accumulation, ratio", [(2, False, 2, 1.0), (3, True, 2, 0.5), (1, True, 3, 1.0)])
def test_equals_the_step_without_offloading_bitwise(stage, bf16, accumulation, ratio):
    # one process: clipped at 1.0 (the default), mixed precision, gradient accumulation, partial offload
    extra = dict(bf16={"enabled": bf16}, gradient_accumulation_steps=accumulation)
    steps = 2 * accumulation  # the last call updates
    step, _, _, losses = _single(_cfg(stage, offload={"ratio": ratio}, **extra), steps=steps)
    plain, _, _, plain_losses = _single({**_cfg(stage, **extra), "zero_optimization": {
        "stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}}, steps=steps)
    assert [l.item() for l in losses] == [l.item() for l in plain_losses]
    ours, theirs = step.model_state_dict(), plain.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    ours, theirs = step.optimizer_state(), plain.optimizer_state()
    assert all(torch.equal(ours[n][k], theirs[n][k]) for n in theirs for k in theirs[n])
    assert any(n.target is host_adam_start for n in step.plan.graph.gm.graph.nodes)


@pytest.mark.parametrize("speculation", [False, True], ids=["after-the-norm", "speculated"])
def test_zero3_updates_go_up_into_the_pieces_they_update(speculation):
    # ZeRO-3 with the masters on the device: the host job writes each updated piece into the piece itself
    # (nothing in the graph reads it after the start), so the device does not hold the old and new masters
    # together at the end of the step (13B: 48 GiB); on a guessed factor into a new tensor (the redo reads the
    # piece as it was). Clipped at 0.05 so the guesses miss and are redone. Bitwise the step on the device
    extra = dict(gradient_clipping=0.05, stepfx={"host_adam": "exact", "host_update_speculation": speculation})
    step, _, _, losses = _single(_cfg(3, **extra), steps=3)
    plain, _, _, plain_losses = _single({**_cfg(3, **extra), "zero_optimization": {
        "stage": 3, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}}, steps=3)
    assert [l.item() for l in losses] == [l.item() for l in plain_losses]
    ours, theirs = step.model_state_dict(), plain.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    starts = [n for n in step.plan.graph.gm.graph.nodes if n.target is host_adam_start]
    assert starts and all(n.kwargs.get("donate") for n in starts)
    assert "go up into the pieces themselves" in step.explain()
    pieces = {k: t for k, t in step._store.tensors.items() if k[0] is Role.PARAM}
    before = {k: t.untyped_storage().data_ptr() for k, t in pieces.items()}
    step(step.plan.executor.binding.model, step.plan.executor.binding.optimizer, dp_batches(1, steps=1)[0][0][0])
    after = {k: t.untyped_storage().data_ptr() for k, t in step._store.tensors.items() if k[0] is Role.PARAM}
    # after the norm: every update in place; speculated: the missed guesses' redo too (they are real then)
    assert after == before


def test_partial_offload_keeps_the_rest_on_the_device():
    step, *_ = _single(_cfg(3, offload={"ratio": 0.3}))
    graph = step.plan.graph
    host = graph.signature.extra[HOST_STATE_KEY]
    moments = [s for s in graph.signature.inputs if s.role is Role.OPTIMIZER_STATE and s.key in ("exp_avg", "exp_avg_sq")]
    numel = {s.ident: s.piece[1] - s.piece[0] for s in moments}
    on_host = sum(numel[s.ident] for s in moments if s.ident in host)
    total = sum(numel.values())
    assert 0.3 <= on_host / total < 0.6, (on_host, total)


def test_a_failing_host_update_leaves_model_and_optimizer_as_they_were(monkeypatch):
    step, model, opt, _ = _single(_cfg(1), steps=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in s.items()} for n, s in step.optimizer_state().items()}

    def broken(*args, **kwargs):
        raise RuntimeError("host out of memory")

    monkeypatch.setattr(H, "adam_chunked", broken)  # the exact kernel (_cfg's)
    (batch,) = dp_batches(1, steps=1, seed=99)[0][0]
    with pytest.raises(Exception, match="host out of memory"):
        step(model, opt, batch)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    after = step.optimizer_state()
    assert all(torch.equal(state[n][k], after[n][k]) for n in state for k in state[n])
    monkeypatch.undo()
    step(model, opt, batch)  # and the next step runs
    assert not all(torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("guess", [False, True], ids=["as-it-comes", "guessed-then-undone"])
def test_fp16_overflow_skips_the_host_update(monkeypatch, guess):
    # speculated: the updates made on the unscale factor before the flag is known are restored
    from stepfx.testing.models import MLP
    from tests.steps import scaled_ce_step

    if guess:
        _guess_always(monkeypatch)

    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = {**_cfg(2), "gradient_clipping": 0,
              "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8, "hysteresis": 1}}
    step = stepfx.parallelize(config)(scaled_ce_step)
    (x, y), (x2, y2) = mlp_batches(2)
    for _ in range(2):
        step(model, opt, x, y, torch.tensor(1.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in step.optimizer_state().items()}
    step(model, opt, x2, y2, torch.tensor(1e30))  # inf in fp16
    assert step.skipped_steps == 1
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    after = step.optimizer_state()
    assert all(torch.equal(state[n][k], after[n][k]) for n in state for k in state[n])
    assert any(n.target is host_adam_start for n in step.plan.graph.gm.graph.nodes)
    assert not guess or H.STATS["rolled_back"] > 0


def _guess_always(monkeypatch):
    # the worker finds the norm unknown at every piece, as on a GPU whose backward is still running: every update
    # made before the validation is on the guessed factor (on CPU the main thread often gets there first)
    monkeypatch.setattr(H._Verdict, "known", lambda self: False)
    monkeypatch.setattr(H, "_CLIPPED", {})
    H.STATS.update(speculated=0, rolled_back=0, copies_peak=0)


def _speculative(stage, speculation=True, **extra):
    config = _cfg(stage, **extra)
    config["stepfx"]["host_update_speculation"] = speculation
    return config


@pytest.mark.parametrize("clip, bf16, stage, on_host", [(1e9, False, 2, False), (1e-3, False, 2, False),
                                                        (1e-3, True, 3, False), (1e-3, False, 3, True)],
                         ids=["never-clipped-kept", "clipped-redone", "clipped-redone-bf16-stage3",
                              "clipped-redone-pieces-on-the-host"])
def test_speculated_host_updates_equal_the_step_without_offloading_bitwise(monkeypatch, clip, bf16, stage, on_host):
    # under clipping every host update starts before the gradient norm is known, on the unclipped factor; where
    # the norm clips, each is restored from its copy (the moments; the piece too where it lives on the host:
    # offload_param) and redone with the real factor
    _guess_always(monkeypatch)
    extra = dict(gradient_clipping=clip, bf16={"enabled": bf16})
    config = _speculative(stage, **extra)
    if on_host:
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    step, _, _, losses = _single(config)
    plain, _, _, plain_losses = _single({**_cfg(stage, **extra), "zero_optimization": {
        "stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}})
    assert [l.item() for l in losses] == [l.item() for l in plain_losses]
    ours, theirs = step.model_state_dict(), plain.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    ours, theirs = step.optimizer_state(), plain.optimizer_state()
    assert all(torch.equal(ours[n][k], theirs[n][k]) for n in theirs for k in theirs[n])
    speculated, undone = H.STATS["speculated"], H.STATS["rolled_back"]
    assert speculated > 0 and undone == (0 if clip > 1 else speculated)
    # the program: every start before the norm, its validation after it, the wait after that
    nodes = list(step.plan.graph.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    norm = next(n for n in nodes if n.name.startswith("grad_norm"))
    starts = [n for n in nodes if n.target is host_adam_start]
    assert starts and all(n.kwargs["speculative"] is True and pos[n] < pos[norm] for n in starts)
    for start in starts:
        (validate,) = start.users
        assert validate.target is H.host_adam_validate and pos[validate] > pos[norm]
        assert all(u.target is H.host_adam_wait for u in validate.users)
    assert "validated after it" in next(r.summary for r in step.plan.records if r.name == "offload_optimizer")
    from stepfx.graph.accounting import estimate_memory

    est = estimate_memory(step.plan.graph)
    # a copy of both moments of every piece at most, and of the piece where it lives on the host
    pieces = sum(n.args[1 + i].meta["val"].numel() for n in starts for i in range(n.args[0]))
    in_place = on_host or bf16 and stage == 3  # offload_param, or host_master_weights: the piece is copied too
    assert all(n.kwargs.get("params_on_host", False) == in_place for n in starts)
    assert est.host_transient == (12 if in_place else 8) * pieces
    assert "host, during the update" in step.explain()


def test_auto_speculation_stops_guessing_after_a_clipped_step(monkeypatch):
    _guess_always(monkeypatch)
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = adamw(model)
    step = stepfx.parallelize(_speculative(2, "auto", gradient_clipping=1e-3))(lm_step)
    guessed = []
    for (batch,) in dp_batches(1, steps=3)[0]:
        before = H.STATS["speculated"]
        step(model, opt, batch)
        guessed.append(H.STATS["speculated"] - before)
    assert guessed[0] > 0 and guessed[1:] == [0, 0]  # clipped every step: one miss, then it waits for the norm
    # the copies alive at once stay within 2 bytes per offloaded element, as the accounting says
    from stepfx.graph.accounting import estimate_memory

    cap = 2 * sum(state["exp_avg"].numel() for state in step.optimizer_state().values())
    assert 0 < H.STATS["copies_peak"] <= cap and estimate_memory(step.plan.graph).host_transient == cap


def test_a_step_failing_after_speculated_updates_leaves_the_host_state_as_it_was(monkeypatch):
    _guess_always(monkeypatch)
    step, model, opt, _ = _single(_speculative(2), steps=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in s.items()} for n, s in step.optimizer_state().items()}
    same = H._same_factor

    def broken(*args):
        raise RuntimeError("validation failed")

    monkeypatch.setattr(H, "_same_factor", broken)
    (batch,) = dp_batches(1, steps=1, seed=99)[0][0]
    guessed = H.STATS["speculated"]
    with pytest.raises(Exception, match="validation failed"):
        step(model, opt, batch)
    assert H.STATS["speculated"] > guessed  # the host state was updated on the guess, then restored
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    after = step.optimizer_state()
    assert all(torch.equal(state[n][k], after[n][k]) for n in state for k in state[n])
    monkeypatch.setattr(H, "_same_factor", same)
    step(model, opt, batch)
    assert not all(torch.equal(before[n], p) for n, p in model.named_parameters())


def _masters(host_master_weights, **extra):
    config = _cfg(3, bf16={"enabled": True}, **extra)
    config["stepfx"]["host_master_weights"] = host_master_weights
    return config


@pytest.mark.parametrize("accumulation", [1, 2])
def test_fp32_masters_on_the_host_and_bf16_copies_on_the_device_are_the_same_step_bitwise(accumulation):
    # bf16 at ZeRO-3 with every update on the host: the fp32 pieces live on the host (the host Adam updates
    # them in place and makes their bf16 copies, which go up), the device reads only the copies; against the
    # fp32 pieces kept on the device, bitwise: the same casts, made on the host; micro-steps read the copies
    from stepfx.graph import MASTER_COPIES_KEY
    from stepfx.graph.accounting import estimate_memory
    from stepfx.runtime.carried import PieceCopy

    extra = dict(gradient_accumulation_steps=accumulation)
    steps = 3 * accumulation
    step, _, _, losses = _single(_masters(True, **extra), steps=steps)
    plain, _, _, plain_losses = _single(_masters(False, **extra), steps=steps)
    assert [l.item() for l in losses] == [l.item() for l in plain_losses]
    ours, theirs = step.model_state_dict(), plain.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    ours, theirs = step.optimizer_state(), plain.optimizer_state()
    assert all(torch.equal(ours[n][k], theirs[n][k]) for n in theirs for k in theirs[n])
    graph = step.plan.graph
    masters = graph.signature.extra[MASTER_COPIES_KEY]
    pieces = [n for n in graph.gm.graph.nodes if n.op == "placeholder" and n.meta["slot"].role is Role.PARAM]
    assert pieces and {n.meta["slot"].ident for n in pieces} == {piece for piece, _, _ in masters.values()}
    assert set(graph.signature.extra[HOST_STATE_KEY]) >= {n.meta["slot"].ident for n in pieces}
    # no device op reads a master: the host update does, the casts became the copies
    assert all(u.target is host_adam_start for n in pieces for u in n.users)
    copies = [c for c in step._store.carried.values() if isinstance(c, PieceCopy)]
    assert len(copies) == len(masters) and all(c.repacks == 1 for c in copies)  # made once, then by the update
    # the accounting: 4 bytes an element move from the device's parameters to the host, 2 come back as copies
    elements = sum(n.meta["val"].numel() for n in pieces)
    ours, theirs = estimate_memory(graph), estimate_memory(plain.plan.graph)
    assert ours.host == theirs.host + 4 * elements
    assert ours.at_rest.get(Role.PARAM, 0) == theirs.at_rest[Role.PARAM] - 4 * elements
    assert ours.at_rest[Role.RUNTIME_STATE] - theirs.at_rest.get(Role.RUNTIME_STATE, 0) == 2 * elements
    # over PCIe a step: the fp32 gradients down (clipped: the norm reads them in fp32 too) and the bf16 copies
    # up, against gradients and pieces down and the pieces up; explain() says so, with times at the cost
    # model's rates against the device's compute
    from stepfx.graph.accounting import host_traffic

    ours, theirs = host_traffic(graph), host_traffic(plain.plan.graph)
    assert (ours.to_host, ours.to_device) == (4 * elements, 2 * elements)
    assert (theirs.to_host, theirs.to_device) == (8 * elements, 4 * elements)
    assert ours.host_elements == {"exact": elements} and ours.flops > 0
    assert "offload per step on this rank" in step.explain() and "bound by" in step.explain()


def test_unclipped_bf16_gradients_go_down_in_16_bits(monkeypatch):
    # the backward makes bf16 gradients; where nothing but the host update reads their fp32 widening (no
    # clipping norm, no overflow check, no fp32 accumulation), they go down as they are and the host widens
    # them: the same values (bitwise the step without offloading), half the bytes down, and no fp32 copy of
    # the gradients on the device (a lower predicted peak than with the widening kept)
    from stepfx.graph.accounting import estimate_memory, host_traffic
    from stepfx.passes.memory import offload_optimizer as O

    config = _cfg(3, bf16={"enabled": True}, gradient_clipping=0)
    step, _, _, losses = _single(config)
    plain, _, _, plain_losses = _single({**config, "zero_optimization": {
        k: v for k, v in config["zero_optimization"].items() if k != "offload_optimizer"}})
    assert [l.item() for l in losses] == [l.item() for l in plain_losses]
    ours, theirs = step.model_state_dict(), plain.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    ours, theirs = step.optimizer_state(), plain.optimizer_state()
    assert all(torch.equal(ours[n][k], theirs[n][k]) for n in theirs for k in theirs[n])
    starts = [n for n in step.plan.graph.gm.graph.nodes if n.target is host_adam_start]
    grads = [a.meta["val"] for n in starts for a in n.args[1 + n.args[0]:1 + 2 * n.args[0]]]
    elements = sum(g.numel() for g in grads)
    narrow = sum(g.numel() for g in grads if g.dtype == torch.bfloat16)
    assert narrow >= 0.9 * elements  # the small parameters' gradients share fp32 buckets (biases, norms' weights)
    # (the fp32 masters live on the host here: host_master_weights; only gradients go down)
    assert host_traffic(step.plan.graph).to_host == 2 * narrow + 4 * (elements - narrow)
    monkeypatch.setattr(O, "_narrow_gradients", lambda g: 0)
    wide, _, _, _ = _single(config, steps=1)
    assert estimate_memory(step.plan.graph).peak < estimate_memory(wide.plan.graph).peak
    assert host_traffic(wide.plan.graph).to_host == 4 * elements


@pytest.mark.parametrize("stage", [2, 3])
def test_clipped_bf16_gradients_go_down_in_16_bits_with_kernels(monkeypatch, stage):
    # under clipping the norm reads the gradients too; with kernels it is a sum of squares that reads the 16-bit
    # gradients (fold_gradient_casts), so the host update takes them as they are as well: the same step bit for
    # bit, speculated updates undone and redone included, with half the bytes down and no fp32 copy of them
    from stepfx.graph.accounting import estimate_memory, host_traffic

    _guess_always(monkeypatch)
    config = _speculative(stage, bf16={"enabled": True}, gradient_clipping=1e-3)
    config["stepfx"]["codegen"] = True
    step, _, _, losses = _single(config)
    assert H.STATS["speculated"] > 0 and H.STATS["rolled_back"] == H.STATS["speculated"]
    wide_config = {**config, "stepfx": {**config["stepfx"], "disable": ["fold_gradient_casts"]}}
    wide, _, _, wide_losses = _single(wide_config)
    assert [l.item() for l in losses] == [l.item() for l in wide_losses]
    ours, theirs = step.model_state_dict(), wide.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    ours, theirs = step.optimizer_state(), wide.optimizer_state()
    assert all(torch.equal(ours[n][k], theirs[n][k]) for n in theirs for k in theirs[n])

    def grads(graph):
        starts = [n for n in graph.gm.graph.nodes if n.target is host_adam_start]
        return [a.meta["val"] for n in starts for a in n.args[1 + n.args[0]:1 + 2 * n.args[0]]]

    elements = sum(g.numel() for g in grads(step.plan.graph))
    narrow = sum(g.numel() for g in grads(step.plan.graph) if g.dtype == torch.bfloat16)
    assert narrow >= 0.9 * elements and not any(g.dtype == torch.bfloat16 for g in grads(wide.plan.graph))
    assert host_traffic(wide.plan.graph).to_host - host_traffic(step.plan.graph).to_host == 2 * narrow
    assert estimate_memory(step.plan.graph).peak < estimate_memory(wide.plan.graph).peak
    summary = next(r.summary for r in step.plan.records if r.name == "fold_gradient_casts")
    assert "go down to the host update in 16 bits" in summary


def test_frozen_pieces_keep_their_master_on_the_host_and_their_copy_unchanged():
    # a frozen parameter at ZeRO-3 is sharded and gathered, never updated: its copy is made once and read after
    def frozen_gpt():
        torch.manual_seed(0)
        model = tiny_gpt()
        model.pos.weight.requires_grad_(False)
        return model

    config = _masters(True)
    step, model, _, losses = _single(config, model=frozen_gpt(), steps=3)
    config["stepfx"]["host_master_weights"] = False
    plain, _, _, plain_losses = _single(config, model=frozen_gpt(), steps=3)
    assert [l.item() for l in losses] == [l.item() for l in plain_losses]
    ours, theirs = step.model_state_dict(), plain.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    from stepfx.runtime.carried import PieceCopy

    frozen = [c for k, c in step._store.carried.items() if isinstance(c, PieceCopy) and k[1] == "pos.weight"]
    assert frozen and frozen[0].repacks == 1 and frozen[0].reads == 3


def test_masters_stay_on_the_device_where_the_host_has_no_room_for_them():
    # "auto" (the default): 12 host bytes an element do not fit a budget of 10 (the moments' 8 do)
    elements = sum(p.numel() for p in tiny_gpt().parameters())
    config = _masters("auto", gradient_clipping=0)
    config["stepfx"]["host_memory_budget_gib"] = 10 * elements / 2**30
    step, *_ = _single(config, steps=1)
    record = next(r for r in step.plan.records if r.name == "host_master_weights")
    assert not record.changed and "would not fit the host with the moments" in record.summary, record.summary
    config["stepfx"]["host_memory_budget_gib"] = 12 * elements / 2**30
    step, *_ = _single(config, steps=1)
    assert next(r for r in step.plan.records if r.name == "host_master_weights").changed


def _lm_forward_backward(model, optimizer, idx):
    from stepfx.testing.models import lm_loss

    loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    return loss


@pytest.mark.parametrize("clip, warm", [(0.0, 0), (0.5, 0), (0.5, 2)],
                         ids=["unclipped", "clipped-speculated", "two-exact-steps-first"])
def test_delayed_parameter_update_is_zero_offloads_one_step_stale_update_bitwise(clip, warm):
    # stepfx.delayed_parameter_update: each step's host update runs while the next step computes. Against
    # the rule written out eagerly: step t computes at the parameters before update t-1 and its gradient updates
    # those after it; reading the state applies the pending update, and the next step computes at the latest.
    # An integer N: the first N steps wait for their own update (exact), the delay begins after them
    import copy

    from stepfx.testing.equivalence import mixed_precision_reference

    batches = [b for (b,) in dp_batches(1, steps=5)[0]]
    config = _masters(True, gradient_clipping=clip)
    config["stepfx"]["delayed_parameter_update"] = warm or True
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = adamw(model)
    step = stepfx.parallelize(config)(lm_step)
    losses = [step(model, opt, b).item() for b in batches[:4]]
    params, state = step.model_state_dict(), step.optimizer_state()  # applies the 4th update
    after = step(model, opt, batches[4]).item()

    torch.manual_seed(0)
    stale = tiny_gpt()  # what the steps compute at
    master = copy.deepcopy(stale)
    ref_opt = adamw(master)
    fwd_bwd = mixed_precision_reference(_lm_forward_backward, torch.bfloat16)
    expected = []
    for i, b in enumerate(batches[:4]):
        expected.append(fwd_bwd(stale, None, b).item())
        before = [p.detach().clone() for p in master.parameters()]
        for p, q in zip(master.parameters(), stale.parameters()):
            p.grad, q.grad = q.grad, None
        if clip:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():  # exact: the next step computes at this update's parameters; delayed: at those before
            for q, p, v in zip(stale.parameters(), master.parameters(), before):
                q.copy_(p if i < warm else v)
    assert losses == expected
    assert all(torch.equal(params[n], p) for n, p in master.named_parameters())
    ours = {n: state[n]["exp_avg"] for n in state}
    assert all(torch.equal(ours[n], ref_opt.state[p]["exp_avg"]) for n, p in master.named_parameters())
    assert after == fwd_bwd(master, None, batches[4]).item()  # at the latest parameters, once the state was read
    assert any(n.target is H.host_adam_swap for n in step.plan.graph.gm.graph.nodes)
    summary = next(r.summary for r in step.plan.records if r.name == "host_master_weights")
    assert "delayed parameter update" in summary and (f"after {warm} exact first steps" in summary) == bool(warm)


def test_the_delayed_updates_copies_are_in_the_memory_estimate():
    # the delayed job uploads its bf16 copies outside the graph, while the next step runs (measured on the 1.3B:
    # 23.0 GiB against 18.0 without the delay, predicted 17.3 for both before this): the previous job's copies are
    # counted all step, this step's from its job's start
    from stepfx.graph.accounting import estimate_memory

    def planned(delayed):
        config = _masters(True, gradient_clipping=0.5)
        config["stepfx"]["delayed_parameter_update"] = delayed
        torch.manual_seed(0)
        model = tiny_gpt()
        step = stepfx.parallelize(config)(lm_step)
        step(model, adamw(model), dp_batches(1, steps=1)[0][0][0])
        return step

    exact, delayed = planned(False), planned(True)
    copies = sum(t.numel() * t.element_size() for k, t in delayed._store.tensors.items()
                 if k[0] is Role.RUNTIME_STATE and k[2] == "master_copy")
    assert copies > 0
    extra = estimate_memory(delayed.plan.graph).peak - estimate_memory(exact.plan.graph).peak
    assert copies <= extra <= 2 * copies, (extra, copies)


def test_delayed_parameter_update_on_two_ranks_follows_the_rule(rank_pool):
    # each rank's loss at the stale parameters, the gradients averaged over the ranks and clipped over both;
    # against the rule written out eagerly per rank's batch (gradients averaged as the all-reduce does, in
    # another order: 1e-5)
    import copy

    from stepfx.testing.equivalence import mixed_precision_reference

    steps = 3
    results = rank_pool(2).run(W.delayed_update_run, steps)
    batches = dp_batches(2, steps=steps)
    torch.manual_seed(0)
    stale = tiny_gpt()
    master = copy.deepcopy(stale)
    opt = adamw(master)
    fwd_bwd = mixed_precision_reference(_lm_forward_backward, torch.bfloat16)
    for i in range(steps):
        grads = []
        for rank in range(2):
            loss = fwd_bwd(stale, None, batches[rank][i][0]).item()
            assert abs(results[rank]["losses"][i] - loss) <= 1e-5 * abs(loss), (rank, i)
            grads.append([q.grad for q in stale.parameters()])
            for q in stale.parameters():
                q.grad = None
        before = [p.detach().clone() for p in master.parameters()]
        for p, a, b in zip(master.parameters(), *grads):
            p.grad = (a + b) / 2
        torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for q, v in zip(stale.parameters(), before):
                q.copy_(v)
    for rank in range(2):
        got = results[rank]["params"]
        for n, p in master.named_parameters():
            assert torch.allclose(got[n], p, rtol=1e-5, atol=1e-6), (rank, n, (got[n] - p).abs().max())


def test_delayed_parameter_update_without_host_masters_is_refused_by_key():
    config = _cfg(2, bf16={"enabled": True})
    config["stepfx"]["delayed_parameter_update"] = True
    with pytest.raises(ConfigError, match=r"stepfx\.delayed_parameter_update: needs the fp32 masters on the host.*"
                                          r"below ZeRO-3"):
        _single(config, steps=1)


def test_an_optimizer_without_a_host_update_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"zero_optimization\.offload_optimizer.*SGD"):
        _single(_cfg(2), opt_fn=sgd_momentum, steps=1)


def test_offload_at_stage_0_is_refused():
    with pytest.raises(ConfigError, match="offload_optimizer"):
        _single(_cfg(0), steps=1)


def test_fused_host_adam_is_within_an_ulp_per_step():
    # stepfx.host_adam "fused" (the default): torch's fused CPU Adam; one step from the same state: the moments bitwise, the
    # parameters within 1e-6 relative (normwise) of the unfused ops
    from stepfx.testing.equivalence import compare_tensors

    step, *_ = _single(_cfg(2, host_adam="fused"), steps=1)
    plain, *_ = _single(_cfg(2), steps=1)
    assert "(fused kernel)" in next(r.summary for r in step.plan.records if r.name == "offload_optimizer")
    ours, theirs = step.optimizer_state(), plain.optimizer_state()
    assert all(torch.equal(ours[n][k], theirs[n][k]) for n in theirs for k in theirs[n])
    ours, theirs = step.model_state_dict(), plain.model_state_dict()
    worst = max(compare_tensors(n, ours[n], theirs[n], 1e-6, 0.0, normwise=True)[1] for n in theirs)
    assert 0 < worst <= 1e-6  # not the same arithmetic, and within the per-step tolerance


@pytest.mark.parametrize("stage, masters", [(2, False), (3, False), (3, True)],
                         ids=["stage2", "stage3", "stage3-bf16-host-masters"])
def test_checkpoint_of_host_held_state_resumes_bitwise(tmp_path, stage, masters):
    # the moments live on the host: a checkpoint holds them, a fresh run loads them into its host store,
    # and training continues exactly as the run that never stopped; with the fp32 masters there too
    # (host_master_weights), loading into the running step makes the bf16 copies afresh from them
    config = _masters(True) if masters else _cfg(stage)
    step, model, opt, _ = _single(config, steps=2)
    step.save_checkpoint(tmp_path)
    batches = [b for (b,) in dp_batches(1, steps=4, seed=5)[0]]
    losses = [float(step(model, opt, b)) for b in batches]
    torch.manual_seed(1)
    fresh_model = tiny_gpt()
    fresh_opt = adamw(fresh_model)
    fresh = stepfx.parallelize(config)(lm_step)
    fresh.load_checkpoint(tmp_path, model=fresh_model, optimizer=fresh_opt)
    resumed = [float(fresh(fresh_model, fresh_opt, b)) for b in batches]
    assert resumed == losses
    ours, theirs = fresh.model_state_dict(), step.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    ours, theirs = fresh.optimizer_state(), step.optimizer_state()
    assert all(torch.equal(ours[n][k], theirs[n][k]) for n in theirs for k in theirs[n])
    host = fresh.plan.graph.signature.extra[HOST_STATE_KEY]
    assert host and all(ident in fresh._store.tensors for ident in host)
    if masters:
        from stepfx.runtime.carried import PieceCopy

        made = sum(c.repacks for c in step._store.carried.values() if isinstance(c, PieceCopy))
        step.load_checkpoint(tmp_path)
        assert [float(step(model, opt, b)) for b in batches] == losses
        assert sum(c.repacks for c in step._store.carried.values() if isinstance(c, PieceCopy)) > made


@pytest.mark.parametrize("stage, bf16", [(2, False), (3, True)], ids=["moments", "moments-and-bf16-masters"])
def test_nvme_keeps_the_moments_in_files_and_equals_the_host_tier(tmp_path, stage, bf16):
    # device nvme: the moments are mapped files under nvme_path (unlinked once mapped: nothing left behind);
    # the arithmetic is the cpu tier's, bitwise; a checkpoint loaded into the running step stays in the files.
    # Under bf16 at ZeRO-3 the fp32 masters live there too (host_master_weights)
    nvme = tmp_path / "nvme"
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    step, model, _, losses = _single(_cfg(stage, offload={"device": "nvme", "nvme_path": str(nvme)}, **extra), steps=3)
    host, _, _, host_losses = _single(_cfg(stage, **extra), steps=3)
    assert [float(l) for l in losses] == [float(l) for l in host_losses]
    ours, theirs = step.optimizer_state(), host.optimizer_state()
    assert all(torch.equal(ours[n][k], theirs[n][k]) for n in theirs for k in theirs[n])
    ours, theirs = step.model_state_dict(), host.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    roles = {s.role for s in step.plan.graph.signature.inputs if s.ident in step.plan.graph.signature.extra[HOST_STATE_KEY]}
    assert roles == ({Role.OPTIMIZER_STATE, Role.PARAM} if bf16 else {Role.OPTIMIZER_STATE})
    held = [step._store.tensors[i] for i in step.plan.graph.signature.extra[HOST_STATE_KEY]]
    assert held and all(str(t.untyped_storage().filename).startswith(str(nvme)) for t in held)
    assert os.listdir(nvme) == []
    assert "in files under" in next(r.summary for r in step.plan.records if r.name == "offload_optimizer")
    step.save_checkpoint(tmp_path / "ckpt")
    step.load_checkpoint(tmp_path / "ckpt")
    held_again = [step._store.tensors[i] for i in step.plan.graph.signature.extra[HOST_STATE_KEY]]
    assert all(a is b for a, b in zip(held, held_again))


def test_nvme_without_a_path_is_refused_by_key():
    with pytest.raises(ConfigError, match=r"offload_optimizer\.nvme_path"):
        _single(_cfg(2, offload={"device": "nvme"}), steps=1)


@pytest.mark.slow
def test_tensor_parallel_shards_are_updated_on_the_host(rank_pool):
    # TP 2 x ZeRO-2 (over a data-parallel group of one): each rank's Megatron shard's pieces, clipped over
    # the shards, updated on the host. Against the same split step updated on the device, bitwise (the host
    # update is torch's arithmetic: "exact"); the losses against the single-process reference (1e-5). The
    # parameters are not compared with the single process's after Adam: where a gradient's sign flips
    # between the two steps, Adam's update is a small difference of moments, and the split step's rounding
    # (its sums over features in another order) moves it by ~1e-6 absolute, more than 1e-5 of the tensor's
    # largest entry; the SGD tests in test_tensor_parallel.py hold the split step to 1e-5.
    from stepfx.testing.equivalence import data_parallel_reference
    from tests.runtime.test_tensor_parallel import CLIP, TP2
    from tests.steps import hf_llama, hf_step
    from tests.tp_workers import tp_run

    batches = [dp_batches(1, steps=2)[0]]
    on_device = {**TP2, "gradient_clipping": CLIP, "zero_optimization": {"stage": 2}}
    config = {**on_device, "stepfx": {"host_adam": "exact"},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    results = rank_pool(2).run(tp_run, hf_step, hf_llama, adamw, batches, config)
    device = rank_pool(2).run(tp_run, hf_step, hf_llama, adamw, batches, on_device)
    outputs, _, _ = data_parallel_reference(hf_step, hf_llama, adamw, batches, clip_norm=CLIP)
    for got, ref in zip(results, device):
        assert got["losses"] == pytest.approx([out[0].item() for out in outputs], rel=1e-5, abs=0)
        assert got["losses"] == ref["losses"]
        for name, value in ref["state"].items():
            assert torch.equal(got["state"][name], value), name
    assert all("run on the host" in got["explain"] for got in results)
