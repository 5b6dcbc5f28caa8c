"""How each block treats keys it does not know, and the shared machinery of typed blocks.

DeepSpeed reads a block in one of two ways, and stepfx copies whichever one
DeepSpeed uses for that block (the per-block table is in ``schema.py``):

- STRICT: a pydantic model with ``extra="forbid"``
  (``deepspeed/runtime/config_utils.py: DeepSpeedConfigModel.model_config``):
  an unknown key is an error.
- LENIENT: plain dict lookups (``get_scalar_param``): unknown keys are never
  looked at. stepfx reads them the same way but warns, naming the closest
  valid key.
- TIGHTENED: a block that current DeepSpeed validates strictly but that
  older releases, which published configs were written for, read with dict
  lookups (fp16 and bf16 until v0.17.1, ``compile`` until v0.16.6). An
  unknown key that is a near-miss of a valid key (difflib ratio >= 0.75) is
  an error, as current DeepSpeed rejects it and it is almost surely a typo;
  any other unknown key (a leftover of an older schema, e.g. gpt-neox's
  ``"fp16": {"fp16": true}``) is warned about and ignored, as those releases
  ignored it.
- OPAQUE: stepfx keeps the block in ``raw`` and does not look inside.
"""
from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Mapping
from typing import Any, Iterable

from .errors import ConfigError, ConfigWarning, bad_value, join, similarity, unknown_key, unknown_key_warning
from .values import AUTO, Check

# difflib ratio at or above which an unknown key in a TIGHTENED block counts as a typo.
NEAR_MISS = 0.75


class Rule(enum.Enum):
    STRICT = "strict"
    TIGHTENED = "tightened"
    LENIENT = "lenient"
    OPAQUE = "opaque"


class Notes:
    """Collects the warnings of one ``load_config`` call; they are emitted once, at the end.

    ``immediate=True`` (used when a dataclass is built directly in Python)
    warns at once instead.
    """

    def __init__(self, immediate: bool = False):
        self.immediate = immediate
        self.messages: list[str] = []

    def warn(self, message: str) -> None:
        if self.immediate:
            warnings.warn(message, ConfigWarning, stacklevel=4)
        else:
            self.messages.append(message)

    def emit(self, stacklevel: int) -> None:
        for message in self.messages:
            warnings.warn(message, ConfigWarning, stacklevel=stacklevel + 1)


def handle_unknown(path: str, value: Any, valid: Iterable[str], rule: Rule, notes: Notes, block: str) -> None:
    """Apply ``rule`` to an unknown key at ``path``: raise, warn, or let it pass."""
    valid = sorted(set(valid))
    key = path.rsplit(".", 1)[-1]
    if rule is Rule.STRICT:
        raise unknown_key(path, value, valid, f"DeepSpeed validates '{block}' strictly and rejects unknown keys")
    if rule is Rule.TIGHTENED:
        if any(similarity(key, v) >= NEAR_MISS for v in valid):
            raise unknown_key(path, value, valid,
                              f"current DeepSpeed validates '{block}' strictly and this looks like a misspelling")
        notes.warn(unknown_key_warning(path, valid, f"DeepSpeed before strict validation of '{block}' ignored it"))
    elif rule is Rule.LENIENT:
        notes.warn(unknown_key_warning(path, valid, f"DeepSpeed reads '{block}' with plain lookups and ignores it"))


def auto_not_allowed(path: str) -> ConfigError:
    return ConfigError(
        path, "got 'auto', but 'auto' is accepted only at the keys that HF transformers/accelerate fill in "
        "(batch sizes, gradient_clipping, fp16/bf16.enabled, optimizer lr/betas/eps/weight_decay, "
        "scheduler warmup/total steps, ZeRO stage/bucket sizes/offload devices); give a value here",
        value="auto", expected="a concrete value")


def is_auto(value: Any) -> bool:
    return value is AUTO or (isinstance(value, str) and value == "auto")


def spec(default: Any = dataclasses.MISSING, check: Check | None = None, *, auto: bool = False,
         json: tuple[str, ...] = (), factory: Any = dataclasses.MISSING, **extra: Any) -> Any:
    """A dataclass field that carries its checker.

    ``auto``: HF transformers / accelerate fill this key, so ``AUTO`` is a
    valid value. ``json``: other spellings DeepSpeed accepts for the key.
    ``auto_value=True`` (in ``extra``): "auto" is one of the key's own values
    (stepfx's keys, which HF never fills), handed to the checker as it is.
    """
    metadata = {"check": check, "auto": auto, "json": json, **extra}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def checked_fields(cls_or_obj) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls_or_obj) if f.metadata.get("check") is not None]


_DROPPED = object()


def _coerce(f: dataclasses.Field, value: Any, path: str, pydantic: bool, notes: Notes) -> Any:
    """One field's value, checked; "auto" becomes AUTO where HF fills it, else per the block's reader.

    ``pydantic``: DeepSpeed reads the block with a ``DeepSpeedConfigModel``,
    whose non-strict constructor drops every "auto" value
    (``config_utils.py: DeepSpeedConfigModel.__init__``), so "auto" at a key
    HF does not fill means DeepSpeed's default (returns ``_DROPPED``);
    elsewhere it is an error.
    """
    if not is_auto(value) or f.metadata.get("auto_value"):
        return f.metadata["check"]("auto" if value is AUTO else value, path)
    if f.metadata["auto"]:
        return AUTO
    if pydantic:
        notes.warn(f"{path}: 'auto' is not filled in by HF transformers/accelerate here, so DeepSpeed drops it "
                   f"and uses its default {default_of(f)!r}; stepfx does the same")
        return _DROPPED
    raise auto_not_allowed(path)


def validate_fields(obj: Any, prefix: str, *, pydantic: bool = False) -> None:
    """Check and coerce every field of a frozen dataclass in place (used by ``__post_init__``)."""
    for f in checked_fields(obj):
        value = _coerce(f, getattr(obj, f.name), join(prefix, f.name), pydantic, Notes(immediate=True))
        object.__setattr__(obj, f.name, default_of(f) if value is _DROPPED else value)


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def parse_fields(cls, mapping: Any, path: str, canon: str, notes: Notes, rule: Rule, *, pydantic: bool,
                 handled: Iterable[str] = (), block: str | None = None) -> tuple[dict, list[str]]:
    """Validate a user's mapping against the checked fields of dataclass ``cls``.

    Returns the constructor kwargs (canonical field names) and the canonical
    dotted paths the user set. ``handled`` keys are left to the caller.
    ``pydantic``: see ``_coerce``.
    """
    if not isinstance(mapping, Mapping):
        raise bad_value(path, mapping, "a mapping (JSON object)")
    by_json: dict[str, dataclasses.Field] = {}
    for f in checked_fields(cls):
        by_json[f.name] = f
        for alias in f.metadata["json"]:
            by_json[alias] = f
    handled = set(handled)
    kwargs: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, value in mapping.items():
        if key in handled:
            continue
        key_path = join(path, key)
        f = by_json.get(key)
        if f is None:
            handle_unknown(key_path, value, set(by_json) | handled, rule, notes, block or path)
            continue
        if f.name in seen:
            raise ConfigError(key_path, f"{seen[f.name]!r} and {key!r} are two spellings of the same key; "
                              "DeepSpeed rejects a config that gives both", value=value,
                              expected="only one of them")
        seen[f.name] = key
        value = _coerce(f, value, key_path, pydantic, notes)
        if value is not _DROPPED:
            kwargs[f.name] = value
    return kwargs, [join(canon, name) for name in seen]
