"""A module whose parameters ZeRO-3 holds as pieces (or other pipeline
stages hold) says so when it is used.

Between steps under ZeRO-3 the user's module keeps empty parameters (the
rank's pieces live in the step's store), so calling it outside the step —
an evaluation loop, ``model.generate()``, a second decorated step over the
same model — used to fail deep inside aten ("'weight' must be 2-D").
A forward pre-hook on the module now raises first, naming the step that
holds the parameters and what to call (``step.sync_model()``) instead; so
does ``module.state_dict()`` (``torch.save(model.state_dict())`` or
``save_pretrained`` would write empty tensors), except for stepfx's own
reads (``reading_emptied``).

The hook reads only the parameters' sizes. While the step that holds them
traces the module again (a new shape), the module is reparametrized with
whole-sized tensors, so the hook lets it through; a *different* step's
capture sees the empty ones and is refused with this message as its cause.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator

import torch


__all__ = ["EmptiedModuleError", "hold_emptied", "reading_emptied"]


class EmptiedModuleError(RuntimeError):
    """The module was called while a step holds its parameters as ZeRO-3 pieces."""


# module -> (the step's name, parameter name -> whole size) for the modules a step has emptied
_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HOOKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_READING = threading.local()  # stepfx's own reads of an emptied module's state_dict (its keys, its buffers)


@contextlib.contextmanager
def reading_emptied() -> Iterator[None]:
    """Let stepfx read an emptied module's ``state_dict()`` (the keys it
    fills with gathered parameters, the buffers it saves)."""
    depth = getattr(_READING, "depth", 0)
    _READING.depth = depth + 1
    try:
        yield
    finally:
        _READING.depth = depth


def hold_emptied(module: torch.nn.Module, step_name: str, sizes: dict[str, torch.Size]) -> None:
    """Note that ``step_name`` holds ``module``'s parameters (``sizes``: the
    whole sizes of those that are not empty) and hook the module, once, to
    refuse calls while any of them is empty in it."""
    _HELD[module] = (step_name, sizes)  # (the caller's dict, kept: this runs after every step)
    if module not in _HOOKED:
        _HOOKED[module] = (module.register_forward_pre_hook(_refuse_emptied),
                           module.register_state_dict_pre_hook(_refuse_emptied_state_dict))


def _refuse_emptied_state_dict(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
    if not getattr(_READING, "depth", 0):
        _refuse_emptied(module, (), "state_dict() would hold empty tensors for them")


def _refuse_emptied(module: torch.nn.Module, args, what: str = "the module cannot run outside it") -> None:
    held = _HELD.get(module)
    if held is None:
        return
    step_name, sizes = held
    params = dict(module.named_parameters(remove_duplicate=False))
    empty = [name for name in sizes if name in params and params[name].numel() == 0]
    if not empty:
        return
    raise EmptiedModuleError(
        f"{type(module).__name__}'s parameters are held by the stepfx step {step_name!r} between steps, as ZeRO-3 "
        f"pieces or on the pipeline stages that own them "
        f"({len(empty)} of {len(sizes)} are empty in the module, e.g. {empty[0]} of size {tuple(sizes[empty[0]])}), "
        f"so {what}: evaluate with a step decorated by @{step_name}.evaluator (it gathers the pieces as the "
        f"training forward does), or call {step_name}.sync_model() on every rank to put whole parameters back "
        f"(generation, saving; the next step shards them again), or read them with {step_name}.model_state_dict(), "
        f"or save with {step_name}.save_checkpoint()")
