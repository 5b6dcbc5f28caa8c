"""DeepSpeed's top-level keys that stepfx accepts but does not type, and how each is read.

The typed blocks (zero_optimization, fp16, bf16/bfloat16, optimizer,
scheduler, stepfx, tensor_parallel) and the typed top-level scalars live on ``Config``; this
file lists everything else DeepSpeed v0.19.5 reads, with the rule
(``rules.Rule``) DeepSpeed applies and where that comes from. Values are
checked with the types DeepSpeed's code needs, and kept in ``Config.raw``.

A key in none of these tables and not a Config field is unknown: DeepSpeed
never looks at it, so stepfx warns and lists it in ``Config.ignored_keys``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .errors import bad_value, join
from .rules import Notes, Rule, auto_not_allowed, handle_unknown, is_auto
from .values import AnyMap, Anything, Bool, Check, Choice, Float, Int, ListOf, OneOf, Optional, Str

# DeepSpeed's DtypeEnum spellings (runtime/config.py), used by data_types and torch_autocast.
DTYPE_NAMES = ("torch.float16", "fp16", "float16", "half", "torch.float32", "fp32", "float32", "float",
               "torch.int8", "int8", "torch.bfloat16", "bf16", "bfloat16")
_DTYPE = Optional(Choice(DTYPE_NAMES))
_B, _I, _S, _F = Bool(), Int(), Str(), Float()
_OS = Optional(_S)


@dataclass(frozen=True)
class Block:
    """How one untyped top-level block is read.

    ``keys``: the keys DeepSpeed reads and their checkers (empty for OPAQUE).
    ``enabled_default``: DeepSpeed's default for the block's ``enabled``
    switch, or None when the block has no switch (then it is on whenever present).
    ``source``: where DeepSpeed reads it.
    """

    rule: Rule
    source: str
    keys: Mapping[str, Check] = field(default_factory=dict)
    enabled_default: bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "keys", MappingProxyType(dict(self.keys)))


@dataclass(frozen=True)
class StrictKeys:
    """A nested pydantic block used as a value checker (e.g. ``timers.throughput``): unknown keys are errors."""

    keys: Mapping[str, Check]
    block: str
    expected: str = "a mapping (JSON object)"

    def __post_init__(self):
        object.__setattr__(self, "keys", MappingProxyType(dict(self.keys)))

    def __call__(self, value: Any, path: str) -> Any:
        # STRICT never warns, so these notes stay empty.
        check_block_keys(value, path, Block(Rule.STRICT, self.block, self.keys), Notes())
        return value


_COMPILE_BOOLS = ("deepcompile", "free_activation", "offload_activation", "offload_activation_pin_memory",
                  "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log", "offload_parameters",
                  "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
                  "keep_int_input_tensors", "keep_all_input_tensors")

BLOCKS: Mapping[str, Block] = MappingProxyType({
    # --- STRICT: pydantic DeepSpeedConfigModel, extra="forbid" ---
    "comms_logger": Block(Rule.STRICT, "comm/config.py: CommsLoggerConfig", {
        "enabled": _B, "prof_all": _B, "prof_ops": ListOf(_S), "verbose": _B, "debug": _B}, False),
    "tensorboard": Block(Rule.STRICT, "monitor/config.py: TensorBoardConfig", {
        "enabled": _B, "output_path": _S, "job_name": _S}, False),
    "wandb": Block(Rule.STRICT, "monitor/config.py: WandbConfig", {
        "enabled": _B, "group": _OS, "team": _OS, "project": _S}, False),
    "csv_monitor": Block(Rule.STRICT, "monitor/config.py: CSVConfig", {
        "enabled": _B, "output_path": _S, "job_name": _S}, False),
    "comet": Block(Rule.STRICT, "monitor/config.py: CometConfig", {
        "enabled": _B, "samples_log_interval": _I, "project": _OS, "workspace": _OS, "api_key": _OS,
        "experiment_name": _OS, "experiment_key": _OS, "online": Optional(_B), "mode": _OS}, False),
    "hybrid_engine": Block(Rule.STRICT, "runtime/config.py: HybridEngineConfig", {
        "enabled": _B, "max_out_tokens": _I, "inference_tp_size": _I, "release_inference_cache": _B,
        "pin_parameters": _B, "tp_gather_partition_size": _I, "enable_cuda_graph": _B}, False),
    "weight_quantization": Block(Rule.STRICT, "inference/config.py: WeightQuantConfig", {
        "enabled": _B, "num_bits": _I, "q_type": Choice(("asymmetric", "symmetric")), "q_groups": _I,
        "quantized_initialization": AnyMap(), "post_init_quant": AnyMap()}, True),
    # --- TIGHTENED: strict since v0.16.6 (DeepCompile's CompileConfig); v0.14's torch.compile block had
    # enabled/backend/kwargs, and axolotl's configs still carry disable/backend.
    "compile": Block(Rule.TIGHTENED, "compile/config.py: CompileConfig", {
        **{name: _B for name in _COMPILE_BOOLS}, "free_activation_threshold": Int(ge=0),
        "passes": Optional(ListOf(Choice(("z1", "z3", "autosp", "autotp"))))}),
    # --- LENIENT: dict lookups (get_scalar_param / dict.get) ---
    "activation_checkpointing": Block(Rule.LENIENT, "runtime/activation_checkpointing/config.py", {
        "partition_activations": _B, "contiguous_memory_optimization": _B, "cpu_checkpointing": _B,
        "number_checkpoints": Optional(Int(ge=0)), "synchronize_checkpoint_boundary": _B, "profile": _B}),
    "flops_profiler": Block(Rule.LENIENT, "profiling/config.py: DeepSpeedFlopsProfilerConfig", {
        "enabled": _B, "recompute_fwd_factor": _F, "profile_step": _I, "module_depth": _I, "top_modules": _I,
        "detailed": _B, "output_file": _OS}, False),
    "aio": Block(Rule.LENIENT, "runtime/swap_tensor/aio_config.py: get_aio_config", {
        "block_size": Int(ge=1), "queue_depth": Int(ge=1), "intra_op_parallelism": Int(ge=1),
        "single_submit": _B, "overlap_events": _B, "use_gds": _B}),
    "data_types": Block(Rule.LENIENT, "runtime/config.py: get_data_types_params", {
        "grad_accum_dtype": _DTYPE, "param_dtype": _DTYPE, "buffer_dtype": _DTYPE}),
    "torch_autocast": Block(Rule.LENIENT, "runtime/config.py: get_torch_autocast_*", {
        "enabled": _B, "dtype": _DTYPE, "lower_precision_safe_modules": Optional(ListOf(_S))}, False),
    "progressive_layer_drop": Block(Rule.LENIENT, "runtime/config.py: get_pld_*", {
        "enabled": _B, "theta": _F, "gamma": _F}, False),
    "eigenvalue": Block(Rule.LENIENT, "runtime/config.py: get_eigenvalue_*", {
        "enabled": _B, "verbose": _B, "max_iter": _I, "tol": _F, "stability": _F, "gas_boundary_resolution": _I,
        "layer_name": _S, "layer_num": _I}, False),
    "checkpoint": Block(Rule.LENIENT, "runtime/config.py + runtime/model_checkpointing/config.py", {
        "tag_validation": _S, "load_universal": _B, "use_node_local_storage": _B, "parallel_write": AnyMap(),
        "checkpoint_serialization": _B, "writer": Optional(AnyMap())}),
    "elasticity": Block(Rule.LENIENT, "elasticity/config.py: ElasticityConfig", {
        "enabled": _B, "max_train_batch_size": _I, "micro_batch_sizes": ListOf(Int(ge=1)), "min_gpus": _I,
        "max_gpus": _I, "num_gpus_per_node": _I, "model_parallel_size": _I, "min_time": _I, "version": _F,
        "prefer_larger_batch": _B, "ignore_non_elastic_batch_info": _B}, False),
    "timers": Block(Rule.LENIENT, "utils/config.py: get_timers_config", {
        "throughput": StrictKeys({"enabled": _B, "synchronized": _B}, "timers.throughput")}),
    # --- OPAQUE: nested schemas stepfx does not look into (yet) ---
    "amp": Block(Rule.OPAQUE, "runtime/config.py: get_amp_params (passed to apex.amp.initialize)", {}, False),
    "compression_training": Block(Rule.OPAQUE, "compression/config.py"),
    "quantize_training": Block(Rule.OPAQUE, "compression/config.py: get_quantize_enabled"),
    "data_efficiency": Block(Rule.OPAQUE, "runtime/data_pipeline/config.py", {}, False),
    "curriculum_learning": Block(Rule.OPAQUE, "runtime/data_pipeline/config.py (legacy)", {}, False),
    "sparse_attention": Block(Rule.OPAQUE, "runtime/config.py: get_sparse_attention"),
    "autotuning": Block(Rule.OPAQUE, "autotuning/config.py", {}, False),
    "expert_parallel": Block(Rule.OPAQUE, "module_inject/auto_ep_config.py", {}, False),
    "nebula": Block(Rule.OPAQUE, "nebula/config.py", {}, False),
    "datastates_ckpt": Block(Rule.OPAQUE, "datastates/config.py"),
})

# Top-level scalars DeepSpeed reads (runtime/config.py: _initialize_params) that stepfx does not type.
SCALARS: Mapping[str, Check] = MappingProxyType({
    "dump_state": _B, "disable_allgather": _B, "graph_harvesting": _B, "dataloader_drop_last": _B,
    "managed_gradient_accumulation": _B, "use_data_before_expert_parallelism": _B, "log_level": _OS,
    "vocabulary_size": Optional(Int(ge=1)), "sequence_parallel_size": OneOf((Int(ge=1), Float(gt=0))),
    "allgather_size": Int(ge=0),
})

def check_block_keys(value: Any, path: str, block: Block, notes: Notes) -> None:
    """Check one untyped block's keys and values by its rule; raise or warn as DeepSpeed would."""
    if block.rule is Rule.OPAQUE:
        return
    if not isinstance(value, Mapping):
        raise bad_value(path, value, "a mapping (JSON object)")
    for key, v in value.items():
        key_path = join(path, key)
        check = block.keys.get(key)
        if check is None:
            handle_unknown(key_path, v, block.keys, block.rule, notes, path)
        elif is_auto(v):
            if block.rule is not Rule.STRICT:  # pydantic models drop "auto"; dict lookups would use the string
                raise auto_not_allowed(key_path)
        else:
            check(v, key_path)


def block_enabled(name: str, value: Any) -> bool:
    """Whether a present untyped block is switched on (False only when its ``enabled`` is off)."""
    block = BLOCKS[name]
    if block.enabled_default is None or not isinstance(value, Mapping):
        return True
    enabled = value.get("enabled", block.enabled_default)
    # as DeepSpeed's pydantic models read it: "false" is off, not a non-empty string
    return is_auto(enabled) or Bool()(enabled, f"{name}.enabled")
