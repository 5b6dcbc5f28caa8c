"""What one pass did to the graph: nodes added, removed and rewritten.

Passes copy the nodes they keep (``node_copy`` keeps names), so nodes are
matched by name: a name only after the pass was added, only before it was
removed, and a name on both sides whose statement (op and arguments, as the
printer writes it) or value (shape, dtype) changed was rewritten; one that
kept its statement but changed place among the others was moved (the
fewest such: those off a longest run kept in the old order). Each node
comes with its phase and the user's source line, as the printed graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..graph import META_PHASE, META_SOURCE, StepGraph
from ..graph.printer import format_statement

__all__ = ["GraphDiff", "graph_diff", "node_row", "MAX_ROWS"]

MAX_ROWS = 300  # per kind and pass: a page stays readable; the counts say how many there were


def _value_text(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(_value_text_of(v) for v in val) + ")"
    return ""


def _value_text_of(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).removeprefix('torch.')}[{', '.join(str(s) for s in val.shape)}]"
    return type(val).__name__


def _statement(node: fx.Node) -> str:
    if node.op == "placeholder":
        slot = node.meta.get("slot")
        return f"{node.name}  # input: {slot.describe()}" if slot is not None else f"{node.name}  # input"
    if node.op == "output":
        return "return (...)"
    return format_statement(node)


def node_row(node: fx.Node) -> dict:
    """A node as the report shows it: plain data (JSON-ready)."""
    phase = node.meta.get(META_PHASE)
    return {
        "name": node.name,
        "stmt": _statement(node),
        "value": _value_text(node),
        "phase": str(phase) if phase is not None else ("input" if node.op == "placeholder" else ""),
        "source": node.meta.get(META_SOURCE) or "",
    }


@dataclass
class GraphDiff:
    added: list[dict] = field(default_factory=list)
    removed: list[dict] = field(default_factory=list)
    rewritten: list[dict] = field(default_factory=list)  # {"before": row, "after": row}
    moved: list[dict] = field(default_factory=list)
    counts: dict = field(default_factory=dict)  # kind -> how many (the lists keep MAX_ROWS)

    def as_data(self) -> dict:
        return {"added": self.added, "removed": self.removed, "rewritten": self.rewritten, "moved": self.moved,
                "counts": self.counts}


def graph_diff(before: StepGraph, after: StepGraph, max_rows: int = MAX_ROWS) -> GraphDiff:
    """Nodes ``after`` has that ``before`` lacks (added), the reverse
    (removed), and same-named nodes whose statement or value changed
    (rewritten), in program order."""
    old = {n.name: n for n in before.gm.graph.nodes if n.op != "output"}
    new = {n.name: n for n in after.gm.graph.nodes if n.op != "output"}
    diff = GraphDiff()
    counts = {"added": 0, "removed": 0, "rewritten": 0, "moved": 0}
    for name, node in new.items():
        if name not in old:
            counts["added"] += 1
            if len(diff.added) < max_rows:
                diff.added.append(node_row(node))
            continue
        a, b = node_row(old[name]), node_row(node)
        if a["stmt"] != b["stmt"] or a["value"] != b["value"]:
            counts["rewritten"] += 1
            if len(diff.rewritten) < max_rows:
                diff.rewritten.append({"before": a, "after": b})
    for name, node in old.items():
        if name not in new:
            counts["removed"] += 1
            if len(diff.removed) < max_rows:
                diff.removed.append(node_row(node))
    order = {name: i for i, name in enumerate(old)}
    common = [name for name in new if name in old]
    kept = _longest_increasing([order[name] for name in common])
    for i, name in enumerate(common):
        if i not in kept:
            counts["moved"] += 1
            if len(diff.moved) < max_rows:
                diff.moved.append(node_row(new[name]))
    diff.counts = counts
    return diff


def _longest_increasing(seq: list[int]) -> set[int]:
    """Positions of one longest strictly increasing subsequence (patience sorting, O(n log n))."""
    tails: list[int] = []  # tails[k]: position of the smallest tail of an increasing run of length k + 1
    back = [-1] * len(seq)
    for i, x in enumerate(seq):
        k = _bisect_tails(seq, tails, x)
        if k > 0:
            back[i] = tails[k - 1]
        if k == len(tails):
            tails.append(i)
        else:
            tails[k] = i
    out, i = set(), tails[-1] if tails else -1
    while i >= 0:
        out.add(i)
        i = back[i]
    return out


def _bisect_tails(seq: list[int], tails: list[int], x: int) -> int:
    lo, hi = 0, len(tails)
    while lo < hi:
        mid = (lo + hi) // 2
        if seq[tails[mid]] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo
