"""The memory planner: ``"stepfx": {"memory_budget_gib": X}`` — before the
first step, choose how much the backward recomputes so that the step's
predicted peak on this rank fits X GiB, at the least recomputation.

The prediction is the final per-rank program's (every pass run: ZeRO's
shards, casts, fusions), from graph/accounting.py's liveness walk, which the
tests hold to what a CPU step really allocates (stepfx.testing.memory). The
planner runs the pass pipeline once per candidate, in order of the work a
candidate adds — nothing recomputed, then recompute_activations' levels
(``cheap``, ``matmuls``, ``all``) — and keeps the first whose peak fits.
``explain()`` shows each candidate tried with its predicted peak, and why
it was rejected. A budget no candidate meets is a ConfigError naming the
smallest peak reached and how.

Not yet among the candidates: ZeRO stage (when the config leaves it
"auto"), optimizer and parameter offload — issue 18's later items.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ...config.errors import ConfigError
from ...graph.accounting import estimate_memory
from ..manager import PassOptions, PassRecord
from .recompute_activations import LEVELS, RECOMPUTE_LEVEL_KEY, format_bytes

__all__ = ["CANDIDATES", "Tried", "memory_budget_bytes", "plan_memory"]

CANDIDATES = ("none", *LEVELS)
GIB = 2**30


@dataclass(frozen=True)
class Tried:
    level: str
    peak: int  # predicted peak bytes on this rank
    fits: bool


def memory_budget_bytes(config) -> int | None:
    gib = getattr(getattr(config, "stepfx", None), "memory_budget_gib", None)
    return None if gib is None else int(gib * GIB)


def plan_memory(run: Callable[[PassOptions], list[PassRecord]], options: PassOptions, budget: int,
                *, config_path: str = "stepfx.memory_budget_gib") -> list[PassRecord]:
    """Run the pipeline (``run(options)``) per candidate until one's predicted
    peak fits ``budget`` bytes; the chosen run's records, with a record
    ``plan_memory`` saying what was tried."""
    start = time.perf_counter()
    tried: list[Tried] = []
    for level in CANDIDATES:
        records = run(PassOptions(config=options.config, world_size=options.world_size, rank=options.rank,
                                  device_type=options.device_type, group_name=options.group_name,
                                  extra={**(options.extra or {}), RECOMPUTE_LEVEL_KEY: level}))
        peak = estimate_memory(records[-1].graph).peak
        tried.append(Tried(level, peak, peak <= budget))
        if peak <= budget:
            break
    asked = getattr(options.config.stepfx, "memory_budget_gib", budget / GIB)
    lines = [f"{t.level}: predicted peak {format_bytes(t.peak)}" + ("" if t.fits else " (over the budget)") for t in tried]
    if not tried[-1].fits:
        best = min(tried, key=lambda t: t.peak)
        raise ConfigError(config_path, f"{asked:g} GiB cannot be met on rank {options.rank}: the smallest "
                          f"predicted peak is {format_bytes(best.peak)} (recompute {best.level!r}); tried "
                          + "; ".join(lines), value=asked, expected=f">= {best.peak / GIB:.6g}")
    summary = (f"budget {asked:g} GiB: recompute {tried[-1].level!r} (predicted peak {format_bytes(tried[-1].peak)}); "
               f"tried " + "; ".join(lines))
    record = PassRecord(len(records), "plan_memory", records[-1].graph, False, time.perf_counter() - start, summary)
    return [*records, record]
