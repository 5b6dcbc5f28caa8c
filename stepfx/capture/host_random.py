"""Refuse steps that draw random numbers on the host.

A draw from Python's ``random`` or numpy's global generator runs once, while
the step is traced; the number it returned is then baked into the graph as a
constant and reused on every call (Wav2Vec2's SpecAugment masking draws its
mask with ``np.random``: the same mask every step). Training silently
differs from eager, so capture refuses instead, naming the user's line.

How it is seen, cheaply:

- while tracing, the drawing functions of ``random`` (the module-level
  functions bound to its hidden global ``Random``) and of ``numpy.random``
  (those bound to its global ``RandomState``), and ``numpy.random.default_rng``
  called without a seed (fresh OS entropy each call), are wrapped: a call
  from the tracing thread records the innermost user frame;
- as a backstop for draws that bypass the module attributes
  (``from random import random`` bound at import time), the global
  generators' states are compared before and after the trace.

Generators the user created before the step (``random.Random(0)``,
``np.random.default_rng(0)``) and drew from inside it are not seen: their
methods cannot be wrapped and there is no registry of them.
"""
from __future__ import annotations

import contextlib
import random
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..errors import CaptureError
from .source import innermost_user_frame

__all__ = ["refuse_host_random"]

_HINT = (
    "draw on the device with torch's RNG (torch.rand / torch.randint / torch.bernoulli, optionally with a "
    "torch.Generator), or draw outside the step and pass the result to it as an argument"
)


@dataclass(frozen=True)
class _Draw:
    function: str  # e.g. "np.random.rand"
    source: str | None  # the user's line, "file:line in func: code"


def _numpy():
    """numpy if the user's process already imported it (a step cannot draw
    from a generator of a module nobody imported)."""
    return sys.modules.get("numpy")


def _drawing_functions() -> list[tuple[Any, str, str]]:
    """(namespace, attribute, shown name) of every host drawing function."""
    found = []
    inst = getattr(random, "_inst", None)
    for name in dir(random):
        fn = getattr(random, name)
        if getattr(fn, "__self__", None) is inst and inst is not None and callable(fn) and name not in ("getstate",):
            found.append((random, name, f"random.{name}"))
    np = _numpy()
    if np is not None:
        legacy = getattr(np.random.mtrand, "_rand", None)
        for name in dir(np.random):
            fn = getattr(np.random, name)
            if legacy is not None and getattr(fn, "__self__", None) is legacy and callable(fn) and name != "get_state":
                found.append((np.random, name, f"np.random.{name}"))
    return found


def _states() -> tuple:
    np = _numpy()
    numpy_state = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        numpy_state = (kind, keys.tobytes(), pos, has_gauss, cached)
    return random.getstate(), numpy_state


def _wrap(fn: Callable, shown: str, draws: list[_Draw], thread: int) -> Callable:
    def wrapper(*args, **kwargs):
        if threading.get_ident() == thread:
            draws.append(_Draw(shown, innermost_user_frame()))
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn
    return wrapper


def _wrap_default_rng(fn: Callable, draws: list[_Draw], thread: int) -> Callable:
    def default_rng(seed=None):
        if seed is None and threading.get_ident() == thread:
            draws.append(_Draw("np.random.default_rng() without a seed", innermost_user_frame()))
        return fn(seed)

    default_rng.__wrapped__ = fn
    return default_rng


@contextlib.contextmanager
def refuse_host_random() -> Iterator[None]:
    """Around a trace: raise :class:`CaptureError` if the traced code drew
    from a host random generator (see the module docstring). When the trace
    itself failed after such a draw, the draw is reported (it happened first
    and is the worse problem: a capture that did succeed would train wrongly)."""
    draws: list[_Draw] = []
    thread = threading.get_ident()
    functions = _drawing_functions()
    patched = [(ns, name, getattr(ns, name)) for ns, name, _ in functions]
    np = _numpy()
    before = _states()
    try:
        for (ns, name, fn), (_, _, shown) in zip(list(patched), functions):
            setattr(ns, name, _wrap(fn, shown, draws, thread))
        if np is not None:
            patched.append((np.random, "default_rng", np.random.default_rng))
            np.random.default_rng = _wrap_default_rng(np.random.default_rng, draws, thread)
        try:
            yield
        except Exception as exc:
            if draws:
                raise _refusal(draws, None) from exc
            raise
    finally:
        for ns, name, fn in reversed(patched):
            setattr(ns, name, fn)
    after = _states()
    if draws or after != before:
        changed = [what for what, a, b in zip(("Python's random", "numpy.random"), before, after) if a != b]
        raise _refusal(draws, changed)


def _refusal(draws: list[_Draw], changed: list[str] | None) -> CaptureError:
    if draws:
        first = draws[0]
        sites = list(dict.fromkeys(d.source for d in draws if d.source))
        more = f"; {len(sites) - 1} other line(s) draw too, e.g. {sites[1]}" if len(sites) > 1 else ""
        return CaptureError(
            f"the step draws random numbers on the host ({first.function}): the value drawn while capturing "
            "would be baked into the graph and reused on every call",
            source=first.source,
            detail=(f"{len(draws)} host draw(s) while capturing" + more) if len(draws) > 1 else None,
            hint=_HINT,
        )
    return CaptureError(
        f"the step changed the state of {' and '.join(changed or ['a host random generator'])} while being captured "
        "(a draw from a host generator: its value would be baked into the graph and reused on every call)",
        hint=_HINT,
    )
