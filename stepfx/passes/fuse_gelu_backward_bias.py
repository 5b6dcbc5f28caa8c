"""fuse_gelu_backward_bias: a GELU's backward and the bias gradient of the
linear layer before it in one pass over the activation gradient.

In an MLP ``fc_out(gelu(fc(x)))`` the backward computes
``dh = gelu_backward(dy, h)`` (reads dy and h, writes dh) and then fc's
bias gradient ``dh.sum(0)`` (reads dh again): on the 1.3B GPT 8192 x 8192
bf16 per layer, 107 us + 34 us on an H200. One kernel
(``reduction_kernels.gelu_backward_column_sum``) writes dh and sums the
values it wrote (as rounded to dh's dtype: the same numbers the separate
sum reads) into fp32 partials, saving a read of dh and a launch.

Requires: ``fuse_column_sums`` ran (the bias gradient is a ``column_sum``).
Ensures: every ``column_sum`` of a reshape to 2-D (or of the 2-D tensor
itself) of ``aten.gelu_backward(dy, h, approximate)``, with ``dy`` and
``h`` contiguous, of one shape and dtype, is one
:func:`stepfx.codegen.graph_ops.gelu_backward_column_sum` placed where the
GELU backward was; its two outputs replace the GELU backward and the sum.
Matched by op identity. GELU's derivative is computed in fp32 as torch's
kernel writes it (tanh: its tanh and 1 - tanh^2 from one exponential,
error under torch's own in fp32); 16-bit outputs may differ from torch's
by one unit in the last place where their fp32 values straddle a rounding
boundary.

Before / after::

    gelu_backward = aten.gelu_backward(view_31, view_21, approximate='tanh')   ->   fused = graph_ops.gelu_backward_column_sum(view_31, view_21, approximate='tanh', keepdim=True)
    view_32 = aten.view(gelu_backward, [32, 128])                                   gelu_backward = fused[0]
    column_sum = graph_ops.column_sum(view_32, keepdim=True)                         view_32 = aten.view(gelu_backward, [32, 128])
                                                                                      column_sum = fused[1]
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import StepGraph
from ..graph.build import clone_step_graph_mapped
from .collectives import fake_like, make_node
from .manager import PassOptions, PassResult

__all__ = ["fuse_gelu_backward_bias"]

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _match(node: fx.Node) -> fx.Node | None:
    """The GELU backward whose bias gradient ``node`` (a column_sum) is."""
    from ..codegen import graph_ops

    if node.op != "call_function" or node.target is not graph_ops.column_sum:
        return None
    src = node.args[0]
    if isinstance(src, fx.Node) and src.op == "call_function" and src.target in _RESHAPES:
        src = src.args[0]
    if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.gelu_backward.default):
        return None
    dy, h = src.args[:2]
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in (dy, h)]
    if not all(isinstance(v, torch.Tensor) and v.is_contiguous() for v in vals):
        return None
    if vals[0].shape != vals[1].shape or vals[0].dtype != vals[1].dtype or vals[0].dim() < 1:
        return None
    if node.meta["val"].shape[-1] != vals[1].shape[-1]:
        return None
    return src


def fuse_gelu_backward_bias(graph: StepGraph, options: PassOptions) -> PassResult:
    from ..codegen import graph_ops

    pairs = [(n, gb) for n in graph.gm.graph.nodes if (gb := _match(n)) is not None]
    if not pairs:
        return PassResult(graph, False)
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    for old_sum, old_gb in pairs:
        total, gelu_bwd = copy_of[old_sum], copy_of[old_gb]
        dy, h = gelu_bwd.args[:2]
        approximate = gelu_bwd.kwargs.get("approximate", "none")
        keepdim = total.kwargs["keepdim"]
        vals = (gelu_bwd.meta["val"], total.meta["val"])
        with g.inserting_before(gelu_bwd):
            fused = make_node(g, graph_ops.gelu_backward_column_sum, (dy, h), {"approximate": approximate, "keepdim": keepdim},
                              val=tuple(fake_like(v, v.shape) for v in vals), like=gelu_bwd, name="gelu_backward_bias")
            outs = [make_node(g, operator.getitem, (fused, i), val=fake_like(v, v.shape), like=old, name=old.name + "_out")
                    for i, (v, old) in enumerate(zip(vals, (gelu_bwd, total)))]
        gelu_bwd.replace_all_uses_with(outs[0])
        total.replace_all_uses_with(outs[1])
        g.erase_node(total)
        g.erase_node(gelu_bwd)
    graph.gm.recompile()
    return PassResult(graph, True, f"{len(pairs)} GELU backwards fused with the bias gradient they feed")
