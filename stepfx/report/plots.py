"""The report's pictures, drawn with matplotlib and inlined as SVG.

matplotlib is an optional dependency (the ``report`` extra) imported only
here and only when a picture is drawn: every other part of stepfx, and the
report's data, work without it. No pyplot: figures are made and rendered
directly (no global figure registry, no GUI backend), with text kept as
text (``svg.fonttype: none``: smaller, searchable) and element ids salted
deterministically so the page is the same for the same data.
"""
from __future__ import annotations

import io
import re

__all__ = ["memory_svg", "timeline_svg", "measured_svg", "MissingPlotting", "require_matplotlib", "scope_ids"]

_COLORS = {
    "parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer state": "#59a14f",
    "activations": "#e15759", "buffers": "#76b7b2", "other": "#bab0ac",
    "forward": "#4e79a7", "backward": "#f28e2b", "optimizer": "#59a14f", "communication": "#e15759",
    "compute": "#4e79a7", "host-device copy": "#59a14f", "exposed": "#d62728",
}


class MissingPlotting(ImportError):
    """matplotlib is not installed (the ``report`` extra)."""


def require_matplotlib():
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingPlotting(
            "stepfx's HTML report draws its plots with matplotlib, which is not installed here: "
            "pip install 'stepfx[report]' (or pip install matplotlib)"
        ) from exc
    return matplotlib, Figure


def _svg(fig) -> str:
    matplotlib, _ = require_matplotlib()
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "stepfx"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]  # inline: no XML declaration or DOCTYPE


_ID = re.compile(r'(\bid="|url\(#|href="#)([^")]+)')


def scope_ids(svg: str, prefix: str) -> str:
    """Prefix every id in ``svg`` and every reference to one: matplotlib
    numbers its elements per figure (``figure_1``, clip paths), and two
    pictures inline in one page would otherwise share ids (and clip each
    other's paths)."""
    return _ID.sub(lambda m: m.group(1) + prefix + m.group(2), svg)


def _unit(n: float) -> tuple[float, str]:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return scale, unit
    return 1, "B"


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def memory_svg(memory: dict) -> str:
    """Live bytes by category over the program (stacked), the peak marked."""
    _, Figure = require_matplotlib()
    points, cats = memory["points"], memory["categories"]
    scale, unit = _unit(max(memory["peak"], 1))
    fig = Figure(figsize=(9, 3.4))
    ax = fig.add_subplot()
    x = range(len(points))
    ax.stackplot(x, *[[p[c] / scale for p in points] for c in cats], labels=cats,
                 colors=[_COLORS[c] for c in cats], linewidth=0)
    ax.axvline(memory["peak_index"], color="black", linestyle="--", linewidth=1)
    ax.annotate(f"peak {memory['peak'] / scale:.2f} {unit}\nat {memory['peak_node']}",
                (memory["peak_index"], memory["peak"] / scale), textcoords="offset points", xytext=(6, -24), fontsize=8)
    if memory.get("measured_peak"):
        ax.axhline(memory["measured_peak"] / scale, color="#555", linestyle=":", linewidth=1, label="measured peak")
    ax.set_xlabel("node of the program (in order)")
    ax.set_ylabel(f"live {unit}")
    ax.set_xlim(0, max(len(points) - 1, 1))
    ax.legend(loc="upper left", fontsize=7, ncol=3, frameon=False)
    ax.set_title("memory over the step (predicted live bytes)", fontsize=10)
    return _svg(fig)


def _merged(events: list[dict], gap: float) -> list[tuple[float, float]]:
    """Back-to-back spans as one bar (thousands of ops would be thousands of rectangles)."""
    spans: list[list[float]] = []
    for e in sorted(events, key=lambda e: e["start"]):
        if spans and e["start"] - spans[-1][1] <= gap:
            spans[-1][1] = max(spans[-1][1], e["end"])
        else:
            spans.append([e["start"], e["end"]])
    return [(a, b - a) for a, b in spans]


def timeline_svg(timeline: dict) -> str:
    """The predicted step per stream; exposed waits in red on the compute row."""
    _, Figure = require_matplotlib()
    streams = timeline["streams"]
    scale, unit = _time_unit(max(timeline["seconds"], 1e-9))
    fig = Figure(figsize=(9, 0.7 * len(streams) + 1.2))
    ax = fig.add_subplot()
    gap = timeline["seconds"] * 1e-3
    for row, stream in enumerate(streams):
        events = [e for e in timeline["events"] if e["stream"] == stream and not e.get("exposed")]
        color = _COLORS["compute"] if stream == "compute" else _COLORS.get(stream, _COLORS["communication"])
        spans = _merged(events, gap) if stream == "compute" else [(e["start"], e["end"] - e["start"]) for e in events]
        ax.broken_barh([(a * scale, w * scale) for a, w in spans], (row - 0.35, 0.7), facecolors=color)
        if stream == "compute":
            exposed = [(e["start"] * scale, (e["end"] - e["start"]) * scale) for e in timeline["events"] if e.get("exposed")]
            if exposed:
                ax.broken_barh(exposed, (row - 0.35, 0.7), facecolors="none", edgecolors=_COLORS["exposed"], hatch="///")
    ax.set_yticks(range(len(streams)), labels=streams, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"predicted time ({unit})")
    ax.set_title(f"predicted timeline: {timeline['seconds'] * scale:.3g} {unit}, exposed communication "
                 f"{timeline['exposed_seconds'] * scale:.3g} {unit} (hatched)", fontsize=10)
    return _svg(fig)


def measured_svg(measured: dict) -> str:
    """The measured runs' segments (averaged): phases and communication waited for; gaps are idle."""
    _, Figure = require_matplotlib()
    scale, unit = _time_unit(max(measured["seconds"], 1e-9))
    kinds = list(dict.fromkeys(s["kind"] for s in measured["segments"]))
    fig = Figure(figsize=(9, 0.6 * len(kinds) + 1.2))
    ax = fig.add_subplot()
    for row, kind in enumerate(kinds):
        spans = [(s["start"] * scale, (s["end"] - s["start"]) * scale) for s in measured["segments"] if s["kind"] == kind]
        ax.broken_barh(spans, (row - 0.35, 0.7), facecolors=_COLORS.get(kind, "#888"),
                       hatch="///" if kind == "communication" else None)
    ax.set_yticks(range(len(kinds)), labels=kinds, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"measured time ({unit}; {measured['clock']})")
    ax.set_title(f"measured: {measured['seconds'] * scale:.3g} {unit} per step "
                 f"(mean of {measured['runs']} run(s)); communication waited for is hatched", fontsize=10)
    return _svg(fig)
