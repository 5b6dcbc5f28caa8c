"""The codegen passes on whole steps (fuse_optimizer_update, fuse_sum_squares,
fuse_layer_norm), single process, Triton's interpreter on CPU.

Tolerance: fp32, 1e-5 relative per element, per step (each step compared
from identical states: ``resync=True``) — the project's fp32 bound. The
fused kernels compute the same math
as torch's single-tensor optimizers, LayerNorm and norms, in another
association (fused multiply-adds, one-pass reductions), so bitwise equality
is not expected; the measured differences are ~1e-7.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

import stepfx
from stepfx.graph import META_DONATED
from stepfx.graph.update_rule import UPDATE_RULES_KEY
from stepfx.passes.fusion.fuse_optimizer_update import FUSION_REPORT_KEY
from stepfx.testing.equivalence import assert_step_equivalent
from tests.steps import MLP, lm_step, mlp_batches, scaled_ce_step, tiny_gpt, token_batches

CODEGEN = {"stepfx": {"codegen": True}, "gradient_clipping": 0}


def ce_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _optimizers():
    return {
        "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
        "adam-l2": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.05, betas=(0.8, 0.95)),
        "adam-maximize": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, maximize=True),
        "sgd-nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
        "sgd-dampening": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5, dampening=0.3),
        "sgd-plain": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    }


def _fused(step) -> tuple[int, int, list]:
    """(fused update calls, of them in place, not-fused records) of the latest plan."""
    nodes = [n for n in step.plan.graph.gm.graph.nodes if n.op == "call_function"]
    calls = [n for n in nodes if getattr(n.target, "__name__", "") in ("adam_step", "sgd_step")]
    many = [n for n in nodes if getattr(n.target, "__name__", "") == "adam_step_many"]  # batch_optimizer_updates
    report = [r for r in step.plan.graph.signature.extra.get(FUSION_REPORT_KEY, ()) if r[0] == "fuse_optimizer_update"]
    updates = len(calls) + sum(n.args[0] for n in many)
    in_place = sum(1 for n in calls if n.meta.get(META_DONATED)) + sum(n.args[0] for n in many if n.meta.get(META_DONATED))
    return updates, in_place, report


@pytest.mark.parametrize("name", list(_optimizers()))
def test_fused_updates_equal_the_eager_optimizer(name):
    make_opt = _optimizers()[name]
    report = assert_step_equivalent(ce_step, lambda: MLP((8, 24, 4)), make_opt, mlp_batches(4), config=CODEGEN,
                                    rtol=1e-5, atol=1e-7, resync=True)
    assert report.steps == 4


def _run(config, make_opt=None, steps=3):
    torch.manual_seed(0)
    model = MLP((8, 24, 4))
    opt = (make_opt or _optimizers()["adamw"])(model)
    step = stepfx.parallelize(config)(ce_step)
    for x, y in mlp_batches(steps):
        step(model, opt, x, y)
    return step, model, opt


def test_every_update_is_fused_in_place_and_a_state_creating_step_is_not():
    step, model, opt = _run(CODEGEN)
    calls, in_place, report = _fused(step)
    assert calls == 4 and in_place == 4 and report == []
    assert len(step.plans) == 1  # Adam's state exists before the first capture: its first step is fused too
    # SGD with dampening creates its momentum buffers at its first step (clones of the gradients): that step
    # runs once, unfused
    sgd, _, _ = _run(CODEGEN, _optimizers()["sgd-dampening"])
    first = sgd.plans[0]
    first_report = [r for r in first.graph.signature.extra[FUSION_REPORT_KEY] if r[0] == "fuse_optimizer_update"]
    assert len(first_report) == 4 and all("created in this step" in why for _, _, why in first_report)
    # in place: the module's parameters and the optimizer's state are the same tensors as before the step
    before = [p.data_ptr() for p in model.parameters()] + [s["exp_avg"].data_ptr() for s in opt.state.values()]
    (x, y), = mlp_batches(1, seed=9)
    step(model, opt, x, y)
    assert before == [p.data_ptr() for p in model.parameters()] + [s["exp_avg"].data_ptr() for s in opt.state.values()]


def test_clipping_and_fp16_fold_into_the_kernel():
    config = {"stepfx": {"codegen": True}, "gradient_clipping": 0.5,
              "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8, "hysteresis": 1}}
    step, model, opt = _run(config)
    calls, in_place, report = _fused(step)
    assert calls == 4 and in_place == 4 and report == []
    nodes = [n for n in step.plan.graph.gm.graph.nodes if n.op == "call_function"]
    # the overflow skip of parameters and state is inside the kernel; only the step counters keep theirs
    assert all(n.meta["val"].numel() == 1 for n in nodes if n.target is torch.ops.aten.where.self)
    many = [n for n in nodes if getattr(n.target, "__name__", "") == "sum_squares_many"]  # batch_sum_squares
    assert len(many) == 1 and len(many[0].args) == 4
    text = step.explain()
    assert "adam_step_many" in text and "(4 updates write in place" in text and "@triton.jit" in text  # the kernels' source is shown


def test_fp16_overflow_skips_bit_for_bit_with_fused_kernels():
    config = {"stepfx": {"codegen": True}, "gradient_clipping": 0,
              "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8, "hysteresis": 1}}

    torch.manual_seed(0)
    model = MLP((8, 24, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = stepfx.parallelize(config)(scaled_ce_step)
    (x, y), = mlp_batches(1)
    for _ in range(2):
        step(model, opt, x, y, torch.tensor(1.0))
    assert _fused(step)[0] == 4
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in step.optimizer_state().items()}
    step(model, opt, x, y, torch.tensor(1e30))
    assert step.skipped_steps == 1
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    after = step.optimizer_state()
    assert all(torch.equal(state[n][k], after[n][k]) for n in state for k in state[n])


def test_step_counter_on_the_device_is_read_there(monkeypatch):
    """Under fp16 on CUDA a skipped step leaves the step counter unchanged on
    the device, so the fused updates take Adam's step size and bias
    correction from one ``adam_scalars`` node computed there, never from a
    host read. On CPU the counter is a host tensor: pretend it is not, and
    the results must be bit-identical to the host path's, skipped steps too."""
    from stepfx.passes.fusion import fuse_optimizer_update as fou

    config = {"stepfx": {"codegen": True}, "gradient_clipping": 0.5,
              "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8, "hysteresis": 1}}
    (x, y), = mlp_batches(1)
    runs = []
    for device_path in (False, True):
        if device_path:
            monkeypatch.setattr(fou, "_on_host", lambda val: False)
        torch.manual_seed(0)
        model = MLP((8, 24, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        step = stepfx.parallelize(config)(scaled_ce_step)
        losses = [step(model, opt, x, y, torch.tensor(b)) for b in (1.0, 1.0, 1e30, 1.0, 1.0)]
        runs.append((step, [p.detach().clone() for p in model.parameters()], losses))
    (host, host_params, host_losses), (dev, dev_params, dev_losses) = runs
    assert dev.skipped_steps == 1 and _fused(dev)[0] == 4
    assert all(torch.equal(a, b) for a, b in zip(host_params, dev_params))
    assert all(torch.equal(a, b) for a, b in zip(host_losses, dev_losses))
    nodes = [n for n in dev.plan.graph.gm.graph.nodes if n.op == "call_function"]
    scalars = [n for n in nodes if getattr(n.target, "__name__", "") == "adam_scalars"]
    assert len(scalars) == 1, [n.format_node() for n in scalars]  # once per step, for every parameter's kernel
    # the batched updates, and a lone one carry_parameter_copies made a call of one
    many = [n for n in nodes if getattr(n.target, "__name__", "") == "adam_step_many"]
    assert many and sum(m.args[0] for m in many) == 4 and all(m.kwargs.get("step_on_device") for m in many)
    assert all(m.args[1 + 4 * m.args[0] + 3] is scalars[0] for m in many)  # the step argument
    assert not any(n.target is torch.ops.aten._local_scalar_dense.default and n.args[0].meta["val"].dtype != torch.float64
                   for n in nodes), "the step counter is still read on the host"


@pytest.mark.xdist_group("gpt16_runs")  # one test process: they share _gpt16's runs
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fused_kernels_read_16_bit_gradients(precision):
    """Mixed precision: the fp32 copies of the 16-bit gradients are dropped
    and the kernels read the gradients themselves: the same bits as with
    the copies (widening is exact), one kernel and 6 B/element fewer."""
    (losses, params, nodes), (kept_losses, kept_params, kept_nodes) = _gpt16_with_and_without("fold_gradient_casts", precision)
    assert all(torch.equal(a, b) for a, b in zip(losses, kept_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, kept_params))

    def grad_copies(nodes):
        return [n for n in nodes if n.target is torch.ops.aten._to_copy.default
                and str(n.meta["phase"]) == "backward"  # (not the forward's upcast of fp16 logits)
                and n.meta["val"].dtype == torch.float32 and n.args[0].meta["val"].dtype != torch.float32]

    n_params = len(list(tiny_gpt().parameters()))
    assert len(grad_copies(kept_nodes)) >= n_params and grad_copies(nodes) == []
    grads = []
    for n in nodes:
        name = getattr(n.target, "__name__", "")
        if name == "sum_squares":
            grads.append(n.args[0])
        elif name == "sum_squares_many":  # batch_sum_squares
            grads.extend(n.args)
        elif name == "adam_step":
            grads.append(n.args[1])
        elif name == "adam_step_many":  # batch_optimizer_updates: count, params, grads, ...
            grads.extend(n.args[1 + n.args[0]:1 + 2 * n.args[0]])
    assert len(grads) == 2 * n_params and all(g.meta["val"].dtype != torch.float32 for g in grads)


@pytest.mark.parametrize("stage", [0, 3])
def test_parameter_casts_by_the_cast_kernel(monkeypatch, stage):
    """bf16's compute copies of the parameters (whole, or ZeRO-3 shards
    planned for one rank) by the vectorized cast kernel: the same bits as
    aten's cast (every size here, not only the large ones the pass picks)."""
    from stepfx.passes.fusion import fuse_casts

    monkeypatch.setattr(fuse_casts, "MIN_NUMEL", 0)
    runs = []
    for disable in (["batch_parameter_casts"], ["fuse_casts", "batch_parameter_casts"]):
        torch.manual_seed(0)
        model = tiny_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        config = {**CODEGEN, "bf16": {"enabled": True}, "stepfx": {"codegen": True, "disable": disable}}
        if stage:
            # one rank's plan of a 2-rank ZeRO-3 step, run alone: the shards' casts
            from stepfx.capture import capture_step
            from stepfx.capture.trace import CaptureOptions
            from stepfx.config import load_config
            from stepfx.passes import PIPELINE, PassManager, PassOptions

            lm_step(model, opt, *token_batches(1)[0])
            graph = capture_step(lm_step, model, opt, token_batches(1)[0], {},
                                 options=CaptureOptions(compute_dtype=torch.bfloat16))
            options = PassOptions(config=load_config({**config, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}),
                                  world_size=2, rank=0, group_name="test", device_type="cpu")
            records = PassManager(PIPELINE, disable=disable).run(graph, options)
            casts = [n for n in records[-1].graph.gm.graph.nodes if getattr(n.target, "__name__", "") == "cast"]
            runs.append(casts)
            continue
        step = stepfx.parallelize(config)(lm_step)
        losses = [step(model, opt, *batch) for batch in token_batches(2)]  # the second reuses the plan
        casts = [n for n in step.plan.graph.gm.graph.nodes if getattr(n.target, "__name__", "") == "cast"]
        runs.append((losses, [p.detach().clone() for p in model.parameters()], casts))
    if stage:
        assert len(runs[0]) > 0 and runs[1] == []
        return
    (losses, params, casts), (kept_losses, kept_params, kept_casts) = runs
    assert len(casts) == len(list(model.parameters())) and kept_casts == []
    assert all(torch.equal(a, b) for a, b in zip(losses, kept_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, kept_params))


_PRECISION = {"bf16": {"bf16": {"enabled": True}},
              "fp16": {"fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8}}}


@functools.cache
def _gpt16(precision: str = "bf16", disable: tuple[str, ...] = ()):
    """16-bit AdamW steps of the tiny GPT with codegen and clipping, the
    passes in ``disable`` off: (losses, parameters after, the final graph's
    calls). Enough steps that the last reuses the final plan with Adam's
    state warm (and reads the copies the step before carried): two in bf16;
    three in fp16, whose second call captures again. Cached: several tests
    compare a pass against the bf16 run with every pass on, which is the
    same run (callers only read it)."""
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = stepfx.parallelize({**CODEGEN, **_PRECISION[precision], "gradient_clipping": 1.0,
                               "stepfx": {"codegen": True, "disable": list(disable)}})(lm_step)
    losses = [step(model, opt, *batch) for batch in token_batches(2 if precision == "bf16" else 3)]
    assert step.plan.created_at_call < len(losses)  # the final plan was reused
    nodes = [n for n in step.plan.graph.gm.graph.nodes if n.op == "call_function"]
    return losses, [p.detach().clone() for p in model.parameters()], nodes


def _gpt16_with_and_without(pass_name: str, precision: str = "bf16"):
    """:func:`_gpt16` with every pass, and with ``pass_name`` disabled."""
    return [_gpt16(precision, ()), _gpt16(precision, (pass_name,))]


@pytest.mark.xdist_group("gpt16_runs")  # one test process: they share _gpt16's runs
def test_parameter_casts_batched_into_one_launch_are_the_same_bits():
    """batch_parameter_casts: every parameter's bf16 copy is a view of one
    packed buffer (one cast_pack launch), at offsets aligned for cuBLAS;
    the losses and updated parameters are bitwise those of one cast per
    parameter."""
    from stepfx.graph.layout import ALIGN

    # without carry_parameter_copies, which makes the pack an input of the step
    (losses, params, nodes), (kept_losses, kept_params, kept_nodes) = [
        _gpt16("bf16", ("carry_parameter_copies",)), _gpt16("bf16", ("carry_parameter_copies", "batch_parameter_casts"))]
    assert all(torch.equal(a, b) for a, b in zip(losses, kept_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, kept_params))
    model = tiny_gpt()
    packs = [n for n in nodes if getattr(n.target, "__name__", "") == "pack" and n.name.startswith("params16")]
    assert len(packs) == 1
    sources, offsets, total = packs[0].args
    n_params = len(list(model.parameters()))
    assert len(sources) == n_params and all(s.op == "placeholder" for s in sources)
    assert all(o % ALIGN == 0 for o in offsets) and total % ALIGN == 0
    # no parameter is converted on its own any more; without the pass each one is
    converted = [n for n in nodes if getattr(n.target, "__name__", "") == "cast" or n.target is torch.ops.aten._to_copy.default]
    assert not any(n.args[0].op == "placeholder" for n in converted)
    kept = [n for n in kept_nodes if getattr(n.target, "__name__", "") == "cast" or n.target is torch.ops.aten._to_copy.default]
    assert sum(n.args[0].op == "placeholder" for n in kept) == n_params


def test_generic_regions_go_to_inductor(monkeypatch):
    """Hugging Face Llama's hand-written RMSNorm (with the residual add
    before it; here with fuse_rms_norm off, as for a norm its kernels do not
    take), SwiGLU, their backward chains and the rotary embedding
    (slices, neg, cat; slice_backward in backward) become inductor regions; the step still equals eager per step within
    1e-5 (SGD: inductor's CPU code vectorizes and fuses multiply-adds).
    Regions on CPU only here: inductor's CPU backend compiles C++."""
    from stepfx.codegen.regions import REGIONS
    from stepfx.passes.fusion import fuse_generic_regions
    from tests.steps import hf_llama, hf_step, parallelized_steps

    monkeypatch.setattr(fuse_generic_regions, "ON_CPU", True)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    made = parallelized_steps(monkeypatch)  # the regions read below are those of the compared run
    config = {**CODEGEN, "stepfx": {**CODEGEN.get("stepfx", {}), "disable": ["fuse_rms_norm"]}}
    report = assert_step_equivalent(hf_step, hf_llama, sgd, token_batches(3), config=config, rtol=1e-5, atol=1e-7,
                                    resync=True)
    assert report.steps == 3
    (step,) = made
    regions = step.plan.graph.signature.extra["generic_regions"]
    keys = [key for key, _ in regions]
    assert len(set(keys)) < len(keys)  # identical layers share one compiled region
    rms = [key for key in set(keys) if {"aten.mean.dim", "aten.rsqrt.default", "aten.pow.Tensor_Scalar"} <= set(REGIONS[key].ops)]
    assert rms, "the RMSNorm chain is not one region"
    # SwiGLU: silu(gate) * up, with up made after silu (the region goes where its last op was)
    assert any({"aten.silu.default", "aten.mul.Tensor"} <= set(REGIONS[key].ops) for key in set(keys))
    # rotary embeddings: q * cos + rotate_half(q) * sin in one region, and their backward
    assert any({"aten.cat.default", "aten.neg.default", "aten.slice.Tensor"} <= set(REGIONS[key].ops) for key in set(keys))
    assert any({"aten.slice_backward.default", "aten.neg.default"} <= set(REGIONS[key].ops) for key in set(keys))
    nodes = list(step.plan.graph.gm.graph.nodes)
    assert not any(n.target is torch.ops.aten.rsqrt.default for n in nodes)
    text = step.explain()
    assert "handed to inductor" in text and f"# -- {rms[0]}" in text and "torch.ops.aten.rsqrt.default" in text
    assert all(REGIONS[key].failed is None for key in keys)


def test_a_region_inductor_cannot_compile_runs_as_its_ops(monkeypatch, caplog):
    from stepfx import compat
    from stepfx.codegen import regions
    from stepfx.passes.fusion import fuse_generic_regions

    def broken(gm, dynamic=False):
        def run(*args):
            raise RuntimeError("no backend today")
        return run

    monkeypatch.setattr(fuse_generic_regions, "ON_CPU", True)
    monkeypatch.setattr(compat, "compile_region", broken)
    monkeypatch.setattr(regions, "REGIONS", {})  # fresh: nothing compiled by earlier tests
    from tests.steps import hf_llama, hf_step

    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    assert_step_equivalent(hf_step, hf_llama, sgd, token_batches(2), config=CODEGEN, rtol=1e-6, atol=1e-7)
    assert regions.REGIONS and all("no backend today" in r.failed for r in regions.REGIONS.values())
    assert "runs as aten ops" in caplog.text


@pytest.mark.xdist_group("gpt16_runs")  # one test process: they share _gpt16's runs
def test_updates_batched_into_one_launch_are_bit_identical():
    """batch_optimizer_updates: every in-place Adam update of the step in
    one multi-tensor call (the tied embedding's too, whose step argument
    comes in the other form), the same bits as one call per parameter."""
    # without carry_parameter_copies, which makes a lone update one multi-tensor call too
    runs = [(losses, params, [getattr(n.target, "__name__", "") for n in nodes]) for losses, params, nodes in
            (_gpt16("bf16", ("carry_parameter_copies",)), _gpt16("bf16", ("carry_parameter_copies", "batch_optimizer_updates")))]
    (losses, params, names), (kept_losses, kept_params, kept_names) = runs
    n_params = len(params)
    assert names.count("adam_step_many") == 1 and "adam_step" not in names
    assert kept_names.count("adam_step") == n_params and "adam_step_many" not in kept_names
    assert all(torch.equal(a, b) for a, b in zip(losses, kept_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, kept_params))


def test_the_check_refuses_ops_that_compute_another_rule(monkeypatch):
    # capture records eps=1e-8; claim 1e-3: the update ops no longer match the kernel's reference
    from stepfx.capture import trace

    real = trace.update_rule_of

    def wrong_eps(optimizer, group):
        rule = real(optimizer, group)
        return dataclasses.replace(rule, eps=1e-3)

    monkeypatch.setattr(trace, "update_rule_of", wrong_eps)
    step, _, _ = _run(CODEGEN)
    calls, _, report = _fused(step)
    assert calls == 0 and len(report) == 4
    assert all("do not compute" in why for _, _, why in report)


def test_amsgrad_is_left_as_ops_with_the_reason():
    step, _, _ = _run(CODEGEN, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True))
    calls, _, report = _fused(step)
    assert calls == 0 and {why for _, _, why in report} == {"amsgrad has no fused kernel"}
    assert "amsgrad has no fused kernel" in step.explain()


@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov"])
def test_a_model_held_in_bf16_keeps_torchs_update_ops_with_the_reason(name):
    """The update kernels take fp32 parameters (masters); a model the user holds in bf16 (no mixed precision
    config) used to fail the pass ("param has dtype torch.bfloat16") at its first call with codegen, the
    default on CUDA. Its updates stay torch's ops, named in explain(), and the step equals eager bf16 bitwise
    (an MLP: no other kernel takes these bf16 ops on the CPU)."""
    make_opt = _optimizers()[name]
    report = assert_step_equivalent(ce_step, lambda: MLP((8, 24, 4)).to(torch.bfloat16), make_opt,
                                    [(x.to(torch.bfloat16), y) for x, y in mlp_batches(3)], config=CODEGEN,
                                    rtol=0, atol=0)
    assert report.steps == 3
    model = MLP((8, 24, 4)).to(torch.bfloat16)
    step = stepfx.parallelize(CODEGEN)(ce_step)
    opt = make_opt(model)
    for x, y in mlp_batches(2):
        step(model, opt, x.to(torch.bfloat16), y)
    calls, _, records = _fused(step)
    assert calls == 0 and records
    assert all("param has dtype torch.bfloat16" in why for _, _, why in records)
    assert "the kernel does not take it: param has dtype torch.bfloat16" in step.explain()


def test_update_rules_are_recorded_per_parameter():
    step, model, _ = _run(CODEGEN, lambda m: torch.optim.SGD(
        [{"params": [m.net[0].weight], "momentum": 0.9}, {"params": [p for p in m.parameters() if p is not m.net[0].weight]}], lr=0.1))
    rules = step.plan.captured.signature.extra[UPDATE_RULES_KEY]
    assert rules["net.0.weight"].momentum == 0.9 and rules["net.0.bias"].momentum == 0.0


def sgd_momentum(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def test_layer_norm_and_whole_gpt_step_with_codegen():
    # SGD: its update is linear in the gradient, so the kernels' other
    # summation orders (LayerNorm's weight gradient, the chunked head
    # gradient) show up at their own size, ~1e-7
    from tests.passes.test_precision import clipped_reference

    report = assert_step_equivalent(lm_step, tiny_gpt, sgd_momentum, token_batches(3),
                                    config={**CODEGEN, "gradient_clipping": 1.0}, reference_fn=clipped_reference(lm_step, 1.0),
                                    rtol=1e-5, atol=1e-7, resync=True)
    assert report.steps == 3


def test_whole_gpt_step_with_codegen_and_adamw_tracks_the_losses():
    # AdamW divides by sqrt(v): on elements whose gradient is ~eps a
    # last-bit difference in the gradient moves the update by O(lr), so the
    # parameters are not compared elementwise; the losses are (1e-5 relative)
    torch.manual_seed(0)
    model, ref = tiny_gpt(), tiny_gpt()
    ref.load_state_dict(model.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, ref)]
    fused = stepfx.parallelize({**CODEGEN, "gradient_clipping": 1.0})(lm_step)
    plain = stepfx.parallelize({"gradient_clipping": 1.0})(lm_step)
    for batch in token_batches(4):
        a, b = fused(model, opts[0], *batch), plain(ref, opts[1], *batch)
        assert abs(a.item() - b.item()) <= 1e-5 * abs(b.item())
    step = fused
    names = [getattr(n.target, "__name__", "") for n in step.plan.graph.gm.graph.nodes if n.op == "call_function"]
    layer_norms = sum(m.__class__.__name__ == "LayerNorm" for m in model.modules())
    # fuse_residual_layer_norm: norms of a residual sum run with the add (all but the first block's ln1)
    assert names.count("layer_norm") + names.count("add_layer_norm") == layer_norms
    assert names.count("layer_norm_backward") == layer_norms
    assert torch.ops.aten.native_layer_norm.default not in [n.target for n in step.plan.graph.gm.graph.nodes]
    calls, in_place, report = _fused(step)
    assert calls == sum(1 for p in model.parameters() if p.requires_grad) and in_place == calls and report == []
    targets = {n.target for n in step.plan.graph.gm.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert not targets & {aten._log_softmax.default, aten.nll_loss_forward.default, aten._log_softmax_backward_data.default}
    assert names.count("linear_cross_entropy") == 1


def _lce_consumers(step) -> list[str]:
    """Targets of the nodes reading the fused head's gradients (items 1 and 2)."""
    nodes = step.plan.graph.gm.graph.nodes
    (call,) = [n for n in nodes if getattr(n.target, "__name__", "") == "linear_cross_entropy"]
    items = [u for u in call.users if u.args[1] in (1, 2)]
    return sorted(str(getattr(v.target, "__name__", v.target)) for u in items for v in u.users)


def test_head_gradients_are_multiplied_only_by_a_real_upstream_gradient():
    """loss.backward(): the fused head's unit gradients are the gradients (no
    multiply by ones); (loss / 3).backward(): they are multiplied by the
    upstream gradient, and the step equals the one without codegen."""
    def thirds_step(model, optimizer, idx):
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        (loss / 3).backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for step_fn, multiplied in ((lm_step, False), (thirds_step, True)):
        torch.manual_seed(0)
        model, ref = tiny_gpt(), tiny_gpt()
        ref.load_state_dict(model.state_dict())
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
        fused = stepfx.parallelize(CODEGEN)(step_fn)
        plain = stepfx.parallelize({"gradient_clipping": 0})(step_fn)
        for batch in token_batches(2):
            a, b = fused(model, opts[0], *batch), plain(ref, opts[1], *batch)
            assert abs(a.item() - b.item()) <= 1e-5 * abs(b.item())
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
        assert ("mul.Tensor" in _lce_consumers(fused)) == multiplied, _lce_consumers(fused)


def test_logits_the_step_returns_are_not_fused_away():
    def step_returning_logits(model, optimizer, idx):
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss, logits.detach()

    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = stepfx.parallelize(CODEGEN)(step_returning_logits)
    (batch,) = token_batches(1)[0]
    step(model, opt, batch)
    report = step.plan.graph.signature.extra[FUSION_REPORT_KEY]
    assert ("fuse_linear_cross_entropy", "nll_loss_forward", "the logits are read elsewhere") in report


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_bias_gradients_by_the_column_sum_kernel(monkeypatch, model):
    """fuse_column_sums and fuse_bias_gradients (every size here): the bias
    gradients of the linear layers are column sums, taken by the kernel that
    writes their input where one does (the concatenation of the GPT's q, k, v
    gradients; a LayerNorm backward: the GPT's attention projection and MLP
    output), by column_sum otherwise (after a GELU: the GPT's tanh, the MLP's
    exact); the fp32 step stays within the
    project's bound of eager (SGD: the other summation order shows at its
    own size); without the passes they are aten sums."""
    from stepfx.passes.fusion import fuse_column_sums
    from tests.passes.test_precision import clipped_reference
    from tests.steps import ce_step

    monkeypatch.setattr(fuse_column_sums, "MIN_NUMEL", 0)
    if model == "gpt":
        make, step_fn, batches = tiny_gpt, lm_step, token_batches(3)
        # per block: qkv's by the q/k/v gradients' concatenation, proj's and fc_out's by a LayerNorm backward
        cats, norm_sums = len(tiny_gpt().blocks), 2 * len(tiny_gpt().blocks)
    else:
        def make():
            return MLP((8, 24, 16, 4))
        step_fn, batches, cats, norm_sums = ce_step, mlp_batches(3), 0, 0
    report = assert_step_equivalent(step_fn, make, sgd_momentum, batches,
                                    config={**CODEGEN, "gradient_clipping": 1.0}, reference_fn=clipped_reference(step_fn, 1.0),
                                    rtol=1e-5, atol=1e-7, resync=True)
    assert report.steps == 3
    counts = []
    for disable in ([], ["fuse_bias_gradients"], ["fuse_column_sums"]):
        torch.manual_seed(0)
        net = make()
        step = stepfx.parallelize({**CODEGEN, "stepfx": {"codegen": True, "disable": disable}})(step_fn)
        step(net, sgd_momentum(net), *batches[0])
        nodes = [n for n in step.plan.graph.gm.graph.nodes if n.op == "call_function"]
        names = [getattr(n.target, "__name__", "") for n in nodes]
        counts.append((names.count("column_sum"), names.count("cat_column_sum"),
                       sum(name == "layer_norm_backward" and n.kwargs.get("grad_input_sum") is not None
                           for n, name in zip(nodes, names)),
                       sum(n.target is torch.ops.aten.sum.dim_IntList and n.args[1] == [0] and n.args[0].meta["val"].dim() == 2
                           for n in nodes)))
    linears = sum(isinstance(m, torch.nn.Linear) and m.bias is not None for m in make().modules())
    assert counts == [(linears - cats - norm_sums, cats, norm_sums, 0), (linears, 0, 0, 0), (0, 0, 0, linears)], counts


@pytest.mark.xdist_group("gpt16_runs")  # one test process: they share _gpt16's runs
def test_residual_adds_fused_into_the_layer_norm_are_the_same_bits():
    """fuse_residual_layer_norm: every residual add the GPT normalizes next
    (two per block) runs in the LayerNorm kernel, and every add of a norm's
    input gradient to the residual stream's in the backward kernel; the
    bf16 steps' losses and parameters are bitwise those with the adds apart."""
    def fusions(nodes):
        return (sum(getattr(n.target, "__name__", "") == "add_layer_norm" for n in nodes),
                sum(n.kwargs.get("residual_grad") is not None for n in nodes))

    (losses, params, nodes), (kept_losses, kept_params, kept_nodes) = _gpt16_with_and_without("fuse_residual_layer_norm")
    fused, kept = fusions(nodes), fusions(kept_nodes)
    assert all(torch.equal(a, b) for a, b in zip(losses, kept_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, kept_params))
    blocks = len(tiny_gpt().blocks)
    assert fused == (2 * blocks, 2 * blocks) and kept == (0, 0)


@pytest.mark.xdist_group("gpt16_runs")  # one test process: they share _gpt16's runs
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_parameter_copies_carried_between_steps_are_the_same_bits(precision):
    """carry_parameter_copies: the step packs no parameter copies; the
    multi-tensor Adam update writes every parameter's next copy into the
    buffer the rank keeps; losses and parameters over the 16-bit steps are
    bitwise those of packing at each step's start."""
    (losses, params, nodes), (kept_losses, kept_params, kept_nodes) = _gpt16_with_and_without(
        "carry_parameter_copies", precision)
    assert all(torch.equal(a, b) for a, b in zip(losses, kept_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, kept_params))

    def packs(nodes):
        return [n for n in nodes if getattr(n.target, "__name__", "") == "pack" and n.name.startswith("params16")]

    assert packs(nodes) == [] and len(packs(kept_nodes)) == 1
    (update,) = [n for n in nodes if getattr(n.target, "__name__", "") == "adam_step_many"]
    offsets = update.kwargs["copy_offsets"]
    assert len(offsets) == update.args[0] == len(list(tiny_gpt().parameters())) and min(offsets) >= 0
    buffer = update.args[-1]
    assert buffer.op == "placeholder" and buffer.meta["slot"].name == "param_copies"
    assert len(update.meta[META_DONATED]) == 3 * update.args[0] + 1 and update.meta[META_DONATED][-1] == len(update.args) - 1


def test_a_view_to_a_symbolic_size_stays_out_of_generic_regions():
    """A view whose size is read from a symbolic batch size reads that size's node; a region takes tensors
    only, so the view stays outside (it made the pass fail before: padded cuDNN attention's output gradient
    view, 2026-12-05), and the pointwise ops around it still fuse."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from stepfx.graph import META_PHASE, Phase
    from stepfx.passes.fusion.fuse_generic_regions import _regions

    def f(x):
        y = (x.sin() * 2).cos()
        return (y.view(x.shape[0], 2, 2) + 1).exp()

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(6, 4))
    for n in gm.graph.nodes:
        n.meta[META_PHASE] = Phase.FORWARD
    view = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default)
    assert any(isinstance(a.meta["val"], torch.SymInt) for a in view.all_input_nodes)
    regions = _regions(gm.graph)
    assert regions and all(view not in r.nodes for r in regions)
    assert sorted(len(r.nodes) for r in regions) == [2, 3]  # sin, mul, cos | add, exp
