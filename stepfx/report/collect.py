"""What the HTML report shows of one rank's plan, as plain JSON-ready data.

``report_data(step)`` reads the plan the step last ran: its pass records
(with a diff per pass that changed the graph), the final program node by
node, the predicted timeline, memory over the step and the collectives.
The page (``page.py``) is drawn from this data alone, so the data can be
saved (``step.dump``: ``report.json``), gathered from every rank, or turned
into a page on another machine (``stepfx report-html``).
"""
from __future__ import annotations

import time

import torch.fx as fx

from ..graph.accounting import communication, estimate_memory, size_values
from ..graph.layout import LAYOUT_KEY
from ..passes.data_parallel.reduce_gradients import META_REDUCED
from .diff import graph_diff, node_row
from .memory import memory_over_step
from .timeline import predicted_timeline

__all__ = ["report_data", "REPORT_DATA_FILE", "FORMAT"]

REPORT_DATA_FILE = "report.json"
FORMAT = 1  # bumped when the data's shape changes; the page checks it


def _passes(records) -> list[dict]:
    out = []
    previous = None
    for r in records:
        entry = {"label": r.label, "name": r.name, "seconds": r.seconds, "summary": r.summary,
                 "changed": bool(r.changed), "skipped": r.skipped, "diff": None}
        if r.graph is not None and previous is not None and r.changed and not r.skipped:
            entry["diff"] = graph_diff(previous, r.graph).as_data()
        if r.graph is not None:
            previous = r.graph
        out.append(entry)
    return out


def _bucket_of(node: fx.Node) -> int | None:
    """The ZeRO bucket a collective moves, where a pass marked it nearby (the averaged flat buffer)."""
    seen = [node, *node.all_input_nodes]
    for user in node.users:
        seen.append(user)
        seen.extend(user.users)
    for n in seen:
        if META_REDUCED in n.meta:
            return n.meta[META_REDUCED]
    return None


def _communication(graph, world: int, values, timeline: dict, links: dict | None = None) -> list[dict]:
    """Each collective: its bytes, predicted time (the device model's assumed bus bandwidth) and,
    after ``step.profile`` measured the link (``links``: bytes/s per kind), its time at that rate."""
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    seconds = {e["node"]: e["end"] - e["start"] for e in timeline["events"] if e["stream"].startswith("comm")}
    rows = []
    for item in communication(graph, world, values):
        node = nodes[item.node]
        rate = (links or {}).get(item.op)
        rows.append({**node_row(node), "op": item.op, "payload_bytes": item.payload_bytes,
                     "sent_bytes": item.sent_bytes, "predicted_seconds": seconds.get(item.node, 0.0),
                     "measured_link_seconds": item.sent_bytes / rate if rate else None,
                     "bucket": _bucket_of(node)})
    return rows


def report_data(step, plan=None) -> dict:
    """The report's data for ``plan`` (default: the plan the step last ran) on this rank."""
    plan = plan if plan is not None else step.plan
    graph = plan.graph
    dp = getattr(step, "_dp", None)
    world = dp.world_size if dp is not None else 1
    rank = dp.rank if dp is not None else 0
    values = size_values(graph, getattr(plan, "last_batch_shapes", None))
    timeline = predicted_timeline(graph, plan.device_type, world, values)
    memory = memory_over_step(graph, values)
    memory["explain_peak"] = estimate_memory(graph, values).peak  # what explain() prints: equal by construction
    layout = graph.signature.extra.get(LAYOUT_KEY)
    profile = getattr(step, "_profile", None)
    measured = profile.as_data() if profile is not None and profile.plan is plan else None
    if measured is not None:
        memory["measured_peak"] = measured["peak_bytes"]
    return {
        "format": FORMAT,
        "step": step.__name__,
        "rank": rank,
        "world_size": world,
        "device": plan.device_type,
        "config": str(getattr(step.config, "source", "") or ""),
        "made": time.strftime("%Y-%m-%d %H:%M:%S"),
        "from_cache": bool(plan.from_cache),
        "zero_stage": layout.stage if layout is not None else None,
        "passes": _passes(plan.records),
        "program": [node_row(n) for n in graph.gm.graph.nodes if n.op != "output"],
        "timeline": timeline,
        "measured": measured,
        "memory": memory,
        "communication": _communication(graph, world, values, timeline, (measured or {}).get("links")),
        "links": (measured or {}).get("links") or {},
    }
