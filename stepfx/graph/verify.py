"""Invariants every step graph satisfies after every pass.

:func:`verify_step_graph` checks, and returns human-readable problems (each
with the offending node and the lines around it):

1. fx's own ``Graph.lint()`` (topological order, node ownership, targets);
2. placeholders are exactly the signature's inputs, in order, each carrying
   its slot in ``meta["slot"]``;
3. the output node returns one flat tuple with one value per output slot;
4. slot identities are unique among inputs and among outputs;
5. every call_function node carries ``meta["val"]`` (its fake value) and
   ``meta["phase"]``; nodes a pass adds must fill them in;
6. in a graph marked functional, no node writes a graph input or constant
   (directly or through a view), except a kernel call that donates inputs
   (``meta["donated"]``): it must be the last reader of each donated value.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .ops import is_view, mutated_args
from .printer import _expression
from .step_graph import META_DONATED, META_PHASE, META_SLOT, StepGraph

__all__ = ["verify_step_graph", "mutation_base"]


def mutation_base(value) -> fx.Node | None:
    """Follow view ops back to the node whose storage a write lands in."""
    node = value
    while isinstance(node, fx.Node) and node.op == "call_function" and is_view(node) and node.args:
        node = node.args[0]
    return node if isinstance(node, fx.Node) else None


def _context(node: fx.Node, radius: int = 2) -> str:
    nodes = list(node.graph.nodes)
    i = nodes.index(node)
    lines = []
    for j in range(max(0, i - radius), min(len(nodes), i + radius + 1)):
        n = nodes[j]
        mark = ">>" if j == i else "  "
        body = n.name if n.op in ("placeholder", "output") else f"{n.name} = {_expression(n)}"
        lines.append(f"    {mark} {body}")
    return "\n".join(lines)


def _returns_value(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return bool(target._schema.returns)
    return True


def verify_step_graph(graph: StepGraph) -> list[str]:
    """All invariant violations of ``graph``, as messages (empty when fine)."""
    problems: list[str] = []
    gm = graph.gm
    try:
        gm.graph.lint()
    except Exception as exc:  # lint raises a bare RuntimeError with its own message
        problems.append(f"fx lint: {exc}")
        return problems

    sig = graph.signature
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(sig.inputs):
        problems.append(f"{len(phs)} placeholders but {len(sig.inputs)} input slots in the signature")
    for i, (ph, slot) in enumerate(zip(phs, sig.inputs)):
        if ph.meta.get(META_SLOT) != slot:
            problems.append(
                f"placeholder #{i} {ph.name} carries slot {ph.meta.get(META_SLOT)!r}, "
                f"signature says {slot.describe()}"
            )

    outs = [n for n in gm.graph.nodes if n.op == "output"]
    if len(outs) != 1:
        problems.append(f"{len(outs)} output nodes")
    else:
        (ret,) = outs[0].args
        if not isinstance(ret, (tuple, list)):
            problems.append("the output node does not return a flat tuple")
        elif len(ret) != len(sig.outputs):
            problems.append(f"the graph returns {len(ret)} values but the signature has {len(sig.outputs)} outputs")

    problems.extend(sig.check_unique())

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "get_attr"):
            continue
        for i in node.meta.get(META_DONATED, ()):
            donated = node.args[i]
            # a host update across steps (update_across_steps) writes what the step returns: the output may read it
            later = [u.name for u in donated.users if u is not node and order[u] > order[node]
                     and not (u.op == "output" and node.kwargs.get("across_steps"))]
            if later:
                problems.append(f"{node.name} writes {donated.name} in place, but {', '.join(later)} read it later:\n{_context(node)}")
        if node.op == "call_function":
            needed = ("val", META_PHASE) if _returns_value(node) else (META_PHASE,)
            missing = [k for k in needed if k not in node.meta]
            if missing:
                problems.append(f"node {node.name} lacks meta {missing}:\n{_context(node)}")
        if graph.functional and node.op == "call_function":
            for arg in mutated_args(node):
                base = mutation_base(arg)
                if base is not None and base.op in ("placeholder", "get_attr"):
                    problems.append(
                        f"functional graph writes {base.op} {base.name} in place:\n{_context(node)}"
                    )
    return problems
