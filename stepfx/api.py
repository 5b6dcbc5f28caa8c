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
from .config import AUTO, Config, load_config, resolve_zero_auto
from .errors import ExecutionError
from .graph import Role, StepGraph, TensorSpec
from .graph.layout import LAYOUT_KEY, Sharding
from .passes import PIPELINE, PassManager, PassOptions, PassRecord, dump_records
from .runtime import (
    DataParallel,
    LocalExecutor,
    ModuleBinding,
    RankStore,
    collective_fingerprint,
    data_parallel,
    gather_sharded_params,
    gather_sharded_state,
    preflight,
)

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
    held: dict = field(default_factory=dict)  # what the rank holds instead of the user's objects

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
        self._optimizer: torch.optim.Optimizer | None = None
        self._dp: DataParallel | None = None
        self._store = RankStore()  # what this rank holds for the user's objects (ZeRO)

    # -- calling --------------------------------------------------------------
    def __call__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *args, **kwargs) -> Any:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"{self.__name__}: the first argument must be the nn.Module being trained, got {type(model).__name__}"
            )
        if self._model is not None and (model is not self._model or optimizer is not self._optimizer) and self._store.tensors:
            raise ValueError(
                f"{self.__name__} holds sharded state of another model/optimizer; use one decorated step per model"
            )
        self._calls += 1
        if self._dp is None:
            self.config = _resolve_model_sizes(self.config, model)
            self._dp = data_parallel(_device_type(list(model.parameters()) + list(model.buffers())))
        elif self._dp.active and self._dp.group is None:
            raise ExecutionError(f"{self.__name__}: an earlier step failed and aborted stepfx's data-parallel group; restart the job")
        key = fingerprint(model, optimizer, args, kwargs, held=self._store.held)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._compile(key, model, optimizer, args, kwargs)
        else:
            self._plans.move_to_end(key)
        batch = [x for x in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(x, torch.Tensor)]
        result = plan.executor.run(batch)
        if plan.runs == 0:
            self._store.held.update({k: v for k, v in plan.held.items() if k not in self._store.held})
        plan.runs += 1
        self._last = plan
        self._model, self._optimizer = model, optimizer
        return result

    def _compile(self, key, model, optimizer, args, kwargs) -> Plan:
        if self._last is not None:
            log.info("stepfx: re-capturing %s (call %d): %s", self.__name__, self._calls, describe_change(self._last.key, key))
        dp = self._dp
        error: BaseException | None = None
        plan = None
        try:
            plan = self._build_plan(key, model, optimizer, args, kwargs)
        except Exception as exc:  # every rank learns of it in the pre-flight
            error = exc
        preflight(dp, collective_fingerprint(plan.graph) if plan else None, error)
        self._plans[key] = plan
        options = self.config.stepfx
        while len(self._plans) > max(1, options.cache_size):
            old_key, old = self._plans.popitem(last=False)
            log.warning(
                "stepfx: %s keeps at most %d captured variants (stepfx.cache_size); dropped the one from call %d",
                self.__name__, options.cache_size, old.created_at_call,
            )
        log.info(
            "stepfx: captured %s (call %d): %d ops, capture %.2fs, passes %.2fs",
            self.__name__, self._calls, plan.graph.count_ops(), plan.capture_seconds, plan.passes_seconds,
        )
        if self.dump_dir:
            suffix = f"_rank{dp.rank}" if dp.active else ""
            dump_records(plan.records, os.path.join(self.dump_dir, f"variant{len(self._plans) - 1:02d}_call{self._calls}{suffix}"))
        return plan

    def _build_plan(self, key, model, optimizer, args, kwargs) -> Plan:
        options = self.config.stepfx
        dp = self._dp
        start = time.perf_counter()
        inputs = collect_inputs(model, optimizer, args, kwargs, held=self._store.held)
        captured = capture_step(self.fn, model, optimizer, args, kwargs, inputs=inputs)
        capture_seconds = time.perf_counter() - start
        first = PassRecord(0, "capture", captured, True, capture_seconds, f"{captured.count_ops()} ops captured")
        # the model's own device (under ZeRO-3 its tensors are empty but keep
        # their device); the learning rate and step counters are CPU scalars
        device_type = _device_type(list(model.parameters()) + list(model.buffers()) + inputs.values)
        manager = PassManager(PIPELINE, disable=options.disable, verify=options.verify, dump_dir=None)
        pass_options = PassOptions(
            config=self.config, world_size=dp.world_size, rank=dp.rank, device_type=device_type, group_name=dp.group_name
        )
        start = time.perf_counter()
        records = manager.run(captured, pass_options, first=first)
        passes_seconds = time.perf_counter() - start
        final = records[-1].graph
        executor = LocalExecutor(final, ModuleBinding(final.signature, model, optimizer, self._store), dp)
        plan = Plan(key, records, executor, capture_seconds, passes_seconds, self._calls, device_type)
        plan.held = _held_specs(captured, final)
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

    def model_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The whole model state (parameters and buffers) by the module's
        own ``state_dict`` keys.

        Under ZeRO-3 the parameters exist only as pieces spread over the
        ranks: this gathers them, so it is a collective — every rank must
        call it. ``rank0_only=True`` returns the dict on rank 0 and an empty
        dict elsewhere (all ranks still take part in the gather). Stages 0-2
        keep whole parameters in the user's module, which this reads."""
        if self._model is None:
            raise RuntimeError(f"{self.__name__} has not been called yet")
        gathered = self._gather_params()
        names = {id(p): n for n, p in self._model.named_parameters()}
        state = {}
        for key, value in self._model.state_dict(keep_vars=True).items():
            name = names.get(id(value))
            state[key] = (gathered[name] if name in gathered else value).detach()
        if rank0_only and self._dp is not None and self._dp.rank != 0:
            return {}
        return state

    def sync_model(self) -> None:
        """Write whole parameters back into the user's module (ZeRO-3 keeps
        them as pieces; between steps the module's parameters are empty, so
        using the module fails loudly instead of computing with stale
        values). A collective: every rank must call it. The next step
        empties them again."""
        if self._model is None:
            raise RuntimeError(f"{self.__name__} has not been called yet")
        params = dict(self._model.named_parameters())
        for name, value in self._gather_params().items():
            params[name].data = value

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Parameter name -> {state key -> whole tensor}: the optimizer's
        state, wherever it lives. Under ZeRO stages 1-3 the ranks hold it in
        pieces and this gathers it (a collective: every rank must call it);
        otherwise it reads the user's optimizer."""
        if self._model is None:
            raise RuntimeError(f"{self.__name__} has not been called yet")
        names = {id(p): n for n, p in self._model.named_parameters()}
        out: dict[str, dict[str, torch.Tensor]] = {}
        if self._optimizer is not None:
            for p, state in self._optimizer.state.items():
                tensors = {k: v.detach() for k, v in state.items() if isinstance(v, torch.Tensor)}
                if tensors and id(p) in names:
                    out[names[id(p)]] = tensors
        layout = self.plan.graph.signature.extra.get(LAYOUT_KEY)
        if layout is not None:
            for name, state in gather_sharded_state(layout, self._store, self._dp).items():
                out.setdefault(name, {}).update(state)
        return out

    def _gather_params(self) -> dict[str, torch.Tensor]:
        layout = self.plan.graph.signature.extra.get(LAYOUT_KEY)
        if layout is None or not any(b.sharding is Sharding.PARAMETERS for b in layout.buckets):
            return {}
        return gather_sharded_params(layout, self._store, self._dp)


def _hidden_size(model: torch.nn.Module) -> int | None:
    """The model's hidden size, as HF's DeepSpeed integration reads it
    (``config.hidden_size``, or the largest of ``config.hidden_sizes``);
    for other modules, the most common input width of its Linear layers."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "hidden_size", None):
        return int(cfg.hidden_size)
    if getattr(cfg, "hidden_sizes", None):
        return int(max(cfg.hidden_sizes))
    widths = collections.Counter(m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    return widths.most_common(1)[0][0] if widths else None


def _resolve_model_sizes(config: Config, model: torch.nn.Module) -> Config:
    """ZeRO's "auto" bucket sizes come from the model (HF's rules)."""
    zero = config.zero_optimization
    keys = ("stage", "reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold")
    if not any(getattr(zero, k) is AUTO for k in keys):
        return config
    resolved = resolve_zero_auto(config, hidden_size=_hidden_size(model))
    log.info("stepfx: resolved ZeRO 'auto' values from the model: %s", {k: getattr(resolved.zero_optimization, k) for k in keys})
    return resolved


def _held_specs(captured: StepGraph, final: StepGraph) -> dict:
    """``(role, name, key) -> TensorSpec`` of every whole tensor the rank
    keeps (in pieces, or whole) instead of the user's objects after this
    plan runs: all optimizer state of parameters in sharded buckets, and the
    parameters themselves under ZeRO-3. Shapes come from the captured
    (unsharded) graph, so later captures see the same whole tensors."""
    layout = final.signature.extra.get(LAYOUT_KEY)
    if layout is None:
        return {}
    whole: dict[tuple, TensorSpec] = {}
    gm = captured.gm
    outs = [v for v in gm.graph.nodes if v.op == "output"][0].args[0]
    for slot, node in [(n.meta["slot"], n) for n in gm.graph.nodes if n.op == "placeholder"] + list(zip(captured.signature.outputs, outs)):
        val = node.meta.get("val") if hasattr(node, "meta") else None
        if isinstance(val, torch.Tensor):
            whole[(slot.role, slot.name, slot.key)] = TensorSpec.of(val)
    held = {}
    for bucket, p in layout.params():
        if bucket.sharding is Sharding.NONE:
            continue
        for (role, name, key), spec in whole.items():
            if name == p.name and role is Role.OPTIMIZER_STATE:
                held[(role, name, key)] = spec
        if bucket.sharding is Sharding.PARAMETERS:
            held[(Role.PARAM, p.name, None)] = whole[(Role.PARAM, p.name, None)]
    return held


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
