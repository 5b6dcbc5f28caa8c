"""Errors and warnings of the config front end, and the "did you mean" helper.

Every message names the dotted key path, the value given, what is allowed,
and — for unknown keys — the closest valid key, so that a user can fix the
file without reading stepfx's (or DeepSpeed's) source.
"""
from __future__ import annotations

import difflib
from typing import Any, Iterable

# difflib ratio at or above which a key is offered as "did you mean".
SUGGEST_CUTOFF = 0.75


class ConfigError(ValueError):
    """A config value or key that DeepSpeed (and so stepfx) rejects.

    Attributes hold the parts of the message for tools and tests: ``path``
    (dotted key path), ``value`` (as given), ``expected`` (allowed values or
    type), ``suggestion`` (closest valid key, or None).
    """

    def __init__(self, path: str, message: str, *, value: Any = None, expected: str | None = None,
                 suggestion: str | None = None):
        self.path = path
        self.value = value
        self.expected = expected
        self.suggestion = suggestion
        super().__init__(f"{path}: {message}" if path else message)


class ConfigWarning(UserWarning):
    """Something DeepSpeed accepts but that is most likely not what the user meant."""


def closest(key: str, candidates: Iterable[str]) -> str | None:
    """The valid key closest to ``key`` (difflib), or None when none is close or two are equally close."""
    scored = sorted(((similarity(key, c), c) for c in set(candidates)), reverse=True)
    if not scored or scored[0][0] < SUGGEST_CUTOFF or (len(scored) > 1 and scored[1][0] == scored[0][0]):
        return None
    return scored[0][1]


def similarity(key: str, other: str) -> float:
    return difflib.SequenceMatcher(None, key, other).ratio()


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def bad_value(path: str, value: Any, expected: str, detail: str = "") -> ConfigError:
    """The error for a value of the wrong type or out of range."""
    tail = f" ({detail})" if detail else ""
    return ConfigError(path, f"got {value!r}; expected {expected}{tail}", value=value, expected=expected)


def unknown_key(path: str, value: Any, valid: Iterable[str], why: str) -> ConfigError:
    """The error for a key a strictly validated block does not have."""
    valid = sorted(set(valid))
    suggestion = closest(path.rsplit(".", 1)[-1], valid)
    hint = f" Did you mean {suggestion!r}?" if suggestion else ""
    return ConfigError(path, f"unknown key (value {value!r}); {why}.{hint} Valid keys: {', '.join(valid)}.",
                       value=value, expected=f"one of the keys {valid}", suggestion=suggestion)


def unknown_key_warning(path: str, valid: Iterable[str], why: str) -> str:
    suggestion = closest(path.rsplit(".", 1)[-1], valid)
    hint = f" Did you mean {suggestion!r}?" if suggestion else ""
    return f"{path}: unknown key, ignored ({why}).{hint}"
