"""The ``stepfx`` command line (``python -m stepfx`` or the ``stepfx`` script).

A thin layer: each subcommand parses its arguments, calls one public
function of this module (``check_config``, ``environment_report``), prints
the result as text or ``--json``, and turns it into an exit status:

- 0: done (``check``: the config is valid; warnings and notes allowed),
- 1: ``check`` found errors in the config,
- 2: usage errors: bad arguments, a file that cannot be read, a file that
  is not JSON (argparse's own status for bad arguments is 2 as well).

Subcommands are entries of ``COMMANDS``; a new one (``export``, ``plan``)
is one more ``Command`` there, with its own ``add_arguments`` and ``run``.
Environment variables are read here, at the entry point, and nowhere
deeper (STYLE.md): ``report`` reads the cache-directory variables.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from .bisect import bisect_arguments, run_bisect
from .check import ConfigCheck, Finding, _check_arguments, _run_check, check_config
from .export import export_arguments, import_deepspeed_arguments, run_export, run_import_deepspeed
from .plan import plan_arguments, run_plan
from .report import _report_arguments, _run_report, environment_report
from .report_html import report_html_arguments, run_report_html
from .status import EXIT_INVALID, EXIT_OK, EXIT_USAGE

__all__ = ["COMMANDS", "Command", "ConfigCheck", "Finding", "check_config", "environment_report", "main",
           "EXIT_OK", "EXIT_INVALID", "EXIT_USAGE"]


# -- the command table and main ---------------------------------------------------
@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, how it adds its arguments,
    and what it runs (returning the exit status)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: tuple[Command, ...] = (
    Command("check", "validate a DeepSpeed JSON config as stepfx reads it", _check_arguments, _run_check),
    Command("report", "versions, devices, backends and kernel caches (like DeepSpeed's ds_report)",
            _report_arguments, _run_report),
    Command("plan", "predict a step's per-rank memory and communication on the meta device (no GPU needed)",
            plan_arguments, run_plan),
    Command("export", "consolidated safetensors (Hugging Face's layout) from a stepfx checkpoint, no GPU needed",
            export_arguments, run_export),
    Command("report-html", "the HTML report (passes, diffs, program, timeline, memory, communication) from a dump directory",
            report_html_arguments, run_report_html),
    Command("bisect", "the first pass after which the step computes something else than the captured step",
            bisect_arguments, run_bisect),
    Command("import-deepspeed", "a DeepSpeed ZeRO checkpoint (stages 1-3) as a stepfx checkpoint",
            import_deepspeed_arguments, run_import_deepspeed),
)


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepfx", description="stepfx: a compiler for whole PyTorch training steps")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in commands:
        sub_parser = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub_parser)
        sub_parser.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``) and return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return args.run(args)

