"""``zero_optimization``: ZeroConfig and OffloadConfig.

Mirrors ``deepspeed/runtime/zero/config.py: DeepSpeedZeroConfig`` and
``deepspeed/runtime/zero/offload_config.py`` (DeepSpeed v0.19.5): the same
keys, defaults, aliases and deprecations. DeepSpeed validates the block,
both offload blocks, ``zenflow`` and ``leaf_module`` with pydantic models
with ``extra="forbid"``, so an unknown key anywhere in here is an error.

Spellings resolved to one canonical field each (JSON only; Python code uses
the canonical names):

- ``stage3_<name>`` and ``<name>`` (pydantic alias + ``populate_by_name``)
  for prefetch_bucket_size, param_persistence_threshold,
  model_persistence_threshold, max_live_parameters, max_reuse_distance,
  gather_16bit_weights_on_model_save, module_granularity_threshold,
  use_all_reduce_for_fetch_params, allgather_sequential. Giving both is an
  error, as in DeepSpeed.
- deprecated ``cpu_offload: true`` -> ``offload_optimizer: {device: cpu}``,
  ``cpu_offload_param: true`` -> ``offload_param: {device: cpu}``,
  ``stage3_gather_fp16_weights_on_model_save`` ->
  ``gather_16bit_weights_on_model_save`` (DeepSpeed's ``new_param``), each
  with a deprecation warning; giving a deprecated key and its replacement
  together is an error (DeepSpeed asserts). ``cpu_offload_use_pin_memory``
  is deprecated with no replacement: DeepSpeed only warns, and so does stepfx.
- legacy ``"zero_optimization": true/false`` -> stage 1/0 with
  ``allgather_bucket_size`` from the top-level ``allgather_size``
  (``read_zero_config_deprecated``); handled by the loader.
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .errors import ConfigError, bad_value, join
from .rules import Notes, Rule, handle_unknown, parse_fields, spec, validate_fields
from .values import AUTO, AnyMap, Bool, Choice, Float, FrozenMap, Int, Optional, PathStr, StrList

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
SLOTS = ("offload_param", "offload_optimizer")
# DeepSpeed's two offload models differ in keys and in the buffer_count default.
_PARAM_KEYS = frozenset({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"})
_OPTIMIZER_KEYS = frozenset({"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                             "fast_init", "ratio", "super_offload", "cpuadam_cores_perc"})
_SLOT_KEYS = MappingProxyType({"offload_param": _PARAM_KEYS, "offload_optimizer": _OPTIMIZER_KEYS})
_BUFFER_COUNT_DEFAULT = MappingProxyType({"offload_param": 5, "offload_optimizer": 4})


@dataclass(frozen=True)
class OffloadConfig:
    """``offload_param`` / ``offload_optimizer``: where ZeRO keeps params or optimizer state.

    One class for both blocks; each block accepts only its own DeepSpeed keys
    (param: buffer_size, max_in_cpu; optimizer: pipeline_read/write,
    fast_init, ratio, super_offload, cpuadam_cores_perc). ``buffer_count``
    left as None takes the block's DeepSpeed default (param 5, optimizer 4)
    once placed in a ZeroConfig.
    """

    device: Any = spec("none", Choice(OFFLOAD_DEVICES), auto=True)
    nvme_path: Any = spec(None, Optional(PathStr()), auto=True)
    buffer_count: int | None = spec(None, Optional(Int(ge=0)))
    buffer_size: int = spec(100_000_000, Int(ge=0))
    max_in_cpu: int = spec(1_000_000_000, Int(ge=0))
    pin_memory: bool = spec(True, Bool())
    pipeline_read: bool = spec(False, Bool())
    pipeline_write: bool = spec(False, Bool())
    fast_init: bool = spec(False, Bool())
    ratio: float = spec(1.0, Float(ge=0.0, le=1.0))
    super_offload: bool = spec(False, Bool())
    cpuadam_cores_perc: float = spec(0.8, Float(ge=0.0, le=1.0))

    def __post_init__(self):
        validate_fields(self, "offload", pydantic=True)

    @property
    def enabled(self) -> bool:
        """Offloading is on (device cpu or nvme; AUTO counts as on until resolved)."""
        return self.device != "none"

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's derived ``pipeline`` flag (``set_pipeline`` validator)."""
        return self.pipeline_read or self.pipeline_write


# zenflow: deepspeed/runtime/zenflow/zenflow_config.py (pydantic, strict). Its own "auto" values are literal.
_INTERVAL = Optional(Int(ge=0))
ZENFLOW_KEYS: Mapping[str, Any] = MappingProxyType({
    "topk_ratio": (0.1, Float(ge=0.0, le=1.0)),
    "select_strategy": ("auto", Choice(("auto", "step", "epoch"))),
    "select_interval": ("auto", None),
    "update_interval": ("auto", None),
    "overlap_step": (False, Bool()),
    "offload": (False, Bool()),
    "auto_ratio": (0.99, Float(ge=0.0, le=1.0)),
    "full_warm_up_rounds": (0, Int()),
    "pt_reserved_cores_perc": (0.5, Float(ge=0.0, le=1.0)),
    "steps_per_epoch": (None, _INTERVAL),
})
# leaf_module: deepspeed/runtime/zero/leaf_module_config.py (pydantic, strict).
LEAF_MODULE_DEFAULT = FrozenMap({
    "classes": ("transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"),
    "names": (),
    "name_suffixes": (),
})


def _check_zenflow(value: Any, path: str, notes: Notes | None = None) -> FrozenMap | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad_value(path, value, "a mapping (JSON object) or null")
    for key, v in value.items():
        if key not in ZENFLOW_KEYS:
            handle_unknown(join(path, key), v, ZENFLOW_KEYS, Rule.STRICT, notes or Notes(True), path)
    out = {}
    for key, (default, check) in ZENFLOW_KEYS.items():
        v = value.get(key, default)
        if v == "auto":  # DeepSpeedConfigModel drops "auto", leaving the default
            v = default
        if check is None:  # an interval: "auto" or an integer (ZenFlowConfig.validate_fields)
            if v != "auto":
                v = Int(ge=0)(v, join(path, key))
        else:
            v = check(v, join(path, key))
        out[key] = v
    return FrozenMap(out)


def _check_leaf_module(value: Any, path: str, notes: Notes | None = None) -> FrozenMap:
    if not isinstance(value, Mapping):
        raise bad_value(path, value, "a mapping with keys classes, names, name_suffixes")
    out = dict(LEAF_MODULE_DEFAULT)
    for key, v in value.items():
        if key not in LEAF_MODULE_DEFAULT:
            handle_unknown(join(path, key), v, LEAF_MODULE_DEFAULT, Rule.STRICT, notes or Notes(True), path)
            continue
        out[key] = tuple(dict.fromkeys(StrList()(v, join(path, key))))  # DeepSpeed de-duplicates
    return FrozenMap(out)


def _stage3(name: str) -> tuple[str, ...]:
    return (f"stage3_{name}", )


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization`` with DeepSpeed's keys and defaults (canonical field names).

    ``overlap_comm`` None means DeepSpeed's dynamic default: on for stage 3,
    off otherwise; it is resolved as soon as ``stage`` is known.
    """

    stage: Any = spec(0, Int(ge=0, le=3), auto=True)
    contiguous_gradients: bool = spec(True, Bool())
    reduce_scatter: bool = spec(True, Bool())
    reduce_bucket_size: Any = spec(500_000_000, Int(ge=0), auto=True)
    use_multi_rank_bucket_allreduce: bool = spec(True, Bool())
    allgather_partitions: bool = spec(True, Bool())
    allgather_bucket_size: int = spec(500_000_000, Int(ge=0))
    overlap_comm: bool | None = spec(None, Optional(Bool()))
    load_from_fp32_weights: bool = spec(True, Bool())
    elastic_checkpoint: bool = spec(False, Bool())
    offload_param: OffloadConfig | None = None
    offload_optimizer: OffloadConfig | None = None
    zenflow: FrozenMap | None = None
    sub_group_size: int = spec(1_000_000_000, Int(ge=0))
    prefetch_bucket_size: Any = spec(50_000_000, Int(ge=0), auto=True, json=_stage3("prefetch_bucket_size"))
    param_persistence_threshold: Any = spec(100_000, Int(ge=0), auto=True,
                                            json=_stage3("param_persistence_threshold"))
    model_persistence_threshold: int = spec(sys.maxsize, Int(ge=0), json=_stage3("model_persistence_threshold"))
    max_live_parameters: int = spec(1_000_000_000, Int(ge=0), json=_stage3("max_live_parameters"))
    max_reuse_distance: int = spec(1_000_000_000, Int(ge=0), json=_stage3("max_reuse_distance"))
    gather_16bit_weights_on_model_save: Any = spec(False, Bool(), auto=True,
                                                   json=_stage3("gather_16bit_weights_on_model_save"))
    module_granularity_threshold: int = spec(0, Int(), json=_stage3("module_granularity_threshold"))
    use_all_reduce_for_fetch_params: bool = spec(False, Bool(), json=_stage3("use_all_reduce_for_fetch_params"))
    allgather_sequential: bool = spec(False, Bool(), json=_stage3("allgather_sequential"))
    ignore_unused_parameters: bool = spec(True, Bool())
    legacy_stage1: bool = spec(False, Bool())
    round_robin_gradients: bool = spec(False, Bool())
    zero_hpz_partition_size: int = spec(1, Int(ge=0))
    zero_quantized_weights: bool = spec(False, Bool())
    zero_quantized_nontrainable_weights: bool = spec(False, Bool())
    zero_quantized_gradients: bool = spec(False, Bool())
    zeropp_loco_param: FrozenMap | None = spec(None, Optional(AnyMap()))
    mics_shard_size: int = spec(-1, Int())
    mics_hierarchical_params_gather: bool = spec(False, Bool())
    memory_efficient_linear: bool = spec(True, Bool())
    pipeline_loading_checkpoint: bool = spec(False, Bool())
    override_module_apply: bool = spec(True, Bool())
    log_trace_cache_warnings: bool = spec(False, Bool())
    enable_sanity_checks: bool = spec(False, Bool())
    save_muon_momentum_buffer_in_memory: bool = spec(False, Bool())
    leaf_module: FrozenMap = LEAF_MODULE_DEFAULT

    def __post_init__(self):
        validate_fields(self, "zero_optimization", pydantic=True)
        object.__setattr__(self, "zenflow", _check_zenflow(self.zenflow, "zero_optimization.zenflow"))
        object.__setattr__(self, "leaf_module", _check_leaf_module(self.leaf_module, "zero_optimization.leaf_module"))
        for slot in SLOTS:
            object.__setattr__(self, slot, _place_offload(getattr(self, slot), slot))
        if self.overlap_comm is None and self.stage is not AUTO:
            object.__setattr__(self, "overlap_comm", self.stage == 3)  # DeepSpeed's overlap_comm_valid
        opt = self.offload_optimizer
        if opt is not None and opt.ratio < 1.0 and self.stage is not AUTO and self.stage != 3:
            raise ConfigError("zero_optimization.offload_optimizer.ratio",
                              f"got {opt.ratio!r}; partial offloading (ratio < 1) is only supported with ZeRO "
                              f"stage 3, but stage is {self.stage}", value=opt.ratio, expected="1.0 below stage 3")

    @property
    def enabled(self) -> bool:
        return self.stage is AUTO or self.stage > 0


def _place_offload(value: Any, slot: str) -> OffloadConfig | None:
    """Check an OffloadConfig against the keys of ``slot`` and fill the slot's buffer_count default."""
    if value is None:
        return None
    path = f"zero_optimization.{slot}"
    if not isinstance(value, OffloadConfig):
        raise bad_value(path, value, "an OffloadConfig or None (use load_config for DeepSpeed dicts)")
    for f in dataclasses.fields(OffloadConfig):
        if f.name not in _SLOT_KEYS[slot] and getattr(value, f.name) != f.default:
            raise ConfigError(join(path, f.name), f"DeepSpeed's {slot} has no key {f.name!r}; it belongs to the "
                              f"other offload block", value=getattr(value, f.name),
                              expected=f"one of the keys {sorted(_SLOT_KEYS[slot])}")
    if value.buffer_count is None:
        value = dataclasses.replace(value, buffer_count=_BUFFER_COUNT_DEFAULT[slot])
    return value


_DEPRECATED = MappingProxyType({
    "cpu_offload": "offload_optimizer",
    "cpu_offload_param": "offload_param",
    "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "cpu_offload_use_pin_memory": None,
})
_NESTED = ("offload_param", "offload_optimizer", "zenflow", "leaf_module")


def parse_zero(mapping: Any, path: str, notes: Notes) -> tuple[ZeroConfig, list[str]]:
    """Build a ZeroConfig from the user's ``zero_optimization`` mapping (DeepSpeed's rules)."""
    handled = tuple(_DEPRECATED) + _NESTED
    kwargs, set_paths = parse_fields(ZeroConfig, mapping, path, "zero_optimization", notes, Rule.STRICT,
                                     pydantic=True, handled=handled, block="zero_optimization")
    for slot in SLOTS:
        if slot in mapping and mapping[slot] is not None:
            kwargs[slot], sub = _parse_offload(mapping[slot], slot, join(path, slot), notes)
            set_paths += sub
    if mapping.get("zenflow") is not None:
        kwargs["zenflow"] = _check_zenflow(mapping["zenflow"], join(path, "zenflow"), notes)
        set_paths.append("zero_optimization.zenflow")
    if "leaf_module" in mapping:
        kwargs["leaf_module"] = _check_leaf_module(mapping["leaf_module"] or {}, join(path, "leaf_module"), notes)
        set_paths.append("zero_optimization.leaf_module")
    for old, new in _DEPRECATED.items():
        if old not in mapping:
            continue
        old_path = join(path, old)
        # DeepSpeed types the cpu_offload* keys Optional[bool] and the fp16-save key plain bool.
        value = (Bool() if old.startswith("stage3_") else Optional(Bool()))(mapping[old], old_path)
        if new is None:
            notes.warn(f"{old_path}: deprecated and ignored by DeepSpeed; set pin_memory in offload_param or "
                       "offload_optimizer instead")
            continue
        if new in mapping or (new == "gather_16bit_weights_on_model_save" and "stage3_" + new in mapping):
            raise ConfigError(old_path, f"deprecated key given together with its replacement {new!r}; DeepSpeed "
                              "rejects that (set only the new key)", value=mapping[old], expected=f"only {new!r}")
        notes.warn(f"{old_path}: deprecated; use {new!r} instead (DeepSpeed maps it there, and so does stepfx)")
        if new in SLOTS:
            kwargs[new] = OffloadConfig(device="cpu") if value else None
            if value:
                set_paths.append(f"zero_optimization.{new}.device")
        elif value is not None:
            kwargs[new] = value
            set_paths.append(f"zero_optimization.{new}")
    return ZeroConfig(**kwargs), set_paths


def _parse_offload(mapping: Any, slot: str, path: str, notes: Notes) -> tuple[OffloadConfig, list[str]]:
    if not isinstance(mapping, Mapping):
        raise bad_value(path, mapping, "a mapping (JSON object) or null")
    for key, value in mapping.items():
        if key not in _SLOT_KEYS[slot]:
            handle_unknown(join(path, key), value, _SLOT_KEYS[slot], Rule.STRICT, notes, path)
    if mapping.get("buffer_count", "auto") != "auto":  # None means "slot default" only in Python, not in JSON
        Int(ge=0)(mapping["buffer_count"], join(path, "buffer_count"))
    kwargs, set_paths = parse_fields(OffloadConfig, mapping, path, f"zero_optimization.{slot}", notes, Rule.STRICT,
                                     pydantic=True, block=path)
    return OffloadConfig(**kwargs), set_paths


def legacy_zero(enabled: Any, allgather_size: Any, notes: Notes) -> tuple[ZeroConfig, list[str]]:
    """``"zero_optimization": true|false`` (DeepSpeed's ``read_zero_config_deprecated``)."""
    on = Bool()(enabled, "zero_optimization")
    notes.warn("zero_optimization: a boolean is DeepSpeed's deprecated form; use {\"stage\": N} instead")
    if not on:
        return ZeroConfig(stage=0), ["zero_optimization.stage"]
    size = 500_000_000 if allgather_size is None else Int(ge=0)(allgather_size, "allgather_size")
    return ZeroConfig(stage=1, allgather_bucket_size=size), ["zero_optimization.stage",
                                                            "zero_optimization.allgather_bucket_size"]

