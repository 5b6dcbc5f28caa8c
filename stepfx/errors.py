"""Exceptions stepfx raises at users. Imports nothing of stepfx.

Every message names what was wrong and where: the op, the user's source line,
the config key, the pass.
"""
from __future__ import annotations

__all__ = ["StepfxError", "CaptureError", "PassError", "ExecutionError", "CaptureWarning"]


class StepfxError(RuntimeError):
    """Base class of stepfx's own errors."""


class CaptureError(StepfxError):
    """The user's step cannot be captured as one graph.

    ``construct`` names what was unsupported, ``source`` the user's source
    location (``file.py:12``) when known, ``hint`` what to do instead.
    """

    def __init__(self, construct: str, *, source: str | None = None, hint: str | None = None, detail: str | None = None):
        self.construct = construct
        self.source = source
        self.hint = hint
        msg = f"stepfx cannot capture this step: {construct}"
        if source:
            msg += f"\n  at {source}"
        if detail:
            msg += f"\n  {detail}"
        if hint:
            msg += f"\n  what to do: {hint}"
        super().__init__(msg)


class PassError(StepfxError):
    """A pass broke the graph's invariants (a stepfx bug, reported with context)."""


class ExecutionError(StepfxError):
    """Running a compiled step failed; the user's state is left as it was."""


class CaptureWarning(UserWarning):
    """Something in the step is captured, but probably not as the user meant
    (Python side effects that run only once, at capture)."""
