"""An optimizer as ``accelerate``'s ``Accelerator.prepare`` returns it (an
``AcceleratedOptimizer``, itself an ``Optimizer`` subclass delegating to the
torch optimizer) was refused as "unsupported optimizer". stepfx takes the
torch optimizer inside, as it takes the module inside DDP: a loop written
for accelerate (``accelerator.backward(loss)`` included) trains bitwise as
without stepfx, and the user's wrapper sees the state stepfx leaves."""
from __future__ import annotations

import torch

import stepfx
from stepfx.capture.optimizers import unwrapped_optimizer


def _make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model, optimizer, x, backward):
    loss = model(x).square().mean()
    backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_an_accelerate_prepared_optimizer_trains_bitwise_as_eager():
    from accelerate import Accelerator

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(3, 4, generator=g) for _ in range(4)]
    model, optimizer = _make()
    expected = [_step(model, optimizer, x, torch.Tensor.backward).item() for x in batches]
    accelerator = Accelerator(cpu=True)
    prepared, wrapped = accelerator.prepare(*_make())
    assert type(wrapped).__name__ == "AcceleratedOptimizer" and unwrapped_optimizer(wrapped) is wrapped.optimizer
    step = stepfx.parallelize({"gradient_clipping": 0})(_step)
    assert [step(prepared, wrapped, x, accelerator.backward).item() for x in batches] == expected
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), prepared.parameters()))
    state, theirs = wrapped.state_dict()["state"], optimizer.state_dict()["state"]
    assert all(torch.equal(state[i][k], theirs[i][k]) for i in theirs for k in theirs[i])
