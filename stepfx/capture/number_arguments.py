"""Python numbers among a step's arguments that change between calls become
inputs of the captured step instead of constants.

A step that takes a count computed per batch as a Python number — the
tokens to average the loss over (Hugging Face passes ``num_items_in_batch``
to its losses), a per-step scale — holds it as a constant when traced,
so each new value captured the step again (the plans cache holding the
last few). Like torch.compile's automatic dynamic for ints, an ``int`` or
``float`` argument (a leaf of the arguments, in a dict or list too; never
a ``bool``, which decides Python branches) whose value differs from the
last plan's becomes a 0-d input: an int64 or float64 CPU tensor, which the
traced step reads back with ``.item()`` — an unbacked symbolic number whose
arithmetic the graph records, in the same precision as Python's — so one
more capture serves every later value. Where the step's Python decides
something on the number (``range(n)``, ``if n > 0``, a size), that capture
fails on the data-dependent value and the number stays a constant, as
before, with the warning that says so.

Which arguments: ``pytree.keystr`` paths over ``(args, kwargs)``, the
labels the fingerprint gives them (``"argument [0][2]"``).
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["INPUT", "is_number", "as_input", "changed_numbers", "LABEL"]

INPUT = "<step input>"  # the fingerprint's value for a number that is an input (any value serves)
LABEL = "argument "  # the fingerprint's label prefix of an argument leaf


def is_number(value: Any) -> bool:
    """A Python int or float (exactly: not bool, not a subclass)."""
    return type(value) in (int, float)


def as_input(value: int | float) -> torch.Tensor:
    """The 0-d CPU tensor that feeds a number argument to the graph."""
    return torch.tensor(value, dtype=torch.int64 if type(value) is int else torch.float64)


def changed_numbers(old: tuple, new: tuple) -> frozenset[str]:
    """Paths of the number arguments whose values differ between two
    fingerprints (the same type in both: an int that became a float stays a
    new plan)."""
    before = dict(old)
    changed = set()
    for label, value in new:
        was = before.get(label)
        if not label.startswith(LABEL) or was is None or was == value:
            continue
        if all(isinstance(v, tuple) and len(v) == 2 and v[0] in (int, float) for v in (was, value)) \
                and was[0] is value[0] and INPUT not in (was[1], value[1]):
            changed.add(label[len(LABEL):])
    return frozenset(changed)
