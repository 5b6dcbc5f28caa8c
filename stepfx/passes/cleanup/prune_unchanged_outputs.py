"""prune_unchanged_outputs: stop returning state the step leaves as it was.

Requires: a functional graph without alias ops (so "unchanged" is visible as
the output being the input placeholder itself).

Ensures: no output slot of a state role (param, buffer, grad, optimizer
state) returns the placeholder of the same slot. Frozen parameters,
parameters outside the optimizer and buffers nobody updates are then not
written back every step.

Before / after::

    return (addcdiv, p_frozen_weight, ...)   # param fc.weight, param frozen.weight
    ->
    return (addcdiv, ...)                    # param fc.weight
"""
from __future__ import annotations

from ...graph import STATE_ROLES, StepGraph, output_node, output_values
from ...graph.build import clone_step_graph
from ..manager import PassOptions, PassResult

__all__ = ["prune_unchanged_outputs"]


def prune_unchanged_outputs(graph: StepGraph, options: PassOptions) -> PassResult:
    sig = graph.signature
    phs = {n.meta["slot"].ident: n for n in graph.gm.graph.nodes if n.op == "placeholder"}
    values = output_values(graph.gm)
    keep = [
        i
        for i, (slot, value) in enumerate(zip(sig.outputs, values))
        if not (slot.role in STATE_ROLES and phs.get(slot.ident) is value)
    ]
    if len(keep) == len(values):
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    out = output_node(graph.gm)
    new_values = output_values(graph.gm)
    out.args = (tuple(new_values[i] for i in keep),)
    graph.gm.recompile()
    pruned = [sig.outputs[i].describe() for i in range(len(values)) if i not in set(keep)]
    graph = graph.replace(signature=sig.with_outputs(tuple(sig.outputs[i] for i in keep)))
    return PassResult(graph, True, f"{len(pruned)} unchanged state outputs pruned")
