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

Under ZeRO-3, once offloading all of Adam's state fits, smaller ratios are
tried (0.5, 0.25: DeepSpeed's partial offload) and the least that fits is
kept: less host work a step.

When ``zero_optimization.stage`` is "auto", the stage is a candidate too
(0-3 over two or more data-parallel ranks; over one rank sharding saves
nothing, so 0, and 2 for the offload): the
(stage, level) pairs are tried in the order of what they add to a step
(``STAGE_COST`` + ``LEVEL_COST``). The ranks take the highest stage any of
them chose (the api does, before its pre-flight) and, where that is not
stage 0, capture once more with that stage's state layout.

``stepfx.host_memory_budget_gib`` bounds what offloaded state may take in
host memory: a candidate over it is rejected (and named so in explain());
under ZeRO-3 smaller offload ratios are tried at that level first, then
more recomputation (which makes room on the device for a smaller ratio).
A host budget no candidate meets is a ConfigError naming it and the least
host memory a device-fitting candidate needed.

Last, under ZeRO-3 (configured, or "auto" over two or more ranks): the
parameters' pieces on the host too (``offload_param``, with the optimizer
offload where the optimizer allows it), fetched ahead of each use.
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

__all__ = ["CANDIDATES", "PLANNED_CHOICE_KEY", "Tried", "host_budget_bytes", "memory_budget_bytes", "plan_memory",
           "planned_stage", "stage_candidates"]
# options.extra: a Tried the planner chose in an earlier round (the api's first capture, when it chose the ZeRO
# stage): tried first, and kept if it fits
PLANNED_CHOICE_KEY = "planned_choice"

CANDIDATES = ("none", *LEVELS)
GIB = 2**30


@dataclass(frozen=True)
class Tried:
    level: str
    peak: int  # predicted peak bytes on this rank
    fits: bool
    offload: bool = False
    ratio: float = 1.0
    stage: int | None = None  # the ZeRO stage the planner chose (None: the config's)
    params: bool = False  # the parameters' pieces offloaded too (stage 3)
    host: int = 0  # predicted bytes held in host memory (offloaded state)
    over_host: bool = False  # fits the device budget, not stepfx.host_memory_budget_gib

    def line(self) -> str:
        host = f", host {format_bytes(self.host)}" if self.host else ""
        why = "" if self.fits else " (over the host budget)" if self.over_host else " (over the budget)"
        return f"{self.name}: predicted peak {format_bytes(self.peak)}{host}{why}"

    @property
    def name(self) -> str:
        return (f"ZeRO stage {self.stage}, " if self.stage is not None else "") + f"recompute {self.level!r}" + \
            (" + optimizer offload" if self.offload else "") + (" + parameter offload" if self.params else "") + \
            (f" (ratio {self.ratio:g})" if self.offload and self.ratio < 1 else "")


def memory_budget_bytes(config) -> int | None:
    gib = getattr(getattr(config, "stepfx", None), "memory_budget_gib", None)
    return None if gib is None else int(gib * GIB)


def host_budget_bytes(config) -> int | None:
    """``stepfx.host_memory_budget_gib`` in bytes: what offloaded state may take in host memory (per rank)."""
    gib = getattr(getattr(config, "stepfx", None), "host_memory_budget_gib", None)
    return None if gib is None else int(gib * GIB)


RATIOS = (0.5, 0.25)  # under ZeRO-3, once offloading everything fits: the least that still fits (less host work)
# What each choice adds to a step, as a rough fraction of its time, to order the candidates when the planner
# also chooses the ZeRO stage: stages 1 and 2 move what stage 0's all-reduce moves (a reduce-scatter and an
# all-gather); stage 3 gathers every parameter twice more (1.5x the bytes; mostly overlapped with compute);
# recomputation adds its share of the forward (all: one more forward, about a third of the step's FLOPs).
# Offloading comes after all of them (the host update: 0.96 s against a 0.13 s step for the 1.3B GPT).
STAGE_COST = {0: 0.0, 1: 0.01, 2: 0.02, 3: 0.15}
LEVEL_COST = {"none": 0.0, "cheap": 0.03, "matmuls": 0.25, "all": 0.33}


def planned_stage(config) -> bool:
    """Whether the planner chooses the ZeRO stage: ``zero_optimization.stage`` is "auto"."""
    zero = getattr(config, "zero_optimization", None)
    return zero is not None and not isinstance(zero.stage, int)


def stage_candidates(options: PassOptions) -> tuple[int, ...]:
    """The stages the planner may choose: sharding over one data-parallel rank saves nothing (stage 0, and
    stage 2 for the optimizer offload, which needs ZeRO)."""
    return (0,) if options.world_size <= 1 else (0, 1, 2, 3)


def _with_offload(config, ratio: float = 1.0):
    """``config`` with Adam's state offloaded to the host (``ratio`` of it), or None when it has no room for that
    (no ZeRO, or offload already configured)."""
    zero = getattr(config, "zero_optimization", None)
    if zero is None or not isinstance(zero.stage, int) or zero.stage < 1 or zero.offload_optimizer is not None:
        return None
    block = OffloadConfig(device="cpu", pin_memory=True, ratio=ratio)
    return dataclasses.replace(config, zero_optimization=dataclasses.replace(zero, offload_optimizer=block))


def _with_param_offload(config):
    """``config`` with ZeRO-3's parameter pieces at rest on the host (``offload_param: {device: cpu}``)."""
    zero = config.zero_optimization
    block = OffloadConfig(device="cpu", pin_memory=True)
    return dataclasses.replace(config, zero_optimization=dataclasses.replace(zero, offload_param=block))


def _candidates(options: PassOptions) -> list[tuple[int | None, str]]:
    """(stage, level) in the order of what they add to a step (the config's stage: None)."""
    if not planned_stage(options.config):
        return [(None, level) for level in CANDIDATES]
    pairs = [(stage, level) for stage in stage_candidates(options) for level in CANDIDATES]
    return sorted(pairs, key=lambda p: (STAGE_COST[p[0]] + LEVEL_COST[p[1]], p[0]))


def plan_memory(run: Callable[[PassOptions], list[PassRecord]], options: PassOptions, budget: int,
                *, config_path: str = "stepfx.memory_budget_gib") -> tuple[list[PassRecord], Tried]:
    """Run the pipeline (``run(options)``) per candidate until one's predicted
    peak fits ``budget`` bytes; the chosen run's records, with a record
    ``plan_memory`` saying what was tried, and the choice. When the config's
    ZeRO stage is "auto" the stage is a candidate too (:func:`stage_candidates`),
    the candidates ordered by what they add to a step (``STAGE_COST``,
    ``LEVEL_COST``)."""
    from ...config.auto import at_stage

    start = time.perf_counter()
    tried: list[Tried] = []
    notes: list[str] = []
    records = None
    planned = planned_stage(options.config)
    if planned:  # the optimizer offload needs ZeRO: stage 2 (and 3 for a partial offload) where sharding helps
        stages = [s for s in stage_candidates(options) if s >= 2] or [2]
        offload_configs = [(s, _with_offload(at_stage(options.config, s))) for s in stages]
    else:
        offload_configs = [(None, _with_offload(options.config))]
    offload_configs = [(s, c) for s, c in offload_configs if c is not None]

    def attempt(config, level):
        return run(PassOptions(config=config, world_size=options.world_size, rank=options.rank,
                               device_type=options.device_type, group_name=options.group_name,
                               extra={**(options.extra or {}), RECOMPUTE_LEVEL_KEY: level},
                               tp_size=options.tp_size, tp_rank=options.tp_rank, tp_group_name=options.tp_group_name))

    host_budget = host_budget_bytes(options.config)

    def judged(level, est, offload, ratio=1.0, stage=None, params=False) -> Tried:
        host = est.host + est.host_transient  # the copies speculated host updates make count while they live
        over_host = host_budget is not None and host > host_budget
        return Tried(level, est.peak, est.peak <= budget and not over_host, offload, ratio, stage, params, host,
                     over_host and est.peak <= budget)

    def search(pairs, config_of, offload: bool, params: bool = False) -> bool:
        nonlocal records
        for stage, level in pairs:
            candidate = attempt(config_of(stage), level)
            tried.append(judged(level, estimate_memory(candidate[-1].graph), offload, stage=stage, params=params))
            records = candidate
            if tried[-1].fits or tried[-1].over_host:  # more recomputation would not bring the host's bytes down
                return tried[-1].fits
        return False

    def offload_search(stage, config) -> bool:
        """The levels with the optimizer offloaded: the first whose device peak fits, then (stage 3) the least
        ratio that still fits; where the host budget is exceeded, smaller ratios at that level, then more
        recomputation (which makes room on the device for a smaller ratio)."""
        nonlocal records
        base = options.config if stage is None else at_stage(options.config, stage)
        partial_ok = config.zero_optimization.stage == 3  # DeepSpeed's partial offload: stage 3 only
        for level in CANDIDATES:
            candidate = attempt(config, level)
            tried.append(judged(level, estimate_memory(candidate[-1].graph), True, stage=stage))
            if tried[-1].peak > budget:
                continue
            fitted = tried[-1].fits
            if fitted:
                records = candidate
            if partial_ok and (fitted or tried[-1].over_host):
                for ratio in RATIOS:  # less offloaded: less host work and memory, more device memory
                    partial = attempt(_with_offload(base, ratio), level)
                    tried.append(judged(level, estimate_memory(partial[-1].graph), True, ratio, stage))
                    if tried[-1].peak > budget:
                        break
                    if tried[-1].fits:
                        records, fitted = partial, True
            if fitted:
                if not tried[-1].fits:  # the last that fits is the choice (its records are kept): name it last
                    chosen = next(i for i in range(len(tried) - 1, -1, -1) if tried[i].fits)
                    tried.append(tried.pop(chosen))
                return True
            if not partial_ok and tried[-1].over_host:
                return False  # more recomputation would not bring the host's bytes down
        return False

    hint = (options.extra or {}).get(PLANNED_CHOICE_KEY)
    fitted = False
    if hint is not None and not planned:  # the earlier round's choice at the stage it chose
        config = options.config
        if hint.offload:
            config = _with_offload(config, hint.ratio) or config
        if hint.params and config.zero_optimization.offload_param is None:
            config = _with_param_offload(config)
        candidate = attempt(config, hint.level)
        again = judged(hint.level, estimate_memory(candidate[-1].graph), hint.offload, hint.ratio, None, hint.params)
        if again.fits:
            tried.append(again)
            records, fitted = candidate, True
    if not fitted:
        fitted = search(_candidates(options), lambda s: options.config if s is None else at_stage(options.config, s),
                        False)
    for stage, config in ([] if fitted else offload_configs):
        try:
            fitted = offload_search(stage, config)
        except ConfigError as exc:
            notes.append(f"optimizer offload not possible: {exc}")
            break
        if fitted:
            break
    if not fitted:  # last: ZeRO-3's pieces on the host too (ZeRO-Infinity), fetched ahead of each use
        stage = 3 if planned and 3 in stage_candidates(options) else None
        base = at_stage(options.config, 3) if stage == 3 else options.config
        zero = getattr(base, "zero_optimization", None)
        if zero is not None and zero.stage == 3 and zero.offload_param is None:
            with_optimizer = _with_offload(base) if not notes else None
            config = _with_param_offload(with_optimizer or base)
            try:
                fitted = search([(stage, level) for level in CANDIDATES], lambda s, c=config: c,
                                config.zero_optimization.offload_optimizer is not None, True)
            except ConfigError as exc:
                notes.append(f"parameter offload not possible: {exc}")
    asked = getattr(options.config.stepfx, "memory_budget_gib", budget / GIB)
    lines = [t.line() for t in tried] + notes
    if not tried[-1].fits:
        if any(t.over_host for t in tried):  # the device budget was met, only with more host memory than allowed
            host_asked = options.config.stepfx.host_memory_budget_gib
            least = min((t for t in tried if t.over_host), key=lambda t: t.host)
            raise ConfigError("stepfx.host_memory_budget_gib", f"{host_asked:g} GiB of host memory cannot hold what "
                              f"fitting {asked:g} GiB on the device needs on rank {options.rank}: the least is "
                              f"{format_bytes(least.host)} ({least.name}); tried " + "; ".join(lines),
                              value=host_asked, expected=f">= {least.host / GIB:.6g}")
        best = min(tried, key=lambda t: t.peak)
        raise ConfigError(config_path, f"{asked:g} GiB cannot be met on rank {options.rank}: the smallest "
                          f"predicted peak is {format_bytes(best.peak)} ({best.name}); tried "
                          + "; ".join(lines), value=asked, expected=f">= {best.peak / GIB:.6g}")
    summary = (f"budget {asked:g} GiB: {tried[-1].name} (predicted peak {format_bytes(tried[-1].peak)}); "
               f"tried " + "; ".join(lines))
    record = PassRecord(len(records), "plan_memory", records[-1].graph, False, time.perf_counter() - start, summary)
    return [*records, record], tried[-1]
