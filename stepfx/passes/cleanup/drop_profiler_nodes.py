"""drop_profiler_nodes: remove ``record_function`` enter/exit markers.

Requires: nothing. Ensures: no PROFILER_OPS nodes remain. They compute
nothing (torch.optim wraps ``step`` and ``zero_grad`` in them); left in,
they pin node order and show up as noise in every printed graph.

Before / after::

    r = torch.ops.profiler._record_function_enter_new('Optimizer.step#AdamW.step')   ->  (gone)
    torch.ops.profiler._record_function_exit._RecordFunction(r)                     ->  (gone)
"""
from __future__ import annotations

from ...graph import StepGraph
from ...graph.build import clone_step_graph
from ...graph.ops import PROFILER_OPS
from ..manager import PassOptions, PassResult

__all__ = ["drop_profiler_nodes"]


def drop_profiler_nodes(graph: StepGraph, options: PassOptions) -> PassResult:
    if not any(n.op == "call_function" and n.target in PROFILER_OPS for n in graph.gm.graph.nodes):
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    removed = 0
    # exits use the enters' handles: erase users first
    for node in reversed(list(graph.gm.graph.nodes)):
        if node.op == "call_function" and node.target in PROFILER_OPS:
            graph.gm.graph.erase_node(node)
            removed += 1
    graph.gm.recompile()
    return PassResult(graph, True, f"removed {removed} profiler markers")
