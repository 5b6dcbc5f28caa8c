"""Generic regions compiled by inductor: static shapes through inductor's
compile_fx called directly (no torch.compile frame guards on every call),
symbolic shapes through torch.compile; both compute what the region's ops do."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from stepfx import compat


def _region(a, b):
    return (torch.sigmoid(a) * b + a, (a * b).sum(-1, keepdim=True))


def test_a_static_region_runs_without_dynamo():
    a, b = torch.randn(4, 9), torch.randn(4, 9)
    gm = make_fx(_region)(a, b)
    compiled = compat.compile_region(gm)
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(3):
        out = compiled(a, b)
        assert isinstance(out, tuple) and len(out) == 2
        for got, want in zip(out, gm(a, b)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # never traced by dynamo
    # the module shown in explain() is not the one inductor rewrote
    assert gm.code == make_fx(_region)(a, b).code


def test_a_symbolic_region_serves_every_size():
    a, b = torch.randn(4, 9), torch.randn(4, 9)
    gm = make_fx(_region)(a, b)
    compiled = compat.compile_region(gm, dynamic=True)
    for rows in (4, 7, 2):
        x, y = torch.randn(rows, 9), torch.randn(rows, 9)
        for got, want in zip(compiled(x, y), _region(x, y)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
