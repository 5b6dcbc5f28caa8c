"""Parametrizations over breadth (the same check on more architectures)
that run a rotating part of their cases, so the suite keeps its time.

``rotating(values, keep, salt=...)`` gives every case as a pytest param;
all but ``keep`` of them carry a skip mark saying why. Which ones run is
drawn from the UTC date (each day another sample, the same on both xdist
workers and on a rerun the same day) or from ``STEPFX_TEST_ROTATION``:
``STEPFX_TEST_ROTATION=all`` runs every case (``make test-all``), any
other value seeds the draw. Only for cases that check one thing on
another model or layout; combinations of features that take their own
code paths are never rotated out.
"""
from __future__ import annotations

import datetime
import os
import random
from typing import Any, Sequence

import pytest
from _pytest.mark.structures import ParameterSet

ENV = "STEPFX_TEST_ROTATION"


def rotation_seed() -> str | None:
    """The seed of today's draw, or None when every case runs."""
    value = os.environ.get(ENV, "").strip()
    if value == "all":
        return None
    return value or datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def rotating(values: Sequence[Any], keep: int, *, salt: str, ids: Sequence[str] | None = None) -> list:
    """``values`` (single arguments, tuples of arguments, or pytest params)
    as params, ``keep`` of them drawn to run and the others skipped."""
    values = list(values)
    seed = rotation_seed()
    if seed is None or keep >= len(values):
        chosen = set(range(len(values)))
    else:
        chosen = set(random.Random(f"{seed}/{salt}").sample(range(len(values)), keep))
    skip = pytest.mark.skip(reason=f"rotated out of this run ({ENV}={seed}: {keep} of {len(values)} run); "
                                   f"{ENV}=all runs every one")
    out = []
    for i, value in enumerate(values):
        marks = () if i in chosen else (skip,)
        given = ids[i] if ids is not None else None
        if isinstance(value, ParameterSet):
            out.append(pytest.param(*value.values, marks=(*value.marks, *marks), id=value.id or given))
        elif isinstance(value, tuple):
            out.append(pytest.param(*value, marks=marks, id=given))
        else:
            out.append(pytest.param(value, marks=marks, id=given))
    return out
