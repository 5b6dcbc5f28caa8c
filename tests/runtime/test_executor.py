from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from stepfx.errors import ExecutionError
from tests.steps import MLP, ce_step, lm_step, mlp_batches


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 10)

    def forward(self, idx):
        return self.fc(self.emb(idx))


def _snapshot(model, opt):
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    states = {(i, k): v.clone() for i, p in enumerate(model.parameters()) for k, v in opt.state.get(p, {}).items()}
    return params, states


def test_a_failed_step_leaves_model_and_optimizer_as_they_were():
    torch.manual_seed(0)
    model = Embedder()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = stepfx.parallelize()(lm_step)
    good = torch.randint(0, 10, (2, 6))
    step(model, opt, good)
    step(model, opt, good)
    before = _snapshot(model, opt)
    bad = good.clone()
    bad[0, 2] = 99  # out of range: fake tracing cannot see values; the real run fails
    with pytest.raises(ExecutionError, match="left as they were"):
        step(model, opt, bad)
    after = _snapshot(model, opt)
    assert before[0].keys() == after[0].keys() and before[1].keys() == after[1].keys()
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    step(model, opt, good)  # and the next good call works


def test_write_back_keeps_parameter_objects_and_optimizer_keys():
    model = MLP((8, 16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    params = list(model.parameters())
    step = stepfx.parallelize()(ce_step)
    for x, y in mlp_batches(3):
        step(model, opt, x, y)
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert {id(k) for k in opt.state.keys()} == {id(p) for p in params}
    assert all(set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in params)
    assert all(p.grad is None for p in params)  # zero_grad(set_to_none=True) in the step


def test_existing_grads_cleared_by_the_step_become_none():
    model = MLP((8, 16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = mlp_batches(1)[0]
    F.cross_entropy(model(x), y).backward()  # grads exist before the step

    def step(model, optimizer, x, y):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    stepfx.parallelize()(step)(model, opt, x, y)
    assert all(p.grad is None for p in model.parameters())


def test_buffers_are_updated_in_place_of_the_same_tensor():
    from stepfx.testing.models import SmallCNN

    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    running = model.bn.running_mean
    stepfx.parallelize()(ce_step)(model, opt, torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))
    assert model.bn.running_mean is running and running.abs().sum() > 0
    assert model.bn.num_batches_tracked.item() == 1
