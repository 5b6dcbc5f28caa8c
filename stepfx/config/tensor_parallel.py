"""``tensor_parallel``: DeepSpeed's AutoTP training block, typed.

Mirrors ``deepspeed/runtime/tensor_parallel/config.py: TPTrainingConfig``
(DeepSpeed v0.19.5, a pydantic model with ``extra="forbid"``: an unknown key
is an error) and its ``partition_config``
(``module_inject/autotp_config.py``: ``use_default_specs`` and a list of
``layer_specs``, each with ``patterns``, ``partition_type`` "row" or
"column", optional ``shape`` and ``partition_dim``). ``vocab_parallel_lm_head``
(DeepSpeed's default false) is unset here unless given: unset, the search
splits embeddings and LM heads over the vocabulary where that propagates;
false keeps heads replicated; true requires a head to split.

What stepfx honours today (``applied.py``): ``autotp_size`` (Megatron pairs
found on the graph, ``passes/tensor_parallel``) and ``partition_config``
(its layer_specs split what they match; with ``use_default_specs`` the
search splits the rest), ``preset_model`` (DeepSpeed's presets,
``passes/tensor_parallel/presets.py``), ``vocab_parallel_lm_head`` and
``tp_overlap_comm`` (unset or true: on CUDA each TP collective is waited at
its first reader, so independent work such as the backward's weight-gradient
matmul runs meanwhile; false: waited where issued). The rest is validated and listed in
``Config.not_applied``.

The checks that need the world and the model (``autotp_size`` divides the
world size; head counts divisible by it) are :func:`check_tensor_parallel`,
called by the runtime once both are known.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, bad_value, join
from .rules import Notes, Rule, handle_unknown, parse_fields, spec, validate_fields
from .values import AnyMap, Anything, Bool, Choice, FrozenMap, Int, ListOf, OneOf, Optional, Str, StrList

__all__ = ["TensorParallelConfig", "LayerSpec", "parse_tensor_parallel", "check_tensor_parallel"]

PARTITION_TYPES = ("row", "column", "skip")
# DeepSpeed AutoTP's presets (module_inject/autotp_config.py: AutoTPPresets.get_preset); their layer specs are
# passes/tensor_parallel/presets.py's
PRESET_NAMES = ("bloom", "chatglm", "deepseek_v2", "llama", "mixtral", "phi3", "qwen2")
_LAYER_SPEC_KEYS = ("patterns", "partition_type", "shape", "partition_dim", "model_types", "gather_output")
_PARTITION_KEYS = ("use_default_specs", "layer_specs")
_SHAPE = Optional(ListOf(OneOf((Int(), ListOf(Int()), Str()))))


@dataclass(frozen=True)
class LayerSpec:
    """One ``partition_config.layer_specs`` entry: parameters whose names match
    ``patterns`` (regular expressions, matched at the name's start as
    DeepSpeed's ``re.match``) are split by ``partition_type`` ("skip": kept
    whole); ``shape`` at the partition dimension names fused parts (an int:
    that many equal parts; a list: their sizes); ``model_types``: only for
    models whose ``config.model_type`` is listed; ``gather_output``: a
    column whose output every rank reads whole (an LM head)."""

    patterns: tuple[str, ...] = spec((), StrList())
    partition_type: str = spec("column", Choice(PARTITION_TYPES, lower=True))
    shape: tuple | None = spec(None, _SHAPE)
    partition_dim: int | None = spec(None, Optional(Int(ge=0)))
    model_types: tuple[str, ...] | None = spec(None, Optional(StrList()))
    gather_output: bool = spec(False, Bool())

    def __post_init__(self):
        validate_fields(self, "tensor_parallel.partition_config.layer_specs[]", pydantic=True)
        if not self.patterns:
            raise bad_value("tensor_parallel.partition_config.layer_specs[].patterns", self.patterns,
                            "a non-empty list of regular expressions")
        if self.shape is not None:
            self._check_shape()

    def _check_shape(self) -> None:
        """DeepSpeed's rules (``TPLayerSpec._validate_shape_format``): the
        partition dimension exists; each size is a positive int or -1; one
        list of positive part sizes at most, at the partition dimension."""
        path = "tensor_parallel.partition_config.layer_specs[].shape"
        expected = "ints > 0 or -1, with at most a list of positive part sizes at the partition dimension"
        dim = self.partition_dim if self.partition_dim is not None else (0 if self.partition_type == "column" else 1)
        if dim >= len(self.shape):
            raise bad_value(path, list(self.shape), f"a shape with the partition dimension {dim}")
        for i, size in enumerate(self.shape):
            if isinstance(size, (list, tuple)):
                if i != dim or not size or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in size):
                    raise bad_value(path, list(self.shape), expected)
            elif not isinstance(size, int) or isinstance(size, bool) or size == 0 or size < -1:
                raise bad_value(path, list(self.shape), expected)


@dataclass(frozen=True)
class TensorParallelConfig:
    """``tensor_parallel`` with DeepSpeed's keys and defaults.

    ``autotp_size`` 0 or 1: no tensor parallelism (DeepSpeed's default 0).
    ``partition_config``: None, or ``{"use_default_specs": bool,
    "layer_specs": (LayerSpec, ...)}``.
    """

    autotp_size: int = spec(0, Int(ge=0))
    tp_overlap_comm: bool | None = spec(None, Optional(Bool()))  # None: on (DeepSpeed's default false: off)
    preset_model: str | None = spec(None, Optional(Str()))
    vocab_parallel_lm_head: bool | None = spec(None, Optional(Bool()))  # None: the search decides
    partition_config: FrozenMap | None = spec(None, Optional(AnyMap()))
    # DeepSpeed's other keys, read by its inference / injection paths: kept, not acted on
    dtype: Any = spec(None, Anything())
    tensor_parallel: FrozenMap | None = spec(None, Optional(AnyMap()))
    tp: FrozenMap | None = spec(None, Optional(AnyMap()))
    injection_policy_tuple: Any = spec(None, Anything())
    keep_module_on_host: bool = spec(False, Bool())
    replace_with_kernel_inject: bool = spec(False, Bool())
    kernel_inject: bool = spec(False, Bool())

    def __post_init__(self):
        validate_fields(self, "tensor_parallel", pydantic=True)
        if self.preset_model is not None and self.preset_model.lower() not in PRESET_NAMES:
            raise bad_value("tensor_parallel.preset_model", self.preset_model, " | ".join(PRESET_NAMES))
        if self.partition_config is not None:
            object.__setattr__(self, "partition_config", _check_partition(self.partition_config))

    @property
    def degree(self) -> int:
        """The tensor-parallel degree (1: off)."""
        return max(1, self.autotp_size)

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        return tuple(self.partition_config.get("layer_specs", ())) if self.partition_config else ()


def _check_partition(value: Any, notes: Notes | None = None) -> FrozenMap:
    path = "tensor_parallel.partition_config"
    if not isinstance(value, Mapping):
        raise bad_value(path, value, "a mapping with use_default_specs and layer_specs")
    for key, v in value.items():
        if key not in _PARTITION_KEYS:
            handle_unknown(join(path, key), v, _PARTITION_KEYS, Rule.STRICT, notes or Notes(True), path)
    use_default = Bool()(value.get("use_default_specs", True), join(path, "use_default_specs"))
    specs = value.get("layer_specs", ())
    if not isinstance(specs, (list, tuple)):
        raise bad_value(join(path, "layer_specs"), specs, "a list of layer specs")
    out = []
    for i, item in enumerate(specs):
        item_path = f"{path}.layer_specs[{i}]"
        if isinstance(item, LayerSpec):
            out.append(item)
            continue
        if not isinstance(item, Mapping):
            raise bad_value(item_path, item, "a mapping with patterns and partition_type")
        for key, v in item.items():
            if key not in _LAYER_SPEC_KEYS:
                handle_unknown(join(item_path, key), v, _LAYER_SPEC_KEYS, Rule.STRICT, notes or Notes(True), item_path)
        try:
            out.append(LayerSpec(**dict(item)))
        except ConfigError as e:  # name the entry, not "layer_specs[]"
            raise ConfigError(e.path.replace("layer_specs[]", f"layer_specs[{i}]"), str(e).split(": ", 1)[-1],
                              value=e.value, expected=e.expected) from None
    return FrozenMap({"use_default_specs": use_default, "layer_specs": tuple(out)})


def parse_tensor_parallel(mapping: Any, path: str, notes: Notes) -> tuple[TensorParallelConfig, list[str]]:
    """Build a TensorParallelConfig from the user's ``tensor_parallel`` mapping."""
    kwargs, set_paths = parse_fields(TensorParallelConfig, mapping, path, "tensor_parallel", notes, Rule.STRICT,
                                     pydantic=True, handled=("partition_config",), block="tensor_parallel")
    if mapping.get("partition_config") is not None:
        kwargs["partition_config"] = _check_partition(mapping["partition_config"], notes)
        set_paths.append("tensor_parallel.partition_config")
    return TensorParallelConfig(**kwargs), set_paths


def check_tensor_parallel(config: TensorParallelConfig, world_size: int, heads: dict[str, int] | None = None) -> int:
    """The TP degree, checked against the world and the model's head counts
    (``heads``: e.g. {"num_attention_heads": 12, "num_key_value_heads": 4};
    a key-value head count of 1 is replicated, as Megatron does for MQA).
    Raises ConfigError naming the numbers."""
    tp = config.degree
    if tp == 1:
        return 1
    if world_size % tp:
        raise ConfigError("tensor_parallel.autotp_size", f"{tp} does not divide the world size {world_size}; "
                          f"tensor-parallel groups are {tp} consecutive ranks", value=tp,
                          expected=f"a divisor of {world_size}")
    for name, count in (heads or {}).items():
        if count and count % tp and not (name == "num_key_value_heads" and count == 1):
            raise ConfigError("tensor_parallel.autotp_size", f"{tp} does not divide the model's {name} ({count}); "
                              "each rank must hold whole heads", value=tp, expected=f"a divisor of {count}")
    return tp
