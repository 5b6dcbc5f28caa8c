"""batch_sum_squares: the per-gradient sums of squares behind the clipping
norm and the overflow check become one multi-tensor call.

``unscale_clip_gradients`` stacks one sum of squares per ZeRO piece (or
gradient) and sums the stack where the norm is not in torch's order;
``fuse_sum_squares`` puts a torch-order norm over 16-bit gradients' copies
into that form too and made each sum a kernel call.
For a transformer that is ~300 launches (and as many partial sums) whose
GPU time is a few microseconds each: the host's launch cost dominates.
``graph_ops.sum_squares_many`` computes the whole stack in two launches per
gradient dtype, at the stack's place (every gradient exists there).

Requires: ``fuse_sum_squares`` ran. Ensures: no ``aten.stack`` whose every
element is a ``sum_squares`` call read by nothing else remains.

Before / after::

    s1 = graph_ops.sum_squares(g1)
    s2 = graph_ops.sum_squares(g2)         ->   sumsqs = graph_ops.sum_squares_many(g1, g2)
    sumsqs = aten.stack([s1, s2])
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...graph import StepGraph
from ...graph.build import clone_step_graph_mapped
from ..manager import PassOptions, PassResult

__all__ = ["batch_sum_squares"]

aten = torch.ops.aten


def _stack_of_sums(node: fx.Node) -> bool:
    from ...codegen import graph_ops

    if node.op != "call_function" or node.target is not aten.stack.default:
        return False
    if len(node.args) > 1 and node.args[1] not in (0, -1) or node.kwargs.get("dim", 0) != 0:
        return False
    parts = node.args[0]
    return len(parts) > 1 and all(
        isinstance(p, fx.Node) and p.target is graph_ops.sum_squares and len(p.users) == 1 for p in parts)


def batch_sum_squares(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    found = [n for n in graph.gm.graph.nodes if _stack_of_sums(n)]
    if not found:
        return PassResult(graph, False)
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    total = 0
    for match in found:
        stack = copy_of[match]
        parts = list(stack.args[0])
        with g.inserting_before(stack):
            new = g.create_node("call_function", graph_ops.sum_squares_many, tuple(p.args[0] for p in parts), {},
                                name="sumsqs_many")
        new.meta.update(stack.meta)
        stack.replace_all_uses_with(new)
        g.erase_node(stack)
        for p in parts:
            g.erase_node(p)
        total += len(parts)
    graph.gm.recompile()
    return PassResult(graph, True, f"{total} sums of squares in {len(found)} multi-tensor calls")
