"""The public face: ``stepfx.parallelize``.

``parallelize(config)(train_step)`` returns a :class:`ParallelStep`. Its
first call captures the step, runs the pass pipeline and binds an executor
(a *plan*); later calls reuse the plan. A call whose inputs differ from what
a plan was captured for (shapes, dtypes, structure, optimizer state,
hyperparameters, train/eval mode) gets its own plan — never a stale graph.
Plans live in a small LRU cache (``stepfx.cache_size``); every capture and
eviction is logged with the reason.
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from .capture import capture_step, collect_inputs
from .capture.fingerprint import describe_change, fingerprint
from .config import Config, load_config
from .graph import Role, StepGraph
from .passes import PIPELINE, PassManager, PassOptions, PassRecord, dump_records
from .runtime import LocalExecutor, ModuleBinding

__all__ = ["parallelize", "ParallelStep", "Plan", "DUMP_ENV"]

log = logging.getLogger("stepfx")

DUMP_ENV = "STEPFX_DUMP_DIR"


@dataclass
class Plan:
    """One captured-and-compiled variant of the step."""

    key: tuple
    records: list[PassRecord]
    executor: LocalExecutor
    capture_seconds: float
    passes_seconds: float
    created_at_call: int
    device_type: str
    runs: int = field(default=0)

    @property
    def graph(self) -> StepGraph:
        return self.records[-1].graph

    @property
    def captured(self) -> StepGraph:
        return self.records[0].graph


class ParallelStep:
    """A compiled training step; call it like the function it wraps."""

    def __init__(self, fn: Callable, config: Config, *, dump_dir: str | None = None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.config = config
        self.dump_dir = dump_dir
        self._plans: collections.OrderedDict[tuple, Plan] = collections.OrderedDict()
        self._calls = 0
        self._last: Plan | None = None
        self._model: torch.nn.Module | None = None

    # -- calling --------------------------------------------------------------
    def __call__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *args, **kwargs) -> Any:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"{self.__name__}: the first argument must be the nn.Module being trained, got {type(model).__name__}"
            )
        self._calls += 1
        key = fingerprint(model, optimizer, args, kwargs)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._compile(key, model, optimizer, args, kwargs)
        else:
            self._plans.move_to_end(key)
        batch = [x for x in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(x, torch.Tensor)]
        result = plan.executor.run(batch)
        plan.runs += 1
        self._last = plan
        self._model = model
        return result

    def _compile(self, key, model, optimizer, args, kwargs) -> Plan:
        if self._last is not None:
            log.info("stepfx: re-capturing %s (call %d): %s", self.__name__, self._calls, describe_change(self._last.key, key))
        options = self.config.stepfx
        start = time.perf_counter()
        inputs = collect_inputs(model, optimizer, args, kwargs)
        captured = capture_step(self.fn, model, optimizer, args, kwargs, inputs=inputs)
        capture_seconds = time.perf_counter() - start
        first = PassRecord(0, "capture", captured, True, capture_seconds, f"{captured.count_ops()} ops captured")
        device_type = _device_type(inputs.values)
        manager = PassManager(PIPELINE, disable=options.disable, verify=options.verify, dump_dir=None)
        start = time.perf_counter()
        records = manager.run(captured, PassOptions(config=self.config, device_type=device_type), first=first)
        passes_seconds = time.perf_counter() - start
        final = records[-1].graph
        executor = LocalExecutor(final, ModuleBinding(final.signature, model, optimizer))
        plan = Plan(key, records, executor, capture_seconds, passes_seconds, self._calls, device_type)
        self._plans[key] = plan
        while len(self._plans) > max(1, options.cache_size):
            old_key, old = self._plans.popitem(last=False)
            log.warning(
                "stepfx: %s keeps at most %d captured variants (stepfx.cache_size); dropped the one from call %d",
                self.__name__, options.cache_size, old.created_at_call,
            )
        log.info(
            "stepfx: captured %s (call %d): %d ops, capture %.2fs, passes %.2fs",
            self.__name__, self._calls, final.count_ops(), capture_seconds, passes_seconds,
        )
        if self.dump_dir:
            dump_records(records, os.path.join(self.dump_dir, f"variant{len(self._plans) - 1:02d}_call{self._calls}"))
        return plan

    # -- inspection -----------------------------------------------------------
    @property
    def plan(self) -> Plan:
        if self._last is None:
            raise RuntimeError(f"{self.__name__} has not been called yet: nothing is captured")
        return self._last

    @property
    def plans(self) -> list[Plan]:
        return list(self._plans.values())

    @property
    def graphs(self) -> dict[str, StepGraph]:
        """Pass name -> graph after that pass, for the most recently run plan
        (``"capture"`` first)."""
        return {r.name: r.graph for r in self.plan.records}

    def explain(self) -> str:
        from .explain import explain_plan

        return explain_plan(self, self.plan)

    def dump(self, directory: str) -> list[str]:
        """Write ``NN_<pass>.py`` for every pass of the latest plan."""
        return dump_records(self.plan.records, directory)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 model state (parameters and buffers) by the
        module's own state_dict keys. While nothing is sharded this reads
        the live module."""
        if self._model is None:
            raise RuntimeError(f"{self.__name__} has not been called yet")
        return {k: v.detach() for k, v in self._model.state_dict().items()}


def _device_type(values) -> str:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device.type
    return "cpu"


def parallelize(config: Any = None) -> Callable[[Callable], ParallelStep]:
    """Decorate ``def train_step(model, optimizer, *args, **kwargs)``.

    ``config`` is None, a path to a DeepSpeed-style JSON file, a dict in
    DeepSpeed's schema, or a :class:`stepfx.Config`. Setting the
    ``STEPFX_DUMP_DIR`` environment variable writes every pass's graph of
    every captured variant there.
    """
    if callable(config) and not isinstance(config, (str, os.PathLike, dict, Config)):
        raise TypeError("use @stepfx.parallelize() or @stepfx.parallelize(config), not @stepfx.parallelize")
    cfg = load_config(config)
    dump_dir = cfg.stepfx.dump_dir or os.environ.get(DUMP_ENV) or None

    def wrap(fn: Callable) -> ParallelStep:
        return ParallelStep(fn, cfg, dump_dir=dump_dir)

    return wrap
