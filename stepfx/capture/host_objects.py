"""Refuse steps that drive host-side training objects inside them: a
learning-rate scheduler's ``step()`` and torch's ``GradScaler``.

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

``torch.amp.GradScaler`` (and ``torch.cuda.amp.GradScaler``) decides on the
host whether to skip the update (``scaler.step`` reads ``found_inf``), which a
captured step cannot follow: capture used to stop there with a generic
"Python code reads a tensor's value". stepfx scales the loss itself, in the
graph (the config's ``fp16`` block: dynamic loss scaling, overflowed steps
skipped without a host sync, as DeepSpeed), so the refusal says to drop the
scaler for it. Its ``scale``, ``unscale_``, ``step`` and ``update`` are
wrapped as the schedulers' ``step``; a disabled scaler
(``GradScaler(enabled=False)``, as nanoGPT builds it under bf16) passes
through: it scales nothing and its ``step`` is the optimizer's.

A second torch optimizer stepped in the step (a GAN's discriminator
optimizer beside the generator's) holds the module's real parameters, while
the trace computes gradients for their traced stand-ins: its step would
update nothing (an optimizer with no state yet), or fail on a real tensor.
A global optimizer step pre-hook refuses any optimizer but the step's own.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import CaptureError
from .source import innermost_user_frame

__all__ = ["refuse_host_objects"]


def _with_subclasses(*bases: type) -> list[type]:
    found, todo = [], [b for b in bases if b is not None]
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            todo.extend(cls.__subclasses__())
    return found


_SCHEDULER_HINT = ("call scheduler.step() after the step returns, outside it (stepfx reads the learning rate at every "
                   "call, so the next step uses the new one), or describe the schedule in the config's scheduler "
                   "block, which stepfx advances after each update as DeepSpeed does")
_SCALER_HINT = ('stepfx scales the loss itself, in the graph: remove the scaler (scaler.scale(loss).backward() -> '
                'loss.backward(), scaler.step(optimizer) -> optimizer.step(), no scaler.update() or unscale_) and set '
                '"fp16": {"enabled": true} in the config (dynamic loss scaling, overflowed steps skipped without a '
                'host sync, as DeepSpeed); with "bf16" no scaling is needed')


def _scheduler_refusal(scheduler) -> tuple[str, str]:
    return (f"the step calls {type(scheduler).__name__}.step(), which sets the optimizer's learning rate in Python: "
            "inside a captured step it would run once, at capture, and the schedule would never move on",
            _SCHEDULER_HINT)


def _scaler_refusal(scaler) -> tuple[str, str]:
    return (f"the step uses {type(scaler).__module__}.{type(scaler).__name__}, which decides on the host whether to "
            "skip the update (scaler.step reads found_inf): a captured step cannot follow that", _SCALER_HINT)


def _other_optimizer_refusal(other, ours) -> tuple[str, str]:
    params = [p for group in other.param_groups for p in group["params"]]
    return (f"the step steps a second optimizer ({type(other).__name__} over {len(params)} parameter(s)) besides "
            f"the one it was given ({type(ours).__name__ if ours is not None else 'None'}): stepfx captures and runs "
            "the update of the step's own optimizer; another one holds the module's real parameters, which the "
            "captured step does not update (it would not update them, or fail)",
            "put every parameter group in the one optimizer the step is given (torch.optim.Adam([{'params': ...}, "
            "{'params': ...}])), or write one decorated step per optimizer (a GAN's generator and discriminator "
            "steps, at ZeRO stages 0-2)")


@contextlib.contextmanager
def refuse_host_objects(optimizer=None) -> Iterator[None]:
    """Around a trace: a scheduler stepped, a GradScaler used or an optimizer
    other than the step's (``optimizer``) stepped by the traced code raises
    :class:`CaptureError` naming the line (see the module docstring)."""
    thread = threading.get_ident()

    def other_optimizer(stepped, args, kwargs):
        if threading.get_ident() == thread and stepped is not optimizer:
            message, hint = _other_optimizer_refusal(stepped, optimizer)
            raise CaptureError(message, source=innermost_user_frame(), hint=hint)

    schedulers = _with_subclasses(torch.optim.lr_scheduler.LRScheduler,
                                  getattr(torch.optim.lr_scheduler, "ReduceLROnPlateau", None))
    scalers = _with_subclasses(getattr(getattr(torch, "amp", None), "GradScaler", None))
    patched = [(cls, "step", cls.__dict__["step"], _scheduler_refusal) for cls in schedulers if "step" in cls.__dict__]
    patched += [(cls, name, cls.__dict__[name], _scaler_refusal) for cls in scalers
                for name in ("scale", "unscale_", "step", "update") if name in cls.__dict__]

    def wrap(method, refusal):
        def refusing(self, *args, **kwargs):
            if threading.get_ident() != thread or (refusal is _scaler_refusal and not self.is_enabled()):
                return method(self, *args, **kwargs)  # a disabled scaler (nanoGPT's under bf16) passes through
            message, hint = refusal(self)
            raise CaptureError(message, source=innermost_user_frame(), hint=hint)

        refusing.__wrapped__ = method
        return refusing

    hook = None
    try:
        for cls, name, method, refusal in patched:
            setattr(cls, name, wrap(method, refusal))
        hook = register_optimizer_step_pre_hook(other_optimizer)
        yield
    finally:
        if hook is not None:
            hook.remove()
        for cls, name, method, _ in reversed(patched):
            setattr(cls, name, method)
