"""hold_accumulated_gradients: gradients accumulating over micro-steps live
on the rank, not in the user's ``.grad``.

Requires: ``zero_optimization`` may shard the step; ``gradient_accumulation_steps`` > 1.

Ensures: every GRAD slot (the accumulator a micro-step reads and, before
the update, writes) has storage "rank": the executor keeps it between
calls, the user's ``param.grad`` stays as it was (as with DeepSpeed's
engine, whose partitioned gradients users do not touch either), and ZeRO
may hold it even where it shards gradients.

Before / after::

    g_fc_weight: grad fc.weight          ->  g_fc_weight: grad fc.weight (rank)
"""
from __future__ import annotations

import dataclasses

from ...graph import Role, StepGraph, Storage
from ...graph.build import clone_step_graph
from ..manager import PassOptions, PassResult

__all__ = ["hold_accumulated_gradients", "accumulation_steps"]


def accumulation_steps(options: PassOptions) -> int:
    value = getattr(options.config, "gradient_accumulation_steps", 1)
    return value if isinstance(value, int) and value > 0 else 1


def hold_accumulated_gradients(graph: StepGraph, options: PassOptions) -> PassResult:
    sig = graph.signature
    if not any(s.role is Role.GRAD and s.storage is Storage.USER for s in (*sig.inputs, *sig.outputs)):
        return PassResult(graph, False)
    graph = clone_step_graph(graph)

    def held(slot):
        return dataclasses.replace(slot, storage=Storage.RANK) if slot.role is Role.GRAD else slot

    inputs = tuple(held(s) for s in sig.inputs)
    for node in graph.gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["slot"] = held(node.meta["slot"])
    graph = graph.replace(signature=sig.with_inputs(inputs).with_outputs(tuple(held(s) for s in sig.outputs)))
    n = sum(1 for s in (*sig.inputs, *sig.outputs) if s.role is Role.GRAD)
    return PassResult(graph, True, f"{n} gradient accumulators held by the rank")
