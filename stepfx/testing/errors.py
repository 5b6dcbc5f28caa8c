"""Errors of the rank runners: which ranks failed, how, and what they printed.

RankError, RankTimeout and RankFailure are public (exported by
stepfx.testing); the functions here are shared by the two runners.
"""
from __future__ import annotations

import dataclasses
import traceback
from typing import Callable

_OUTPUT_TAIL_CHARS = 3000   # how much of a rank's output an error message quotes


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank.

    kind is "raised" (fn raised), "died" (the process exited), "unfinished"
    (still running when the run was given up) or "aborted" (threads only:
    woken out of a collective because another rank failed).
    """

    rank: int
    kind: str
    exc_type: str = ""
    message: str = ""
    traceback: str = ""   # the remote traceback, or where an unfinished rank was
    output: str = ""      # the rank's stdout and stderr during the run

    def describe(self) -> str:
        """This failure as error-message text: the headline, then the indented traceback and output."""
        what = {
            "raised": f"raised {self.exc_type}: {self.message}",
            "died": f"died: {self.message}",
            "unfinished": f"did not finish: {self.message}",
            "aborted": f"aborted: {self.message}",
        }[self.kind]
        lines = [f"rank {self.rank} {what}"]
        if self.traceback:
            lines.append(_indent(self.traceback.rstrip()))
        crash = self.output.rfind("Fatal Python error") if self.kind == "died" else -1
        if crash >= 0 and crash < len(self.output) - _OUTPUT_TAIL_CHARS:
            # faulthandler's dump starts with the thread that crashed; the other threads' stacks follow and would
            # push it out of the tail
            lines.append(f"    -- the crash on rank {self.rank} --")
            lines.append(_indent(self.output[crash:crash + _OUTPUT_TAIL_CHARS].rstrip()))
        if self.output:
            tail = self.output[-_OUTPUT_TAIL_CHARS:]
            cut = " (tail)" if len(tail) < len(self.output) else ""
            lines.append(f"    -- output of rank {self.rank}{cut} --")
            lines.append(_indent(tail.rstrip()))
        return "\n".join(lines)


class RankError(RuntimeError):
    """One or more ranks failed; `failures` says which and how, in rank order."""

    def __init__(self, headline: str, failures: list[RankFailure],
                 outputs: list[str] | None = None):
        self.failures = sorted(failures, key=lambda f: f.rank)
        self.outputs = outputs or []
        body = "\n".join(f.describe() for f in self.failures)
        super().__init__(f"{headline}\n{body}")

    @property
    def ranks(self) -> list[int]:
        """The ranks that failed."""
        return [f.rank for f in self.failures]


class RankTimeout(RankError):
    """Some ranks did not finish within the timeout (and none raised)."""


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def failure_from(rank: int, exc: BaseException, context: str = "", skip_frames: int = 0) -> RankFailure:
    """Describe `exc`; skip_frames drops the runner's own frames from the top of the traceback."""
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    message = f"{context}: {exc}" if context else str(exc)
    tb = exc.__traceback__
    for _ in range(skip_frames):
        tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    return RankFailure(rank, "raised", name, message,
                       "".join(traceback.format_exception(kind, exc, tb)))


def fn_name(fn: Callable) -> str:
    """`module.qualname` of fn, as error messages name it."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def ranks_text(ranks: list[int]) -> str:
    """"rank 1" or "ranks 0, 2"."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
