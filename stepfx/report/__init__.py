"""What stepfx did to a step, as one HTML page; and which pass broke it.

- ``write_report(step, path)`` (``step.report(path)``): one self-contained
  HTML file for this rank, or, called by every rank with
  ``all_ranks=True``, for all of them in one file written by rank 0.
- ``profile_step(step, steps)`` (``step.profile(steps=N)``): measure the
  next N runs; the report then draws the measured timeline beside the
  predicted one.
- ``save_report_data`` / ``write_report_from_dump``: the page's data as
  ``report.json`` in a dump directory, and the page made from it later or
  elsewhere (``stepfx report-html DUMP_DIR``).
- ``bisect_divergence``: the first pass whose program computes something
  else than the captured step, and the first node in it that departs.

The data (``collect.py``) needs only the plan; the pictures need matplotlib
(the ``report`` extra), imported when a page is drawn.
"""
from __future__ import annotations

import json
import os

from .bisect import Divergence, bisect_divergence, bisect_records
from .collect import REPORT_DATA_FILE, report_data
from .page import render_page
from .plots import MissingPlotting
from .profile import Profile, profile_step

__all__ = ["write_report", "report_data", "render_page", "save_report_data", "write_report_from_dump",
           "profile_step", "Profile", "bisect_divergence", "bisect_records", "Divergence", "MissingPlotting",
           "REPORT_DATA_FILE"]


def write_report(step, path: str, *, all_ranks: bool = False) -> str | None:
    """Write the HTML report of ``step``'s current plan to ``path``; returns the path.

    ``all_ranks=True`` is collective: every rank of the step's group must
    call it; rank 0 writes one page with every rank's section and the
    others return None."""
    data = report_data(step)
    ranks = [data]
    dp = getattr(step, "_dp", None)
    if all_ranks and dp is not None and dp.active:
        import torch.distributed as dist

        gathered = [None] * dp.world_size if dp.rank == 0 else None
        dist.gather_object(data, gathered, dst=dist.get_global_rank(dp.group, 0), group=dp.group)
        if dp.rank != 0:
            return None
        ranks = sorted(gathered, key=lambda d: d["rank"])
    return _write(path, render_page(ranks))


def save_report_data(step, directory: str) -> str:
    """``report.json`` in ``directory``: the page's data, to draw the page later (``stepfx report-html``)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, REPORT_DATA_FILE)
    with open(path, "w") as f:
        json.dump(report_data(step), f)
    return path


def write_report_from_dump(directory: str, path: str | None = None) -> str:
    """The page from a dump directory's ``report.json`` files (``report.json``
    or ``*/report.json``, one per rank); written to ``path`` (default
    ``DIRECTORY/report.html``)."""
    found = []
    for root, _, files in sorted(os.walk(directory)):
        if REPORT_DATA_FILE in files:
            found.append(os.path.join(root, REPORT_DATA_FILE))
    if not found:
        raise FileNotFoundError(f"no {REPORT_DATA_FILE} under {directory} (step.dump(directory) writes one)")
    ranks = []
    for name in found:
        with open(name) as f:
            ranks.append(json.load(f))
    ranks.sort(key=lambda d: d["rank"])
    return _write(path or os.path.join(directory, "report.html"), render_page(ranks))


def _write(path: str, text: str) -> str:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
