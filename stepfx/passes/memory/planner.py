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

When no level fits and the step is ZeRO 1-3 without offload configured,
the levels are tried again with Adam's state offloaded to the host
(``zero_optimization.offload_optimizer: {device: cpu, pin_memory: true}``,
passes/memory/offload_optimizer.py): offloading costs the host update each
step (0.96 s for the 1.3B GPT on the H200 machine, against a 0.13 s step),
more than any level of recomputation, so it comes last; a model whose
optimizer the host cannot update (SGD, amsgrad) has no such candidate, and
``explain()`` says why.

Not yet among the candidates: ZeRO stage (when the config leaves it
"auto"), parameter offload. Under ZeRO-3, once offloading all of Adam's state fits,
smaller ratios are tried (0.5, 0.25: DeepSpeed's partial offload) and the
least that fits is kept: less host work a step.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...config.errors import ConfigError
from ...config.zero import OffloadConfig
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
    offload: bool = False
    ratio: float = 1.0

    @property
    def name(self) -> str:
        return f"recompute {self.level!r}" + (" + optimizer offload" if self.offload else "") + \
            (f" (ratio {self.ratio:g})" if self.offload and self.ratio < 1 else "")


def memory_budget_bytes(config) -> int | None:
    gib = getattr(getattr(config, "stepfx", None), "memory_budget_gib", None)
    return None if gib is None else int(gib * GIB)


RATIOS = (0.5, 0.25)  # under ZeRO-3, once offloading everything fits: the least that still fits (less host work)


def _with_offload(config, ratio: float = 1.0):
    """``config`` with Adam's state offloaded to the host (``ratio`` of it), or None when it has no room for that
    (no ZeRO, or offload already configured)."""
    zero = getattr(config, "zero_optimization", None)
    if zero is None or not isinstance(zero.stage, int) or zero.stage < 1 or zero.offload_optimizer is not None:
        return None
    block = OffloadConfig(device="cpu", pin_memory=True, ratio=ratio)
    return dataclasses.replace(config, zero_optimization=dataclasses.replace(zero, offload_optimizer=block))


def plan_memory(run: Callable[[PassOptions], list[PassRecord]], options: PassOptions, budget: int,
                *, config_path: str = "stepfx.memory_budget_gib") -> list[PassRecord]:
    """Run the pipeline (``run(options)``) per candidate until one's predicted
    peak fits ``budget`` bytes; the chosen run's records, with a record
    ``plan_memory`` saying what was tried."""
    start = time.perf_counter()
    tried: list[Tried] = []
    notes: list[str] = []
    records = None
    offloaded = _with_offload(options.config)
    configs = [(False, options.config)] + ([(True, offloaded)] if offloaded is not None else [])

    def attempt(config, level):
        return run(PassOptions(config=config, world_size=options.world_size, rank=options.rank,
                               device_type=options.device_type, group_name=options.group_name,
                               extra={**(options.extra or {}), RECOMPUTE_LEVEL_KEY: level},
                               tp_size=options.tp_size, tp_rank=options.tp_rank, tp_group_name=options.tp_group_name))

    for offload, config in configs:
        for level in CANDIDATES:
            try:
                candidate = attempt(config, level)
            except ConfigError as exc:
                if not offload:
                    raise
                notes.append(f"optimizer offload not possible: {exc}")
                break
            peak = estimate_memory(candidate[-1].graph).peak
            tried.append(Tried(level, peak, peak <= budget, offload))
            records = candidate
            if peak <= budget:
                break
        if tried and tried[-1].fits:
            if offload and config.zero_optimization.stage == 3:  # DeepSpeed's partial offload: stage 3 only
                for ratio in RATIOS:
                    partial = attempt(_with_offload(options.config, ratio), tried[-1].level)
                    peak = estimate_memory(partial[-1].graph).peak
                    if peak > budget:
                        tried.append(Tried(tried[-1].level, peak, False, True, ratio))
                        break
                    fits = Tried(tried[-1].level, peak, True, True, ratio)
                    tried.append(fits)
                    records = partial
                if not tried[-1].fits:  # the last that fits is the choice (its records are kept): name it last
                    chosen = next(i for i in range(len(tried) - 1, -1, -1) if tried[i].fits)
                    tried.append(tried.pop(chosen))
            break
    asked = getattr(options.config.stepfx, "memory_budget_gib", budget / GIB)
    lines = [f"{t.name}: predicted peak {format_bytes(t.peak)}" + ("" if t.fits else " (over the budget)") for t in tried]
    lines += notes
    if not tried[-1].fits:
        best = min(tried, key=lambda t: t.peak)
        raise ConfigError(config_path, f"{asked:g} GiB cannot be met on rank {options.rank}: the smallest "
                          f"predicted peak is {format_bytes(best.peak)} ({best.name}); tried "
                          + "; ".join(lines), value=asked, expected=f">= {best.peak / GIB:.6g}")
    summary = (f"budget {asked:g} GiB: {tried[-1].name} (predicted peak {format_bytes(tried[-1].peak)}); "
               f"tried " + "; ".join(lines))
    record = PassRecord(len(records), "plan_memory", records[-1].graph, False, time.perf_counter() - start, summary)
    return [*records, record]
