"""hoist_symbolic_sizes: every symbolic size is read off a batch input.

With symbolic batch sizes (``stepfx.dynamic``) the trace reads each size it
needs with ``aten.sym_size.int(t, d)`` from whichever tensor it was handling
at the time: an activation, the logits. Such a read is a use of that
tensor: it keeps the tensor alive to the last size read (the memory plan
counts it so) and makes fusions that must be a tensor's only reader (the
chunked linear + cross-entropy never materializes the logits) see another.

Requires: a functional graph. Ensures: each ``sym_size`` node whose size is
one of the batch inputs' own symbols reads that batch input (one node per
symbol, right after the placeholders); a size that is integer arithmetic
on them (``2*s0 - 2``: flattened logits) becomes that arithmetic on those
reads; data-dependent sizes (``nonzero``'s length) stay where they are.

Before / after::

    mm = aten.mm(x, w);  sym_size = aten.sym_size.int(mm, 0);  view = aten.view(mm, [sym_size, 4])
    size_s0 = aten.sym_size.int(idx, 1)  # after the placeholders
    mm = aten.mm(x, w);  view = aten.view(mm, [size_s0, 4])
"""
from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from ... import compat
from ...graph import Role, StepGraph
from ...graph.build import clone_step_graph
from ...graph.ops import has_side_effect
from ..manager import PassOptions, PassResult

__all__ = ["hoist_symbolic_sizes", "SizeBuilder", "symbol_sources"]

aten = torch.ops.aten


def symbol_sources(graph: fx.Graph) -> dict:
    """Symbol -> (batch placeholder, dim) that holds it as a size (the first)."""
    sources: dict = {}
    for node in graph.nodes:
        if node.op != "placeholder" or node.meta["slot"].role is not Role.BATCH:
            continue
        val = node.meta.get("val")
        for d, size in enumerate(getattr(val, "shape", ())):
            if isinstance(size, torch.SymInt):
                expr = compat.size_expr(size)
                if expr.is_symbol and expr not in sources:
                    sources[expr] = (node, d)
    return sources


def _expressible(expr, sources: dict) -> bool:
    """Whether ``expr`` is integer arithmetic (+, *, //) on batch symbols."""
    if expr.is_Integer or expr in sources:
        return True
    if isinstance(expr, (sympy.Add, sympy.Mul)) or type(expr).__name__ == "FloorDiv":
        return all(_expressible(a, sources) for a in expr.args)
    return False


class SizeBuilder:
    """Emits Python arithmetic on hoisted ``sym_size`` reads of the batch
    inputs for a size expression (each symbol read once per graph, right
    after the placeholders). ``reuse``: an expression built once is read by
    every later ``build`` of it (callers that build in graph order); else
    each ``build`` makes its arithmetic right before its reader."""

    def __init__(self, g: fx.Graph, sources: dict, after: fx.Node, reuse: bool = True):
        self.g, self.sources, self.after, self.reuse = g, sources, after, reuse
        self.symbols: dict = {}
        self.built: dict = {}  # expression -> the node computing it (earlier in the graph)

    def symbol(self, expr, like: fx.Node) -> fx.Node:
        if expr not in self.symbols:
            placeholder, dim = self.sources[expr]
            with self.g.inserting_after(self.after):
                node = self.g.call_function(aten.sym_size.int, (placeholder, dim))
            _annotate(node, like, placeholder.meta["val"].shape[dim])
            self.symbols[expr] = node
        return self.symbols[expr]

    def build(self, expr, before: fx.Node, like: fx.Node | None = None):
        """A node computing ``expr`` (or its int), made before ``before``, with ``like``'s metadata
        (phase, source; ``before``'s by default)."""
        like = before if like is None else like
        if expr.is_Integer:
            return int(expr)
        if expr in self.sources:
            return self.symbol(expr, like)
        if self.reuse and expr in self.built:
            return self.built[expr]
        op = {sympy.Add: operator.add, sympy.Mul: operator.mul}.get(type(expr), operator.floordiv)
        args = [self.build(a, before, like) for a in expr.args]
        out = args[0]
        for arg in args[1:]:
            with self.g.inserting_before(before):
                node = self.g.call_function(op, (out, arg))
            _annotate(node, like, op(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in (out, arg)]))
            out = node
        self.built[expr] = out
        return out


def _annotate(node: fx.Node, like: fx.Node, val) -> None:
    """A new size node takes the metadata (phase, source) of the node it was made for."""
    node.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    node.meta["val"] = val


def hoist_symbolic_sizes(graph: StepGraph, options: PassOptions) -> PassResult:
    sources = symbol_sources(graph.gm.graph)
    if not sources:
        return PassResult(graph, False)

    def movable(n: fx.Node) -> bool:
        if n.op != "call_function" or n.target is not aten.sym_size.int or not isinstance(n.meta.get("val"), torch.SymInt):
            return False
        expr = compat.size_expr(n.meta["val"])
        if expr in sources:
            return (n.args[0], n.args[1]) != sources[expr]
        return _expressible(expr, sources)

    if not any(movable(n) for n in graph.gm.graph.nodes):
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    sources = symbol_sources(g)
    builder = SizeBuilder(g, sources, [n for n in g.nodes if n.op == "placeholder"][-1])
    moved = 0
    for node in list(g.nodes):
        if not movable(node):
            continue
        value = builder.build(compat.size_expr(node.meta["val"]), node)
        node.replace_all_uses_with(value)
        g.erase_node(node)
        moved += 1
    g.eliminate_dead_code(is_impure_node=has_side_effect)
    graph.gm.recompile()
    return PassResult(graph, True, f"{moved} size reads of intermediate tensors now read {len(builder.symbols)} batch sizes")
