"""A step that updates another module in place — an EMA copy of the
weights, passed as an argument or read from its scope — is refused with
the line and that module's tensor named (the write would happen only at
capture: another module's tensors are constants of the captured step).
What the refusal advises works: EMA weights kept as buffers of the trained
model are updated at every step, bitwise as eager, at ZeRO stages 0 and 3."""
from __future__ import annotations

import copy

import pytest
import torch

import stepfx
from stepfx.errors import CaptureError
from tests.steps import square_step


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 4, generator=g) for _ in range(4)]


@pytest.mark.parametrize("where", ["argument", "scope"])
def test_an_ema_module_updated_in_the_step_is_refused_naming_its_tensor(where):
    model, optimizer = _setup()
    ema = copy.deepcopy(model).requires_grad_(False)

    def train_step(model, optimizer, x, other=None):
        loss = square_step(model, optimizer, x)
        with torch.no_grad():
            for e, p in zip((other if other is not None else ema).parameters(), model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
        return loss

    before = [t.clone() for t in ema.parameters()]
    args = (ema,) if where == "argument" else ()
    shown = r"its argument #4" if where == "argument" else r"'ema' from its scope"
    with pytest.raises(CaptureError, match=rf"writes in place \(aten\.mul_\.Tensor\) into 0\.weight of Sequential "
                                           rf"\({shown}\)[\s\S]*e\.mul_\(0\.9\)[\s\S]*register_buffer"):
        stepfx.parallelize({"gradient_clipping": 0})(train_step)(model, optimizer, _batches()[0], *args)
    assert all(torch.equal(a, b) for a, b in zip(before, ema.parameters()))


@pytest.mark.parametrize("stage", [0, 3])
def test_ema_weights_kept_as_buffers_of_the_model_train_as_eager(stage):
    def train_step(model, optimizer, x):
        loss = square_step(model, optimizer, x)
        with torch.no_grad():
            for name, p in model.named_parameters():
                getattr(model, "ema_" + name.replace(".", "_")).lerp_(p, 0.1)
        return loss

    runs = []
    for compiled in (False, True):
        model, optimizer = _setup()
        for name, p in list(model.named_parameters()):
            model.register_buffer("ema_" + name.replace(".", "_"), p.detach().clone())
        config = {"gradient_clipping": 0, "zero_optimization": {"stage": stage}}
        step = stepfx.parallelize(config)(train_step) if compiled else train_step
        losses = [step(model, optimizer, x).item() for x in _batches()]
        runs.append((losses, {k: v.clone() for k, v in model.named_buffers()}))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1].keys() == runs[1][1].keys() and all(torch.equal(v, runs[1][1][k]) for k, v in runs[0][1].items())
