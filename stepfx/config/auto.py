"""``resolve_auto``: fill ``AUTO`` values the way HF transformers / accelerate do.

Sources: transformers ``integrations/deepspeed.py``
(``HfTrainerDeepSpeedConfig.trainer_config_process`` and
``trainer_config_finalize``) and accelerate ``Accelerator._prepare_deepspeed``
/ ``DeepSpeedPlugin`` (``utils/dataclasses.py``):

- train_micro_batch_size_per_gpu <- the per-device batch size;
  gradient_accumulation_steps <- gas (default 1, both libraries' default);
  train_batch_size <- world_size * micro * gas.
- gradient_clipping <- max_grad_norm (default 1.0, both libraries' default).
- fp16.enabled / bf16.enabled <- mixed_precision ("no" by default).
- optimizer.params lr, betas, eps, weight_decay <- the given values.
- scheduler.params warmup_min_lr <- 0 (a constant in both),
  warmup_max_lr <- learning_rate, warmup_num_steps <- warmup_steps,
  total_num_steps <- total_num_steps.
- zero_optimization.reduce_bucket_size <- hidden_size**2; on stage 3,
  stage3_prefetch_bucket_size <- int(0.9 * hidden_size**2) and
  stage3_param_persistence_threshold <- 10 * hidden_size. Below stage 3
  transformers leaves those two "auto" and DeepSpeed drops them, i.e. they
  take DeepSpeed's defaults. As in transformers, any of the three being
  "auto" needs hidden_size.
- accelerate only: zero_optimization.stage <- zero_stage; offload devices
  <- "none" and nvme paths <- None unless given (the plugin's defaults, and
  what DeepSpeed makes of a dropped "auto"); gather_16bit_weights_on_model_save
  <- False.

Explicit config values always win; arguments only replace AUTO (the
libraries' "mismatch" checks are not repeated). Every AUTO left without a
source is reported in one ConfigError naming the keys and the argument to pass.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .blocks import OptimizerConfig, SchedulerConfig
from .config import Config
from .errors import ConfigError
from .rules import default_of
from .values import AUTO, FrozenMap
from .zero import SLOTS, ZeroConfig

_HIDDEN_KEYS = ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold")

def resolve_auto(config: Config, *, hidden_size: int | None = None, world_size: int = 1,
                 micro_batch_size: int | None = None, gradient_accumulation_steps: int = 1,
                 max_grad_norm: float = 1.0, mixed_precision: str = "no", learning_rate: float | None = None,
                 betas: tuple[float, float] | None = None, eps: float | None = None,
                 weight_decay: float | None = None, warmup_steps: int | None = None,
                 total_num_steps: int | None = None, zero_stage: int | None = None,
                 offload_optimizer_device: str = "none", offload_param_device: str = "none",
                 offload_optimizer_nvme_path: str | None = None, offload_param_nvme_path: str | None = None,
                 gather_16bit_weights_on_model_save: bool = False) -> Config:
    """A copy of ``config`` with every AUTO value filled in (see the module docstring for the rules).

    ``world_size`` is the data-parallel world size (what DeepSpeed's
    train_batch_size counts). ``mixed_precision``: "no", "fp16" or "bf16".
    """
    if mixed_precision not in ("no", "fp16", "bf16"):
        raise ConfigError("mixed_precision", f"got {mixed_precision!r}; expected 'no', 'fp16' or 'bf16'",
                          value=mixed_precision, expected="'no', 'fp16' or 'bf16'")
    missing: list[str] = []
    fill = _filler(missing, "pass {argument}=...")
    offload = {"offload_optimizer": (offload_optimizer_device, offload_optimizer_nvme_path),
               "offload_param": (offload_param_device, offload_param_nvme_path)}
    zero = _resolve_zero(config.zero_optimization, fill, missing, hidden_size=hidden_size, zero_stage=zero_stage,
                         offload=offload, gather_16bit=gather_16bit_weights_on_model_save)
    micro = fill(config.train_micro_batch_size_per_gpu, micro_batch_size, "train_micro_batch_size_per_gpu",
                 "micro_batch_size")
    gas = fill(config.gradient_accumulation_steps, gradient_accumulation_steps, "gradient_accumulation_steps",
               "gradient_accumulation_steps")
    train = config.train_batch_size
    if train is AUTO:
        m = micro_batch_size if micro in (None, AUTO) else micro
        g = gradient_accumulation_steps if gas in (None, AUTO) else gas
        train = fill(train, None if m is None or g is None else world_size * m * g, "train_batch_size",
                     "micro_batch_size")
    fp16 = dataclasses.replace(config.fp16, enabled=fill(config.fp16.enabled, mixed_precision == "fp16",
                                                         "fp16.enabled", "mixed_precision"))
    bf16 = dataclasses.replace(config.bf16, enabled=fill(config.bf16.enabled, mixed_precision == "bf16",
                                                         "bf16.enabled", "mixed_precision"))
    optimizer = config.optimizer
    if optimizer is not None:
        given = {"lr": learning_rate, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        names = {"lr": "learning_rate"}
        optimizer = OptimizerConfig(type=optimizer.type, legacy_fusion=optimizer.legacy_fusion, params=FrozenMap({
            k: fill(v, given.get(k), f"optimizer.params.{k}", names.get(k, k)) for k, v in optimizer.params.items()}))
    scheduler = config.scheduler
    if scheduler is not None:
        given = {"warmup_min_lr": 0, "warmup_max_lr": learning_rate, "warmup_num_steps": warmup_steps,
                 "total_num_steps": total_num_steps}
        names = {"warmup_max_lr": "learning_rate", "warmup_num_steps": "warmup_steps"}
        scheduler = SchedulerConfig(type=scheduler.type, params=FrozenMap({
            k: fill(v, given.get(k), f"scheduler.params.{k}", names.get(k, k)) for k, v in scheduler.params.items()}))
    clipping = fill(config.gradient_clipping, max_grad_norm, "gradient_clipping", "max_grad_norm")
    if missing:
        raise ConfigError(missing[0].split(" ")[0], "'auto' values that cannot be resolved: " + "; ".join(missing),
                          value=AUTO, expected="the arguments named")
    return dataclasses.replace(config, zero_optimization=zero, train_batch_size=train,
                               train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas,
                               gradient_clipping=clipping, fp16=fp16, bf16=bf16, optimizer=optimizer,
                               scheduler=scheduler)


def _filler(missing: list[str], hint: str):
    """``fill(value, given, key, argument)``: ``given`` replaces an AUTO
    ``value``; an AUTO with nothing given is recorded in ``missing`` with
    ``hint`` (formatted with ``argument``)."""

    def fill(value: Any, given: Any, key: str, argument: str) -> Any:
        if value is not AUTO:
            return value
        if given is None:
            missing.append(f"{key} ({hint.format(argument=argument)})")
            return value
        return given

    return fill


def _resolve_zero(zero: ZeroConfig, fill, missing: list[str], *, hidden_size: int | None, zero_stage: int | None,
                  offload: dict[str, tuple[str, str | None]], gather_16bit: bool) -> ZeroConfig:
    defaults = {f.name: default_of(f) for f in dataclasses.fields(ZeroConfig) if f.name in _HIDDEN_KEYS}
    stage = fill(zero.stage, zero_stage, "zero_optimization.stage", "zero_stage")
    changes: dict[str, Any] = {"stage": stage}
    hidden_keys = [name for name in _HIDDEN_KEYS if getattr(zero, name) is AUTO]
    if hidden_keys and hidden_size is None:
        missing += [f"zero_optimization.{name} (pass hidden_size=...)" for name in hidden_keys]
    elif hidden_keys:
        h = hidden_size
        by_hidden = {"reduce_bucket_size": h * h, "prefetch_bucket_size": int(0.9 * h * h),
                     "param_persistence_threshold": 10 * h}
        for name in hidden_keys:
            stage3_only = name != "reduce_bucket_size"
            changes[name] = by_hidden[name] if stage == 3 or not stage3_only else defaults[name]
    changes["gather_16bit_weights_on_model_save"] = fill(zero.gather_16bit_weights_on_model_save, gather_16bit,
                                                         "zero_optimization.gather_16bit_weights_on_model_save",
                                                         "gather_16bit_weights_on_model_save")
    if zero.overlap_comm is None and stage is not AUTO:
        changes["overlap_comm"] = stage == 3  # DeepSpeed's dynamic default, now that the stage is known
    for slot in SLOTS:
        block = getattr(zero, slot)
        if block is None:
            continue
        device_arg, nvme_arg = offload[slot]
        device = fill(block.device, device_arg, f"zero_optimization.{slot}.device", f"{slot}_device")
        nvme = nvme_arg if block.nvme_path is AUTO else block.nvme_path
        changes[slot] = dataclasses.replace(block, device=device, nvme_path=nvme)
    return dataclasses.replace(zero, **changes)


def resolve_zero_auto(config: Config, *, hidden_size: int | None, stage_planned: bool = False) -> Config:
    """Fill only the ``zero_optimization`` AUTO values — the bucket sizes HF
    derives from the model's hidden size, the offload devices and the
    16-bit-save flag (HF/accelerate defaults) — leaving the rest of the
    config as it is. What stepfx does on a step's first call, when it knows
    the model. A ZeRO AUTO value without a source (the stage) is a
    ConfigError naming the key, unless ``stage_planned``: the memory
    planner chooses the stage (``stepfx.memory_budget_gib``), so it stays
    AUTO here and the sizes are resolved as for stage 3 (the values only
    stage 3 reads are unused below it); see :func:`at_stage`."""
    missing: list[str] = []
    fill = _filler(missing, "set it in the config, or set stepfx.memory_budget_gib for the planner to choose it")
    offload = {"offload_optimizer": ("none", None), "offload_param": ("none", None)}
    zero = config.zero_optimization
    planned = stage_planned and zero.stage is AUTO
    resolved = _resolve_zero(dataclasses.replace(zero, stage=3) if planned else zero, fill, missing,
                             hidden_size=hidden_size, zero_stage=None, offload=offload, gather_16bit=False)
    if planned:
        resolved = dataclasses.replace(resolved, stage=AUTO, overlap_comm=zero.overlap_comm)
    if missing:
        raise ConfigError(missing[0].split(" ")[0], "'auto' values that cannot be resolved: " + "; ".join(missing),
                          value=AUTO, expected="a value")
    return dataclasses.replace(config, zero_optimization=resolved)


def at_stage(config: Config, stage: int) -> Config:
    """``config`` with ZeRO ``stage`` where it was AUTO (the planner's
    choice), and DeepSpeed's stage-dependent default for ``overlap_comm``
    (on for stage 3) where the config left it open."""
    zero = config.zero_optimization
    overlap = zero.overlap_comm if zero.overlap_comm is not None else stage == 3
    return dataclasses.replace(config, zero_optimization=dataclasses.replace(zero, stage=stage, overlap_comm=overlap))
