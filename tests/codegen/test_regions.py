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


def _cache_cat(past_k, past_v, fused):
    """Bloom's attention before its views: the fused q/k/v split, k and v appended to an empty past."""
    b, t, _ = fused.shape
    q, k, v = fused.view(b, t, 4, 3, 16).unbind(3)
    return (torch.cat([past_k, k.transpose(1, 2)], -2), torch.cat([past_v, v.transpose(1, 2)], -2),
            q.transpose(1, 2).contiguous())


def test_outputs_keep_the_layout_of_the_region_s_ops():
    """Inductor lays a cat of transposed values out transposed; the step after the region was traced on the
    cat's own (contiguous) layout, and Bloom's next view failed at run #1 on the GPU (2026-12-06). The region
    copies such outputs back into the ops' layout, on the first call and every later one."""
    from stepfx.codegen.regions import Region

    past = torch.zeros(3, 4, 0, 16)
    fused = torch.randn(3, 7, 192)
    gm = make_fx(_cache_cat)(past, past, fused)
    inductor = compat.compile_region(gm)(past, past, fused)
    eager = gm(past, past, fused)
    assert any(a.stride() != b.stride() for a, b in zip(inductor, eager))  # what made the fix necessary
    region = Region("region_test_layout", gm, ())
    for _ in range(2):
        out = region(past, past, fused)
        for got, want in zip(out, eager):
            assert got.stride() == want.stride() and torch.equal(got, want)
        out[0].view(12, -1, 16)  # the view Bloom's attention takes next
