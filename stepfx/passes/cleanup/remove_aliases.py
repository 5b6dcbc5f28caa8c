"""remove_aliases: drop ops that return their input unchanged.

Requires: a functional graph (nothing writes through an alias, so an alias
and its source always hold the same value).

Ensures: no ALIAS_OPS nodes (``detach``, ``alias``, ``lift_fresh_copy``);
their users read the source directly. In a no-grad functional program
``detach`` is autograd bookkeeping only.

Before / after::

    detach = aten.detach(p_fc1_weight)      ->  (gone)
    t = aten.t(detach)                      ->  t = aten.t(p_fc1_weight)
"""
from __future__ import annotations

from ...errors import PassError
import torch.fx as fx

from ...graph import META_GRAD_OF, StepGraph
from ...graph.build import clone_step_graph, label_params
from ...graph.ops import ALIAS_OPS
from ..manager import PassOptions, PassResult
from ..pipeline.partition_stages import pipeline_settings

__all__ = ["remove_aliases"]


def remove_aliases(graph: StepGraph, options: PassOptions) -> PassResult:
    if not graph.functional:
        raise PassError("remove_aliases requires a functional graph (run functionalize_graph first)")
    if not any(n.op == "call_function" and n.target in ALIAS_OPS for n in graph.gm.graph.nodes):
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    removed = moved = 0
    for node in list(graph.gm.graph.nodes):
        if node.op == "call_function" and node.target in ALIAS_OPS:
            source = node.args[0]
            # a gradient marker moves to the value it marks
            if META_GRAD_OF in node.meta and isinstance(source, fx.Node):
                source.meta[META_GRAD_OF] = node.meta[META_GRAD_OF]
                moved += 1
            node.replace_all_uses_with(source)
            graph.gm.graph.erase_node(node)
            removed += 1
    if moved and pipeline_settings(options) <= 1:
        # the parameter labels follow the markers: an update reading a gradient accumulated over
        # micro-steps (held + new, marked only through the alias) belongs to its parameter (SGD's
        # first momentum is a clone of it, which ZeRO's rewrite of the update must see as the
        # parameter's). Not under a pipeline: its runtime's ZeRO shares count the clip norm's parts
        # by these labels, and relabelled a PP x ZeRO-1 step with clipping departs from the
        # reference (not understood yet; closing note of 2026-12-04)
        label_params(graph)
    graph.gm.recompile()
    return PassResult(graph, True, f"removed {removed} alias ops")

