"""Property: for generated models x optimizers x hyperparameters, the
captured step equals the eager step bitwise (fp32, CPU) over several steps."""
from __future__ import annotations

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepfx.testing.equivalence import assert_step_equivalent
from stepfx.testing.models import MLP
from tests.steps import ce_step

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU, "sigmoid": nn.Sigmoid, "elu": nn.ELU}


@st.composite
def optimizers(draw):
    kind = draw(st.sampled_from(["sgd", "adam", "adamw"]))
    lr = draw(st.floats(1e-4, 0.2))
    wd = draw(st.sampled_from([0.0, 1e-3, 0.1]))
    if kind == "sgd":
        momentum = draw(st.sampled_from([0.0, 0.5, 0.9]))
        nesterov = momentum > 0 and draw(st.booleans())
        dampening = 0.0 if nesterov else draw(st.sampled_from([0.0, 0.2]))
        kw = dict(lr=lr, momentum=momentum, nesterov=nesterov, dampening=dampening, weight_decay=wd)
        return kind, lambda ps: torch.optim.SGD(ps, **kw)
    betas = (draw(st.sampled_from([0.8, 0.9])), draw(st.sampled_from([0.95, 0.999])))
    kw = dict(lr=lr, betas=betas, weight_decay=wd, amsgrad=draw(st.booleans()), eps=draw(st.sampled_from([1e-8, 1e-6])))
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    return kind, lambda ps: cls(ps, **kw)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    d_in=st.integers(1, 9),
    classes=st.integers(2, 5),
    activation=st.sampled_from(sorted(ACTIVATIONS)),
    dropout=st.sampled_from([0.0, 0.0, 0.25]),
    bias=st.booleans(),
    batch=st.integers(1, 7),
    opt=optimizers(),
    two_groups=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_generated_steps_equal_eager(widths, d_in, classes, activation, dropout, bias, batch, opt, two_groups, seed):
    _, make_opt_for = opt
    sizes = (d_in, *widths, classes)

    def make_model():
        return MLP(sizes, activation=ACTIVATIONS[activation], dropout=dropout, bias=bias)

    def make_opt(model):
        params = list(model.parameters())
        if two_groups and len(params) > 1:
            groups = [{"params": params[:1], "lr": 0.01}, {"params": params[1:]}]
            return make_opt_for(groups)
        return make_opt_for(params)

    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(batch, d_in, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(3)]
    report = assert_step_equivalent(ce_step, make_model, make_opt, batches, exact=True, seed=seed)
    assert report.steps == 3 and report.bitwise
