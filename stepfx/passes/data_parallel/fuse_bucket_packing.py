"""fuse_bucket_packing: a collective's bucket is cast and packed in one pass.

The ZeRO passes build each bucket as ``cat([parts...])``: under bf16/fp16
every 16-bit gradient is first converted to an fp32 copy of its own (the
master's gradient), flattened, and only then copied again into the bucket
(and the parameter shards cast to 16 bits before their gather bucket the
same way). stepfx's ``cast_pack`` kernel writes the bucket once, reading
each part in its own dtype and converting in registers: for bf16 gradients
into an fp32 bucket 6 bytes of traffic per element instead of 14, and no
fp32 gradient copies held while the bucket fills (measured on 2xH200 at
ZeRO-0: the casts and the concatenation were ~11 ms of a 155 ms step).

Requires: the ZeRO passes made the buckets (``pack_flat``). Ensures: every
``aten.cat`` into a 1-D bucket of at least ``MIN_NUMEL`` elements whose
parts are all 1-D and each either

- a dtype conversion (``_to_copy``, possibly flattened by a view) of a
  contiguous tensor, read by nothing but the bucket,
- a contiguous tensor already of the bucket's dtype, or
- an ``aten.zeros`` pad read by nothing but the bucket,

with at least one conversion among them, is one call of
:func:`stepfx.codegen.graph_ops.pack` (the pads become the gaps the
kernel zeroes). Matched by op identity; the values are the same bits
(``cast_pack`` rounds as torch does, tested bitwise). When the bucket is
only summed over N ranks and then divided by N, N a power of two, the pack
multiplies by 1/N instead and the division (a read and a write of every
reduced element) goes: scaling by a power of two is exact before the sum
as after it, so the mean is the same bits (barring under- and overflow,
where pre-scaling is the safer of the two).

Before / after::

    g32 = aten._to_copy(g16, dtype=torch.float32)
    flat = aten.reshape(g32, [-1])                     ->   bucket = graph_ops.pack([g16, w_grad], [0, 4096], 8192, dtype=torch.float32)
    pad = aten.zeros([64], dtype=torch.float32)
    bucket = aten.cat([flat, pad, w_grad])

    all_reduce = _c10d_functional.all_reduce_(bucket, 'sum', '0')      ->   bucket = graph_ops.pack(..., scale=0.5)
    wait = _c10d_functional.wait_tensor(all_reduce)                        all_reduce = _c10d_functional.all_reduce_(bucket, 'sum', '0')
    grad_avg = aten.div.Tensor(wait, 2)                                    wait = _c10d_functional.wait_tensor(all_reduce)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...graph import StepGraph
from ...graph.build import clone_step_graph_mapped
from ...graph.ops import dtype_cast
from ..fusion.fuse_casts import MIN_NUMEL
from ..manager import PassOptions, PassResult

__all__ = ["fuse_bucket_packing"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_FLATTEN = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _only_reader(node: fx.Node, reader: fx.Node) -> bool:
    return set(node.users) == {reader}


def _source(part: fx.Node, bucket: fx.Node, dtype: torch.dtype):
    """What the kernel reads for ``part`` and whether ``part`` was a
    conversion: (tensor node, converted), ``("pad", False)`` for a zeros
    pad, or None when ``part`` is none of the three kinds."""
    val = part.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 1:
        return None
    if part.op == "call_function" and part.target is aten.zeros.default and _only_reader(part, bucket):
        return "pad", False
    inner, reader = part, bucket
    if part.op == "call_function" and part.target in _FLATTEN and _only_reader(part, bucket):
        inner, reader = part.args[0], part  # a flattened conversion: reshape(_to_copy(x), [-1])
    vals = dtype_cast(inner) if isinstance(inner, fx.Node) else None
    if vals is not None and _only_reader(inner, reader):
        src, out = vals
        if out.dtype == dtype and src.dtype in _FLOATS and src.is_contiguous() and src.numel() == val.numel():
            return inner.args[0], True
    if val.dtype == dtype and val.is_contiguous():
        return part, False
    return None


def _is_cat0(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not aten.cat.default or node.kwargs.get("dim", 0) != 0:
        return False
    return len(node.args) == 1 or (len(node.args) == 2 and node.args[1] == 0)


def _plan(bucket: fx.Node):
    """(sources, their offsets, total) when ``bucket`` can be one pack, else None."""
    if not _is_cat0(bucket):
        return None
    out = bucket.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dim() != 1 or out.dtype not in _FLOATS or out.numel() < MIN_NUMEL:
        return None
    sources, offsets, at, converted = [], [], 0, False
    for part in bucket.args[0]:
        found = _source(part, bucket, out.dtype) if isinstance(part, fx.Node) else None
        if found is None:
            return None
        source, was_cast = found
        if source != "pad":
            if source.meta["val"].device != out.device:
                return None
            sources.append(source)
            offsets.append(at)
        converted |= was_cast
        at += part.meta["val"].numel()
    if not converted or at != out.numel():
        return None
    return sources, offsets, at


_COLLECTIVES = (c10d.all_reduce.default, c10d.all_reduce_.default, c10d.reduce_scatter_tensor.default)


def _averaging_division(bucket: fx.Node) -> fx.Node | None:
    """The ``div(..., N)`` that averages what ``bucket``'s sum over N ranks
    gave, when N is a power of two and nothing else reads the sum: the
    bucket alone -> its collective -> the wait (-> the conversion back
    from the communication dtype) -> the division. Scaling by 1/N is then
    exact before the sum as after it (barring under- and overflow), so the
    pack can apply it and the division goes."""
    (collective,) = bucket.users if len(bucket.users) == 1 else (None,)
    if collective is None or collective.target not in _COLLECTIVES or len(collective.users) != 1:
        return None
    (node,) = collective.users
    if node.target is not c10d.wait_tensor.default or len(node.users) != 1:
        return None
    (node,) = node.users
    if dtype_cast(node) is not None:
        if len(node.users) != 1:
            return None
        (node,) = node.users
    if node.target is not aten.div.Tensor or len(node.args) != 2 or node.kwargs:
        return None
    n = node.args[1]
    return node if isinstance(n, int) and not isinstance(n, bool) and n > 1 and n & (n - 1) == 0 else None


def _erase_if_unread(node) -> None:
    """Drop ``node`` (a conversion, a flattening view or a pad the bucket
    read) once nothing reads it, and then its flattened conversion."""
    if not isinstance(node, fx.Node) or node.users or node.op != "call_function":
        return
    if node.target in _FLATTEN or node.target is aten.zeros.default or dtype_cast(node) is not None:
        inner = node.args[0] if node.target in _FLATTEN or dtype_cast(node) is not None else None
        node.graph.erase_node(node)
        _erase_if_unread(inner)


def fuse_bucket_packing(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    found = [n for n in graph.gm.graph.nodes if _plan(n) is not None]
    if not found:
        return PassResult(graph, False)
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    folded = 0
    for old in found:
        bucket = copy_of[old]
        sources, offsets, total = _plan(bucket)
        with g.inserting_before(bucket):
            packed = g.create_node("call_function", graph_ops.pack, (sources, offsets, total),
                                   {"dtype": bucket.meta["val"].dtype}, name="bucket")
        packed.meta.update(bucket.meta)
        parts = list(bucket.args[0])
        division = _averaging_division(bucket)
        bucket.replace_all_uses_with(packed)
        g.erase_node(bucket)
        if division is not None:  # 1/N applied by the pack: the sum that arrives is the mean
            packed.update_kwarg("scale", 1.0 / division.args[1])
            division.replace_all_uses_with(division.args[0])
            g.erase_node(division)
            folded += 1
        for part in parts:  # conversions, their flattening views, pads: read by nothing now
            _erase_if_unread(part)
    graph.gm.recompile()
    return PassResult(graph, True, f"{len(found)} buckets cast and packed in one pass each, "
                                   f"{folded} of them scaled by 1/N for the mean (no division after the sum)")
