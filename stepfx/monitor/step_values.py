"""What a monitor needs from a step call that the step does not say outright.

A user's step returns whatever it likes and takes whatever batch it likes,
so the loss, the token count and the model's FLOPs per token are read by
documented conventions here, in one place, rather than guessed at the
call site. Each function returns None where its convention does not apply;
the monitor then leaves that field out.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["dense_flops_per_token", "loss_of", "tokens_in"]


def loss_of(result: Any) -> torch.Tensor | None:
    """The loss in a step's result: the result itself when it is a
    floating-point tensor with one element, else the first such tensor in
    it (a ``(loss, logits)`` tuple, a ``{"loss": ...}`` dict, an HF
    ``ModelOutput``); None when there is none."""
    for leaf in _tensors(result):
        if leaf.is_floating_point() and leaf.numel() == 1:
            return leaf
    return None


def tokens_in(args: tuple, kwargs: dict) -> int | None:
    """Tokens in one call's batch on this rank: the element count of the
    largest integer tensor among the step's arguments (token ids; labels
    and attention masks have the same count, so they are not added). For a
    batch without integer tensors, None."""
    counts = [leaf.numel() for leaf in _tensors((args, kwargs))
              if not leaf.is_floating_point() and not leaf.is_complex() and leaf.dtype is not torch.bool]
    return max(counts) if counts else None


def dense_flops_per_token(model: torch.nn.Module) -> float | None:
    """Training FLOPs per token of a dense model, ``6 * parameters`` (2 for
    the forward matmuls, 4 for the backward; Kaplan et al. 2020), leaving
    out attention's sequence-length term: a lower bound, so MFU is too.
    Count the parameters before ZeRO-3 empties the module's tensors."""
    n = sum(p.numel() for p in model.parameters())
    return 6.0 * n if n else None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested tuples, lists and mappings (an HF ``ModelOutput``
    is a mapping), in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
