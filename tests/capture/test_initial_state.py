"""Adam's state is created before the first capture, as its first step would
create it, so a fresh run captures once and still matches eager bitwise."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from tests.steps import MLP, ce_step, mlp_batches


def _same_state(opt, ref_opt, model, ref):
    for p, q in zip(model.parameters(), ref.parameters()):
        a, b = opt.state.get(p, {}), ref_opt.state.get(q, {})
        assert set(a) == set(b)
        for k in b:
            assert a[k].dtype == b[k].dtype and a[k].device == b[k].device and torch.equal(a[k], b[k]), k


def _train(model, make_opt, steps=5, config=None, step_fn=ce_step):
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    step = stepfx.parallelize(config)(step_fn)
    for x, y in mlp_batches(steps):
        assert torch.equal(step(model, opt, x, y), step_fn(ref, ref_opt, x, y))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    _same_state(opt, ref_opt, model, ref)
    return step


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True, maximize=True),
], ids=["adamw", "adam-amsgrad", "adamw-foreach-maximize"])
def test_a_fresh_adam_run_captures_once_and_matches_eager(make_opt):
    torch.manual_seed(0)
    step = _train(MLP((8, 16, 4)), make_opt)
    assert len(step.plans) == 1


def test_a_fused_adamw_captures_once_with_the_state_the_reference_loop_makes():
    # stepfx traces the reference loop for a fused group; its state (made before the first capture, as that
    # loop's first step makes it) has eager's keys, dtypes and devices on the CPU. The arithmetic is not the
    # fused kernel's: within 1e-6 of eager's fused step (fp32)
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, ref))
    step = stepfx.parallelize({"gradient_clipping": 0})(ce_step)
    for x, y in mlp_batches(5):
        torch.testing.assert_close(step(model, opt, x, y), ce_step(ref, ref_opt, x, y), rtol=1e-6, atol=0)
    assert len(step.plans) == 1
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        a, b = opt.state[p], ref_opt.state[q]
        assert {k: (v.dtype, v.device, v.shape) for k, v in a.items()} == {
            k: (v.dtype, v.device, v.shape) for k, v in b.items()}


def test_frozen_parameters_get_no_state():
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    model.net[0].bias.requires_grad_(False)
    step = _train(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert len(step.plans) == 1


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = MLP((8, 16, 4))
        self.unused = nn.Linear(4, 4)  # trainable, but the loss never reaches it

    def forward(self, x):
        return self.body(x)


def test_parameters_without_gradients_end_with_no_state_as_in_eager():
    torch.manual_seed(0)
    step = _train(WithUnused(), lambda ps: torch.optim.AdamW(ps, lr=1e-2))  # compares the state's keys too
    assert len(step.plans) == 1  # the capture with state for the unused parameters was dropped, not kept


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9, centered=True, weight_decay=0.01),
    lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    lambda ps: torch.optim.Adamax(ps, lr=0.01, weight_decay=0.01),
    lambda ps: torch.optim.Adadelta(ps, lr=1.0, weight_decay=0.01),
], ids=["sgd-momentum", "sgd-nesterov", "rmsprop-centered-momentum", "rmsprop", "adamax", "adadelta"])
def test_the_other_lazy_optimizers_capture_once_and_match_eager(make_opt):
    # their first steps make zeros too (SGD's momentum buffer is the first gradient, which a zero buffer's
    # update rule gives bitwise when dampening is 0); the state's keys, dtypes and devices are compared
    torch.manual_seed(0)
    step = _train(MLP((8, 16, 4)), make_opt)
    assert len(step.plans) == 1


def test_sgd_momentum_with_dampening_stays_lazy():
    # with dampening the first step (a clone of the gradient) is not what a zero buffer gives: the first step
    # creates it, which costs a second capture
    torch.manual_seed(0)
    step = _train(MLP((8, 16, 4)), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1))
    assert len(step.plans) == 2


def test_sgd_parameters_without_gradients_end_with_no_state_as_in_eager():
    torch.manual_seed(0)
    step = _train(WithUnused(), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    assert len(step.plans) == 1


def test_gradient_accumulation_with_a_fresh_adam():
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = stepfx.parallelize({"gradient_accumulation_steps": 2})(ce_step)
    batches = mlp_batches(6)
    for x, y in batches:
        step(model, opt, x, y)
    for i in range(0, 6, 2):
        for x, y in batches[i:i + 2]:
            (F.cross_entropy(ref(x), y) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    _same_state(opt, ref_opt, model, ref)
    assert len(step.plans) == 2  # one accumulating micro-step, one update


# -- ZeRO 1-3: the state of sharded parameters is described, not created ------------


def _train_zero(model, stage, steps=5, persist=20):
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    config = {"gradient_clipping": 0, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": persist}}
    step = stepfx.parallelize(config)(ce_step)
    for x, y in mlp_batches(steps):
        assert torch.equal(step(model, opt, x, y), ce_step(ref, ref_opt, x, y))
    step.sync_model()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    names = dict(ref.named_parameters())
    state = step.optimizer_state()
    assert set(state) == {n for n, q in names.items() if ref_opt.state.get(q)}
    for name, got in state.items():
        want = ref_opt.state[names[name]]
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), name
    return step, opt


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_capture_once_and_match_eager(stage):
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    step, opt = _train_zero(model, stage)
    assert len(step.plans) == 1
    # the optimizer never held the sharded parameters' state; under stage 3 it
    # holds that of the parameters below the persistence threshold (the biases)
    whole = {id(p) for n, p in model.named_parameters() if stage == 3 and p.numel() < 20}
    assert {id(p) for p in opt.state} == whole


def test_zero3_parameters_without_gradients_end_with_no_state_as_in_eager():
    torch.manual_seed(0)
    step, _ = _train_zero(WithUnused(), 3, persist=0)   # compares the state's keys too
    assert len(step.plans) == 1


def test_a_failed_first_step_under_zero_leaves_no_state_behind():
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize({"gradient_clipping": 0, "zero_optimization": {"stage": 3}})(ce_step)
    x, y = mlp_batches(1)[0]
    with pytest.raises(Exception):
        step(model, opt, x, y[:2])          # batch sizes disagree: the step fails
    assert not opt.state and not step._store.held and not step._store.tensors
    before = [p.detach().clone() for p in model.parameters()]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    assert torch.equal(step(model, opt, x, y), ce_step(ref, ref_opt, x, y))
    assert not all(torch.equal(a, p) for a, p in zip(before, ref.parameters()))
