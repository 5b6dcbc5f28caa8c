"""hoist_getitems: each result of a multi-output op is taken out of its tuple
right after the op.

A pass that makes a later node read one result of a multi-output op (the
recomputation's backward reading a fused residual-add + layer norm's mean and
rstd, say) adds a ``getitem`` there, and the program then holds the op's whole
tuple until that ``getitem`` runs: every result stays alive, also those
nothing reads after the forward. With d 5120 and 24 x 2048 tokens that is a
480 MiB residual sum per block kept to the backward, 18.75 GiB over 40
blocks, which the memory estimate (graph/accounting.py frees a multi-output
op's results one by one, at each one's last reader) did not count: measured
123.6 GiB against 105.7 predicted at 13B.

Requires: nothing (a getitem is free and reads only its op).

Ensures: every ``getitem`` of a ``call_function`` node follows that node
directly (after the other getitems of it), one per index; each takes the
op's phase. The tuple's last reader is then the op's last getitem, and each
result lives until its own last reader.

Before / after::

    out = add_layer_norm(x, h, ...)              out = add_layer_norm(x, h, ...)
    s = getitem(out, 0)                          s = getitem(out, 0)
    y = getitem(out, 1)                          y = getitem(out, 1)
    ...                                   ->     rstd = getitem(out, 3)
    rstd = getitem(out, 3)   # backward          ...
    dx = layer_norm_backward(..., rstd)          dx = layer_norm_backward(..., rstd)
"""
from __future__ import annotations

import operator

import torch.fx as fx

from ...graph import StepGraph
from ...graph.build import clone_step_graph
from ...graph.step_graph import META_PHASE
from ..manager import PassOptions, PassResult

__all__ = ["hoist_getitems"]


def _items(node: fx.Node) -> list:
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]


def _in_place(node: fx.Node, items: list) -> bool:
    """The getitems of ``node`` follow it directly, one per index."""
    nxt, seen = node.next, set()
    for _ in items:
        if nxt not in items or nxt.args[1] in seen:
            return False
        seen.add(nxt.args[1])
        nxt = nxt.next
    return True


def hoist_getitems(graph: StepGraph, options: PassOptions) -> PassResult:
    todo = [n.name for n in graph.gm.graph.nodes if n.op == "call_function" and not _in_place(n, _items(n))]
    if not todo:
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    names = set(todo)
    order = {n: i for i, n in enumerate(g.nodes)}  # (moving getitems never reorders two of one op)
    moved = merged = 0
    for node in [n for n in g.nodes if n.name in names]:
        first: dict = {}
        anchor = node
        for item in sorted(_items(node), key=lambda u: (u.args[1], order[u])):
            index = item.args[1]
            if index in first:  # the same result taken twice: one getitem
                item.replace_all_uses_with(first[index])
                g.erase_node(item)
                merged += 1
                continue
            first[index] = item
            if anchor.next is not item:
                anchor.append(item)
                moved += 1
            if node.meta.get(META_PHASE) is not None:
                item.meta[META_PHASE] = node.meta[META_PHASE]
            anchor = item
    g.lint()
    graph.gm.recompile()
    return PassResult(graph, bool(moved or merged),
                      f"{moved} results of {len(todo)} multi-output ops taken out right after their op"
                      + (f", {merged} duplicate getitems merged" if merged else "")
                      + ": each result lives until its own last reader, not the op's whole tuple")
