"""``load_config``: a DeepSpeed JSON file or dict -> ``Config``, read as DeepSpeed reads it.

Reading order and rules (DeepSpeed v0.19.5, ``runtime/config.py: DeepSpeedConfig``):

- A file is JSON; duplicate keys are an error, as DeepSpeed's
  ``dict_raise_error_on_duplicate_keys`` makes them. (DeepSpeed parses with
  hjson, which also allows comments; stepfx reads strict JSON.)
- Each top-level key goes to its block's parser (``zero.py``,
  ``precision.py``, ``blocks.py``) or to the untyped-block table
  (``schema.py``); each block applies the key rule DeepSpeed applies to it.
- Unknown top-level keys: DeepSpeed never reads them. stepfx ignores them
  too, warns (with the closest known key) and lists them in
  ``Config.ignored_keys``.
- ``Config.not_applied`` gets every canonical key path the user set that is
  not in ``applied.APPLIED``, except from blocks switched off (``enabled``
  false).
"""
from __future__ import annotations

import dataclasses

import json
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .applied import is_applied
from .blocks import parse_optimizer, parse_scheduler, parse_stepfx
from .config import Config
from .errors import ConfigError, bad_value, closest
from .precision import parse_bf16, parse_fp16
from .rules import Notes, Rule, auto_not_allowed, checked_fields, is_auto, parse_fields
from .pipeline import parse_pipeline
from .tensor_parallel import parse_tensor_parallel
from .schema import BLOCKS, SCALARS, block_enabled, check_block_keys
from .zero import legacy_zero, parse_zero

_BLOCK_PARSERS = MappingProxyType({
    "zero_optimization": parse_zero,
    "fp16": parse_fp16,
    "bf16": parse_bf16,
    "bfloat16": parse_bf16,
    "optimizer": parse_optimizer,
    "scheduler": parse_scheduler,
    "stepfx": parse_stepfx,
    "tensor_parallel": parse_tensor_parallel,
    "pipeline": parse_pipeline,
})
_CANONICAL = MappingProxyType({"bfloat16": "bf16"})


def known_top_level_keys() -> frozenset[str]:
    """Every top-level key stepfx (and DeepSpeed) reads."""
    return frozenset({f.name for f in checked_fields(Config)} | set(_BLOCK_PARSERS) | set(BLOCKS) | set(SCALARS))


def load_config(source: Any = None) -> Config:
    """Read a DeepSpeed config as DeepSpeed does, into a frozen ``Config``.

    ``source``: None (all defaults), a path (str or os.PathLike) to a JSON
    file, a Mapping in DeepSpeed's schema, or a Config (returned unchanged).
    Raises ``ConfigError`` (a ValueError) naming the key path, the value and
    what is allowed; warns with ``ConfigWarning`` about keys DeepSpeed ignores.
    """
    if isinstance(source, Config):
        return source
    if source is None:
        raw, name = {}, "<defaults>"
    elif isinstance(source, (str, os.PathLike)):
        raw, name = read_json(source), os.fspath(source)
    elif isinstance(source, Mapping):
        raw, name = source, "<dict>"
    else:
        raise TypeError(f"load_config takes None, a path, a mapping or a Config, not {type(source).__name__}")
    notes = Notes()
    config = _build(raw, name, notes)
    notes.emit(stacklevel=2)
    if source is None:
        # no config at all: run the step as written. (A DeepSpeed config
        # without "gradient_clipping" clips at 1.0, DeepSpeed's default.)
        config = dataclasses.replace(config, gradient_clipping=0.0)
    return config


def read_json(path: str | os.PathLike) -> dict:
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ConfigError(dupes[0], f"duplicate key(s) {dupes} in {os.fspath(path)}; DeepSpeed rejects "
                              "duplicate keys", value=dupes, expected="each key once")
        return dict(pairs)

    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f, object_pairs_hook=no_duplicates)
        except json.JSONDecodeError as e:
            raise ConfigError("", f"{os.fspath(path)} is not valid JSON: {e}") from None


def _build(raw: Any, name: str, notes: Notes) -> Config:
    if not isinstance(raw, Mapping):
        raise bad_value("", raw, "a JSON object at the top level")
    for key in raw:
        if not isinstance(key, str):
            raise bad_value(repr(key), key, "string keys")
    known = known_top_level_keys()
    scalars = {f.name for f in checked_fields(Config)}
    kwargs: dict[str, Any] = {}
    set_paths: list[str] = []
    ignored: list[str] = []

    typed, paths = parse_fields(Config, {k: v for k, v in raw.items() if k in scalars}, "", "", notes,
                                Rule.STRICT, pydantic=False)
    kwargs.update(typed)
    set_paths += paths
    for key, value in raw.items():
        if key in scalars:
            continue
        if key == "bfloat16" and "bf16" in raw:
            notes.warn("bfloat16: ignored because bf16 is also given (DeepSpeed reads bf16 first and never looks "
                       "at bfloat16)")
            ignored.append(key)
        elif key == "zero_optimization" and isinstance(value, bool):
            kwargs[key], paths = legacy_zero(value, raw.get("allgather_size"), notes)
            set_paths += paths
        elif key in _BLOCK_PARSERS:
            block, paths = _BLOCK_PARSERS[key](value, key, notes)
            canonical = _CANONICAL.get(key, key)
            kwargs[canonical] = block
            if not (canonical in ("fp16", "bf16") and block.enabled is False):  # a disabled block adds nothing
                set_paths += paths
        elif key in BLOCKS:
            check_block_keys(value, key, BLOCKS[key], notes)
            if block_enabled(key, value):
                set_paths += _leaf_paths(key, value, BLOCKS[key].rule)
        elif key in SCALARS:
            if is_auto(value):
                raise auto_not_allowed(key)
            SCALARS[key](value, key)
            set_paths.append(key)
        else:
            ignored.append(key)
    _warn_unknown([k for k in ignored if k != "bfloat16"], known, notes)
    not_applied = tuple(dict.fromkeys(p for p in set_paths if not is_applied(p)))
    return Config(**kwargs, raw=raw, source=name, ignored_keys=tuple(ignored), not_applied=not_applied)


def _warn_unknown(keys: list[str], known: frozenset[str], notes: Notes) -> None:
    """One warning per key that looks like a misspelt DeepSpeed key; one for all the others (e.g. gpt-neox's own)."""
    others = []
    for key in keys:
        near = closest(key, known)
        if near:
            notes.warn(f"{key}: not a DeepSpeed config key; DeepSpeed ignores it, and so does stepfx. "
                       f"Did you mean {near!r}?")
        else:
            others.append(key)
    if others:
        notes.warn(f"{', '.join(others)}: not DeepSpeed config keys; DeepSpeed ignores them, and so does stepfx")


def _leaf_paths(key: str, value: Any, rule: Rule) -> list[str]:
    if rule is Rule.OPAQUE or not isinstance(value, Mapping) or not value:
        return [key]
    return [f"{key}.{k}" for k in value]
