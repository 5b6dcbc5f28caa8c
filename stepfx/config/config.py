"""``Config``: a whole DeepSpeed config (plus stepfx's own block) as one frozen, validated dataclass.

Field names are DeepSpeed's top-level keys; defaults are DeepSpeed
v0.19.5's (``deepspeed/runtime/constants.py``). Note that v0.19.5 changed the
default of ``gradient_clipping`` from 0 (off) to 1.0 (#8068); stepfx follows.

Built from a file or dict by ``load_config``, or directly in Python::

    Config(zero_optimization=ZeroConfig(stage=3), bf16=BF16Config(enabled=True))

Either way ``__post_init__`` runs the same checks, with the same messages,
including DeepSpeed's cross-key checks (``DeepSpeedConfig._do_error_check``).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .applied import is_applied
from .blocks import OptimizerConfig, SchedulerConfig, StepfxOptions
from .errors import ConfigError, bad_value, join
from .precision import BF16Config, FP16Config
from .rules import checked_fields, default_of, spec, validate_fields
from .pipeline import PipelineConfig
from .tensor_parallel import TensorParallelConfig
from .values import AUTO, Bool, Choice, Float, FrozenMap, Int, Optional, freeze
from .zero import ZeroConfig

COMM_DTYPES = ("fp32", "fp16", "bf16")


class _StepsPerPrint:
    """A positive int; accelerate's float("inf") ("never print") is stored as None, DeepSpeed's "never"."""

    expected = "a positive integer or null"

    def __call__(self, value: Any, path: str) -> int | None:
        if isinstance(value, float) and math.isinf(value) and value > 0:
            return None
        return Optional(Int(ge=1))(value, path)


_BATCH = Optional(Int(ge=1))  # DeepSpeed asserts each given batch number is > 0 (_batch_assertion)


@dataclass(frozen=True)
class Config:
    """A validated DeepSpeed config. See ``load_config`` for the rules applied to files and dicts.

    Besides DeepSpeed's keys: ``stepfx`` (stepfx's own options), ``raw``
    (the user's mapping, read-only, lists as tuples), ``source`` (path,
    "<dict>", "<defaults>" or "<python>"), ``ignored_keys`` (unknown
    top-level keys, ignored as DeepSpeed ignores them) and ``not_applied``
    (canonical key paths the user set that stepfx accepts but does not act
    on yet; see ``applied.py``). ``not_applied`` describes the config as
    loaded; for a Config built in Python it is computed from the fields that
    differ from their defaults.
    """

    train_batch_size: Any = spec(None, _BATCH, auto=True)
    train_micro_batch_size_per_gpu: Any = spec(None, _BATCH, auto=True)
    gradient_accumulation_steps: Any = spec(None, _BATCH, auto=True)
    gradient_clipping: Any = spec(1.0, Float(ge=0.0), auto=True)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    communication_data_type: str | None = spec(None, Optional(Choice(COMM_DTYPES, lower=True)))
    seq_parallel_communication_data_type: str | None = spec("fp32", Optional(Choice(COMM_DTYPES, lower=True)))
    prescale_gradients: bool = spec(False, Bool())
    gradient_predivide_factor: float = spec(1.0, Float(gt=0.0))
    gradient_allreduce_op: str = spec("mean", Choice(("mean", "sum"), lower=True))
    sparse_gradients: bool = spec(False, Bool())
    steps_per_print: int | None = spec(None, _StepsPerPrint())
    wall_clock_breakdown: bool = spec(False, Bool())
    memory_breakdown: bool = spec(False, Bool())
    zero_allow_untested_optimizer: bool = spec(False, Bool())
    zero_force_ds_cpu_optimizer: bool = spec(True, Bool())
    stepfx: StepfxOptions = field(default_factory=StepfxOptions)
    raw: Mapping = FrozenMap()
    source: str = "<python>"
    ignored_keys: tuple[str, ...] = ()
    not_applied: tuple[str, ...] | None = None

    def __post_init__(self):
        validate_fields(self, "")
        for name, cls in (("zero_optimization", ZeroConfig), ("fp16", FP16Config), ("bf16", BF16Config),
                          ("stepfx", StepfxOptions), ("optimizer", OptimizerConfig),
                          ("tensor_parallel", TensorParallelConfig), ("pipeline", PipelineConfig),
                          ("scheduler", SchedulerConfig)):
            value = getattr(self, name)
            if not isinstance(value, cls) and not (value is None and name in ("optimizer", "scheduler")):
                raise bad_value(name, value, f"a {cls.__name__} (use load_config for DeepSpeed dicts)")
        if not isinstance(self.raw, Mapping):
            raise bad_value("raw", self.raw, "a mapping")
        object.__setattr__(self, "raw", freeze(self.raw))
        object.__setattr__(self, "ignored_keys", tuple(self.ignored_keys))
        _cross_checks(self)
        if not self.raw or self.not_applied is None:
            object.__setattr__(self, "not_applied", _python_not_applied(self))
        object.__setattr__(self, "not_applied", tuple(self.not_applied))


def _cross_checks(c: Config) -> None:
    """DeepSpeed's checks across blocks (runtime/config.py: _initialize_params, _do_error_check)."""
    if c.fp16.enabled is True and c.bf16.enabled is True:
        raise ConfigError("bf16.enabled", "fp16.enabled and bf16.enabled are both true; DeepSpeed: 'bfloat16 and "
                          "fp16 modes cannot be simultaneously enabled'", value=True, expected="at most one enabled")
    stage = c.zero_optimization.stage
    if stage is AUTO:
        return
    for path, on in (("fp16.fp16_master_weights_and_grads", c.fp16.fp16_master_weights_and_grads),
                     ("bf16.bf16_master_weights_and_grads", c.bf16.bf16_master_weights_and_grads),
                     ("bf16.bf16_optimizer_states", c.bf16.bf16_optimizer_states)):
        if on and stage == 0:
            raise ConfigError(path, "true, but it is only supported with ZeRO stage 1, 2 or 3 (stage is 0)",
                              value=True, expected="false with ZeRO stage 0")
    if c.bf16.bf16_optimizer_states and not c.bf16.bf16_master_weights_and_grads:
        raise ConfigError("bf16.bf16_optimizer_states", "true, but it requires bf16.bf16_master_weights_and_grads",
                          value=True, expected="false unless bf16_master_weights_and_grads is true")
    if c.gradient_allreduce_op == "sum":
        deepcompile = isinstance(c.raw.get("compile"), Mapping) and bool(c.raw["compile"].get("deepcompile"))
        for bad, name in ((stage == 3, "ZeRO stage 3"), (c.zero_optimization.zenflow is not None, "ZenFlow"),
                          (deepcompile, "DeepCompile")):
            if bad:
                raise ConfigError("gradient_allreduce_op", f"'sum' is not supported with {name}", value="sum",
                                  expected="'mean'")


def _python_not_applied(c: Config) -> list[str]:
    """Key paths of a Python-built Config that differ from the defaults and are not applied."""
    paths = []
    for f in checked_fields(Config):
        if getattr(c, f.name) != default_of(f):
            paths.append(f.name)
    for name in ("zero_optimization", "fp16", "bf16"):
        block = getattr(c, name)
        if name != "zero_optimization" and block.enabled is False:
            continue  # a disabled block contributes nothing
        paths += _changed(block, type(block)(), name)
    paths += _changed(c.tensor_parallel, TensorParallelConfig(), "tensor_parallel")
    paths += _changed(c.pipeline, PipelineConfig(), "pipeline")
    zero = c.zero_optimization
    if zero.stage is not AUTO and zero.overlap_comm == (zero.stage == 3):  # DeepSpeed's dynamic default
        paths = [p for p in paths if p != "zero_optimization.overlap_comm"]
    for name in ("optimizer", "scheduler"):
        block = getattr(c, name)
        if block is not None:
            paths += [f"{name}.type"] + [f"{name}.params.{k}" for k in block.params]
    return [p for p in paths if not is_applied(p)]


def _changed(obj: Any, default: Any, prefix: str) -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        value, base = getattr(obj, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            if not dataclasses.is_dataclass(base):  # e.g. an offload block: compare with its placed default
                base = getattr(type(default)(**{f.name: type(value)()}), f.name)
            out += _changed(value, base, join(prefix, f.name))
        elif value != base:
            out.append(join(prefix, f.name))
    return out
