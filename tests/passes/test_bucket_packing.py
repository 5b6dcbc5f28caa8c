"""fuse_bucket_packing on hand-built buckets: what is taken into the pack,
what is left, and the same bits as the casts and concatenation (Triton's
interpreter on CPU). Whole ZeRO steps: tests/runtime/test_data_parallel.py."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from stepfx.graph import Role, Slot, StepGraph, StepSignature, verify_step_graph
from stepfx.passes import PassOptions
from stepfx.passes.data_parallel import fuse_bucket_packing

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
BF16, F32 = torch.bfloat16, torch.float32


def _graph(extra_reader: bool = False, with_cast: bool = True, divide_by: int | None = None):
    """bucket = cat([flat(cast(a)), pad, b, cast(c)]) of a: bf16 [6, 5], b: fp32 [20], c: bf16 [7]."""
    g = fx.Graph()
    shapes = {"a": ((6, 5), BF16 if with_cast else F32), "b": ((20,), F32), "c": ((7,), BF16 if with_cast else F32)}
    ph = {}
    for name, (shape, dtype) in shapes.items():
        ph[name] = g.placeholder(name)
        ph[name].meta.update(slot=Slot(Role.BATCH, name), val=torch.empty(shape, dtype=dtype))

    def node(target, args, kwargs, val, name):
        n = g.call_function(target, args, kwargs, name=name) if kwargs else g.call_function(target, args, name=name)
        n.meta.update(phase="backward", val=val)
        return n

    ca = node(aten._to_copy.default, (ph["a"],), {"dtype": F32}, torch.empty(6, 5), "cast_a") if with_cast else ph["a"]
    fa = node(aten.reshape.default, (ca, [-1]), {}, torch.empty(30), "flat_a")
    pad = node(aten.zeros.default, ([2],), {"dtype": F32}, torch.empty(2), "pad")
    cc = node(aten._to_copy.default, (ph["c"],), {"dtype": F32}, torch.empty(7), "cast_c") if with_cast else ph["c"]
    bucket = node(aten.cat.default, ([fa, pad, ph["b"], cc],), {}, torch.empty(59), "bucket")
    outs = [bucket]
    if divide_by is not None:  # summed over ranks in place, waited for, divided: the mean (reduce_gradients' chain)
        summed = node(c10d.all_reduce_.default, (bucket, "sum", "0"), {}, torch.empty(59), "all_reduce")
        done = node(c10d.wait_tensor.default, (summed,), {}, torch.empty(59), "wait")
        outs = [node(aten.div.Tensor, (done, divide_by), {}, torch.empty(59), "grad_avg")]
    slots = [Slot(Role.USER_OUTPUT, "bucket")]
    if extra_reader:
        outs.append(node(aten.mul.Tensor, (cc, 2.0), {}, torch.empty(7), "reader"))
        slots.append(Slot(Role.USER_OUTPUT, "reader"))
    g.output(tuple(outs))
    sig = StepSignature(inputs=tuple(Slot(Role.BATCH, k) for k in shapes), outputs=tuple(slots))
    return StepGraph(fx.GraphModule(torch.nn.Module(), g), sig, functional=True)


def _inputs(with_cast: bool = True):
    g = torch.Generator().manual_seed(0)
    dt = BF16 if with_cast else F32
    return (torch.randn(6, 5, generator=g).to(dt), torch.randn(20, generator=g), torch.randn(7, generator=g).to(dt))


@pytest.fixture(autouse=True)
def _every_size(monkeypatch):
    monkeypatch.setattr(fuse_bucket_packing, "MIN_NUMEL", 0)


def test_casts_views_and_pads_become_one_pack_with_the_same_bits():
    graph = _graph()
    result = fuse_bucket_packing.fuse_bucket_packing(graph, PassOptions())
    assert result.changed and verify_step_graph(result.graph) == []
    calls = [n for n in result.graph.gm.graph.nodes if n.op == "call_function"]
    (pack,) = calls  # the casts, the flattening view, the pad and the cat are gone
    assert pack.target.__name__ == "pack"
    sources, offsets, total = pack.args
    assert [s.name for s in sources] == ["a", "b", "c"] and offsets == [0, 32, 52] and total == 59
    assert pack.kwargs == {"dtype": F32}
    before, after = graph.gm(*_inputs()), result.graph.gm(*_inputs())
    assert torch.equal(before[0], after[0])
    assert torch.equal(after[0][30:32], torch.zeros(2))


def test_a_conversion_read_elsewhere_is_packed_as_computed():
    graph = _graph(extra_reader=True)
    result = fuse_bucket_packing.fuse_bucket_packing(graph, PassOptions())
    assert result.changed and verify_step_graph(result.graph) == []
    pack = next(n for n in result.graph.gm.graph.nodes if getattr(n.target, "__name__", "") == "pack")
    assert [s.name for s in pack.args[0]] == ["a", "b", "cast_c"]  # c's conversion stays: the mul reads it too
    before, after = graph.gm(*_inputs()), result.graph.gm(*_inputs())
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_a_bucket_without_conversions_is_left_to_cat():
    result = fuse_bucket_packing.fuse_bucket_packing(_graph(with_cast=False), PassOptions())
    assert not result.changed


def test_small_buckets_stay_aten(monkeypatch):
    monkeypatch.setattr(fuse_bucket_packing, "MIN_NUMEL", 60)
    assert not fuse_bucket_packing.fuse_bucket_packing(_graph(), PassOptions()).changed


@pytest.mark.parametrize("world, folded", [(2, True), (4, True), (3, False)])
def test_the_mean_over_a_power_of_two_ranks_is_scaled_in_the_pack(world, folded):
    """sum then divide by N == scale by 1/N then sum, bit for bit, when N is a
    power of two: the pack scales and the division goes; for N = 3 it stays."""
    result = fuse_bucket_packing.fuse_bucket_packing(_graph(divide_by=world), PassOptions())
    assert result.changed and verify_step_graph(result.graph) == []
    nodes = [n for n in result.graph.gm.graph.nodes if n.op == "call_function"]
    pack = next(n for n in nodes if getattr(n.target, "__name__", "") == "pack")
    divisions = [n for n in nodes if n.target is aten.div.Tensor]
    assert (pack.kwargs.get("scale") == 1.0 / world) == folded and (not divisions) == folded
    out = next(n for n in result.graph.gm.graph.nodes if n.op == "output").args[0][0]
    assert out.target is (c10d.wait_tensor.default if folded else aten.div.Tensor)
