"""fuse_sum_squares: each gradient's sum of squares (the clipping norm and the
fp16 overflow check) becomes one kernel that reads the gradient once.

Requires: ``unscale_clip_gradients`` ran (it emits, per gradient,
``sum(mul(g32, g32))`` with ``g32 = _to_copy(g, float32)`` for 16-bit
gradients).

Ensures: every ``aten.sum(aten.mul(a, a))`` over a whole tensor, where ``a``
is a gradient or its fp32 copy, is one call of
:func:`stepfx.codegen.graph_ops.sum_squares` on the gradient: no fp32 copy,
no squared temporary (eager reads the gradient, writes and reads the copy,
writes and reads the squares). Matched by op identity.

Before / after::

    g32 = aten._to_copy(g_w, dtype=torch.float32)
    sq = aten.mul.Tensor(g32, g32)              ->   sumsq = stepfx.codegen.graph_ops.sum_squares(g_w)
    sumsq = aten.sum(sq)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import StepGraph
from ..graph.build import clone_step_graph_mapped
from ..graph.ops import has_side_effect
from .manager import PassOptions, PassResult

__all__ = ["fuse_sum_squares"]

aten = torch.ops.aten


def _squared(node: fx.Node) -> fx.Node | None:
    """The tensor whose fp32 squares ``node`` sums, or None."""
    if node.target is not aten.sum.default or len(node.args) != 1 or node.kwargs:
        return None
    sq = node.args[0]
    if not (isinstance(sq, fx.Node) and sq.target is aten.mul.Tensor and len(sq.args) == 2 and sq.args[0] is sq.args[1]):
        return None
    base = sq.args[0]
    if base.target is aten._to_copy.default and dict(base.kwargs) == {"dtype": torch.float32}:
        base = base.args[0]
    val = base.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return base


def fuse_sum_squares(graph: StepGraph, options: PassOptions) -> PassResult:
    from ..codegen import graph_ops

    matches = [(n, _squared(n)) for n in graph.gm.graph.nodes if n.op == "call_function"]
    matches = [(n, base) for n, base in matches if base is not None and base.meta["val"].is_contiguous()]
    if not matches:
        return PassResult(graph, False)
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    for old, base in matches:
        node, base = copy_of[old], copy_of[base]
        with g.inserting_before(node):
            new = g.create_node("call_function", graph_ops.sum_squares, (base,), {}, name="sumsq")
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        g.erase_node(node)
    g.eliminate_dead_code(is_impure_node=has_side_effect)
    graph.gm.recompile()
    return PassResult(graph, True, f"{len(matches)} sums of squares fused (one read of each gradient)")
