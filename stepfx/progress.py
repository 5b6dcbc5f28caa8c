"""A few lines while a first call works: capture, passes, cache, compiles.

A first call of a large model takes seconds to tens of seconds, and stepfx's
other messages are INFO records on the ``stepfx`` logger, which Python's
default logging does not show: without these lines a user sees nothing
until the step returns. Lines go through the ``stepfx.progress`` logger
(rank 0 only), at most a handful per capture::

    stepfx: train_step: capturing the step (not in the plan cache)...
    stepfx: train_step: captured in 12.1 s (4,213 ops); running 33 passes...
    stepfx: train_step: passes done in 2.3 s (3,906 ops); plan cache: saved (14.2 MiB) in 0.4 s
    stepfx: train_step: first run: compiling 14 inductor regions and 9 Triton kernels (cached on disk after this run)...
    stepfx: train_step: first call done in 18.2 s

Where they appear: a stderr handler is added to ``stepfx.progress`` only
when neither the ``stepfx`` logger nor the root logger has handlers, and it
stays silent once either gets some, so an application's own logging
configuration decides. ``"stepfx": {"progress": false}`` turns them off.
"""
from __future__ import annotations

import logging
import sys

__all__ = ["Progress", "LOGGER"]

LOGGER = "stepfx.progress"


class _UntilConfigured(logging.StreamHandler):
    """stderr (as it is at each record), while the application has set up
    no logging of its own."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers or logging.getLogger("stepfx").handlers:
            return  # the application's handlers get the record through propagation
        self.stream = sys.stderr
        super().emit(record)


def _default_handler(log: logging.Logger) -> None:
    if log.handlers or logging.getLogger("stepfx").handlers or logging.getLogger().handlers:
        return
    handler = _UntilConfigured(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


class Progress:
    """The progress lines of one decorated step (``name``); silent when not
    ``enabled`` (``stepfx.progress`` false, or not rank 0)."""

    def __init__(self, name: str, enabled: bool):
        self.name = name
        self.enabled = enabled

    def __call__(self, message: str, *args) -> None:
        if not self.enabled:
            return
        log = logging.getLogger(LOGGER)
        _default_handler(log)
        log.info("stepfx: %s: " + message, self.name, *args)
