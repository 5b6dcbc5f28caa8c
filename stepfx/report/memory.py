"""Memory over the step: predicted live bytes by category at every node.

The same liveness walk as ``explain()``'s predicted peak
(``graph.accounting.liveness``), so the curve's maximum is that peak. Each
live value is put in one category:

- inputs by their role: parameters, gradients, optimizer state, buffers;
  the batch, hyperparameters and stepfx's runtime state are "other";
- computed values: a node the step returns as a parameter or optimizer
  state counts as that; a parameter's accumulated gradient
  (``meta["grad_of"]``) or a value the step returns as a gradient counts as
  gradients; everything else by phase: forward and backward temporaries as
  activations, the optimizer's temporaries as optimizer state.
"""
from __future__ import annotations

import collections

import torch.fx as fx

from ..graph import META_GRAD_OF, META_PHASE, Phase, Role, StepGraph
from ..graph.accounting import Sizes, liveness, size_values
from .diff import node_row

__all__ = ["CATEGORIES", "memory_over_step"]

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "buffers", "other")

_ROLE_CATEGORY = {
    Role.PARAM: "parameters",
    Role.GRAD: "gradients",
    Role.OPTIMIZER_STATE: "optimizer state",
    Role.BUFFER: "buffers",
}


def _categorizer(graph: StepGraph):
    out = [n for n in graph.gm.graph.nodes if n.op == "output"]
    returned: dict[fx.Node, str] = {}
    if out:
        (values,) = out[0].args
        values = values if isinstance(values, (list, tuple)) else (values,)
        for value, slot in zip(values, graph.signature.outputs):
            if isinstance(value, fx.Node) and slot.role in _ROLE_CATEGORY:
                returned.setdefault(value, _ROLE_CATEGORY[slot.role])

    def category(node: fx.Node) -> str:
        if node.op == "placeholder":
            return _ROLE_CATEGORY.get(node.meta["slot"].role, "other")
        if node in returned:
            return returned[node]
        if META_GRAD_OF in node.meta:
            return "gradients"
        return "optimizer state" if node.meta.get(META_PHASE) == Phase.OPTIMIZER else "activations"

    return category


def memory_over_step(graph: StepGraph, values=None, top: int = 12) -> dict:
    """Plain data for the report: ``points`` (one per node that runs:
    its name and the live bytes per category right after it allocated),
    ``peak``/``peak_node``/``peak_index`` and the ``top`` largest holders live
    at the peak."""
    sizes = Sizes(size_values(graph) if values is None else values)
    category = _categorizer(graph)
    points = list(_walk(graph, sizes, category))
    peak_index = max(range(len(points)), key=lambda i: sum(points[i][c] for c in CATEGORIES)) if points else 0
    at_peak = next(_walk(graph, sizes, category, holders_at=peak_index), {}) if points else {}
    ranked = sorted(at_peak.items(), key=lambda kv: -kv[1])[:top]
    return {
        "categories": list(CATEGORIES),
        "points": points,
        "peak": sum(points[peak_index][c] for c in CATEGORIES) if points else 0,
        "peak_node": points[peak_index]["node"] if points else "",
        "peak_index": peak_index,
        "top": [{**node_row(n), "category": category(n), "bytes": b} for n, b in ranked],
    }


def _walk(graph: StepGraph, sizes: Sizes, category, holders_at: int | None = None):
    """Yields a point per node that runs; with ``holders_at``, instead yields
    once the live holders (node -> bytes) at that point and stops."""
    live = collections.Counter()  # category -> bytes
    holders: dict[fx.Node, int] = {}
    index = -1
    for node, size, freed in liveness(graph, sizes):
        if size is not None:
            nbytes = sizes.value(size)
            live[category(node)] += nbytes
            holders[node] = holders.get(node, 0) + nbytes
        if node.op == "placeholder":
            continue
        index += 1
        if holders_at is None:
            yield {"node": node.name, **{c: live[c] for c in CATEGORIES}}
        elif index == holders_at:
            yield {n: b for n, b in holders.items() if b}
            return
        for holder, terms in freed:
            nbytes = sizes.value(terms)
            live[category(holder)] -= nbytes
            holders[holder] -= nbytes
