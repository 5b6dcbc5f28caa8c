"""eliminate_dead_code: remove nodes whose values nobody uses.

Requires: nothing. Ensures: every remaining call_function node is used, or
has an effect that must stay: it writes in place, it draws random numbers
(removing a dropout mask that is never read would still shift the RNG
stream every later op sees, breaking equality with eager), or it is a
collective (every rank must issue the same sequence).
"""
from __future__ import annotations

import torch.fx as fx

from ...graph import StepGraph
from ...graph.build import clone_step_graph
from ...graph.ops import has_side_effect
from ..manager import PassOptions, PassResult

__all__ = ["eliminate_dead_code"]


def _dead(node: fx.Node) -> bool:
    return node.op in ("call_function", "get_attr") and not node.users and not has_side_effect(node)


def eliminate_dead_code(graph: StepGraph, options: PassOptions) -> PassResult:
    if not any(_dead(n) for n in graph.gm.graph.nodes):
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    before = len(graph.gm.graph.nodes)
    graph.gm.graph.eliminate_dead_code(is_impure_node=has_side_effect)
    graph.gm.recompile()
    removed = before - len(graph.gm.graph.nodes)
    return PassResult(graph, removed > 0, f"removed {removed} unused nodes")
