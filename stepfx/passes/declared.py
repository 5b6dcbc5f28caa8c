"""The declared pass pipeline: one explicit ordered list, each entry with the
reason for its place. ``disable=`` in the config turns passes off by name.

The passes live in subpackages by concern (``cleanup``, ``data_parallel``,
``precision``, ``fusion``, ...); their order is decided here and only here."""
from __future__ import annotations

from .cleanup.drop_profiler_nodes import drop_profiler_nodes
from .cleanup.eliminate_dead_code import eliminate_dead_code
from .cleanup.fold_causal_masks import fold_causal_masks
from .cleanup.functionalize_graph import functionalize_graph
from .cleanup.hoist_getitems import hoist_getitems
from .cleanup.hoist_symbolic_sizes import hoist_symbolic_sizes
from .cleanup.prune_unchanged_outputs import prune_unchanged_outputs
from .cleanup.remove_aliases import remove_aliases
from .cleanup.replay_checkpoint_randomness import replay_checkpoint_randomness
from .cleanup.unrepeat_kv_heads import unrepeat_kv_heads
from .cleanup.choose_attention_kernels import choose_attention_kernels
from .data_parallel.fuse_bucket_packing import fuse_bucket_packing
from .memory.host_master_weights import delayed_update, host_master_weights, master_weights_apply
from .memory.offload_optimizer import offload_optimizer, offload_settings
from .memory.offload_parameters import offload_parameters, param_offload_settings
from .memory.offload_activations import activations_apply, offload_activations
from .memory.recompute_activations import recompute_activations
from .memory.update_across_steps import across_steps_apply, update_across_steps
from .data_parallel.hold_accumulated_gradients import accumulation_steps, hold_accumulated_gradients
from .data_parallel.place_gradients_early import place_gradients_early
from .data_parallel.plan_zero_layout import plan_zero_layout, zero_settings
from .data_parallel.reduce_gradients import reduce_gradients
from .data_parallel.schedule_collectives import data_parallel_overlap, schedule_collectives, tensor_parallel_overlap
from .data_parallel.shard_optimizer_update import shard_optimizer_update
from .data_parallel.shard_parameters import shard_parameters
from .fusion.batch_optimizer_updates import batch_optimizer_updates
from .fusion.batch_sum_squares import batch_sum_squares
from .fusion.fuse_attention import fuse_attention
from .fusion.fuse_bias_gradients import fuse_bias_gradients
from .fusion.fuse_casts import fuse_casts
from .fusion.fuse_column_sums import fuse_column_sums
from .fusion.fuse_generic_regions import fuse_generic_regions, regions_apply
from .fusion.fuse_layer_norm import fuse_layer_norm
from .fusion.fuse_linear_cross_entropy import fuse_linear_cross_entropy
from .fusion.fuse_linear_gelu import fuse_linear_gelu
from .fusion.fuse_optimizer_update import fuse_optimizer_update
from .fusion.fuse_residual_layer_norm import fuse_residual_layer_norm
from .fusion.fuse_rms_norm import fuse_rms_norm
from .fusion.fuse_sum_squares import fuse_sum_squares
from .manager import PipelineEntry
from .precision.batch_parameter_casts import batch_parameter_casts
from .precision.carry_parameter_copies import carry_parameter_copies
from .precision.fold_gradient_casts import fold_gradient_casts
from .precision.skip_step_on_overflow import skip_step_on_overflow
from .precision.unscale_clip_gradients import precision_settings, unscale_clip_gradients
from .pipeline.partition_stages import partition_stages, pipeline_settings
from .tensor_parallel.plan_tensor_parallel import plan_tensor_parallel
from .tensor_parallel.shard_tensor_parallel import shard_tensor_parallel

__all__ = ["PIPELINE", "CLEANUP_PASSES", "pass_names", "codegen_enabled"]


def _data_parallel(options) -> bool:
    # under pipeline parallelism the runtime averages each stage's accumulated gradients itself
    return (options.world_size > 1 or zero_settings(options)[0] > 0) and pipeline_settings(options) <= 1


def _overlap(options) -> bool:
    return (_data_parallel(options) and data_parallel_overlap(options)) or tensor_parallel_overlap(options)


def codegen_enabled(options) -> bool:
    """``stepfx.codegen`` as the step resolved it (None: on for CUDA, off for CPU)."""
    value = getattr(getattr(options.config, "stepfx", None), "codegen", None)
    return options.device_type == "cuda" if value is None else bool(value)


def codegen_across_parameters(options) -> bool:
    """Codegen's passes that batch many parameters into one launch (their casts, updates, sums of
    squares, carried copies): not under a pipeline, whose stages own different parameters (one
    launch would span stages)."""
    return codegen_enabled(options) and pipeline_settings(options) <= 1


def _stage_at_least(stage: int):
    # under pipeline parallelism ZeRO-1 is the runtime's (each data-parallel rank of a stage updates its
    # share of the stage's parameters): the graph stays whole
    return lambda options: zero_settings(options)[0] >= stage and pipeline_settings(options) <= 1

PIPELINE: tuple[PipelineEntry, ...] = (
    PipelineEntry(
        "functionalize_graph",
        functionalize_graph,
        "first: every later pass assumes no node writes a graph input",
    ),
    PipelineEntry(
        "drop_profiler_nodes",
        drop_profiler_nodes,
        "torch.optim's record_function markers compute nothing and clutter what later passes and readers see",
    ),
    PipelineEntry(
        "remove_aliases",
        remove_aliases,
        "after functionalization detach/alias are bookkeeping; removing them exposes unchanged outputs",
    ),
    PipelineEntry(
        "prune_unchanged_outputs",
        prune_unchanged_outputs,
        "needs aliases gone to see that an output is its own input (frozen params, untouched buffers)",
    ),
    PipelineEntry(
        "replay_checkpoint_randomness",
        replay_checkpoint_randomness,
        "a cleanup on the functional graph, before eliminate_dead_code (which removes the second draw's inputs) "
        "and recompute_activations: a checkpointed region's recomputed dropout reuses the forward's mask",
    ),
    PipelineEntry(
        "fold_causal_masks",
        fold_causal_masks,
        "a cleanup, before eliminate_dead_code (which removes the mask's computation once no attention reads it): "
        "attention runs as eager's, with is_causal and no mask, where the library built one only because it saw tracing",
    ),
    PipelineEntry(
        "unrepeat_kv_heads",
        unrepeat_kv_heads,
        "after fold_causal_masks (a kernel reading a mask may not take grouped heads) and before eliminate_dead_code "
        "(which removes the repeats): grouped-query attention reads K/V unrepeated, as eager's enable_gqa does",
    ),
    PipelineEntry(
        "choose_attention_kernels",
        choose_attention_kernels,
        "after fold_causal_masks (a folded mask is is_causal, no bias) and unrepeat_kv_heads (the heads it reads), "
        "before eliminate_dead_code: with symbolic lengths attention runs flash (or cuDNN on padded buckets): no plan per new length",
    ),
    PipelineEntry(
        "eliminate_dead_code",
        eliminate_dead_code,
        "after the cleanups: they leave unused nodes behind; ZeRO needs the real set of updated parameters",
    ),
    PipelineEntry(
        "hoist_symbolic_sizes",
        hoist_symbolic_sizes,
        "symbolic batch sizes, once the graph is functional and clean: later passes and the memory plan see "
        "size reads of batch inputs only, not extra readers of activations",
    ),
    PipelineEntry(
        "plan_tensor_parallel",
        plan_tensor_parallel,
        "on the clean graph (cleanups done, sizes hoisted): the column/row search reads the data flow as captured",
        applies=lambda options: options.tp_size > 1,
    ),
    PipelineEntry(
        "shard_tensor_parallel",
        shard_tensor_parallel,
        "right after its plan, before recomputation and ZeRO: recomputed copies read the shards, and ZeRO "
        "buckets and reduces this rank's shards over the data-parallel group",
        applies=lambda options: options.tp_size > 1,
    ),
    PipelineEntry(
        "recompute_activations",
        recompute_activations,
        "on the clean graph, before ZeRO and precision: what the backward recomputes reads parameters and "
        "activations as the backward does (stage 3 gathers them there), and the fusion passes see the copies",
    ),
    PipelineEntry(
        "hold_accumulated_gradients",
        hold_accumulated_gradients,
        "before ZeRO: accumulators held by the rank are state ZeRO may keep even where it shards gradients",
        applies=lambda options: accumulation_steps(options) > 1 and pipeline_settings(options) <= 1,
    ),
    PipelineEntry(
        "place_gradients_early",
        place_gradients_early,
        "before the ZeRO rewrites: a bucket's collective goes right after its last gradient, so gradients must "
        "sit where they are computed (captured mixed-precision graphs put their fp32 casts after the backward)",
        applies=_data_parallel,
    ),
    PipelineEntry(
        "plan_zero_layout",
        plan_zero_layout,
        "before any ZeRO rewrite: buckets and pieces are decided once, from parameters and config",
        applies=_data_parallel,
    ),
    PipelineEntry(
        "reduce_gradients",
        reduce_gradients,
        "whole-gradient buckets (stage 0/1) are averaged before anything reads them",
        applies=_data_parallel,
    ),
    PipelineEntry(
        "shard_optimizer_update",
        shard_optimizer_update,
        "stage >= 1: after reduction, the update shrinks to this rank's pieces",
        applies=_stage_at_least(1),
    ),
    PipelineEntry(
        "shard_parameters",
        shard_parameters,
        "stage 3, after shard_optimizer_update: its piece cuts become the parameters at rest",
        applies=_stage_at_least(3),
    ),
    PipelineEntry(
        "unscale_clip_gradients",
        unscale_clip_gradients,
        "after ZeRO: the norm counts each element of the averaged gradients once, whole or as pieces",
        applies=lambda options: any(precision_settings(options)),
    ),
    PipelineEntry(
        "skip_step_on_overflow",
        skip_step_on_overflow,
        "after the overflow flag exists and every state update is final (pieces included)",
        applies=lambda options: precision_settings(options)[0],
    ),
    PipelineEntry(
        "offload_optimizer",
        offload_optimizer,
        "after the update is sharded and its factor and overflow flag exist (what it reads is final), before "
        "schedule_collectives (which places the gathers of the pieces it returns) and the fusions (which would "
        "otherwise make it a device kernel)",
        applies=lambda options: offload_settings(options) is not None,
    ),
    PipelineEntry(
        "host_master_weights",
        host_master_weights,
        "right after offload_optimizer (the updates are host jobs it makes work on host-held pieces) and before "
        "schedule_collectives and the fusions (which would take the casts it replaces into kernels)",
        applies=lambda options: master_weights_apply(options) is None or delayed_update(options),
    ),
    PipelineEntry(
        "schedule_collectives",
        schedule_collectives,
        "after every collective exists: prefetch gathers, wait as late as readers allow (CUDA only)",
        applies=lambda options: options.device_type == "cuda" and _overlap(options),
    ),
    PipelineEntry(
        "fuse_linear_cross_entropy",
        fuse_linear_cross_entropy,
        "codegen, first of the fusions: it removes the logits and their backward matmuls outright",
        applies=codegen_enabled,
    ),
    PipelineEntry(
        "fuse_attention",
        fuse_attention,
        "codegen, after choose_attention_kernels (its flash calls) and recompute_activations (recomputed attention "
        "is taken with the rest): a swap by identity that changes no dependency",
        applies=codegen_enabled,
    ),
    PipelineEntry(
        "fuse_layer_norm",
        fuse_layer_norm,
        "codegen, after the graph's structure is final: a swap by identity that changes no dependency",
        applies=codegen_enabled,
    ),
    PipelineEntry(
        "fuse_rms_norm",
        fuse_rms_norm,
        "codegen, with the other norms, before fuse_generic_regions (which would take the written-out ops as regions) "
        "and before the casts are fused (it matches the norm's own casts)",
        applies=codegen_enabled,
    ),
    PipelineEntry(
        "fuse_residual_layer_norm",
        fuse_residual_layer_norm,
        "codegen, after fuse_layer_norm (the norm is its kernel call): the residual add joins the norm that reads it",
        applies=codegen_enabled,
    ),
    PipelineEntry(
        "fuse_linear_gelu",
        fuse_linear_gelu,
        "codegen, after recompute_activations (which decides the pre-activations the backward reads) and before "
        "fuse_generic_regions (which would take the GELU into a region with the ops around it)",
        applies=codegen_enabled,
    ),
    PipelineEntry(
        "fuse_sum_squares",
        fuse_sum_squares,
        "codegen, after unscale_clip_gradients made the norm (sums of squares, or torch's order that it turns into sums over 16-bit gradients)",
        applies=codegen_enabled,
    ),
    PipelineEntry(
        "fuse_optimizer_update",
        fuse_optimizer_update,
        "after every pass that shapes the update: its ops are final (ZeRO pieces, unscale/clip factor, overflow guards) and every collective "
        "is placed, so it knows whether the kernel may write in place",
        applies=codegen_enabled,
    ),
    PipelineEntry(
        "fuse_bucket_packing",
        fuse_bucket_packing,
        "codegen: before fuse_casts, so the conversions into buckets are still aten casts it can take into the pack",
        applies=codegen_enabled,
    ),
    PipelineEntry(
        "fuse_casts",
        fuse_casts,
        "codegen: after fuse_optimizer_update, whose check runs the update's ops on CPU samples: a swap by identity (the 16-bit compute copies of parameters and ZeRO shards)",
        applies=codegen_enabled,
    ),
    PipelineEntry(
        "batch_parameter_casts",
        batch_parameter_casts,
        "codegen: after fuse_casts (the large casts are its kernel calls), all the parameters' 16-bit copies in one launch",
        applies=codegen_across_parameters,
    ),
    PipelineEntry(
        "fuse_column_sums",
        fuse_column_sums,
        "codegen: a swap by identity (bias gradients); before fuse_generic_regions, which would take them as reductions",
        applies=codegen_enabled,
    ),
    PipelineEntry(
        "fuse_bias_gradients",
        fuse_bias_gradients,
        "codegen, after fuse_column_sums and the norm fusions: the kernels that write a bias's output gradient also sum it",
        applies=codegen_enabled,
    ),
    PipelineEntry(
        "fold_gradient_casts",
        fold_gradient_casts,
        "after the fusions: only then are the fused kernels the fp32 gradient copies' sole readers",
        applies=codegen_enabled,
    ),
    PipelineEntry(
        "batch_optimizer_updates",
        batch_optimizer_updates,
        "after fold_gradient_casts (which reads single updates' gradient arguments): hundreds of launches become one",
        applies=codegen_across_parameters,
    ),
    PipelineEntry(
        "carry_parameter_copies",
        carry_parameter_copies,
        "after batch_parameter_casts (the copies are one pack) and batch_optimizer_updates (the update that "
        "writes them is one call), when no later pass moves a reader of the copies past it",
        applies=codegen_across_parameters,
    ),
    PipelineEntry(
        "batch_sum_squares",
        batch_sum_squares,
        "after fold_gradient_casts (so the sums read the 16-bit gradients): hundreds of launches become two",
        applies=codegen_across_parameters,
    ),
    PipelineEntry(
        "fuse_generic_regions",
        fuse_generic_regions,
        "last: what stepfx's own kernels did not take is generic, and goes to inductor",
        applies=regions_apply,
    ),
    PipelineEntry(
        "hoist_getitems",
        hoist_getitems,
        "after the recomputation and the fusions (which read results of multi-output ops from later nodes), before "
        "offload_activations (a forward result the backward reads is then a forward value it can store): the "
        "op's tuple no longer keeps every result alive until its last reader",
    ),
    PipelineEntry(
        "offload_activations",
        offload_activations,
        "after the fusions and the recomputation (what the backward reads from the forward is final): "
        "DeepSpeed's cpu_checkpointing keeps those values on the host in between, partition_activations each "
        "tensor-parallel rank's share of them; not under pipeline parallelism (each stage's program is cut after it)",
        applies=activations_apply,
    ),
    PipelineEntry(
        "update_across_steps",
        update_across_steps,
        "after every pass that moves readers of the stage-3 pieces and their copies (the fusions): their first "
        "readers wait for the previous step's host update; before offload_parameters, which it refuses",
        applies=across_steps_apply,
    ),
    PipelineEntry(
        "offload_parameters",
        offload_parameters,
        "after every pass that reads the stage-3 pieces (the fusions, the carried 16-bit copies, the host update): "
        "each device reader gets its fetch, and before partition_stages (which refuses it anyway)",
        applies=lambda options: param_offload_settings(options) is not None,
    ),
    PipelineEntry(
        "partition_stages",
        partition_stages,
        "last, once the graph is final: it marks every op with its pipeline stage, and the stage programs are cut "
        "from exactly the graph that the other passes left",
        applies=lambda options: pipeline_settings(options) > 1,
    ),
)


# The leading passes that clean the captured graph: none reads the ZeRO stage, the offload blocks or the
# recomputation level, which are all the memory planner's candidates change, so the planner runs them once
# and each candidate's pipeline resumes after them (PassManager.run's ``resume``)
CLEANUP_PASSES = 1 + next(i for i, e in enumerate(PIPELINE) if e.name == "hoist_symbolic_sizes")


def pass_names() -> tuple[str, ...]:
    return tuple(e.name for e in PIPELINE)
