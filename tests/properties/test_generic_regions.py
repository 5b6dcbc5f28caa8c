"""Property: cutting generic regions out of the step graph (fuse_generic_regions)
never changes what the step computes, whatever the mix of pointwise ops,
row reductions, rotary embeddings' slices and concatenations, and matmuls
between them.

Generated models chain random ops over a few running values (so regions
start, grow, are interrupted by matmuls and read values made after they
began); the regions run as their own fx code here (inductor is swapped
out: what is tested is the graph surgery — which ops go together, where the
call lands, how its outputs are wired), forward and backward, against the
eager step, per step within 1e-5 (SGD; the same ops in the same order,
differences only from the fused kernels of the optimizer).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepfx.testing.equivalence import assert_step_equivalent
from tests.steps import ce_step

UNARY = ("tanh", "sigmoid", "neg", "exp_small", "square", "silu")
BINARY = ("add", "mul", "sub")
WIDTH = 6


class RandomChain(nn.Module):
    """``program``: ops over a growing list of values, each a (kind, args)."""

    def __init__(self, program, d_in):
        super().__init__()
        self.program = program
        self.inp = nn.Linear(d_in, WIDTH)
        self.mats = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for op in program if op[0] == "linear")
        self.out = nn.Linear(WIDTH, 3)
        angles = torch.arange(WIDTH, dtype=torch.float32) * 0.3
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x):
        values = [self.inp(x)]
        mats = iter(self.mats)
        for kind, a, b in self.program:
            u, v = values[a % len(values)], values[b % len(values)]
            if kind == "linear":
                values.append(next(mats)(u))
            elif kind == "rownorm":
                values.append(u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-5))
            elif kind == "add":
                values.append(u + v)
            elif kind == "mul":
                values.append(u * v)
            elif kind == "sub":
                values.append(u - v)
            elif kind == "tanh":
                values.append(torch.tanh(u))
            elif kind == "sigmoid":
                values.append(torch.sigmoid(u))
            elif kind == "neg":
                values.append(-u)
            elif kind == "exp_small":
                values.append(torch.exp(u * 0.1))
            elif kind == "square":
                values.append(u * u)
            elif kind == "silu":
                values.append(nn.functional.silu(u))
            elif kind == "rotary":  # Hugging Face's rotate_half: slices, neg, cat (slice_backward in backward)
                half = WIDTH // 2
                values.append(u * self.cos + torch.cat((-u[..., half:], u[..., :half]), dim=-1) * self.sin)
        return self.out(values[-1] + values[len(values) // 2])


ops = st.tuples(st.sampled_from(UNARY + BINARY + ("linear", "linear", "rownorm", "rotary")), st.integers(0, 20),
                st.integers(0, 20))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(program=st.lists(ops, min_size=2, max_size=10), d_in=st.integers(1, 5))
def test_regions_never_change_the_step(monkeypatch, program, d_in):
    from stepfx import compat
    from stepfx.passes.fusion import fuse_generic_regions

    monkeypatch.setattr(fuse_generic_regions, "ON_CPU", True)
    monkeypatch.setattr(compat, "compile_region", lambda gm, dynamic=False: gm)  # the region's own ops: surgery under test
    g = torch.Generator().manual_seed(len(program))
    batches = [(torch.randn(4, d_in, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]
    make = lambda: RandomChain(program, d_in)  # noqa: E731
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    assert_step_equivalent(ce_step, make, sgd, batches, config={"stepfx": {"codegen": True}, "gradient_clipping": 0},
                           rtol=1e-5, atol=1e-6, resync=True)


def test_a_region_placed_at_its_last_op(monkeypatch):
    """A fixed chain the property covers at random: ``tanh(a) * b`` with
    ``b`` made by a matmul after the tanh — the region {tanh, mul} can only
    go where the mul was — and a chain whose value a matmul reads mid-way
    (it can only go where its first op was)."""
    import stepfx
    from stepfx import compat
    from stepfx.codegen.regions import REGIONS
    from stepfx.passes.fusion import fuse_generic_regions

    monkeypatch.setattr(fuse_generic_regions, "ON_CPU", True)
    monkeypatch.setattr(compat, "compile_region", lambda gm, dynamic=False: gm)
    program = [("tanh", 0, 0), ("linear", 0, 0), ("mul", 1, 2), ("sigmoid", 3, 3), ("linear", 4, 4), ("add", 4, 5)]
    torch.manual_seed(0)
    model = RandomChain(program, 3)
    step = stepfx.parallelize({"stepfx": {"codegen": True}, "gradient_clipping": 0})(ce_step)
    x, y = torch.randn(4, 3), torch.randint(0, 3, (4,))
    for _ in range(2):
        step(model, torch.optim.SGD(model.parameters(), lr=0.05), x, y)
    keys = [key for key, _ in step.plan.graph.signature.extra["generic_regions"]]
    forward = [REGIONS[k].ops for k in keys]
    assert ("aten.tanh.default", "aten.mul.Tensor", "aten.sigmoid.default") in forward, forward
    assert_step_equivalent(ce_step, lambda: RandomChain(program, 3), lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
                           [(x, y)] * 2, config={"stepfx": {"codegen": True}, "gradient_clipping": 0},
                           rtol=1e-5, atol=1e-6, resync=True)
