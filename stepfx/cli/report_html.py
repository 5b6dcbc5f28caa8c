"""``stepfx report-html DUMP_DIR``: the HTML report from a dump directory.

``step.dump(directory)`` writes the report's data (``report.json``) beside
the pass dumps; this draws the same page from it, on any machine with
stepfx and matplotlib (the ``report`` extra): no model, no run, no GPU.
Per-rank dumps under one folder (``rank0/report.json``, ...) make one page
with every rank.
"""
from __future__ import annotations

import argparse
import sys

from .status import EXIT_OK, EXIT_USAGE

__all__ = ["report_html_arguments", "run_report_html"]


def report_html_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump_dir", metavar="DUMP_DIR", help="a folder step.dump() wrote (report.json, or */report.json per rank)")
    parser.add_argument("-o", "--output", help="the HTML file to write (default: DUMP_DIR/report.html)")


def run_report_html(args: argparse.Namespace) -> int:
    from ..report import MissingPlotting, write_report_from_dump

    try:
        path = write_report_from_dump(args.dump_dir, args.output)
    except (FileNotFoundError, MissingPlotting, ValueError) as exc:
        print(f"stepfx report-html: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(path)
    return EXIT_OK
