"""``optimizer``, ``scheduler`` and stepfx's own ``stepfx`` block.

optimizer / scheduler — LENIENT. DeepSpeed reads them with dict lookups
(``runtime/config.py: get_optimizer_name/params, get_scheduler_name/params``):
keys other than ``type``, ``params`` (and ``legacy_fusion`` for the
optimizer) are never read. ``params`` are keyword arguments handed to the
optimizer / scheduler constructor at engine start, not checked while the
config is parsed (gpt-neox's ``"cuda-aware"`` param parses), so stepfx keeps
them as given, except for the keys HF fills ("auto" is accepted there and
nowhere else in ``params``) whose types stepfx checks.

The type must name something DeepSpeed can build: one of DeepSpeed's
optimizers (any case: DeepSpeed lower-cases them) or a ``torch.optim`` class
(exact case: DeepSpeed does ``getattr(torch.optim, name)``); for the
scheduler, a ``deepspeed.runtime.lr_schedules`` or
``torch.optim.lr_scheduler`` class (``engine._scheduler_from_config``). The
torch names are listed here so that this package needs no torch import.

stepfx — STRICT: stepfx's own options; an unknown key is an error.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .errors import ConfigError, bad_value, closest, join
from .rules import Notes, Rule, auto_not_allowed, handle_unknown, is_auto, parse_fields, spec, validate_fields
from .pipeline import PipelineOptionsCheck
from .values import AUTO, Bool, Choice, Float, FrozenMap, Int, ListOf, OneOf, Optional, Str, StrList, freeze

DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "onebitadam", "onebitlamb", "zerooneadam", "muadam",
                        "muadamw", "musgd", "lion", "muon")
TORCH_OPTIMIZERS = ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "Muon", "NAdam",
                    "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam")
DEEPSPEED_SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
TORCH_SCHEDULERS = ("ChainedScheduler", "ConstantLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "CyclicLR",
                    "ExponentialLR", "LambdaLR", "LinearLR", "MultiStepLR", "MultiplicativeLR", "OneCycleLR",
                    "PolynomialLR", "ReduceLROnPlateau", "SequentialLR", "StepLR")

_LR = Float(ge=0.0)
_LR_OR_LIST = OneOf((_LR, ListOf(_LR)))  # DeepSpeed's schedulers take a float or one per param group
# The params HF transformers / accelerate fill when "auto" (integrations/deepspeed.py: trainer_config_process,
# trainer_config_finalize; accelerate Accelerator._prepare_deepspeed), with the types the consumer needs.
OPTIMIZER_AUTO_PARAMS = MappingProxyType({"lr": _LR, "betas": ListOf(Float(ge=0.0, le=1.0), length=2),
                                          "eps": Float(ge=0.0), "weight_decay": Float(ge=0.0)})
SCHEDULER_AUTO_PARAMS = MappingProxyType({"warmup_min_lr": _LR_OR_LIST, "warmup_max_lr": _LR_OR_LIST,
                                          "warmup_num_steps": Int(ge=0), "total_num_steps": Int(ge=1)})


def _check_type(value: Any, path: str, deepspeed_names: tuple[str, ...], torch_names: tuple[str, ...],
                fold_case: bool) -> str:
    ok = isinstance(value, str) and (value in torch_names or value in deepspeed_names
                                     or (fold_case and value.lower() in deepspeed_names))
    if ok:
        return value
    allowed = deepspeed_names + torch_names
    near = closest(value, allowed) if isinstance(value, str) else None
    hint = f" Did you mean {near!r}?" if near else ""
    raise ConfigError(path, f"got {value!r}; expected a DeepSpeed or torch name, one of {', '.join(allowed)}.{hint}",
                      value=value, expected=f"one of {allowed}", suggestion=near)


def _check_params(value: Any, path: str, auto_params: Mapping[str, Any]) -> FrozenMap:
    if not isinstance(value, Mapping):
        raise bad_value(path, value, "a mapping (JSON object) of constructor arguments")
    out = {}
    for key, v in value.items():
        key_path = join(path, key)
        if is_auto(v):
            if key not in auto_params:
                raise auto_not_allowed(key_path)
            out[key] = AUTO
        elif key in auto_params:
            out[key] = auto_params[key](v, key_path)
        else:
            out[key] = freeze(v)
    return FrozenMap(out)


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: ``type`` (e.g. "AdamW") and constructor ``params`` (values may be AUTO where HF fills them)."""

    type: str = spec(check=Str())
    params: FrozenMap = FrozenMap()
    legacy_fusion: bool = spec(False, Bool())

    def __post_init__(self):
        validate_fields(self, "optimizer")
        object.__setattr__(self, "type", _check_type(self.type, "optimizer.type", DEEPSPEED_OPTIMIZERS,
                                                     TORCH_OPTIMIZERS, fold_case=True))
        object.__setattr__(self, "params", _check_params(self.params, "optimizer.params", OPTIMIZER_AUTO_PARAMS))

    @property
    def name(self) -> str:
        """The type as DeepSpeed resolves it: DeepSpeed's own optimizers lower-cased, torch names as given."""
        return self.type.lower() if self.type.lower() in DEEPSPEED_OPTIMIZERS else self.type


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: ``type`` (e.g. "WarmupLR") and constructor ``params``."""

    type: str = spec(check=Str())
    params: FrozenMap = FrozenMap()

    def __post_init__(self):
        validate_fields(self, "scheduler")
        object.__setattr__(self, "type", _check_type(self.type, "scheduler.type", DEEPSPEED_SCHEDULERS,
                                                     TORCH_SCHEDULERS, fold_case=False))
        object.__setattr__(self, "params", _check_params(self.params, "scheduler.params", SCHEDULER_AUTO_PARAMS))


def _parse_typed(cls, mapping: Any, path: str, notes: Notes, extra: tuple[str, ...]):
    """optimizer / scheduler: a block without ``type`` is ignored by DeepSpeed (no optimizer built)."""
    if not isinstance(mapping, Mapping):
        raise bad_value(path, mapping, "a mapping with 'type' and 'params'")
    for key, value in mapping.items():
        if key not in ("type", "params") + extra:
            handle_unknown(join(path, key), value, ("type", "params") + extra, Rule.LENIENT, notes, path)
    if "type" not in mapping or mapping["type"] is None:
        notes.warn(f"{path}: no 'type', so DeepSpeed builds no {path} from this block; stepfx ignores it too")
        return None, []
    if is_auto(mapping["type"]):
        raise auto_not_allowed(join(path, "type"))
    kwargs = {"type": Str()(mapping["type"], join(path, "type"))}
    params = mapping.get("params") or {}
    kwargs["params"] = _check_params(params, join(path, "params"),
                                     OPTIMIZER_AUTO_PARAMS if cls is OptimizerConfig else SCHEDULER_AUTO_PARAMS)
    set_paths = [join(path, "type")] + [join(path, f"params.{k}") for k in params]
    for key in extra:
        if key in mapping:
            kwargs[key] = Bool()(mapping[key], join(path, key))
            set_paths.append(join(path, key))
    return cls(**kwargs), set_paths


def parse_optimizer(mapping: Any, path: str, notes: Notes):
    return _parse_typed(OptimizerConfig, mapping, path, notes, ("legacy_fusion", ))


def parse_scheduler(mapping: Any, path: str, notes: Notes):
    return _parse_typed(SchedulerConfig, mapping, path, notes, ())


@dataclass(frozen=True)
class _CacheDir:
    """``stepfx.cache_dir``: a directory (string or path), false (no plan
    cache) or true (the default place, as null)."""

    expected: str = "a directory path, false (no plan cache) or null (the default place)"

    def __call__(self, value: Any, path: str) -> str | bool | None:
        if value is True:
            return None
        if value is False:
            return False
        if isinstance(value, (str, os.PathLike)) and os.fspath(value):
            return os.fspath(value)
        raise bad_value(path, value, self.expected)


@dataclass(frozen=True)
class StepfxOptions:
    """The top-level ``"stepfx"`` block: stepfx's own options (not DeepSpeed's).

    codegen: emit Triton kernels; None = on for CUDA, off for CPU.
    disable: names of passes to turn off.
    dump_dir: folder for ``NN_<pass>.py`` dumps after every pass; None = no dumps.
    cache_size: captured variants kept per step (at least 1).
    verify: check the graph invariants after every pass.
    cuda_graphs: replay each captured variant as CUDA graphs from its third
        run on (CUDA only; see stepfx/runtime/graphs.py); None = off.
    freeze_gc: after each capture, move every object the process has to
        Python's permanent GC generation (``gc.freeze()``), so the full
        collections that steps trigger now and then do not walk the plans'
        graphs (~0.35 s per 1.3B plan on a CPU core; one timed step of the
        1.3B GPT took 1000 ms on the H200 where the others took ~129).
        Undone (``gc.unfreeze()``) before the next capture, so what was
        dropped meanwhile, an evicted plan included, is collected again.
    cache_dir: where captured-and-passed plans are kept across runs, so a
        restarted job skips capture and passes (stepfx/plan_cache); inductor's
        and Triton's compiled kernels go under it too unless
        TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR are set. None =
        ``$STEPFX_CACHE_DIR``, else ``~/.cache/stepfx``; false = no plan
        cache. Plans are pickles: stepfx only reads a directory that the
        current user owns and that no one else may write to.
    progress: print a few lines on rank 0 while a first call captures,
        runs passes and compiles (through the ``stepfx.progress`` logger,
        to stderr unless logging is configured); false = quiet.
    dynamic: symbolic batch dimensions. "auto" (default): a dimension of a
        batch tensor that changes between calls becomes symbolic and the
        step is captured once more, for all its sizes (torch.compile's
        automatic dynamic); true: every batch dimension is symbolic from
        the first call; false: one captured variant per batch shape.
    cast_inputs: cast floating-point batch tensors to the compute dtype
        under bf16/fp16, as the Hugging Face Trainer does for DeepSpeed;
        None = on when bf16 or fp16 is enabled, false to feed them as given.
    cast_buffers: under bf16/fp16 a floating buffer the step only reads
        that meets 16-bit weights in a matrix product or convolution (a
        sinusoidal position table) is read in the compute dtype, as
        DeepSpeed holds every buffer (``module.bfloat16()``); other buffers
        stay as they are (fp32 rotary frequencies, running statistics).
        false: such a step is refused at capture, naming the buffer.
    activation_memory_budget: activation checkpointing chosen on the graph
        (passes/memory/recompute_activations.py): the forward values kept for
        the backward may take at most this fraction (0 to 1) of the bytes they
        take without recomputation; 0 = recompute all that can be; None = off,
        unless DeepSpeed's ``activation_checkpointing`` block is there (then 0).
    memory_budget_gib: the memory planner (passes/memory/planner.py): the
        least recomputation whose predicted per-rank peak fits this many GiB
        (overrides activation_memory_budget), then the optimizer offload
        under ZeRO; with ``zero_optimization.stage`` "auto" it chooses the
        stage too; None = no planning.
    host_memory_budget_gib: what offloaded state (optimizer moments,
        parameter pieces) may take in host memory on each rank: the planner
        rejects candidates over it (under ZeRO-3 it takes a smaller offload
        ratio); without ``memory_budget_gib`` the step's own offload is
        checked against it before the first step.
    host_adam: how ``zero_optimization.offload_optimizer`` updates on the
        host (runtime/host_optimizer.py): "fused" (default) runs torch's
        fused CPU Adam/AdamW (one pass over memory; the parameter rounds
        differently from the unfused ops, within 1e-6 relative per step);
        "exact" computes the unfused ops' arithmetic chunk by chunk, bitwise
        equal to the step without offloading, 2.7x slower (1.3B on the H200
        machine's 16 cores: 0.90 s against 2.35 s an update).
    host_update_speculation: with ``offload_optimizer`` under clipping or
        fp16 loss scaling, where the update needs the global gradient norm
        and overflow flag (known after the backward): "auto" (default) and
        true update each bucket on the host as soon as its gradients exist,
        on the factor that holds when nothing is clipped and nothing
        overflows, after copying the host state the update overwrites (8
        bytes per element, 12 where the piece lives on the host); once the
        norm is known the worker keeps what was right bit for bit and
        restores and redoes the rest, so the step is the same either way
        (runtime/host_optimizer.py). "auto" keeps the copies alive at once
        within 2 bytes per offloaded element (a quarter of the moments: a
        backward rarely leaves the host time for more) and stops guessing
        after a step whose guess was undone, until a step is not clipped
        again; true guesses wherever the norm is not known yet; false waits
        for the norm (no copies).
    host_master_weights: with ``offload_optimizer`` under bf16 at ZeRO-3,
        the fp32 master pieces live on the host with the moments and the
        device keeps their bf16 copies, made by the host update (DeepSpeed's
        layout; passes/memory/host_master_weights.py): 12 host bytes and 2
        device bytes per element at rest, 4 over PCIe a step (false: the fp32
        pieces stay on the device, 8 host bytes, 4 device bytes, 10 over
        PCIe). "auto" (default): on where 12 bytes per element fit the host
        (``host_memory_budget_gib``, else 85% of its physical memory over the
        local ranks); true: on regardless.
    delayed_parameter_update: ZeRO-Offload's one-step delayed parameter
        update: each step's host update runs while the next step computes,
        so the step computes at the parameters of two updates before (its
        gradient is applied to those of the update before). Changes the
        training (one step stale); off by default. Needs the masters on the
        host (``host_master_weights``: bf16, ZeRO-3, ``offload_optimizer``).
        Reading the state (``model_state_dict``, ``optimizer_state``, a
        checkpoint) first waits for the pending update and applies it, so
        the next step computes at the latest parameters. An integer N: the
        first N optimizer steps are exact (each waits for its own update),
        the delay begins after them (ZeRO-Offload's warm-up: stale
        gradients hurt most at the start; on the 1.3B, 7 delayed steps
        from the first ended at loss 12.07 against 9.72 exact).
    host_update_across_steps: with ``offload_optimizer`` at ZeRO-3, the
        host update that waits for the gradient norm (clipping, loss
        scaling) runs while the next step begins: the step returns once the
        update is started, its buckets in the order the forward reads them,
        and the next step's first reader of each updated piece (or its bf16
        copy) waits for that bucket only, so the host update overlaps the
        next forward. Exact (the same arithmetic, nothing stale: unlike
        ``delayed_parameter_update``, which it excludes); the updated pieces
        and copies are written in place. Reading the state between steps
        (``model_state_dict``, a checkpoint) waits for the update first.
        Turns ``host_update_speculation`` "auto" off (the two overlap
        different things; true with both is an error). Off by default.
    pipeline: pipeline parallelism's schedule, virtual stages and split
        points (config/pipeline.py: PipelineOptions); given, it turns
        pipeline parallelism on with DeepSpeed's ``pipeline.stages`` "auto".
    attention_pad_multiple: with symbolic lengths (``dynamic``), causal
        self-attention that torch runs on cuDNN runs on the length padded
        with zeros up to a multiple of this (a causal query never reads a
        later key, and the padded rows' outputs are dropped, so the result
        is the same function), so cuDNN builds its execution plan once per
        bucket instead of once per new length. The step is then bitwise
        equal to one captured per length (cuDNN on each); 0 (default) runs
        flash attention instead, which builds no plan and differs by bf16
        rounding (with codegen, stepfx's Triton attention: ``fuse_attention``). Measured on the H200 (1.3B GPT, lengths uniform in
        [1024, 2048]): padded cuDNN 0.889x the fixed-length step's tokens/s,
        flash 0.915x; cuDNN's kernel is faster (0.69 against 1.06 ms a layer
        at length 1678) but the padding and cutting copies cost more.
        "auto": the next power of two at or above an eighth of the traced
        length, within [64, 512].
    sequence_parallel: with tensor parallelism, Megatron's sequence
        parallelism: between the column/row pairs (norms, residual adds,
        dropout's inputs) each rank of the group holds its share of the
        tokens; a row-parallel product is reduce-scattered over the tokens
        instead of all-reduced, and gathered before the next column-parallel
        matmul (passes/tensor_parallel). With stepfx.dynamic the shared token
        count may vary where it divides by the group at every call (a batch
        size divisible by it); else the symbolic capture runs without it.
    """

    codegen: bool | None = spec(None, Optional(Bool()))
    disable: tuple[str, ...] = spec((), StrList())
    dump_dir: str | None = spec(None, Optional(Str()))
    cache_size: int = spec(8, Int(ge=1))
    verify: bool = spec(True, Bool())
    cuda_graphs: bool | None = spec(None, Optional(Bool()))
    freeze_gc: bool = spec(True, Bool())
    cache_dir: str | bool | None = spec(None, Optional(_CacheDir()))
    progress: bool = spec(True, Bool())
    dynamic: str | bool = spec("auto", OneOf((Choice(("auto",)), Bool())), auto_value=True)
    cast_inputs: bool | None = spec(None, Optional(Bool()))
    cast_buffers: bool = spec(True, Bool())
    activation_memory_budget: float | None = spec(None, Optional(Float(ge=0.0, le=1.0)))
    memory_budget_gib: float | None = spec(None, Optional(Float(gt=0.0)))
    host_memory_budget_gib: float | None = spec(None, Optional(Float(gt=0.0)))
    pipeline: Any = spec(None, Optional(PipelineOptionsCheck()))
    host_adam: str = spec("fused", Choice(("fused", "exact")))
    host_update_speculation: str | bool = spec("auto", OneOf((Choice(("auto",)), Bool())), auto_value=True)
    host_master_weights: str | bool = spec("auto", OneOf((Choice(("auto",)), Bool())), auto_value=True)
    delayed_parameter_update: bool | int = spec(False, OneOf((Bool(), Int(ge=1))))
    host_update_across_steps: bool = spec(False, Bool())
    sequence_parallel: bool = spec(False, Bool())
    attention_pad_multiple: int | str = spec(0, OneOf((Choice(("auto",)), Int(ge=0))), auto_value=True)

    def __post_init__(self):
        validate_fields(self, "stepfx")
        for name in self.disable:
            if not name:
                raise bad_value("stepfx.disable", self.disable, "a list of non-empty pass names")


def parse_stepfx(mapping: Any, path: str, notes: Notes) -> tuple[StepfxOptions, list[str]]:
    kwargs, set_paths = parse_fields(StepfxOptions, mapping, path, "stepfx", notes, Rule.STRICT, pydantic=False,
                                     block="stepfx")
    return StepfxOptions(**kwargs), set_paths

