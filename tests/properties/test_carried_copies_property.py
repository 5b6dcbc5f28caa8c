"""Property: for generated models, Adam/AdamW settings (one or two param
groups: one or two updates writing the buffer), 16-bit precisions and an
edit of one parameter between two steps, the steps with the parameters'
compute copies carried between them (``carry_parameter_copies``) are
bitwise the steps that pack the copies at each start."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stepfx
from stepfx.testing.models import MLP
from tests.steps import scaled_ce_step


def bf16_step(model, optimizer, x, y, blowup):
    loss = F.cross_entropy(model(x.to(torch.bfloat16)).float(), y) * blowup
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _edit(kind: str, model: nn.Module, index: int) -> None:
    params = list(model.parameters())
    p = params[index % len(params)]
    if kind == "no_grad in place":
        with torch.no_grad():
            p.mul_(0.5)
    elif kind == ".data":
        p.data.add_(0.25)
    elif kind == "p.data = t":
        p.data = p.detach() * -1.0
    elif kind == "load_state_dict":
        model.load_state_dict({k: v * 0.75 for k, v in model.state_dict().items()})


def _run(sizes, bias, precision, lr, wd, two_groups, steps, edit, seed, carry):
    torch.manual_seed(seed)
    model = MLP(sizes, bias=bias)
    params = list(model.parameters())
    groups = [{"params": params[:1], "lr": lr * 2}, {"params": params[1:]}] if two_groups and len(params) > 1 else params
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=wd)
    if precision == "bf16":
        config, fn = {"bf16": {"enabled": True}}, bf16_step
    else:
        config, fn = {"fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8}}, scaled_ce_step
    config.update(gradient_clipping=1.0, stepfx={"codegen": True, "disable": [] if carry else ["carry_parameter_copies"]})
    step = stepfx.parallelize(config)(fn)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for i in range(steps):
        if edit is not None and i == edit[1]:
            _edit(edit[0], model, edit[2])
        x, y = torch.randn(5, sizes[0], generator=g), torch.randint(0, sizes[-1], (5,), generator=g)
        losses.append(step(model, opt, x, y, torch.tensor(1.0)))
    return losses, [p.detach().clone() for p in model.parameters()], step


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.integers(1, 12), min_size=1, max_size=2),
    d_in=st.integers(1, 9),
    classes=st.integers(2, 5),
    bias=st.booleans(),
    precision=st.sampled_from(["bf16", "fp16"]),
    lr=st.sampled_from([1e-3, 1e-2]),
    wd=st.sampled_from([0.0, 0.1]),
    two_groups=st.booleans(),
    steps=st.integers(3, 5),
    edit=st.none() | st.tuples(st.sampled_from(["no_grad in place", ".data", "p.data = t", "load_state_dict"]),
                               st.integers(1, 4), st.integers(0, 8)),
    seed=st.integers(0, 2**16),
)
def test_carried_copies_never_change_the_steps(widths, d_in, classes, bias, precision, lr, wd, two_groups, steps, edit,
                                               seed):
    sizes = (d_in, *widths, classes)
    args = (sizes, bias, precision, lr, wd, two_groups, steps, edit, seed)
    losses, params, step = _run(*args, carry=True)
    ref_losses, ref_params, _ = _run(*args, carry=False)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    # the optimizer state is created before the first capture, so every step
    # runs the one plan and carries; the copies are packed at the first step
    # and again only after an edit
    carried = list(step._store.carried.values())
    assert len(carried) == 1 and carried[0].reads == steps
    assert 1 <= carried[0].repacks <= (1 if edit is None else 2)
