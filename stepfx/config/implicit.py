"""Defaults that change what training computes, taken without the user asking.

A DeepSpeed config that omits ``gradient_clipping`` clips gradients at
global norm 1.0 (DeepSpeed's default since #8068): a step that never clipped
in eager PyTorch clips under stepfx. Said once, at the first call, so that a
config that meant no clipping can say ``"gradient_clipping": 0``.

Only configs read from JSON or a dict can tell a key left out from a key
set to its default (``Config.raw`` is what the user wrote); a ``Config``
built in Python, and ``parallelize()`` with no config (which does not clip),
say nothing.
"""
from __future__ import annotations

import dataclasses

from .config import Config
from .values import AUTO

__all__ = ["implicit_defaults", "fill_auto_clipping", "unapplied_settings"]


def fill_auto_clipping(config: Config) -> tuple[Config, str | None]:
    """``"gradient_clipping": "auto"`` outside the Hugging Face Trainer (which
    fills it from ``max_grad_norm``, default 1.0): the Trainer's default,
    said once. Left "auto", the clipping pass would read no number and not
    clip at all, silently."""
    if config.gradient_clipping is not AUTO:
        return config, None
    note = ('gradient_clipping is "auto" and nothing filled it (the Hugging Face Trainer fills it from max_grad_norm): '
            "clipping to global norm 1.0, the Trainer's default; set a number to choose")
    return dataclasses.replace(config, gradient_clipping=1.0), note


def implicit_defaults(config: Config) -> list[str]:
    """One sentence per default in effect that changes the step's math and
    that the user's config did not set."""
    if config.source in ("<python>", "<defaults>"):
        return []
    notes = []
    clip = config.gradient_clipping
    if "gradient_clipping" not in config.raw and isinstance(clip, (int, float)) and clip > 0:
        notes.append(
            f"the config does not set gradient_clipping, so gradients are clipped to global norm {clip:g} "
            '(DeepSpeed\'s default); set "gradient_clipping": 0 to train without clipping, or set it to the '
            "norm you want to silence this"
        )
    return notes


def unapplied_settings(config: Config) -> list[str]:
    """One sentence per setting stepfx reads and accepts but does not apply
    yet (memory placement only: what the step computes is unchanged)."""
    notes: list[str] = []
    return notes
