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

import atexit
import collections
import dataclasses
import functools
import gc
import hashlib
import logging
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from . import compat
from .capture import CaptureOptions, capture_step, collect_inputs
from .capture.number_arguments import INPUT as NUMBER_INPUT
from .capture.number_arguments import as_input as number_input
from .capture.number_arguments import changed_numbers, is_number
from .capture.dynamic import BatchShapeGuard, changed_dims
from .capture.trace import UNREAD_ARGUMENTS_KEY, batch_slot_name
from .codegen import available as codegen_available
from .capture.batch_reads import NOT_READ
from .capture.batch_types import open_batch_containers
from .capture.fingerprint import describe_change, fingerprint
from .capture.optimizers import unwrapped_optimizer
from .capture.source import named_free_objects
from .capture.initial_state import create_initial_state, drop_state, stepped_params
from .passes.data_parallel.plan_zero_layout import stays_whole
from .config.auto import at_stage
from .config.implicit import fill_auto_clipping, implicit_defaults, unapplied_settings
from .config import AUTO, Config, ConfigError, check_tensor_parallel, load_config, resolve_batch_sizes, resolve_zero_auto
from .errors import CaptureError, CaptureWarning, ExecutionError, StepfxError
from .monitor import PHASES, Monitor, dense_flops_per_token, loss_of, tokens_in
from .graph import META_PHASE, META_SOURCE, Phase, Role, StepGraph, Storage, TensorSpec
from .graph.layout import EVALUATED_LAYOUT_KEY, LAYOUT_KEY, Sharding
from .graph.accounting import estimate_memory
from .optimizer_builder import build_optimizer
from . import plan_cache
from .progress import Progress
from .runtime.emptied import hold_emptied, reading_emptied
from .passes import CLEANUP_PASSES, PIPELINE, PassManager, PassOptions, PassRecord, dump_records
from .passes.cleanup.choose_attention_kernels import FLASH_CHECK_KEY
from .passes.cleanup.unrepeat_kv_heads import GQA_OPS_KEY
from .passes.tensor_parallel.plan_tensor_parallel import HF_TP_PLAN_KEY, MODEL_TYPE_KEY
from .passes.memory.planner import PLANNED_CHOICE_KEY, host_budget_bytes, memory_budget_bytes, plan_memory, planned_stage
from .passes.memory.recompute_activations import format_bytes
from .runtime import (
    DataParallel,
    LocalExecutor,
    PoolHolder,
    ModuleBinding,
    RankStore,
    collective_fingerprint,
    data_parallel,
    gather_sharded_params,
    gather_sharded_state,
    gather_tensor_parallel,
    preflight,
)
from .runtime.distributed import (RankMismatchError, any_rank, captures_at_call, check_pipeline_batches,
                                  check_tensor_parallel_batches, rank_varying_dims)
from .runtime.carried import PieceCopy
from .schedules import build_scheduler

__all__ = ["parallelize", "ParallelStep", "Plan", "DUMP_ENV"]

log = logging.getLogger("stepfx")
# stepfx froze the collector's generations after its last capture (stepfx.freeze_gc): the next
# capture unfreezes them first
_GC_FROZEN = False
_GC_THAW_REGISTERED = False


def _thaw_gc() -> None:
    """At exit: frozen objects are skipped by the interpreter's last
    collection, and extension types report them as leaked."""
    global _GC_FROZEN
    if _GC_FROZEN:
        gc.unfreeze()
        _GC_FROZEN = False
        gc.collect()


def _register_thaw() -> None:
    global _GC_THAW_REGISTERED
    atexit.register(_thaw_gc)
    _GC_THAW_REGISTERED = True

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
    # symbolic batch sizes (stepfx.dynamic): the fingerprint without batch
    # sizes this variant serves, and the guard a call's sizes must pass
    structure: tuple | None = None
    guard: BatchShapeGuard | None = None
    batch_shapes: dict = field(default_factory=dict)  # batch slot name -> shape at capture
    dynamic_dims: dict = field(default_factory=dict)  # batch slot name -> the dims asked to be symbolic
    last_batch_shapes: list | None = None  # the batch tensors' shapes at the last run (symbolic variants)
    stepped: frozenset = frozenset()  # parameters whose optimizer state the captured step writes
    param_numels: dict = field(default_factory=dict)  # parameter name -> elements, as captured (whole)
    from_cache: bool = False  # loaded from the on-disk plan cache: capture and passes did not run
    cache_note: str = ""  # the plan cache's part in this plan (explain())
    cache_seconds: float = 0.0  # loading it from the cache, or writing it there
    first_call_seconds: float | None = None  # the call that made this plan, start to return
    planned_choice: Any = None  # the memory planner's choice (passes/memory/planner.Tried)
    collectives: list | None = None  # its pre-flight fingerprint (what a rank capturing alone is compared with)

    @property
    def graph(self) -> StepGraph:
        return self.records[-1].graph

    @property
    def captured(self) -> StepGraph | None:
        """The graph as captured (None for a plan loaded from the cache, which keeps the final graph only)."""
        return self.records[0].graph


_NOT_GIVEN: Any = object()  # __call__'s model/optimizer left out (a step called as train_step(batch))


def _is_optimizer(obj: Any) -> bool:
    """A torch optimizer, or an object that steps one as its own (a wrapper
    with ``step``, ``zero_grad`` and ``param_groups``)."""
    return isinstance(obj, torch.optim.Optimizer) or all(
        hasattr(obj, name) for name in ("step", "zero_grad", "param_groups", "state"))


def _call_shape_error(step_name: str, fn: Callable, model: Any, optimizer: Any) -> str:
    """Why a call does not have a step's shape, ``step(model, optimizer,
    *batch)``, and what to write instead (a step defined as a closure over
    its model and optimizer is the usual cause: name them)."""
    shown = lambda obj: "nothing" if obj is _NOT_GIVEN else type(obj).__name__
    if not isinstance(model, torch.nn.Module):
        what = f"the first argument must be the nn.Module being trained, got {shown(model)}"
    else:
        what = f"the second argument must be the optimizer (or None), got {shown(optimizer)}"
    free = named_free_objects(fn)
    modules = [name for name, value in free if isinstance(value, torch.nn.Module)]
    optimizers = [name for name, value in free if isinstance(value, torch.optim.Optimizer)]
    if modules or optimizers:
        reads = " and ".join(part for part in (
            f"model {', '.join(repr(n) for n in modules)}" if modules else "",
            f"optimizer {', '.join(repr(n) for n in optimizers)}" if optimizers else "") if part)
        hint = (f"; {step_name} reads {reads} from its enclosing scope: take them as its first two parameters, "
                f"def {step_name}(model, optimizer, ...), and call {step_name}({modules[0] if modules else 'model'}, "
                f"{optimizers[0] if optimizers else 'None'}, ...)")
    else:
        hint = f"; define it as def {step_name}(model, optimizer, ...) and call {step_name}(model, optimizer, ...)"
    return (f"{step_name}: a stepfx step is called as {step_name}(model, optimizer, *batch) (optimizer None where "
            f"the config's optimizer block builds it): {what}{hint}")


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
        self._micro_steps = 0  # calls so far (gradient accumulation counts micro-steps)
        self._scale_probe: tuple | None = None  # (host copy, ready event) of the loss scaler's counters
        self._scale_seen = (0, 0)  # (skipped steps, overflows at the minimum scale) already reported
        self._built_optimizer: torch.optim.Optimizer | None = None  # from the config's "optimizer" block
        self._lr_scheduler: Any = None  # from the config's "scheduler" block
        self._schedule_pending = False  # fp16: advance the scheduler once the last update's overflow flag arrives
        self._graph_pool = PoolHolder()  # the memory pool all of this step's CUDA graphs share
        self._agreed: set[tuple] = set()  # collective fingerprints every rank's pre-flight agreed on
        self._initial_state_for: Any = None  # the optimizer whose lazy state was created up front (once)
        self._described: dict = {}  # held entries _create_optimizer_state made, until the first run replaces them
        self._moved_state: dict = {}  # parameter -> optimizer state moved to the rank's held map at this call (restored if it fails)
        self._varying: dict[str, frozenset[int]] = {}  # batch dims whose sizes differed between ranks at the first call
        self._warned_constants: set[str] = set()  # arguments named by _warn_changed_constants
        # batch dict entries without tensors (an example's id or text) that no capture saw the step fetch: left
        # out of the fingerprint, so a new value or length runs the plan already made (capture/batch_reads.py)
        self._unread: frozenset[str] = frozenset()
        self._reads_reported = 0  # captures that said what they fetched (the first one sets _unread)
        self._pending_save: Any = None  # an asynchronous checkpoint save under way (checkpoint.PendingSave)
        self._save_group: Any = None  # the process group asynchronous saves run their collectives on
        self._monitor: Monitor | None = None  # logs and DeepSpeed's monitor blocks (stepfx/monitor), from the first call
        self._flops_per_token: float | None = None  # 6 x parameters, counted before ZeRO-3 empties the module
        self._window_loss: torch.Tensor | None = None  # this update's micro-step losses, summed on the device
        self._window_tokens = 0  # this update's tokens on this rank
        self._window_phases: dict[str, float] = {}  # wall_clock_breakdown: this update's seconds per phase
        # the on-disk plan cache (stepfx.cache_dir), opened by the first call (a plan built otherwise,
        # as stepfx.planning's, does without)
        self._cache = plan_cache.PlanCache(None, "not used (the step's first call opens it)")
        self._stage_owner: dict[str, int] | None = None  # pipeline: each parameter's stage, from the first capture
        self._progress = Progress(self.__name__, False)  # progress lines (rank 0, stepfx.progress), from the first call
        self._profile: Any = None  # step.profile(steps=N): the runs it measures (stepfx/report)
        self._param_sizes: dict[str, torch.Size] | None = None  # the model's parameter sizes at the first call
        # the planner's first round when it chose the ZeRO stage: (its summary, its choice)
        self._first_round: tuple[str, Any] | None = None
        self._owner: ParallelStep | None = None  # an evaluator's training step (see evaluator())
        # an evaluator's: the training step's ZeRO layout it reads the pieces with, and a digest of it (in its plans'
        # keys: a plan made for another layout never reads the pieces the training step cut anew)
        self._evaluated_layout: tuple[Any, str | None] | None = None
        # Python number arguments the captures take as inputs (paths), those that changed at this call, and those
        # that failed as inputs and stay constants (capture/number_arguments.py)
        self._numbers: frozenset[str] = frozenset()
        self._new_numbers: frozenset[str] = frozenset()
        self._constant_numbers: frozenset[str] = frozenset()

    def evaluator(self, fn: Callable) -> "ParallelStep":
        """Decorate a forward-only step over this step's model — evaluation,
        a validation loss, logits — that runs where this step keeps the
        parameters: under ZeRO-3 it all-gathers each bucket of pieces before
        its use and frees it after, as the training forward does, instead of
        ``sync_model()`` making every parameter whole on every rank (what
        DeepSpeed's engine does in ``eval()`` mode). Called as
        ``eval_step(model, None, *batch)`` after the training step's first
        call; a collective, so every rank calls it. It reads the parameters
        as the last update left them, trains nothing (a step that calls
        backward or the optimizer is refused), and leaves the training
        step's state as it was."""
        step = ParallelStep(fn, self.config, dump_dir=self.dump_dir)
        step._owner = self
        return step

    def _join_owner(self, model: torch.nn.Module, optimizer) -> None:
        """An evaluator's call: share its training step's world, config and
        held state (checked: the same model, the training step has run)."""
        owner = self._owner
        if optimizer is not None:
            raise TypeError(f"{self.__name__} is an evaluator of {owner.__name__}: it trains nothing, call it as "
                            f"{self.__name__}(model, None, *batch)")
        if owner._model is None:
            raise RuntimeError(
                f"{self.__name__} evaluates where {owner.__name__} keeps the parameters, and {owner.__name__} has "
                f"not been called yet: before its first call the module is whole, so evaluate the module itself")
        if model is not owner._model:
            raise ValueError(f"{self.__name__} evaluates {owner.__name__}'s model ({type(owner._model).__name__}); "
                             f"it was called with another module ({type(model).__name__})")
        if owner._dp.pp_size > 1 or owner._dp.tp_size > 1:
            raise ValueError(f"{self.__name__}: an evaluator runs beside data parallelism and ZeRO only, not yet beside "
                             f"{'pipeline' if owner._dp.pp_size > 1 else 'tensor'} parallelism: call "
                             f"{owner.__name__}.sync_model() on every rank and evaluate the module")
        owner._apply_delayed_update()  # the parameters as the last update left them
        layout = owner._last.graph.signature.extra.get(LAYOUT_KEY) if owner._last is not None else None
        if self._evaluated_layout is None or self._evaluated_layout[0] is not layout:
            digest = hashlib.sha1(repr(layout.buckets).encode()).hexdigest() if layout is not None else None
            self._evaluated_layout = (layout, digest)
        if self._dp is None:
            self.config, self._dp, self._store = owner.config, owner._dp, owner._store
            self._monitor = Monitor(self.config, rank=self._dp.rank, world_size=self._dp.world_size, writers=[])
            self._monitor.close()  # evaluation is not an update: nothing to log
            self._flops_per_token = owner._flops_per_token
            self._progress = Progress(self.__name__, bool(self.config.stepfx.progress) and self._dp.rank == 0)
            self._cache = plan_cache.PlanCache.open(self.config.stepfx.cache_dir)
            self._param_sizes = owner._param_sizes

    def _refuse_training(self, captured: StepGraph) -> None:
        """An evaluator writes none of its training step's state."""
        trains = next((n for n in captured.gm.graph.nodes
                       if n.meta.get(META_PHASE) in (Phase.BACKWARD, Phase.OPTIMIZER)), None)
        if trains is not None:
            what = "a backward pass" if trains.meta[META_PHASE] is Phase.BACKWARD else "an optimizer update"
            raise CaptureError(f"{self.__name__} is an evaluator of {self._owner.__name__} but runs {what} "
                               f"({trains.target}): an evaluator runs the forward only", source=trains.meta.get(META_SOURCE),
                               hint="drop backward()/optimizer.step() from it, or decorate it as a training step "
                                    "of its own model")

    # -- calling --------------------------------------------------------------
    def __call__(self, model: Any = _NOT_GIVEN, optimizer: Any = _NOT_GIVEN, *args, **kwargs) -> Any:
        started = time.perf_counter()
        if not isinstance(model, torch.nn.Module) or not (optimizer is None or _is_optimizer(optimizer)):
            raise TypeError(_call_shape_error(self.__name__, self.fn, model, optimizer))
        model = compat.unwrapped_module(model)  # torch.compile, DDP: stepfx compiles and reduces the step itself
        optimizer = unwrapped_optimizer(optimizer)  # accelerate's AcceleratedOptimizer: stepfx runs the update itself
        open_batch_containers(args, kwargs)  # BatchEncoding, dataclass batches: their tensors are the step's inputs
        if self._owner is not None:
            self._join_owner(model, optimizer)
        if self._dp is None:
            compat.refuse_fsdp_sharded(model)
            self.config = _resolve_precision(_resolve_model_sizes(self.config, model))
            self.config, clip_note = fill_auto_clipping(self.config)
            notes = implicit_defaults(self.config) + ([clip_note] if clip_note else []) + unapplied_settings(self.config)
            for note in notes:  # once: the first call
                log.warning("stepfx: %s: %s", self.__name__, note)
        if self._owner is None:  # (an evaluator builds no optimizer: its training step's config block is not its own)
            optimizer = self._config_optimizer(model, optimizer)
        if self._model is not None and (model is not self._model or optimizer is not self._optimizer):
            if self._store.holds_user_state():
                raise ValueError(
                    f"{self.__name__} holds sharded state of another model/optimizer; use one decorated step per model"
                )
            self._store.drop_carried()
        self._calls += 1
        if self._param_sizes is None:  # the whole sizes, for the message a call of the emptied module gets
            self._param_sizes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)
                                 if p.numel() > 0}
        if self._dp is None:
            device_type = _device_type(list(model.parameters()) + list(model.buffers()))
            self.config = _resolve_cuda_graphs(_resolve_codegen(self.config, device_type), device_type)
            self._dp = data_parallel(device_type, tp_size=_tensor_parallel_degree(self.config, model),
                                     pp_size=_pipeline_degree(self.config))
            self.config = _resolve_batch_sizes(self.config, self._dp.dp_size)
            # after the batch sizes (the monitor's x axis is samples), before any capture: a missing
            # tensorboard/wandb package fails here, on every rank, before any state changes
            self._monitor = Monitor(self.config, rank=self._dp.rank, world_size=self._dp.world_size)
            atexit.register(self._monitor.close)
            self._flops_per_token = dense_flops_per_token(model)
            self._progress = Progress(self.__name__, bool(self.config.stepfx.progress) and self._dp.rank == 0)
            self._cache = plan_cache.PlanCache.open(self.config.stepfx.cache_dir)
        elif self._dp.active and self._dp.group is None:
            raise ExecutionError(f"{self.__name__}: an earlier step failed and aborted stepfx's data-parallel group; restart the job")
        if self._calls == 1 and self._dp.active and self._dp.tp_size > 1:
            check_tensor_parallel_batches(self._dp, _batch_tensors(args, kwargs))
        if self._calls == 1 and self._dp.active and self._dp.pp_size > 1:
            check_pipeline_batches(self._dp, _batch_tensors(args, kwargs))
        if self._calls == 1 and self._dp.active and self.config.stepfx.dynamic == "auto":
            # one exchange at the first call: a dimension the ranks already disagree on varies
            self._varying = rank_varying_dims(self._dp, _batch_shapes(args, kwargs))
        options = self._capture_options()
        fresh = self._create_optimizer_state(model, optimizer)  # before the fingerprint: it includes the state
        try:
            self._new_numbers = frozenset()
            key = self._fingerprint(model, optimizer, args, kwargs, options)
            plan = self._plans.get(key)
            if plan is None and self._numbers_changed(key):  # the numbers become inputs: looked up as such
                key = self._fingerprint(model, optimizer, args, kwargs, options)
                plan = self._plans.get(key)
            batch = self._batch_inputs(args, kwargs)
            guarded = batch
            if self._dp.pp_size > 1:  # a pipeline's plan is captured (and guarded) on one micro-batch
                micro = _micro_batches(self.config)
                guarded = [x[: x.shape[0] // micro] if x.dim() > 0 and x.shape[0] % micro == 0 else x for x in batch]
            structure = None
            if plan is None:
                structure = self._fingerprint(model, optimizer, args, kwargs, options, batch_shapes=False)
                plan = self._fitting_dynamic_plan(structure, guarded)
            any_captures, all_capture = captures_at_call(self._dp, plan is None)
            if plan is not None and any_captures:
                self._join_capture(plan)  # another rank captures at this call: it may need this rank's program
            if plan is None:
                dims = self._dynamic_dims(structure, args, kwargs)
                plan = self._compile(key, model, optimizer, args, kwargs, options, structure=structure,
                                     dynamic_dims=dims, alone=not all_capture)
                if plan is None:  # the planner chose the ZeRO stage: this call again, with its state layout
                    if fresh:
                        self._drop_fresh_state(model, optimizer, fresh)
                        self._initial_state_for = None
                    self._calls -= 1
                    return self(model, optimizer, *args, **kwargs)
                batch = self._batch_inputs(args, kwargs)  # (a number that failed as an input is no longer one)
            self._plans.move_to_end(plan.key)
            if fresh and not options.accumulate_only and self._drop_unused_state(plan, model, optimizer, fresh):
                self._calls -= 1  # the same call, captured anew without that state
                return self(model, optimizer, *args, **kwargs)
            # (an evaluator reads the pieces as its training step cut them: never re-cuts them itself)
            resharded = (self._owner is None and self._last is not None and plan is not self._last
                         and bool(self._store.tensors) and self._reshard(self._last, plan, model, optimizer))
            self._check_loss_scale(wait=self._schedule_pending)
            first = plan.runs == 0 and plan.created_at_call == self._calls  # the call that made it: compiles now
            if first:
                self._progress_compiles(plan)
            result = plan.executor.run(batch)
        except BaseException:
            if fresh:  # the state this call created goes again: the optimizer as it was
                self._drop_fresh_state(model, optimizer, fresh)
                self._initial_state_for = None
            for p, moved in self._moved_state.items():  # and the state it had, back where it was
                optimizer.state[p] = moved
            self._moved_state.clear()
            raise
        self._moved_state.clear()
        if self._owner is None and any(p.numel() == 0 for p in model.parameters()):  # ZeRO-3: empty between steps
            hold_emptied(model, self.__name__, self._param_sizes)
        if first:
            plan.first_call_seconds = time.perf_counter() - started
            self._progress("first call done in %.1f s", plan.first_call_seconds)
        self._micro_steps += 1
        if self._monitor.active:
            self._feed_monitor(result, args, kwargs, options, optimizer, plan)
        if self._lr_scheduler is not None and not options.accumulate_only:
            if options.loss_scale:
                self._schedule_pending = True  # DeepSpeed does not advance it on a skipped step
            else:
                self._lr_scheduler.step()
        self._probe_loss_scale()
        if plan.runs == 0 or resharded:
            held = self._store.held
            # what _create_optimizer_state described and this rank does not hold becomes the plan's
            # description (a step counter of a parameter wholly on other ranks: a TensorSpec, as later)
            held.update({k: v for k, v in plan.held.items() if k not in held or held[k] is self._described.get(k)})
            self._described.clear()
            # described before the first capture but kept whole by the layout (no gradient reaches them)
            for key in [k for k in held if k[0] is Role.PARAM and k not in plan.held]:
                del held[key]
            if (plan.runs == 0 and self._dp.pp_size > 1 and self._release_other_stages(plan, model, optimizer)
                    and _same_optimizer_state(plan, held, model, optimizer)):
                # pipeline parallelism: other stages' parameters and state are described, not kept; the next
                # call's fingerprint says so, and this plan serves it
                self._serve_from_now_on(plan, model, optimizer, args, kwargs, options)
            if plan.runs == 0 and _serves_after_tensor_parallel_move(plan, held, model, optimizer):
                # tensor parallelism: this run moved the split parameters into the rank's store, which
                # describes them from now on; the next call's fingerprint says so, and this plan serves it
                self._serve_from_now_on(plan, model, optimizer, args, kwargs, options)
        plan.runs += 1
        if plan.guard is not None:
            plan.last_batch_shapes = [t.shape for t in batch]
        self._last = plan
        self._model, self._optimizer = model, optimizer
        return result

    def _serve_from_now_on(self, plan: Plan, model, optimizer, args, kwargs, options) -> None:
        """After a run that changed what the rank holds (released or moved
        state), ``plan`` serves the calls that describe the holdings anew:
        under their fingerprint, and (a variant with symbolic batch sizes)
        for every size its guard admits under their structure."""
        self._plans[self._fingerprint(model, optimizer, args, kwargs, options)] = plan
        if plan.guard is not None:
            plan.structure = self._fingerprint(model, optimizer, args, kwargs, options, batch_shapes=False)

    def _config_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
        """The optimizer the step runs: the user's, or the one the config's
        ``optimizer`` block describes (built on the first call, over the
        model's trainable parameters, as ``deepspeed.initialize`` does). The
        ``scheduler`` block's scheduler is built over it on the first call."""
        cfg = self.config
        if cfg.optimizer is not None:
            if optimizer is not None and optimizer is not self._built_optimizer:
                raise ConfigError(
                    "optimizer",
                    f"the config's optimizer block builds the optimizer ({cfg.optimizer.type}), and {self.__name__} was "
                    f"also given a {type(optimizer).__name__}; pass None as the optimizer (the built one is "
                    f"{self.__name__}.optimizer), or remove the block to use your own",
                    value=cfg.optimizer.type, expected="None passed as the step's optimizer",
                )
            if self._built_optimizer is None:
                self._built_optimizer = build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad])
            optimizer = self._built_optimizer
        if cfg.scheduler is not None:
            if optimizer is None:
                raise ConfigError(
                    "scheduler", f"schedules an optimizer, but {self.__name__} was given none and the config has no "
                    "optimizer block", value=cfg.scheduler.type, expected="an optimizer (passed, or an optimizer block)",
                )
            if self._lr_scheduler is None:
                self._lr_scheduler = build_scheduler(cfg.scheduler, optimizer)
            elif self._lr_scheduler.optimizer is not optimizer:
                raise ValueError(
                    f"{self.__name__}: the config's scheduler was built for the optimizer of the first call; "
                    "pass that same optimizer on every call"
                )
        return optimizer

    def _create_optimizer_state(self, model: torch.nn.Module, optimizer) -> list[tuple[str, tuple]]:
        """Adam's lazily created state, created before the first capture as
        its first step would (capture/initial_state.py), so that a run
        captures once. Under ZeRO 1-3 the state of parameters in sharded
        buckets goes to this rank's store as descriptions (the rank reads
        zeros for its pieces at the first run); the optimizer gets only
        that of parameters whose buckets stay whole. Returns (parameter
        name, held keys) of every parameter given state."""
        if optimizer is None or self._initial_state_for is optimizer:
            return []  # once per optimizer (a capture again without unused state must not create it again)
        self._initial_state_for = optimizer
        zero = self.config.zero_optimization
        stage = zero.stage if isinstance(zero.stage, int) and self._dp.pp_size <= 1 else 0  # pipeline: the runtime's
        persist = zero.param_persistence_threshold if isinstance(zero.param_persistence_threshold, int) else 0
        rank_holds = None
        if stage >= 1:
            def rank_holds(p):
                return not stays_whole(stage, p.numel(), p.dim(), persist)
        created, for_rank = create_initial_state(optimizer, rank_holds)
        if rank_holds is not None and not created and not for_rank:
            # state the optimizer already has (a loaded checkpoint, a resumed optimizer): the rank
            # holds that of sharded buckets from the first capture on, as it will after the first run,
            # so the second call sees the same state and does not capture again
            # (a frozen parameter's state, which Adagrad makes at construction, is read by no step: it stays)
            for p in [p for p in list(optimizer.state) if optimizer.state[p] and rank_holds(p) and p.requires_grad]:
                moved = optimizer.state.pop(p)
                self._moved_state[p] = moved
                for_rank[p] = {k: v for k, v in moved.items() if isinstance(v, torch.Tensor)}
        names = {id(p): n for n, p in model.named_parameters()}
        fresh = [(names[id(p)], ()) for p in created if id(p) in names]
        if stage == 3 and not self._store.tensors and not any(k[0] is Role.PARAM for k in self._store.held):
            # the parameters stage 3 will hold in pieces, described as the
            # rank holds them after the first run, so that run's capture is
            # also the later calls' (the module's are emptied then)
            for name, p in model.named_parameters():
                if not stays_whole(stage, p.numel(), p.dim(), persist):
                    key = (Role.PARAM, name, None)
                    self._store.held[key] = TensorSpec.of(p)
                    fresh.append((name, (key,)))
        for p, state in for_rank.items():
            if id(p) not in names:
                continue  # not the model's: capture refuses it
            keys = tuple((Role.OPTIMIZER_STATE, names[id(p)], key) for key in state)
            self._store.held.update(zip(keys, state.values()))
            self._described.update(zip(keys, state.values()))
            fresh.append((names[id(p)], keys))
        return fresh

    def _drop_fresh_state(self, model: torch.nn.Module, optimizer, fresh: list[tuple[str, tuple]],
                          names: set[str] | None = None) -> None:
        """Undo ``_create_optimizer_state`` for ``names`` (default all),
        with any pieces a failed first run already read for them."""
        params = dict(model.named_parameters())
        drop_state(optimizer, [params[n] for n, keys in fresh if not keys and (names is None or n in names)])
        dropped = {key for name, keys in fresh if names is None or name in names for key in keys}
        for key in dropped:
            self._store.held.pop(key, None)
            self._described.pop(key, None)
        for ident in [i for i in self._store.tensors if i[:3] in dropped]:
            del self._store.tensors[ident]

    def _drop_unused_state(self, plan: Plan, model: torch.nn.Module, optimizer, fresh: list[tuple[str, tuple]]) -> bool:
        """Parameters given state by ``_create_optimizer_state`` that the
        captured step does not update (the loss does not reach them) would
        have no state in eager Adam: drop it and the plan that reads it."""
        given_state = {name for name, keys in fresh if not keys or keys[0][0] is Role.OPTIMIZER_STATE}
        unused = given_state - plan.stepped
        if not unused:
            return False
        self._drop_fresh_state(model, optimizer, fresh, unused)
        self._plans.pop(plan.key, None)
        log.info("stepfx: %s: %d parameter(s) get no gradient (e.g. %s); capturing again without optimizer state for them",
                 self.__name__, len(unused), sorted(unused)[0])
        return True

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer the step updates: the config's (built on the first
        call) or the one last passed in. Under ZeRO 1-3 its state lives on
        the ranks in pieces; read it with :meth:`optimizer_state`."""
        return self._built_optimizer or self._optimizer

    @property
    def lr_scheduler(self) -> Any:
        """The scheduler built from the config's ``scheduler`` block (None
        without one). It advances once per optimizer update, not on
        accumulation-only micro-steps, and — as in DeepSpeed — not on a step
        fp16 skipped for overflow. Under fp16 it learns of the overflow
        without a sync, when the next call starts; reading this property
        settles it at once (waiting for the device)."""
        if self._schedule_pending:
            self._check_loss_scale(wait=True)
        return self._lr_scheduler

    # -- symbolic batch sizes (stepfx.dynamic) ------------------------------------
    def _fitting_dynamic_plan(self, structure: tuple, batch: list[torch.Tensor]) -> Plan | None:
        """A variant captured with symbolic batch sizes whose guard this
        call's batch passes (the most recently used first)."""
        for plan in reversed(self._plans.values()):
            if plan.guard is not None and plan.structure == structure and plan.guard.check(batch):
                return plan
        return None

    def _dynamic_dims(self, structure: tuple, args, kwargs) -> dict[str, frozenset[int]]:
        """Which batch dimensions the capture this call needs makes symbolic.

        ``stepfx.dynamic`` false: none; true: every dimension of every batch
        tensor; "auto" (torch.compile's automatic dynamic): the dimensions
        whose size differs between this call and any earlier variant on this
        rank (also one captured for another reason: the optimizer's state
        appearing after SGD's first step), and those that differed between
        ranks at the first call. A variant already captured with
        exactly these symbolic dimensions whose guard this call broke means
        the graph specialized on a size: this call gets a variant of its own
        sizes, as without symbolic sizes."""
        mode = self.config.stepfx.dynamic
        if mode is False:
            return {}
        shapes = _batch_shapes(args, kwargs)
        if mode is True:
            dims = {name: frozenset(range(len(shape))) for name, shape in shapes.items()}
        else:
            dims = {name: d for name, d in self._varying.items() if name in shapes}
            for plan in self._plans.values():  # any variant: a size seen to change is dynamic from then on
                for name, shape in shapes.items():
                    old = plan.batch_shapes.get(name)
                    before = plan.dynamic_dims.get(name, frozenset())
                    changed = changed_dims(old, shape) if old is not None else frozenset()
                    dims[name] = dims.get(name, frozenset()) | changed | before
        dims = {name: d for name, d in dims.items() if d}
        broken = any(plan.structure == structure and plan.dynamic_dims == dims for plan in self._plans.values())
        return {} if broken else dims

    def _warn_changed_constants(self, old: tuple, new: tuple) -> None:
        """A Python value among the step's arguments that changed is why this call captures again: say so once
        per argument (a step counter or a count passed as an int, an example's id or text carried in the batch
        captures at every call, the plans cache holding the last few). The elements of one list or tuple are
        named once, as that argument."""
        before = dict(old)
        for label, value in new:
            if not label.startswith("argument ") or label not in before or before[label] == value:
                continue
            was = before[label]
            if not all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], type) for v in (was, value)):
                continue  # a tensor's description: its size changed (symbolic sizes deal with that)
            if NOT_READ in (was[1], value[1]):
                continue  # an entry the step does not read (capture/batch_reads.py): not why it captures
            if NUMBER_INPUT in (was[1], value[1]):
                continue  # a number the graph takes as an input from now on (capture/number_arguments.py)
            path = label[len("argument "):]
            head = re.match(r"\[0\]\[\d+\]|\[1\]\['[^']+'\]", path)
            cut = head.end() if head else 0  # an argument itself, then the list indices inside it
            where = path[:cut] + re.sub(r"(\[\d+\])+$", "", path[cut:])
            if where in self._warned_constants:
                continue
            self._warned_constants.add(where)
            numbers = all(v[0] in (int, float) for v in (was, value))
            if numbers and path in self._constant_numbers:
                what, fix = "a Python number", ("The step's Python decides on its value (a branch, a range, a size), "
                                                "so it cannot be an input of the graph: each value needs a capture.")
            elif numbers:  # stepfx.dynamic false, a pipeline, or an int that became a float
                what, fix = "a Python number", "Pass it as a tensor (torch.tensor(value)) for one capture."
            else:
                what = f"a Python {value[0].__name__}" if value[0] is was[0] else "a Python value"
                fix = ("The step reads it (an argument itself, or an entry it fetched from a dict while traced); "
                       "values the step never fetches from a batch dict do not capture again. Pass it as a tensor, "
                       "or leave it out of what the step receives.")
            shown = [v[1] if isinstance(v[1], (int, float)) else _short(v[1]) for v in (was, value)]
            warnings.warn(
                f"stepfx: {self.__name__}: {_argument_name(where)} is {what} ({shown[0]!r}, now {shown[1]!r}); the "
                f"captured step holds it as a constant, so each new value captures the step again (the last "
                f"{self.config.stepfx.cache_size} plans are kept). {fix}", CaptureWarning, stacklevel=4)

    # -- Python numbers as inputs (capture/number_arguments.py) ------------------
    def _fingerprint(self, model, optimizer, args, kwargs, options: CaptureOptions, *, batch_shapes: bool = True) -> tuple:
        """This call's plan key (``batch_shapes=False``: its structure, which
        a variant with symbolic batch sizes serves)."""
        evaluated = (("evaluated layout", self._evaluated_layout[1]),) if self._evaluated_layout is not None else ()
        return fingerprint(model, optimizer, args, kwargs, held=self._store.held, batch_shapes=batch_shapes,
                           unread=self._unread, numbers=self._numbers) + (("capture options", options),) + evaluated

    def _numbers_changed(self, key: tuple) -> bool:
        """Python number arguments whose values differ from the last plan's
        become inputs of the captures from now on (not under ``stepfx.dynamic``
        false, nor a pipeline's micro-batches, nor where one already failed
        as an input): True when there are new ones."""
        if self._last is None or self.config.stepfx.dynamic is False or self._dp.pp_size > 1:
            return False
        new = changed_numbers(self._last.key, key) - self._constant_numbers
        if not new:
            return False
        self._numbers, self._new_numbers = self._numbers | new, new
        log.info("stepfx: %s: %s changed value; %s taken as an input of the step from now on (one more capture)",
                 self.__name__, ", ".join(_argument_name(p) for p in sorted(new)),
                 "it is" if len(new) == 1 else "they are")
        return True

    def _numbers_stay_constant(self, exc: Exception, model, optimizer, args, kwargs, options: CaptureOptions,
                               structure: tuple | None) -> tuple[tuple, tuple | None]:
        """The capture with this call's new number inputs failed (the step's
        Python decides on the value): they stay constants for good. Returns
        the key and structure to capture under instead."""
        new, self._new_numbers = self._new_numbers, frozenset()
        self._numbers -= new
        self._constant_numbers |= new
        log.warning("stepfx: %s: %s cannot be an input of the captured step (%s); each new value captures the step "
                    "again", self.__name__, ", ".join(_argument_name(p) for p in sorted(new)), str(exc).splitlines()[0])
        key = self._fingerprint(model, optimizer, args, kwargs, options)
        if self._last is not None:
            self._warn_changed_constants(self._last.key, key)
        return key, (self._fingerprint(model, optimizer, args, kwargs, options, batch_shapes=False)
                     if structure is not None else None)

    def _batch_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The graph's BATCH inputs of this call: its tensors, and its number
        arguments the plans take as inputs (as 0-d tensors), in leaf order."""
        if not self._numbers:
            return [x for x in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(x, torch.Tensor)]
        out = []
        for path, x in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif is_number(x) and pytree.keystr(path) in self._numbers:
                out.append(number_input(x))
        return out

    def _compile(self, key, model, optimizer, args, kwargs, options: CaptureOptions, *, structure: tuple | None = None,
                 dynamic_dims: dict | None = None, alone: bool = False) -> Plan:
        """Capture (or load) this call's plan. ``alone``: other ranks run
        their plans at this call (``captures_at_call``), so no exchange may
        start unless they learn of it (``_local_recapture``)."""
        global _GC_FROZEN
        if _GC_FROZEN:  # what was dropped since the last capture becomes collectable again
            gc.unfreeze()
            _GC_FROZEN = False
        if self._last is not None:
            log.info("stepfx: re-capturing %s (call %d): %s", self.__name__, self._calls, describe_change(self._last.key, key))
            self._warn_changed_constants(self._last.key, key)
        if dynamic_dims:
            log.info("stepfx: %s: capturing with symbolic batch sizes: %s", self.__name__,
                     "; ".join(f"{n} dims {sorted(d)}" for n, d in dynamic_dims.items()))
        dp = self._dp
        error: BaseException | None = None
        plan = None
        try:
            try:
                plan = self._build_plan(key, model, optimizer, args, kwargs, options, dynamic_dims=dynamic_dims,
                                        structure=structure)
            except Exception as exc:
                if not self._new_numbers:
                    raise
                # the step's Python decides something on a number that was to be an input (or a pass could not
                # take it as one): it stays a constant, as it was; an error without it is the error to report
                key, structure = self._numbers_stay_constant(exc, model, optimizer, args, kwargs, options, structure)
                plan = self._build_plan(key, model, optimizer, args, kwargs, options, dynamic_dims=dynamic_dims,
                                        structure=structure)
            if (unread := plan.graph.signature.extra.get(UNREAD_ARGUMENTS_KEY)) is not None:
                # what no capture fetched so far leaves the fingerprint: this plan serves calls that differ there
                self._unread = unread if not self._reads_reported else self._unread & unread
                self._reads_reported += 1
                plan.key = key = self._fingerprint(model, optimizer, args, kwargs, options)
                if structure is not None:
                    structure = self._fingerprint(model, optimizer, args, kwargs, options, batch_shapes=False)
            plan.structure, plan.dynamic_dims = structure, dict(dynamic_dims or {})
            plan.batch_shapes = _batch_shapes(args, kwargs)
            if plan.guard is not None:  # serves every size its guard admits, not just this call's
                plan.key = key = structure + (("dynamic", _frozen_dims(dynamic_dims)),)
        except Exception as exc:  # every rank learns of it in the pre-flight
            error = exc
        if planned_stage(self.config) and self._choose_stage(plan):
            return None  # the caller captures again with the chosen stage
        tp_group = self._dp.tp_group_name if self._dp.tp_size > 1 else None
        collectives = (collective_fingerprint(plan.graph, tp_group) + _pipeline_fingerprint(plan.executor)
                       if plan else None)
        if not (alone and self._local_recapture(collectives, error)):
            preflight(dp, collectives, error, note=f"captured the step at call {self._calls}" + (
                f" ({describe_change(self._last.key, key)})" if self._last is not None else ""))
            if collectives is not None:
                self._agreed.add(tuple(collectives))
        plan.collectives = collectives
        self._plans[key] = plan
        options = self.config.stepfx
        while len(self._plans) > max(1, options.cache_size):
            old_key, old = self._plans.popitem(last=False)
            log.warning(
                "stepfx: %s keeps at most %d captured variants (stepfx.cache_size); dropped the one from call %d",
                self.__name__, options.cache_size, old.created_at_call,
            )
        if plan.from_cache:
            log.info("stepfx: %s (call %d): plan cache: %s", self.__name__, self._calls, plan.cache_note)
        else:
            log.info(
                "stepfx: captured %s (call %d): %d ops, capture %.2fs, passes %.2fs",
                self.__name__, self._calls, plan.graph.count_ops(), plan.capture_seconds, plan.passes_seconds,
            )
        if self.dump_dir:
            suffix = f"_rank{dp.rank}" if dp.active else ""
            dump_records(plan.records, os.path.join(self.dump_dir, f"variant{len(self._plans) - 1:02d}_call{self._calls}{suffix}"))
        if options.freeze_gc:  # the plans' graphs stay out of the full collections steps trigger
            gc.freeze()
            _GC_FROZEN = True
            if not _GC_THAW_REGISTERED:
                _register_thaw()
        return plan

    def _choose_stage(self, plan: Plan | None) -> bool:
        """ZeRO stage "auto": the memory planner chose a stage on each rank
        (their peaks differ where pieces are uneven); every rank takes the
        highest. The config gets it. True when the step must be captured
        again: the capture assumed stage 0's state layout (the optimizer's
        state in the optimizer, parameters whole), which the chosen stage
        changes, or this rank chose another stage. When any rank failed,
        nothing changes: the pre-flight reports it."""
        mine = plan.planned_choice.stage if plan is not None and plan.planned_choice is not None else None
        everyone = [mine]
        if self._dp.active:
            everyone = [None] * self._dp.world_size
            dist.all_gather_object(everyone, mine, group=self._dp.group)
        if any(s is None for s in everyone):
            return False
        stage = max(everyone)
        self.config = at_stage(self.config, stage)
        if stage == 0 and mine == 0:
            return False
        log.info("stepfx: %s: the memory planner chose ZeRO stage %d (ranks: %s); capturing again with it",
                 self.__name__, stage, everyone)
        summary = next(r.summary for r in plan.records if r.name == "plan_memory") + \
            (f"; ZeRO stage {stage} taken (the highest any rank chose: {everyone})" if self._dp.active else "")
        self._first_round = (summary, plan.planned_choice)
        return True

    def _local_recapture(self, collectives: list[str] | None, error: BaseException | None) -> bool:
        """Whether this capture, which this rank makes alone (the others run
        their plans at this call), goes on without a pre-flight: its
        collectives are ones the ranks already agreed on. One more flag
        exchange says whether any capturing rank needs one (new collectives,
        or a failed capture); then every rank joins it, those that did not
        capture with the program they hold (``_join_capture``), and all
        raise together, naming what differs."""
        new = error is not None or collectives is None or tuple(collectives) not in self._agreed
        return not any_rank(self._dp, new)

    def _join_capture(self, plan: Plan) -> None:
        """This rank runs ``plan`` at a call where another rank captures: the
        second flag exchange of ``_local_recapture``, and the pre-flight
        with this rank's program where a capturing rank asked for one."""
        if any_rank(self._dp, False):
            preflight(self._dp, plan.collectives, None,
                      note=f"runs the step captured at call {plan.created_at_call} (no capture at call {self._calls})")

    def _build_plan(self, key, model, optimizer, args, kwargs, capture: CaptureOptions, *,
                    dynamic_dims: dict | None = None, structure: tuple | None = None) -> Plan:
        """Capture and pass this call's plan, or load it from the on-disk
        plan cache (stepfx/plan_cache), which a fresh capture writes."""
        options = self.config.stepfx
        dp = self._dp
        start = time.perf_counter()
        if dp.pp_size > 1:  # the pipeline runs the captured step once per micro-batch
            args, kwargs = _first_micro_batch(args, kwargs, _micro_batches(self.config))
        inputs = collect_inputs(model, optimizer, args, kwargs, held=self._store.held, options=capture,
                                numbers=self._numbers)
        # the model's own device (under ZeRO-3 its tensors are empty but keep
        # their device); the learning rate and step counters are CPU scalars
        device_type = _device_type(list(model.parameters()) + list(model.buffers()) + inputs.values)
        batch_shapes = _batch_shapes(args, kwargs)
        lookup = plan_cache.look_up(
            self._cache, structure + (("dynamic", _frozen_dims(dynamic_dims)),) if dynamic_dims else key, fn=self.fn,
            model=model, optimizer=optimizer, config=self.config, mesh=plan_cache.mesh_of(dp),
            device=_device_of(model, device_type), dynamic_dims=dynamic_dims,
            batch_shapes=batch_shapes, batch=[v for s, v in zip(inputs.slots, inputs.values) if s.role is Role.BATCH])
        if planned_stage(self.config):  # the planner's first round (stage 0's state layout) is never kept
            lookup = plan_cache.Lookup(None, None, "not used while the memory planner chooses the ZeRO stage")
        if lookup.entry is not None:
            return self._plan_from_cache(lookup, key, model, optimizer, device_type, start)
        self._progress("capturing the step (plan cache: %s)...", lookup.note)
        start = time.perf_counter()
        captured = capture_step(self.fn, model, optimizer, args, kwargs, inputs=inputs, options=capture,
                                dynamic_dims=dynamic_dims)
        capture_seconds = time.perf_counter() - start
        if self._owner is not None:
            self._refuse_training(captured)
        first = PassRecord(0, "capture", captured, True, capture_seconds, f"{captured.count_ops()} ops captured")
        manager = PassManager(PIPELINE, disable=options.disable, verify=options.verify, dump_dir=None)
        pass_options = PassOptions(
            config=self.config, world_size=dp.dp_size, rank=dp.dp_rank, device_type=device_type,
            group_name=dp.dp_group_name, tp_size=dp.tp_size, tp_rank=dp.tp_rank, tp_group_name=dp.tp_group_name,
            extra={GQA_OPS_KEY: compat.attention_ops_taking_grouped_kv(_device_of(model, device_type)),
                   FLASH_CHECK_KEY: compat.flash_attention_takes(_device_of(model, device_type)),
                   HF_TP_PLAN_KEY: _hf_tp_plan(model) if dp.tp_size > 1 else (),
                   MODEL_TYPE_KEY: getattr(getattr(model, "config", None), "model_type", None),
                   **({EVALUATED_LAYOUT_KEY: self._evaluated_layout[0]} if self._evaluated_layout is not None else {}),
                   **_pipeline_extra(self.config, dp, model, self._stage_owner)},
        )
        self._progress("captured in %.1f s (%s ops); running %d passes...", capture_seconds,
                       f"{captured.count_ops():,}", manager.count_running(
                           dataclasses.replace(pass_options, config=at_stage(self.config, 0))
                           if planned_stage(self.config) else pass_options))
        start = time.perf_counter()
        budget = memory_budget_bytes(self.config)
        if budget is None:
            records = manager.run(captured, pass_options, first=first)
        else:  # the memory planner: the pipeline per candidate until the predicted peak fits
            first_round = self._first_round
            if first_round is not None:  # the second capture, with the stage the first one chose: its choice first
                self._first_round = None
                pass_options = dataclasses.replace(pass_options, extra={**pass_options.extra,
                                                                         PLANNED_CHOICE_KEY: first_round[1]})
            # the cleanups once, each candidate's pipeline resuming after them (they read nothing the candidates vary)
            cleaned = manager.leading(CLEANUP_PASSES).run(captured, pass_options, first=first)[1:]
            records, chosen = plan_memory(lambda opts: manager.run(captured, opts, first=first, resume=cleaned),
                                          pass_options, budget)
            if first_round is not None:
                records[-1] = dataclasses.replace(records[-1], summary=(
                    f"{first_round[0]}; captured again with that stage's state layout: {chosen.name} (predicted peak "
                    f"{format_bytes(chosen.peak)})"))
        passes_seconds = time.perf_counter() - start
        final = records[-1].graph
        host_budget = host_budget_bytes(self.config)
        if budget is None and host_budget is not None:  # the configured offload, checked before it allocates
            est = estimate_memory(final)
            held = est.host + est.host_transient
            if held > host_budget:
                copies = (f" ({format_bytes(est.host_transient)} of it copies made by speculated updates until the norm "
                          "is known: stepfx.host_update_speculation false makes none)" if est.host_transient else "")
                raise ConfigError("stepfx.host_memory_budget_gib", f"the offloaded state needs "
                                  f"{format_bytes(held)} of host memory on rank {dp.rank} (zero_optimization's "
                                  f"offload blocks){copies}, more than the budget",
                                  value=self.config.stepfx.host_memory_budget_gib,
                                  expected=f">= {held / 2**30:.6g}, or less offloaded (offload_optimizer.ratio)")
        executor = self._executor(final, model, optimizer, device_type)
        plan = Plan(key, records, executor, capture_seconds, passes_seconds, self._calls, device_type)
        if budget is not None:
            plan.planned_choice = chosen
        plan.held = _held_specs(captured, final)
        plan.stepped = stepped_params(captured)
        plan.param_numels = plan_cache.param_numels(captured)
        if dynamic_dims:
            batch = {n.meta["slot"].name: n.meta["val"] for n in captured.gm.graph.nodes
                     if n.op == "placeholder" and n.meta["slot"].role is Role.BATCH}
            plan.guard = BatchShapeGuard.of(batch)
            if plan.guard is None:  # every symbolic size became a constant: this variant serves one size
                guards = BatchShapeGuard.specialized(batch)
                log.warning("stepfx: %s: the capture with symbolic batch sizes specialized every one of them, so each "
                            "new size is captured again; the guards: %s", self.__name__,
                            "; ".join(f"{e} at {w}" for e, w in guards[:4]) or "none recorded")
        plan.cache_note = lookup.note
        if lookup.key is not None:
            start = time.perf_counter()
            note = plan_cache.save(self._cache, lookup.key, captured=captured, final=final, records=records,
                                   held=plan.held, stepped=plan.stepped, guard=plan.guard, batch_shapes=batch_shapes,
                                   dynamic=bool(dynamic_dims), capture_seconds=capture_seconds,
                                   passes_seconds=passes_seconds)
            plan.cache_seconds = time.perf_counter() - start
            plan.cache_note = f"{note} under key {lookup.key.short} in {plan.cache_seconds:.1f} s"
        self._progress("passes done in %.1f s (%s ops); plan cache: %s", passes_seconds, f"{final.count_ops():,}",
                       plan.cache_note)
        return plan

    def _executor(self, final: StepGraph, model, optimizer, device_type: str):
        """What runs the final graph on this rank: the graph itself, or under
        pipeline parallelism this rank's stage programs in the schedule's order."""
        binding = ModuleBinding(final.signature, model, optimizer, self._store)
        if self._dp.pp_size > 1:
            from .passes.pipeline.stage_programs import split_programs
            from .runtime.pipeline import PipelineExecutor, zero1_shares
            from .runtime.pipeline_schedule import build as build_schedule, validate

            pipe = self.config.stepfx.pipeline
            name = pipe.schedule if pipe is not None else "1f1b"
            virtual = pipe.virtual_stages if pipe is not None else 1
            micro = _micro_batches(self.config)
            schedule = build_schedule(name, self._dp.pp_size, micro, virtual=virtual)
            validate(schedule)
            zero_config = self.config.zero_optimization
            zero = zero_config.stage if isinstance(zero_config.stage, int) else 0
            shares = names = None
            if zero >= 1 and self._dp.dp_size > 1:
                if zero == 3:  # runtime/pipeline_params.py
                    from .runtime.pipeline_params import partitionable

                    persist = zero_config.param_persistence_threshold
                    names = partitionable(final, persist if isinstance(persist, int) else 0)
                shares = zero1_shares(final, self._dp.dp_size, first=names or frozenset())
            keep = (lambda name: shares.get(name, 0) == self._dp.dp_rank) if shares is not None else None
            programs = split_programs(final, split_backward=schedule.split_backward, keep_update=keep,
                                      shard_gradients=zero >= 2)
            if self._stage_owner is None:  # later captures keep these stages (partition_stages)
                self._stage_owner = dict(programs.plan.owner)
            partitioned = {}
            if names:
                from .runtime.pipeline_params import partitioned_parameters

                partitioned = partitioned_parameters(final, names, shares, self._dp, schedule.stage_rank)
            prefetch = zero_config.prefetch_bucket_size
            return PipelineExecutor(final, binding, self._dp, programs, schedule, micro, update_shares=shares,
                                    shard_gradients=zero >= 2, partitioned=partitioned,
                                    prefetch_elements=prefetch if isinstance(prefetch, int) else 50_000_000,
                                    pipe_partitioned=self.config.pipeline.pipe_partitioned,
                                    grad_partitioned=self.config.pipeline.grad_partitioned)
        return LocalExecutor(final, binding, self._dp, cuda_graphs=bool(self.config.stepfx.cuda_graphs),
                             device_type=device_type, graph_pool=self._graph_pool,
                             time_phases=self.config.wall_clock_breakdown)

    def _plan_from_cache(self, lookup, key, model, optimizer, device_type: str, start: float) -> Plan:
        """The plan of a cache entry: its final graph bound to this call's
        model, optimizer and rank store; its regions registered again."""
        from .codegen.regions import restore_regions

        entry = lookup.entry
        restore_regions(entry.regions)
        final = entry.graph
        executor = self._executor(final, model, optimizer, device_type)
        last = len(entry.records) - 1
        records = [PassRecord(i, name, final if n == last else None, changed, seconds, summary, skipped)
                   for n, (i, name, changed, seconds, summary, skipped) in enumerate(entry.records)]
        plan = Plan(key, records, executor, entry.capture_seconds, entry.passes_seconds, self._calls, device_type)
        plan.held, plan.stepped, plan.param_numels, plan.guard = entry.held, entry.stepped, entry.param_numels, entry.guard
        plan.from_cache = True
        plan.cache_seconds = time.perf_counter() - start
        plan.cache_note = (f"loaded from {entry.loaded_from} (key {lookup.key.short}) in {plan.cache_seconds:.1f} s; "
                           f"capture and passes skipped (they took {entry.capture_seconds + entry.passes_seconds:.1f} s)")
        self._progress("loaded the plan from the cache in %.1f s (key %s, %s ops): capture and passes skipped",
                       plan.cache_seconds, lookup.key.short, f"{final.count_ops():,}")
        return plan

    def _progress_compiles(self, plan: Plan) -> None:
        """The progress line before a plan's first run, when it compiles."""
        from .codegen.graph_ops import KERNELS_OF, kernels_of
        from .codegen.regions import REGIONS, regions_of
        from .codegen.registry import interpreting

        regions = [k for k in regions_of(plan.graph.gm) if REGIONS[k].compiled is None]
        kernels = set() if interpreting() else {
            name for n in plan.graph.gm.graph.nodes if n.op == "call_function" and n.target in KERNELS_OF
            for name in kernels_of(n.target)}
        parts = ([f"{len(regions)} inductor region(s)"] if regions else []) + (
            [f"stepfx's Triton kernels ({len(kernels)})"] if kernels else [])
        if parts:
            kept = "; kept on disk for the next run" if self._cache.enabled else ""
            self._progress("first run: compiling %s%s...", " and ".join(parts), kept)

    def _capture_options(self) -> CaptureOptions:
        """What the config asks of this call's capture (gradient accumulation:
        every k-th call updates, the others only accumulate)."""
        cfg = self.config
        fp16 = cfg.fp16.enabled is True
        compute = torch.float16 if fp16 else torch.bfloat16 if cfg.bf16.enabled is True else None
        k = cfg.gradient_accumulation_steps if isinstance(cfg.gradient_accumulation_steps, int) else 1
        pipelined = self._dp is not None and self._dp.pp_size > 1  # one call runs every micro-batch
        # floating batch tensors in the compute dtype, as the Hugging Face Trainer feeds DeepSpeed
        # (stepfx.cast_inputs; None: whenever bf16/fp16 is on, fp16's own auto_cast included)
        cast = cfg.stepfx.cast_inputs
        return CaptureOptions(
            compute_dtype=compute,
            cast_inputs=compute is not None and (cast if cast is not None else True),
            cast_buffers=cfg.stepfx.cast_buffers,
            loss_scale=fp16,
            grad_accumulation=k,
            accumulate_only=k > 1 and not pipelined and self._micro_steps % k != k - 1,
        )

    # -- fp16 loss scaling: observed without a host sync per step -----------------
    def _probe_loss_scale(self) -> None:
        """Start copying the loss scaler's counters to the host (non-blocking);
        the next call looks at them (``_check_loss_scale``)."""
        counters = [self._store.tensors.get((Role.RUNTIME_STATE, n, None, None, Storage.RANK, None)) for n in ("skipped_steps", "overflows_at_min_scale")]
        if any(c is None for c in counters):
            if self._schedule_pending:  # no loss scaler in this plan: nothing was skipped
                self._schedule_pending = False
                self._lr_scheduler.step()
            return
        device = counters[0].device
        stacked = torch.stack(counters)
        if device.type == "cuda":
            host = torch.empty(2, dtype=stacked.dtype, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = stacked.clone(), None
        self._scale_probe = (host, event)

    def _check_loss_scale(self, *, wait: bool = False) -> None:
        """Read the counters ``_probe_loss_scale`` sent; ``wait`` waits for
        them (a pending scheduler step needs to know whether the last update
        was skipped)."""
        if self._scale_probe is None:
            return
        host, event = self._scale_probe
        if event is not None and not event.query():
            if not wait:
                return  # not there yet: look again next call
            event.synchronize()
        self._scale_probe = None
        skipped, at_min = (int(v) for v in host.tolist())
        if self._schedule_pending:
            self._schedule_pending = False
            if skipped == self._scale_seen[0]:
                self._lr_scheduler.step()
        if skipped > self._scale_seen[0]:
            log.warning("stepfx: %s skipped %d step(s) on fp16 gradient overflow (%d in all)", self.__name__, skipped - self._scale_seen[0], skipped)
        self._scale_seen = (skipped, at_min)
        if at_min:
            raise StepfxError(
                f"{self.__name__}: the fp16 loss scale is at fp16.min_loss_scale and gradients still overflow "
                "(DeepSpeed stops here too); lower the learning rate, use bf16, or lower min_loss_scale"
            )

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (reads the device: a sync)."""
        t = self._store.tensors.get((Role.RUNTIME_STATE, "loss_scale", None, None, Storage.RANK, None))
        return None if t is None else float(t.item())

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far because gradients overflowed (reads the device)."""
        t = self._store.tensors.get((Role.RUNTIME_STATE, "skipped_steps", None, None, Storage.RANK, None))
        return 0 if t is None else int(t.item())

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
        """Write ``NN_<pass>.py`` for every pass of the latest plan, and the
        HTML report's data (``report.json``: ``stepfx report-html DIRECTORY``)."""
        from .report import save_report_data

        return [*dump_records(self.plan.records, directory), save_report_data(self, directory)]

    def report(self, path: str, *, all_ranks: bool = False) -> str | None:
        """Write the HTML report of the latest plan to ``path`` (stepfx/report);
        ``all_ranks=True``: every rank calls it, rank 0 writes all ranks' page."""
        from .report import write_report

        return write_report(self, path, all_ranks=all_ranks)

    def profile(self, steps: int = 1):
        """Measure the next ``steps`` runs of the latest plan; the report then shows the measured
        timeline. Under data parallelism a collective (every rank calls it): the link's bus bandwidth
        per kind of collective is measured on the step's group too."""
        from .report import profile_step

        self._profile = profile_step(self, steps)
        return self._profile

    def _apply_delayed_update(self) -> None:
        """``stepfx.delayed_parameter_update``: the last step's host update is
        still running; wait for it and install what it made, so what is read
        next (or the next step) sees the latest parameters; under
        ``stepfx.host_update_across_steps``, wait for the update the last step
        left running (it writes in place)."""
        from .runtime.host_optimizer import flush_delayed, settle_across_steps

        flush_delayed(self._store)
        settle_across_steps()

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
        self._apply_delayed_update()
        gathered = self._gather_params()
        names = {id(p): n for n, p in self._model.named_parameters()}
        state = {}
        with reading_emptied():
            entries = self._model.state_dict(keep_vars=True)
        for key, value in entries.items():
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
        self._apply_delayed_update()
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
        self._apply_delayed_update()
        names = {id(p): n for n, p in self._model.named_parameters()}
        out: dict[str, dict[str, torch.Tensor]] = {}
        if self._optimizer is not None:
            for p, state in self._optimizer.state.items():
                tensors = {k: v.detach() for k, v in state.items() if isinstance(v, torch.Tensor)}
                if tensors and id(p) in names:
                    out[names[id(p)]] = tensors
        layout = self.plan.graph.signature.extra.get(LAYOUT_KEY)
        held = gather_sharded_state(layout, self._store, self._dp) if layout is not None else {}
        if self._dp.tp_size > 1:  # whole tensors from the Megatron shards (ZeRO's pieces gathered first)
            held.update(gather_tensor_parallel(self.plan.graph.signature, self._store, self._dp,
                                               Role.OPTIMIZER_STATE, local=held))
        for name, state in held.items():
            out.setdefault(name, {}).update(state)
        for (name, key), value in self._gather_from_stages(Role.OPTIMIZER_STATE, local=out).items():  # stages'
            out.setdefault(name, {})[key] = value
        return out

    def _feed_monitor(self, result, args, kwargs, options: CaptureOptions, optimizer, plan: Plan) -> None:
        """Sum the loss and tokens of every micro-step; after an update, hand
        the monitor that update's values. Device values stay on the device:
        the monitor reads them at print steps."""
        loss = loss_of(result)
        if loss is not None:
            loss = loss.detach().to(torch.float32, copy=True)  # a copy: the plan may reuse its output buffers
            self._window_loss = loss if self._window_loss is None else self._window_loss + loss
        self._window_tokens += tokens_in(args, kwargs) or 0
        for kind, seconds in (plan.executor.phase_seconds or {}).items():  # wall_clock_breakdown
            if kind in PHASES:
                self._window_phases[kind] = self._window_phases.get(kind, 0.0) + seconds
        if options.accumulate_only:
            return
        state = self._store.tensors
        self._monitor.after_update(
            self.updates,
            # (a pipelined call already returns the mean over its micro-batches)
            loss=None if self._window_loss is None else self._window_loss / (
                1 if self._dp.pp_size > 1 else options.grad_accumulation),
            lr=optimizer.param_groups[0]["lr"] if optimizer is not None else None,
            # every data-parallel rank's batch assumed this size (tensor- and pipeline-parallel ranks share one)
            tokens=self._window_tokens * self._dp.dp_size or None,
            peak_memory_bytes=torch.cuda.max_memory_allocated() if plan.device_type == "cuda" else None,
            loss_scale=state.get((Role.RUNTIME_STATE, "loss_scale", None, None, Storage.RANK, None)),
            skipped_steps=state.get((Role.RUNTIME_STATE, "skipped_steps", None, None, Storage.RANK, None)),
            flops_per_token=self._flops_per_token,
            phase_seconds=self._window_phases or None,
        )
        self._window_loss, self._window_tokens, self._window_phases = None, 0, {}

    # -- checkpoints (stepfx/checkpoint) ------------------------------------------
    @property
    def updates(self) -> int:
        """Optimizer updates so far (DeepSpeed's ``global_steps``)."""
        cfg = self.config
        k = cfg.gradient_accumulation_steps if isinstance(cfg.gradient_accumulation_steps, int) else 1
        if self._dp is not None and self._dp.pp_size > 1:
            return self._micro_steps  # one call runs every micro-batch
        return self._micro_steps // k

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None, *,
                        async_save: bool = False):
        """Save the run where each rank writes what it holds (DeepSpeed's
        ``save_checkpoint``; see stepfx/checkpoint/checkpoint.py). A
        collective. ``tag`` defaults to ``global_step<updates>``."""
        self._apply_delayed_update()
        from .checkpoint.checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag, client_state, async_save=async_save)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **kwargs) -> tuple[str, dict]:
        """Resume from a checkpoint of any world size, ZeRO stage or
        precision; returns ``(path, client_state)``. A collective."""
        self._apply_delayed_update()
        from .checkpoint.checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag, **kwargs)

    def save_pretrained(self, directory: str, *, dtype=None, max_shard_size: int | str = "5GB") -> list[str]:
        """The whole model as Hugging Face safetensors (+ config.json for
        transformers models); a collective, rank 0 writes
        (stepfx/checkpoint/export.py)."""
        self._apply_delayed_update()
        from .checkpoint.export import save_pretrained

        return save_pretrained(self, directory, dtype=dtype, max_shard_size=max_shard_size)

    def wait_checkpoint(self) -> str | None:
        """Wait for an asynchronous save to complete; its path (None if none was under way)."""
        pending, self._pending_save = self._pending_save, None
        return pending.wait() if pending is not None else None

    def _checkpoint_group(self) -> Any:
        """A gloo group of its own for asynchronous saves: their collectives
        run on a background thread and must not interleave with the step's."""
        if self._dp is None or not self._dp.active:
            return None
        if self._save_group is None:
            import torch.distributed as dist

            self._save_group = dist.new_group(backend="gloo")
        return self._save_group

    def _reshard(self, old: Plan, new: Plan, model: torch.nn.Module, optimizer) -> bool:
        """``new`` shards differently from ``old`` (which parameters train
        changed, so the buckets did): every piece this rank holds under the
        old layout is gathered back into the user's module and optimizer,
        and the new plan cuts its own pieces from there on its first run. A
        collective: every rank changed the same parameters (the pre-flight
        check compares the plans' inputs)."""
        old_layout = old.graph.signature.extra.get(LAYOUT_KEY)
        new_layout = new.graph.signature.extra.get(LAYOUT_KEY)
        if old_layout is None or new_layout is None or old_layout.buckets == new_layout.buckets:
            return False
        self._apply_delayed_update()
        pending = [k for k in self._store.tensors if k[0] is Role.GRAD]
        if pending:
            raise ExecutionError(
                f"{self.__name__}: which parameters train changed in the middle of gradient accumulation "
                f"(this rank holds accumulated gradients, e.g. of {pending[0][1]}); change requires_grad at an update"
            )
        params = gather_sharded_params(old_layout, self._store, self._dp)
        states = gather_sharded_state(old_layout, self._store, self._dp)
        named = dict(model.named_parameters())
        for name, value in params.items():
            named[name].data = value
        if optimizer is not None:
            for name, state in states.items():
                optimizer.state[named[name]].update(state)
        for k in [k for k in self._store.tensors if k[0] in (Role.PARAM, Role.OPTIMIZER_STATE)]:
            del self._store.tensors[k]
        for k in [k for k, c in self._store.carried.items() if isinstance(c, PieceCopy)]:  # the old pieces' copies
            self._store.tensors.pop(k, None)
            del self._store.carried[k]
        for k in [k for k in self._store.held if k[0] in (Role.PARAM, Role.OPTIMIZER_STATE)]:
            del self._store.held[k]
        log.info("stepfx: %s: the ZeRO layout changed (parameters that train changed); pieces re-cut from whole values",
                 self.__name__)
        return True

    def _release_other_stages(self, plan: Plan, model: torch.nn.Module, optimizer) -> bool:
        """Under pipeline parallelism, after a plan's first run: the
        parameters (and their optimizer state) that no program of this rank
        reads are described in the rank's store and emptied in the user's
        objects, so a rank keeps only its stages' part of the model.
        ``model_state_dict()``/``sync_model()``/``optimizer_state()`` bring
        them back (collectives). Returns whether anything was released."""
        unread = plan.executor.unread_inputs()
        params = dict(model.named_parameters())
        held = self._store.held
        placeholders = [n for n in plan.graph.gm.graph.nodes if n.op == "placeholder"]
        released = False
        for i in sorted(unread):
            slot = plan.graph.signature.inputs[i]
            if slot.storage is not Storage.USER or slot.name not in params:
                continue
            p = params[slot.name]
            val = placeholders[i].meta.get("val")  # the whole tensor as captured (already released: empty now)
            if not isinstance(val, torch.Tensor):
                continue
            if slot.role is Role.PARAM:
                spec = TensorSpec(tuple(val.shape), p.dtype, p.device)
                held[(Role.PARAM, slot.name, None)] = plan.held[(Role.PARAM, slot.name, None)] = spec
                if p.numel() > 0:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                released = True
            elif slot.role is Role.OPTIMIZER_STATE and optimizer is not None and slot.key != "step":
                value = optimizer.state.get(p, {}).get(slot.key)
                if isinstance(value, torch.Tensor):
                    spec = TensorSpec(tuple(val.shape), value.dtype, value.device)
                    held[(Role.OPTIMIZER_STATE, slot.name, slot.key)] = plan.held[
                        (Role.OPTIMIZER_STATE, slot.name, slot.key)] = spec
                    if value.numel() > 0:
                        optimizer.state[p][slot.key] = torch.empty(0, dtype=value.dtype, device=value.device)
                    released = True
        return released

    def _gather_from_stages(self, role: Role, local: dict | None = None) -> dict[tuple[str, str | None], torch.Tensor]:
        """Pipeline parallelism: every tensor of ``role`` that this rank does
        not keep, broadcast over all ranks from one that does (a parameter:
        the first rank of its stage, or under ZeRO-3 the data-parallel rank
        that keeps it; optimizer state: the data-parallel rank that updates
        it under ZeRO-1). A collective: every rank walks the same list."""
        import torch.distributed as dist

        executor = self.plan.executor
        programs = getattr(executor, "programs", None)
        if programs is None or self._dp.pp_size <= 1:
            return {}
        owner, shares = programs.plan.owner, executor.update_shares or {}
        per_stage = self._dp.world_size // self._dp.pp_size
        params = dict(self._model.named_parameters())
        out = {}
        for slot in self.plan.graph.signature.inputs:
            if slot.role is not role or slot.name not in owner or (role is Role.OPTIMIZER_STATE and slot.key == "step"):
                continue
            p = params[slot.name]
            src = executor.schedule.stage_rank[owner[slot.name]] * per_stage
            # ``local``: whole tensors this rank has already (gathered over its tensor-parallel group)
            whole = (local or {}).get(slot.name)
            keeper = executor.partitioned_keeper(slot.name) if role is Role.PARAM else None
            if keeper is not None:  # ZeRO-3: one data-parallel rank of the stage keeps it (that of TP rank 0)
                src = keeper - self._dp.tp_rank
            if role is Role.OPTIMIZER_STATE:
                src += shares.get(slot.name, 0) * self._dp.tp_size
                have = (whole or {}).get(slot.key)
                if have is None and self._optimizer is not None:
                    have = self._optimizer.state.get(p, {}).get(slot.key)
                if have is None:
                    continue
            else:
                have = whole if whole is not None else p.detach()
            spec = self._store.held.get((role, slot.name, slot.key))
            mine = self._dp.rank == src
            value = have.contiguous() if mine else torch.empty(
                spec.shape if spec is not None else have.shape, dtype=have.dtype, device=have.device)
            dist.broadcast(value, src=src, group=self._dp.group)
            if not mine:
                out[(slot.name, slot.key)] = value
        return out

    def _gather_params(self) -> dict[str, torch.Tensor]:
        out = {}
        # ZeRO-3: the pieces over the data-parallel group first (under tensor parallelism they make this
        # rank's Megatron shard of a split parameter, gathered over the TP group next)
        layout = self.plan.graph.signature.extra.get(LAYOUT_KEY)
        zero = {}
        if layout is not None and any(b.sharding is Sharding.PARAMETERS for b in layout.buckets):
            zero = gather_sharded_params(layout, self._store, self._dp)
        if self._dp is not None and self._dp.tp_size > 1:  # the Megatron shards of split parameters
            split = gather_tensor_parallel(self.plan.graph.signature, self._store, self._dp, Role.PARAM,
                                           local={name: {None: value} for name, value in zero.items()})
            out.update({name: keys[None] for name, keys in split.items()})
            zero = {name: value for name, value in zero.items() if name not in split}
        # pipeline stages: what other stages keep, from them (whole, after their tensor-parallel gather)
        out.update({name: value for (name, _), value in self._gather_from_stages(Role.PARAM, local=out).items()})
        return {**out, **zero}


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


def _serves_after_tensor_parallel_move(plan: Plan, held: dict, model, optimizer) -> bool:
    """Whether a plan that split parameters over a tensor-parallel group
    also serves the next call, whose inputs the rank's store now describes:
    the same optimizer state exists as at its capture (not so when the run
    created state lazily, e.g. SGD's momentum buffers). The state is read
    off the captured step: under ZeRO the final one lacks the state of
    parameters whose piece is on other ranks."""
    if not any(s.split is not None for s in plan.graph.signature.inputs):
        return False
    return _same_optimizer_state(plan, held, model, optimizer)


def _same_optimizer_state(plan: Plan, held: dict, model, optimizer) -> bool:
    """The optimizer state a plan was captured with is what the next call
    brings (no state created lazily by this run)."""
    names = {id(p): n for n, p in model.named_parameters()}
    read = (plan.captured or plan.graph).signature.inputs
    before = {(s.name, s.key) for s in read if s.role is Role.OPTIMIZER_STATE}
    after = {(n, k) for (r, n, k) in held if r is Role.OPTIMIZER_STATE}
    if optimizer is not None:
        after |= {(names.get(id(p)), k) for p, state in optimizer.state.items() for k in state}
    return before == after


def _tensor_parallel_degree(config: Config, model: torch.nn.Module) -> int:
    """``tensor_parallel.autotp_size`` checked against torchrun's world and
    the model's head counts; what it does not compose with yet is refused
    by name. It composes with gradient clipping, bf16/fp16 and ZeRO stages
    0-2 over the data-parallel axis."""
    import torch.distributed as dist

    tp_config = config.tensor_parallel
    if tp_config.degree == 1:
        return 1
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    heads = {key: getattr(cfg, attr, None) for key, attr in (
        ("num_attention_heads", "num_attention_heads"), ("num_key_value_heads", "num_key_value_heads"),
        ("num_attention_heads", "n_heads"), ("num_attention_heads", "n_head")) if getattr(cfg, attr, None)}
    tp = check_tensor_parallel(tp_config, world, heads)
    return tp


def _pipeline_degree(config: Config) -> int:
    """The number of pipeline ranks (1: off), checked against the world."""
    import torch.distributed as dist

    from .config.pipeline import pipeline_degree

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    return max(1, pipeline_degree(config.pipeline, config.stepfx.pipeline, world, config.tensor_parallel.degree))


def _pipeline_fingerprint(executor) -> list[str]:
    from .runtime.pipeline import pipeline_fingerprint

    return pipeline_fingerprint(executor)


def _micro_batches(config: Config) -> int:
    """Micro-batches per call under pipeline parallelism: DeepSpeed's gradient accumulation steps."""
    k = config.gradient_accumulation_steps
    return k if isinstance(k, int) and k > 0 else 1


def _first_micro_batch(args: tuple, kwargs: dict, micro: int) -> tuple[tuple, dict]:
    """The call's arguments with every batch tensor cut to its first
    micro-batch (the rows along dim 0, which must split evenly)."""
    def cut(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.shape[0] % micro:
                raise ConfigError("gradient_accumulation_steps", f"a batch tensor of shape {tuple(x.shape)} does not split "
                                  f"into {micro} micro-batches along dim 0", value=micro,
                                  expected=f"a divisor of {x.shape[0]}")
            return x[: x.shape[0] // micro]
        return x
    return pytree.tree_map(cut, (tuple(args), dict(kwargs)))


def _pipeline_extra(config: Config, dp, model: torch.nn.Module, pinned: dict | None = None) -> dict:
    """PassOptions.extra for partition_stages: the number of stages, the
    module classes above each parameter (``type:<regex>`` partitions) and
    the owners of the step's first capture (``pinned``: a rank released
    other stages' parameters after its first run; a later capture keeps
    the stages)."""
    if dp.pp_size <= 1:
        return {}
    from .passes.pipeline.partition_stages import MODULE_CLASSES_KEY, PINNED_OWNER_KEY, STAGES_KEY, module_classes

    pipe = config.stepfx.pipeline
    virtual = pipe.virtual_stages if pipe is not None else 1
    return {STAGES_KEY: dp.pp_size * virtual, MODULE_CLASSES_KEY: module_classes(model),
            **({PINNED_OWNER_KEY: dict(pinned)} if pinned else {})}


def _hf_tp_plan(model: torch.nn.Module) -> tuple:
    """A Hugging Face model's own tensor-parallel plan (``_tp_plan``: module
    patterns, from its config's ``base_model_tp_plan``) as items, or ()."""
    plan = getattr(model, "_tp_plan", None)
    return tuple((str(k), str(v)) for k, v in plan.items()) if isinstance(plan, dict) else ()


def _resolve_precision(config: Config) -> Config:
    """fp16/bf16 "enabled": "auto" take HF's default (off) — HF fills them
    from its training arguments, which stepfx does not have."""
    changes = {}
    for name in ("fp16", "bf16"):
        block = getattr(config, name)
        if block.enabled is AUTO:
            changes[name] = dataclasses.replace(block, enabled=False)
            log.info("stepfx: %s.enabled is 'auto'; off (pass true to enable)", name)
    if config.fp16.enabled is True and config.bf16.enabled is True:
        raise ConfigError("bf16.enabled", "fp16 and bf16 cannot both be enabled", value=True, expected="one of them")
    return dataclasses.replace(config, **changes) if changes else config


def _resolve_codegen(config: Config, device_type: str) -> Config:
    """``stepfx.codegen``: None becomes on for CUDA (when Triton can run), off
    elsewhere; an explicit true where the kernels cannot run is an error."""
    options = config.stepfx
    ok, why = codegen_available(device_type)
    if options.codegen is True and not ok:
        raise ConfigError("stepfx.codegen", f"is true, but stepfx's Triton kernels cannot run on {device_type}: {why}",
                          value=True, expected="false (or run on CUDA)")
    if options.codegen is None:
        enabled = device_type == "cuda" and ok
        log.info("stepfx: codegen %s (stepfx.codegen unset; on for CUDA)", "on" if enabled else "off")
        return dataclasses.replace(config, stepfx=dataclasses.replace(options, codegen=enabled))
    return config


def _resolve_cuda_graphs(config: Config, device_type: str) -> Config:
    """``stepfx.cuda_graphs``: None is off (on 2xH200 replay measured no
    faster than launching at 1.3B: benchmarks/README.md); true where there
    are no CUDA graphs is an error."""
    from .runtime import graphs

    options = config.stepfx
    ok = device_type == "cuda" or (graphs.EMULATE and device_type == "cpu")
    if options.cuda_graphs is True and not ok:
        raise ConfigError("stepfx.cuda_graphs", f"is true, but the step runs on {device_type}: CUDA graphs need CUDA",
                          value=True, expected="false (or run on CUDA)")
    if options.cuda_graphs is None:
        return dataclasses.replace(config, stepfx=dataclasses.replace(options, cuda_graphs=False))
    return config


def _resolve_batch_sizes(config: Config, world_size: int) -> Config:
    """DeepSpeed's batch-size rules, when the config gives a batch size:
    the missing number is derived (gradient accumulation steps included) and
    train = micro x accumulation x ranks is checked, with DeepSpeed's errors."""
    if not any(isinstance(v, int) for v in (config.train_batch_size, config.train_micro_batch_size_per_gpu)):
        return config
    train, micro, gas = resolve_batch_sizes(config, world_size)
    return dataclasses.replace(config, train_batch_size=train, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)


def _resolve_model_sizes(config: Config, model: torch.nn.Module) -> Config:
    """ZeRO's "auto" bucket sizes come from the model (HF's rules)."""
    zero = config.zero_optimization
    keys = ("stage", "reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold")
    if not any(getattr(zero, k) is AUTO for k in keys):
        return config
    planned = zero.stage is AUTO and config.stepfx.memory_budget_gib is not None  # the planner chooses it
    resolved = resolve_zero_auto(config, hidden_size=_hidden_size(model), stage_planned=planned)
    log.info("stepfx: resolved ZeRO 'auto' values from the model: %s", {k: getattr(resolved.zero_optimization, k) for k in keys})
    return resolved


def _held_specs(captured: StepGraph, final: StepGraph) -> dict:
    """``(role, name, key) -> TensorSpec`` of every whole tensor the rank
    keeps (in pieces, or whole) instead of the user's objects after this
    plan runs: all optimizer state of parameters in sharded buckets, and the
    parameters themselves under ZeRO-3. Shapes come from the captured
    (unsharded) graph, so later captures see the same whole tensors."""
    layout = final.signature.extra.get(LAYOUT_KEY)
    split = [s for s in (*final.signature.inputs, *final.signature.outputs) if s.split is not None]
    if layout is None and not split:
        return {}
    whole: dict[tuple, TensorSpec] = {}
    gm = captured.gm
    outs = [v for v in gm.graph.nodes if v.op == "output"][0].args[0]
    for slot, node in [(n.meta["slot"], n) for n in gm.graph.nodes if n.op == "placeholder"] + list(zip(captured.signature.outputs, outs)):
        val = node.meta.get("val") if hasattr(node, "meta") else None
        if isinstance(val, torch.Tensor):
            whole[(slot.role, slot.name, slot.key)] = TensorSpec.of(val)
    # tensor parallelism: a split parameter and its split optimizer state (its step counter is held whole);
    # a gradient accumulated over micro-steps is described by the binding after each run that holds it
    held = {(s.role, s.name, s.key): whole[(s.role, s.name, s.key)] for s in split if s.role is not Role.GRAD}
    for bucket, p in (layout.params() if layout is not None else ()):
        if bucket.sharding is Sharding.NONE:
            continue
        for (role, name, key), spec in whole.items():
            # a frozen bucket's parameters keep their optimizer state (if any) in the user's optimizer
            if name == p.name and role is Role.OPTIMIZER_STATE and bucket.shards_state:
                held[(role, name, key)] = spec
        if bucket.sharding is Sharding.PARAMETERS:
            held[(Role.PARAM, p.name, None)] = whole[(Role.PARAM, p.name, None)]
    return held


def _batch_shapes(args, kwargs) -> dict[str, tuple[int, ...]]:
    """Batch slot name (as capture names it) -> shape, for every tensor argument."""
    return {name: tuple(t.shape) for name, t in _batch_tensors(args, kwargs).items()}


def _batch_tensors(args, kwargs) -> dict[str, torch.Tensor]:
    """Batch slot name -> tensor, for every tensor argument."""
    leaves, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    return {batch_slot_name(path): leaf for path, leaf in leaves if isinstance(leaf, torch.Tensor)}


def _frozen_dims(dims: dict) -> tuple:
    return tuple(sorted((name, tuple(sorted(d))) for name, d in dims.items()))


def _device_type(values) -> str:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device.type
    return "cpu"


def _device_of(model, device_type: str) -> torch.device:
    """The model's device (of its first tensor on ``device_type``)."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == device_type:
            return t.device
    return torch.device(device_type)


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


def _short(value: Any, limit: int = 40) -> Any:
    """A constant as a warning shows it: long strings (an example's text) cut."""
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "..."
    if isinstance(value, bytes) and len(value) > limit:
        return value[:limit] + b"..."
    return value


def _argument_name(path: str) -> str:
    """A step argument's pytree path over ``(args, kwargs)`` (``[0][1]``, ``[1]['n']['k']``) in the user's terms."""
    m = re.match(r"\[0\]\[(\d+)\](.*)", path)
    if m:
        return f"the step's argument #{int(m.group(1)) + 3} (after the model and optimizer){' at ' + m.group(2) if m.group(2) else ''}"
    m = re.match(r"\[1\]\['([^']+)'\](.*)", path)
    if m:
        return f"the step's keyword argument {m.group(1)!r}{' at ' + m.group(2) if m.group(2) else ''}"
    return f"the step's argument {path}"

