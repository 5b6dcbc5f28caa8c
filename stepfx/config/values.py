"""Value checkers with DeepSpeed's (pydantic v2 "lax" mode) coercion rules.

DeepSpeed validates most of its blocks with pydantic models
(``deepspeed/runtime/config_utils.py: DeepSpeedConfigModel``). Pydantic's lax
mode is what users' files rely on, so stepfx coerces the same way:

- int: an int, a float with no fractional part (``5e8``), or a string of
  digits (``"500"``). A fractional float (``5.5``), ``"5e8"``, inf/nan are
  errors.
- float: an int, a float, or a numeric string.
- bool: a bool, 0/1 (int or float), or one of the strings pydantic accepts
  (true/false, yes/no, on/off, t/f, y/n, 1/0; any case).

One deliberate difference: pydantic takes ``true`` where an int is wanted
(``"stage": true`` is stage 1); stepfx rejects booleans in numeric fields, as
DeepSpeed's own fp16 validators do since #8050 ("a bool ... would silently
pass").

A checker is called as ``check(value, path)`` and returns the coerced value
or raises ``ConfigError`` naming the path, the value and what is allowed.
"""
from __future__ import annotations

import enum
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .errors import ConfigError, bad_value, closest


class Auto(enum.Enum):
    """The type of ``AUTO``: the value ``"auto"`` that HF transformers/accelerate fill in."""

    AUTO = "auto"

    def __repr__(self) -> str:
        return "AUTO"

    __str__ = __repr__


AUTO = Auto.AUTO


class FrozenMap(Mapping):
    """A read-only, hashable mapping; nested dicts and lists are frozen too (lists become tuples)."""

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping | None = None):
        object.__setattr__(self, "_data", {k: freeze(v) for k, v in (data or {}).items()})
        object.__setattr__(self, "_hash", None)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(frozenset(self._data.items())))
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    def __setattr__(self, name, value):
        raise AttributeError("FrozenMap is read-only")

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


def freeze(value: Any) -> Any:
    """Deep read-only copy: Mapping -> FrozenMap, list/tuple -> tuple."""
    if isinstance(value, FrozenMap):
        return value
    if isinstance(value, Mapping):
        return FrozenMap(value)
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Inverse of ``freeze`` for JSON-like data: FrozenMap -> dict, tuple -> list."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


Check = Callable[[Any, str], Any]

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _bounds(lo, hi, lo_open=False) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo}")
    if hi is not None:
        parts.append(f"<= {hi}")
    return " and ".join(parts)


@dataclass(frozen=True)
class Int:
    ge: int | None = None
    le: int | None = None

    @property
    def expected(self) -> str:
        b = _bounds(self.ge, self.le)
        return f"an integer{' ' + b if b else ''}"

    def __call__(self, value: Any, path: str) -> int:
        out = None
        if isinstance(value, bool):
            pass
        elif isinstance(value, int):
            out = value
        elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
            out = int(value)
        elif isinstance(value, str):
            try:
                out = int(value.strip())
            except ValueError:
                pass
        if out is None:
            raise bad_value(path, value, self.expected)
        if (self.ge is not None and out < self.ge) or (self.le is not None and out > self.le):
            raise bad_value(path, value, self.expected)
        return out


@dataclass(frozen=True)
class Float:
    ge: float | None = None
    le: float | None = None
    gt: float | None = None

    @property
    def expected(self) -> str:
        b = _bounds(self.gt if self.gt is not None else self.ge, self.le, lo_open=self.gt is not None)
        return f"a finite number{' ' + b if b else ''}"

    def __call__(self, value: Any, path: str) -> float:
        out = None
        if isinstance(value, bool):
            pass
        elif isinstance(value, (int, float)):
            out = float(value)
        elif isinstance(value, str):
            try:
                out = float(value.strip())
            except ValueError:
                pass
        if out is None or not math.isfinite(out):
            raise bad_value(path, value, self.expected)
        if ((self.ge is not None and out < self.ge) or (self.le is not None and out > self.le)
                or (self.gt is not None and out <= self.gt)):
            raise bad_value(path, value, self.expected)
        return out


@dataclass(frozen=True)
class Bool:
    expected: str = "a boolean (true/false)"

    def __call__(self, value: Any, path: str) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad_value(path, value, self.expected)


@dataclass(frozen=True)
class Choice:
    """One of fixed strings; ``lower`` accepts any case (as DeepSpeed lower-cases some keys)."""

    values: tuple[str, ...]
    lower: bool = False

    @property
    def expected(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.values)

    def __call__(self, value: Any, path: str) -> str:
        if isinstance(value, str):
            v = value.lower() if self.lower else value
            if v in self.values:
                return v
            near = closest(v, self.values)
            if near:
                error = bad_value(path, value, self.expected, f"did you mean {near!r}?")
                error.suggestion = near
                raise error
        raise bad_value(path, value, self.expected)


@dataclass(frozen=True)
class Str:
    expected: str = "a string"

    def __call__(self, value: Any, path: str) -> str:
        if isinstance(value, str):
            return value
        raise bad_value(path, value, self.expected)


@dataclass(frozen=True)
class PathStr:
    """A filesystem path (pydantic's ``Path``): a string or os.PathLike, kept as a string."""

    expected: str = "a filesystem path (string)"

    def __call__(self, value: Any, path: str) -> str:
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
        raise bad_value(path, value, self.expected)


@dataclass(frozen=True)
class StrList:
    """A list of strings (a lone string is taken as a one-element list, as DeepSpeed's leaf_module does)."""

    expected: str = "a list of strings"

    def __call__(self, value: Any, path: str) -> tuple[str, ...]:
        if isinstance(value, str):
            return (value, )
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise bad_value(path, value, self.expected)


@dataclass(frozen=True)
class AnyMap:
    """Any JSON object, kept read-only and not looked into."""

    expected: str = "a mapping (JSON object)"

    def __call__(self, value: Any, path: str) -> FrozenMap:
        if isinstance(value, Mapping):
            return freeze(value)
        raise bad_value(path, value, self.expected)


@dataclass(frozen=True)
class Anything:
    expected: str = "any value"

    def __call__(self, value: Any, path: str) -> Any:
        return freeze(value)


@dataclass(frozen=True)
class Optional:
    inner: Check

    @property
    def expected(self) -> str:
        return f"{self.inner.expected} or null"

    def __call__(self, value: Any, path: str) -> Any:
        return None if value is None else self.inner(value, path)


@dataclass(frozen=True)
class OneOf:
    """The first of several checkers that accepts the value."""

    options: tuple[Check, ...]

    @property
    def expected(self) -> str:
        return " or ".join(o.expected for o in self.options)

    def __call__(self, value: Any, path: str) -> Any:
        for option in self.options:
            try:
                return option(value, path)
            except ConfigError:
                pass
        raise bad_value(path, value, self.expected)


@dataclass(frozen=True)
class ListOf:
    inner: Check
    length: int | None = None

    @property
    def expected(self) -> str:
        n = f"{self.length} " if self.length else ""
        return f"a list of {n}values, each {self.inner.expected}"

    def __call__(self, value: Any, path: str) -> tuple:
        if not isinstance(value, (list, tuple)) or (self.length and len(value) != self.length):
            raise bad_value(path, value, self.expected)
        return tuple(self.inner(v, f"{path}[{i}]") for i, v in enumerate(value))


def allow_auto(check: Check) -> Check:
    """``check`` that also lets ``AUTO`` (or the string "auto") through as ``AUTO``."""
    return OneOf((_AutoCheck(), check))


@dataclass(frozen=True)
class _AutoCheck:
    expected: str = '"auto"'

    def __call__(self, value: Any, path: str) -> Auto:
        if value is AUTO or value == "auto":
            return AUTO
        raise bad_value(path, value, self.expected)
