"""carry_parameter_copies at run time: the 16-bit compute copies kept between
steps are packed afresh whenever something else changed a parameter.

Each case runs the same bf16 AdamW steps with the pass on and off and an
edit of the parameters between two steps; the two runs must agree bitwise
(losses and parameters), which they only do if the carried copies were
packed again after the edit. ``detect=False`` shows the comparison can fail:
with the check blinded, the stale copies give other losses.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import stepfx
from stepfx.runtime import carried
from tests.steps import MLP, mlp_batches, scaled_ce_step

CONFIG = {"bf16": {"enabled": True}, "gradient_clipping": 1.0}


def _config(carry: bool) -> dict:
    return {**CONFIG, "stepfx": {"codegen": True, "disable": [] if carry else ["carry_parameter_copies"]}}


def bf16_step(model, optimizer, x, y):
    """ce_step with the input in bf16 (bf16 gives the model bf16 parameters; its inputs are the user's)."""
    loss = F.cross_entropy(model(x.to(torch.bfloat16)).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _other_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x.to(torch.bfloat16)).float(), y) * 0.5
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _replace_bias(model, opt, batch):
    bias = model.net[2].bias
    bias.data = bias.detach() * 0.5


def _scale_all(model, opt, batch):
    model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})


EDITS = {
    "none": lambda model, opt, batch: None,
    "in place under no_grad": lambda model, opt, batch: model.net[0].weight.detach().mul_(0.5),
    "through .data": lambda model, opt, batch: model.net[0].weight.data.mul_(0.5),
    "p.data = new tensor": _replace_bias,
    "load_state_dict": _scale_all,
    "another decorated step": lambda model, opt, batch: _OTHER(model, opt, *batch),
    "torch.nn.init": lambda model, opt, batch: torch.nn.init.constant_(model.net[0].bias, 0.25),
}
_OTHER = stepfx.parallelize({**CONFIG, "stepfx": {"codegen": True}})(_other_step)


def _run(edit: str, carry: bool, steps: int = 5, at: int = 3):
    torch.manual_seed(0)
    model = MLP((8, 24, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = stepfx.parallelize(_config(carry))(bf16_step)
    batches = mlp_batches(steps + 1)
    losses = []
    for i in range(steps):
        if i == at:
            EDITS[edit](model, opt, batches[-1])
        losses.append(step(model, opt, *batches[i]))
    return losses, [p.detach().clone() for p in model.parameters()], step


def _carried(step) -> list:
    return list(step._store.carried.values())


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_between_steps_is_seen(edit):
    losses, params, step = _run(edit, carry=True)
    ref_losses, ref_params, ref_step = _run(edit, carry=False)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    (kept,) = _carried(step)  # the one in-place plan carries (Adam's state exists before the first capture)
    assert not _carried(ref_step)
    assert kept.reads == 5
    # packed on the plan's first step, and once more after an edit
    assert kept.repacks == (1 if edit == "none" else 2), kept.describe()
    if edit == "none":  # the buffer holds exactly what a fresh pack of the parameters gives
        held = step._store.tensors[next(iter(step._store.carried))]
        lay = kept.layout
        fresh = torch.zeros_like(held)
        for name, off in zip(lay.names, lay.offsets):
            p = dict(step._model.named_parameters())[name]
            fresh[off:off + p.numel()] = p.detach().reshape(-1).to(lay.dtype)
        assert torch.equal(held, fresh)


def test_a_blind_check_would_use_stale_copies(monkeypatch):
    """The comparison above can fail: with the token blind to the edit, the
    step after it computes with the old copies."""
    monkeypatch.setattr(carried.CarriedCopy, "_token", lambda self: ("blind",))
    losses, _, step = _run("in place under no_grad", carry=True)
    ref_losses, _, _ = _run("in place under no_grad", carry=False)
    assert torch.equal(losses[2], ref_losses[2]) and not torch.equal(losses[3], ref_losses[3])
    assert _carried(step)[0].repacks == 1


def test_a_failed_step_packs_afresh(monkeypatch):
    """A step that fails leaves the carried copies to be packed again."""
    from stepfx.codegen import optimizer_kernels

    torch.manual_seed(0)
    model = MLP((8, 24, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize(_config(True))(bf16_step)
    batches = mlp_batches(4)
    step(model, opt, *batches[0])
    step(model, opt, *batches[1])
    (kept,) = _carried(step)
    assert kept.token is not None

    def broken(*args, **kwargs):
        raise RuntimeError("the update broke")

    with monkeypatch.context() as patch:
        patch.setattr(optimizer_kernels, "adam_update_many", broken)
        with pytest.raises(Exception, match="the update broke"):
            step(model, opt, *batches[2])
    assert kept.token is None
    step(model, opt, *batches[3])
    assert kept.repacks == 2 and kept.reads == 4  # packed at the first step and after the failure


def test_a_parameter_subclass_is_packed_every_step():
    """A parameter of another nn.Parameter subclass is not watched (its
    class is left alone): the copies are packed each step, results unchanged."""
    class Tagged(torch.nn.Parameter):
        pass

    def run(carry):
        torch.manual_seed(0)
        model = MLP((8, 24, 4))
        model.net[0].weight = Tagged(model.net[0].weight.detach().clone())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = stepfx.parallelize(_config(carry))(bf16_step)
        return [step(model, opt, *b) for b in mlp_batches(4)], step, model

    losses, step, model = run(True)
    ref, _, _ = run(False)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref))
    (kept,) = _carried(step)
    assert not kept.watched and kept.repacks == kept.reads == 4
    assert type(model.net[0].weight).__name__ == "Tagged"
    assert "packed every step" in step.explain()


def test_a_watched_parameter_looks_and_travels_as_a_parameter():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3))
    shown = repr(p)
    assert carried.watch(p) and type(p) is carried.WatchedParameter and isinstance(p, torch.nn.Parameter)
    assert repr(p) == shown
    p.data.mul_(1.0)
    p.data = p.detach().clone()
    assert p.data_uses == 2
    p.tag = "kept"  # a user's attribute pickles (as a plain Parameter's does), the count does not
    twin = copy.deepcopy(p)
    assert type(twin) is torch.nn.Parameter and torch.equal(twin, p) and twin.data_ptr() != p.data_ptr()
    assert "data_uses" not in twin.__dict__
    buf = io.BytesIO()
    torch.save(p, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is torch.nn.Parameter and torch.equal(loaded, p) and loaded.tag == "kept"
    assert "data_uses" not in loaded.__dict__
    m = torch.nn.Linear(2, 2)
    assert carried.watch(m.weight)
    assert set(m.state_dict()) == {"weight", "bias"} and type(m.state_dict()["weight"]) is torch.Tensor


def test_explain_says_what_is_carried():
    _, _, step = _run("none", carry=True)
    text = step.explain()
    assert "carry_parameter_copies" in text and "carried between steps: 4 parameters' bfloat16 copies" in text
    assert "packed afresh at 1 of 5 steps" in text
    assert "carried copies at rest" in text  # the buffer the rank keeps between steps


def test_an_fp16_step_skipped_for_overflow_keeps_the_copies_right():
    """fp16 with loss scaling: a step whose gradients overflow writes neither
    parameters nor copies (the kernel's skip), and the steps after it agree
    bitwise with packing at every step."""
    def run(carry):
        torch.manual_seed(0)
        model = MLP((8, 24, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        config = {"fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8, "hysteresis": 1},
                  "gradient_clipping": 0, "stepfx": _config(carry)["stepfx"]}
        step = stepfx.parallelize(config)(scaled_ce_step)
        blowups = [1.0, 1.0, 1e30, 1.0, 1.0]
        losses = [step(model, opt, x, y, torch.tensor(b)) for (x, y), b in zip(mlp_batches(5), blowups)]
        return losses, [p.detach().clone() for p in model.parameters()], step

    losses, params, step = run(True)
    ref_losses, ref_params, _ = run(False)
    assert step.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    (kept,) = _carried(step)
    assert kept.repacks == 1 and kept.layout.dtype is torch.float16


def test_gradient_accumulation_micro_steps_read_the_carried_copies():
    """Micro-steps that only accumulate read the update step's carried
    buffer (the same layout: one buffer, not a second copy) instead of
    packing; bitwise equal to packing at every call."""
    def run(carry):
        torch.manual_seed(0)
        model = MLP((8, 24, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = stepfx.parallelize({**_config(carry), "gradient_accumulation_steps": 2})(bf16_step)
        losses = [step(model, opt, *b) for b in mlp_batches(8)]
        return losses, [p.detach().clone() for p in model.parameters()], step

    losses, params, step = run(True)
    ref_losses, ref_params, _ = run(False)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    (kept,) = _carried(step)
    read_only = [p for p in step.plans if any("read only" in r.summary for r in p.records)]
    assert len(read_only) == 1  # the micro-steps' plan (Adam's state exists before the first capture)
    # every call reads it; packed once, at the first call (the updates write the copies in place)
    assert kept.reads == 8 and kept.repacks == 1, kept.describe()


def test_two_layouts_of_one_model_keep_one_buffer():
    """Plans whose packs hold different parameters (a frozen gain vector the
    step uses only when asked) each carry a buffer; reading one drops the
    others', so the rank keeps one copy of each parameter, and each switch
    packs afresh: still bitwise equal to packing each call."""
    def step_fn(model, optimizer, x, y, gained):
        out = model(x.to(torch.bfloat16))
        if gained:
            out = out * model.gain.to(torch.bfloat16)
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def run(carry):
        torch.manual_seed(0)
        model = MLP((8, 24, 4))
        model.gain = torch.nn.Parameter(torch.full((4,), 1.5), requires_grad=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = stepfx.parallelize(_config(carry))(step_fn)
        losses, held = [], []
        for i, b in enumerate(mlp_batches(8)):
            losses.append(step(model, opt, *b, i % 2 == 1))
            held.append(sum(k[1] == "param_copies" for k in step._store.tensors))
        return losses, [p.detach().clone() for p in model.parameters()], step, held

    losses, params, step, held = run(True)
    ref_losses, ref_params, _, _ = run(False)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    kept = _carried(step)
    assert len({c.layout.names for c in kept}) == 2, [c.layout.names for c in kept]
    assert max(held) == 1
    assert all(c.repacks == c.reads for c in kept)  # each switch packs afresh


def test_one_step_for_two_models_in_turn():
    """One decorated step used for two models in turn (allowed when it holds
    no ZeRO state): each switch drops the other model's copies, and a
    switch back packs its own again; bitwise equal to packing each call."""
    def run(carry):
        torch.manual_seed(0)
        models = [MLP((8, 24, 4)), MLP((8, 16, 4))]
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
        step = stepfx.parallelize(_config(carry))(bf16_step)
        losses = [step(models[i % 2], opts[i % 2], *b) for i, b in enumerate(mlp_batches(8))]
        return losses, [p.detach().clone() for m in models for p in m.parameters()], step

    losses, params, step = run(True)
    ref_losses, ref_params, _ = run(False)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert sum(k[1] == "param_copies" for k in step._store.tensors) == 1  # the last model's only


def test_recomputed_casts_share_the_carried_copy():
    """Under recompute_activations the backward casts each parameter again (its own copy of the
    forward's cast): the pack holds one place per parameter, which the update keeps current, so a
    run with the copies carried equals one without, bitwise, step after step."""
    def run(carry: bool):
        torch.manual_seed(0)
        model = MLP((8, 24, 24, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        config = _config(carry)
        config["stepfx"]["activation_memory_budget"] = 0.0
        step = stepfx.parallelize(config)(bf16_step)
        losses = [step(model, opt, *batch) for batch in mlp_batches(5)]
        return losses, [p.detach().clone() for p in model.parameters()], step

    losses, params, step = run(True)
    ref_losses, ref_params, _ = run(False)
    summaries = {r.name: r.summary for r in step.plan.records}
    assert "ops recomputed" in summaries["recompute_activations"]
    assert "carried between steps" in summaries["carry_parameter_copies"]
    for a, b in zip(losses, ref_losses):
        assert torch.equal(a, b)
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
