"""fold_gradient_casts: the fused kernels read 16-bit gradients themselves,
so the fp32 copy of each gradient that mixed precision makes is dropped.

Under bf16/fp16 the fp32 master parameter's gradient is the backward of the
forward's cast: ``_to_copy(g16, dtype=float32)``, one kernel and 4 bytes per
element written, then read again by the norm and the update. The fused
kernels (``sum_squares``, ``adam_step``, ``sgd_step``) load a bf16/fp16
gradient and widen it to fp32 in registers, the exact same values (the
widening is exact), so when those kernels are the copy's only readers they
take ``g16`` instead and the copy goes: one kernel per parameter less, 6
bytes per element less traffic, and no fp32 gradient buffers at the peak.

Requires: the fusion passes ran (``fuse_sum_squares``,
``fuse_optimizer_update``). Ensures: no ``_to_copy`` to fp32 of a 16-bit
tensor is read only by fused kernels at their gradient argument.

Before / after::

    g32 = aten._to_copy(g16, dtype=torch.float32)     ->   sumsq = graph_ops.sum_squares(g16)
    sumsq = graph_ops.sum_squares(g32)                     upd = graph_ops.adam_step(p, g16, ...)
    upd = graph_ops.adam_step(p, g32, ...)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...graph import StepGraph
from ...graph.build import clone_step_graph_mapped
from ...graph.ops import dtype_cast
from ..manager import PassOptions, PassResult

__all__ = ["fold_gradient_casts"]

aten = torch.ops.aten
_NARROW = (torch.bfloat16, torch.float16)


def _grad_position(user: fx.Node, cast: fx.Node) -> bool:
    """``cast`` is read by ``user`` only as a fused kernel's gradient."""
    from ...codegen import graph_ops

    if user.op != "call_function" or user.kwargs and cast in user.kwargs.values():
        return False
    positions = [i for i, a in enumerate(user.args) if a is cast]
    if user.target is graph_ops.sum_squares:
        return positions == [0]
    if user.target in (graph_ops.adam_step, graph_ops.sgd_step):
        return positions == [1]
    return False


def _foldable(node: fx.Node) -> bool:
    vals = dtype_cast(node)
    if vals is None:
        return False
    src, out = vals
    return (src.dtype in _NARROW and out.dtype == torch.float32 and src.is_contiguous()
            and bool(node.users) and all(_grad_position(u, node) for u in node.users))


def fold_gradient_casts(graph: StepGraph, options: PassOptions) -> PassResult:
    found = [n for n in graph.gm.graph.nodes if _foldable(n)]
    if not found:
        return PassResult(graph, False)
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    for match in found:
        cast = copy_of[match]
        cast.replace_all_uses_with(cast.args[0])
        g.erase_node(cast)
    graph.gm.recompile()
    return PassResult(graph, True, f"{len(found)} fp32 gradient copies dropped: the fused kernels read the 16-bit gradients")
