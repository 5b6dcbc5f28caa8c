from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from stepfx.errors import ExecutionError
from tests.steps import MLP, ce_step, lm_loss, lm_step, mlp_batches


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


_ZERO3_ONE_RANK = {  # the parameters' pieces: on the device (the user's storage), or copied to the host
    "device": {},
    "offload_optimizer-fp32": {"offload_optimizer": {"device": "cpu"}},  # fp32: the masters stay on the device
    "host_masters-bf16": {"offload_optimizer": {"device": "cpu"}},  # bf16: the masters move to the host
    "offload_param": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
}


def _zero3_one_rank(where):
    bf16 = where.endswith("bf16")
    return {"gradient_clipping": 0.0 if bf16 else 1.0, "bf16": {"enabled": bf16}, "stepfx": {"host_adam": "exact"},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **_ZERO3_ONE_RANK[where]}}


def _reference_run(where, batches):
    # fp32: the eager step with torch's clipping; bf16: the mixed-precision step DeepSpeed's bf16 stands for
    from stepfx.testing.equivalence import mixed_precision_reference

    torch.manual_seed(0)
    model = Embedder()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    bf16 = where.endswith("bf16")

    def clipped(model, opt, b):
        loss = lm_loss(model(b[:, :-1]), b[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    one = mixed_precision_reference(lm_step, torch.bfloat16) if bf16 else clipped
    return model, [one(model, opt, b).detach() for b in batches]


@pytest.mark.parametrize("where", list(_ZERO3_ONE_RANK))
def test_zero3_on_one_rank_lets_the_users_parameters_go_before_the_first_run(monkeypatch, where):
    # one rank's ZeRO-3 piece is the whole parameter: the user's copy must not be held beside it through the
    # first run (a 13B model's fp32 parameters twice on one GPU). On the device the piece takes the user's
    # storage; offloaded, the user's copy goes once its host piece is made
    from stepfx.runtime.binding import ModuleBinding

    seen, read_from = [], []
    read = ModuleBinding.inputs

    def spy(self, batch, *, release=False):
        values = read(self, batch, release=release)
        if release:
            seen.append([p.numel() for p in self.model.parameters()])
            read_from.append({v.untyped_storage().data_ptr() for v in values if isinstance(v, torch.Tensor)})
        return values

    monkeypatch.setattr(ModuleBinding, "inputs", spy)
    torch.manual_seed(0)
    model = Embedder()
    storages = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = stepfx.parallelize(_zero3_one_rank(where))(lm_step)
    batches = [torch.randint(0, 10, (2, 6), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    losses = [step(model, opt, b) for b in batches]
    assert seen and all(n == 0 for n in seen[0]), seen  # gone before the graph ran
    assert ("host as masters" in step.explain()) == where.startswith("host_masters")
    ref, ref_losses = _reference_run(where, batches)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    step.sync_model()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=n)
    # on the device no copy was made: the first run read the user's storage as its pieces; offloaded, copies
    assert (set(storages.values()) <= read_from[0]) == ("host" not in where and "param" not in where), read_from


@pytest.mark.parametrize("where", list(_ZERO3_ONE_RANK))
def test_a_failed_first_zero3_step_gives_the_user_their_parameters_back(where):
    torch.manual_seed(0)
    model = Embedder()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = stepfx.parallelize(_zero3_one_rank(where))(lm_step)
    good = torch.randint(0, 10, (2, 6), generator=torch.Generator().manual_seed(0))
    bad = good.clone()
    bad[0, 2] = 99  # out of range: the real run fails after the pieces were made
    with pytest.raises(ExecutionError, match="left as they were"):
        step(model, opt, bad)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n  # whole again, the same values
    assert not opt.state
    loss = step(model, opt, good)  # and the next call trains from them
    _, ref_losses = _reference_run(where, [good])
    assert torch.equal(loss, ref_losses[0])
