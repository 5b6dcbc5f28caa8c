"""Refuse steps that step a learning-rate scheduler inside them.

``scheduler.step()`` is host Python: it sets the optimizer's learning rate
in its param groups. Inside a captured step it would run once, while the
step is traced, and never again — the schedule would stay at its first
value while eager training moves on (a LambdaLR halving the lr each step:
the losses part from eager's at the third step, without a word). stepfx
reads the learning rate as an input of the step at every call, so a
scheduler stepped *outside* the step works unchanged; inside, capture is
refused with the user's line and that advice.

How: while tracing, ``step`` of torch's ``LRScheduler`` and of every
subclass that defines its own (``ReduceLROnPlateau``, ``SequentialLR``,
``ChainedScheduler``, user schedulers) is wrapped; a call from the tracing
thread raises. Schedulers built by the config's ``scheduler`` block are
stepped by stepfx after each update, outside the trace.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

from ..errors import CaptureError
from .source import innermost_user_frame

__all__ = ["refuse_scheduler_steps"]


def _scheduler_classes() -> list[type]:
    base = torch.optim.lr_scheduler.LRScheduler
    found, todo = [], [base, getattr(torch.optim.lr_scheduler, "ReduceLROnPlateau", base)]
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [cls for cls in found if "step" in cls.__dict__]


@contextlib.contextmanager
def refuse_scheduler_steps() -> Iterator[None]:
    """Around a trace: a scheduler stepped by the traced code raises
    :class:`CaptureError` naming the line (see the module docstring)."""
    thread = threading.get_ident()
    patched = [(cls, cls.__dict__["step"]) for cls in _scheduler_classes()]

    def wrap(cls, step):
        def refusing(self, *args, **kwargs):
            if threading.get_ident() != thread:
                return step(self, *args, **kwargs)
            raise CaptureError(
                f"the step calls {type(self).__name__}.step(), which sets the optimizer's learning rate in Python: "
                "inside a captured step it would run once, at capture, and the schedule would never move on",
                source=innermost_user_frame(),
                hint="call scheduler.step() after the step returns, outside it (stepfx reads the learning rate at "
                     "every call, so the next step uses the new one), or describe the schedule in the config's "
                     "scheduler block, which stepfx advances after each update as DeepSpeed does",
            )

        refusing.__wrapped__ = step
        return refusing

    try:
        for cls, step in patched:
            setattr(cls, "step", wrap(cls, step))
        yield
    finally:
        for cls, step in reversed(patched):
            setattr(cls, "step", step)
