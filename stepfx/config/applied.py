"""The config key paths stepfx acts on today.

``Config.not_applied`` lists every key path the user set that is *not*
covered here: DeepSpeed keys stepfx accepts but does not implement yet, so
that nothing in a user's file is dropped silently. Add a path here in the
same change that makes a pass or the runtime honour it.

A path is covered by an exact entry ("train_batch_size") or by an entry
ending in ".*" for a whole block ("stepfx.*"). Paths are canonical: aliases
resolved (``stage3_max_live_parameters`` ->
``zero_optimization.max_live_parameters``, ``bfloat16`` -> ``bf16``).
"""
from __future__ import annotations

APPLIED: frozenset[str] = frozenset({
    "stepfx.*",  # stepfx's own options
    # ZeRO (passes/data_parallel: plan_zero_layout, reduce_gradients, shard_*, schedule_collectives)
    "zero_optimization.stage",
    "zero_optimization.reduce_bucket_size",  # the bucket size of every collective
    "zero_optimization.prefetch_bucket_size",  # how far ahead stage-3 gathers run
    "zero_optimization.max_live_parameters",  # also bounds prefetch (a single larger bucket still gathers whole)
    "zero_optimization.max_reuse_distance",  # keep a forward gather for backward when reused this soon
    "zero_optimization.param_persistence_threshold",  # stage-3 parameters kept whole
    "zero_optimization.overlap_comm",  # false: collectives are waited for at once
    "zero_optimization.reduce_scatter",  # false: stage 2/3 all-reduce, then keep the shard
    # stepfx's buckets are always contiguous and always all-gathered; these
    # DeepSpeed switches choose between equivalent ways of moving the same bytes
    "zero_optimization.contiguous_gradients",
    "zero_optimization.allgather_partitions",
    # offload (passes/memory: offload_optimizer, host_master_weights, offload_parameters); DeepSpeed's NVMe
    # swapping knobs (buffer_count of the optimizer's, buffer_size, max_in_cpu, pipeline_read/write) are not used
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_optimizer.nvme_path",
    "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_optimizer.ratio",
    "zero_optimization.offload_param.device",
    "zero_optimization.offload_param.nvme_path",
    "zero_optimization.offload_param.pin_memory",
    "zero_optimization.offload_param.buffer_count",  # how many fetches run ahead of their readers
    # tensor parallelism: Megatron pairs found on the graph (passes/tensor_parallel), or named by
    # partition_config's layer_specs (or a Hugging Face model's base_model_tp_plan); embeddings and LM heads split over
    # the vocabulary (vocab_parallel_lm_head); DeepSpeed's presets (preset_model, passes/tensor_parallel/presets.py);
    "tensor_parallel.tp_overlap_comm",  # schedule_collectives: TP waits at their first reader (CUDA)
    "tensor_parallel.autotp_size",
    "tensor_parallel.partition_config",
    "tensor_parallel.preset_model",
    "tensor_parallel.vocab_parallel_lm_head",
    # pipeline parallelism (passes/pipeline, runtime/pipeline.py): stages and how they are cut;
    # seed_layers is not honoured yet
    "pipeline.stages",
    "pipeline.pipe_partitioned",  # under TP: activations cross stages in TP slices, gathered at the receiver
    "pipeline.grad_partitioned",  # ... and their gradients
    "pipeline.partition",
    "activation_checkpointing.cpu_checkpointing",  # passes/memory/offload_activations.py (not under pipeline)
    "activation_checkpointing.partition_activations",  # the same pass: over the tensor-parallel group (none: no-op)
    "pipeline.activation_checkpoint_interval",  # > 0: recompute_activations at budget 0 (the graph's cut, not every N)
    # precision, accumulation, clipping (capture options and the passes
    # hold_accumulated_gradients, unscale_clip_gradients, skip_step_on_overflow)
    "bf16.enabled",
    "fp16.enabled",
    "fp16.auto_cast",  # floating-point batch tensors cast to fp16
    "fp16.loss_scale",
    "fp16.initial_scale_power",
    "fp16.loss_scale_window",
    "fp16.hysteresis",
    "fp16.consecutive_hysteresis",
    "fp16.min_loss_scale",
    "gradient_clipping",
    "communication_data_type",  # the dtype gradients are reduced in (reduce_gradients, shard_optimizer_update)
    "gradient_accumulation_steps",
    "train_batch_size",  # checked against micro x accumulation x ranks
    "train_micro_batch_size_per_gpu",
    # built by ParallelStep on the first call (optimizer_builder, schedules)
    "optimizer.*",
    "scheduler.*",
    # the training log and DeepSpeed's monitor blocks (stepfx/monitor)
    "steps_per_print",
    "tensorboard.*",
    "csv_monitor.*",
    "wandb.*",
    "wall_clock_breakdown",  # seconds per phase of the program, marked by the executor (runtime/phase_timer.py)
})


def is_applied(path: str, applied: frozenset[str] = APPLIED) -> bool:
    if path in applied:
        return True
    parts = path.split(".")
    return any(".".join(parts[:i]) + ".*" in applied for i in range(1, len(parts) + 1))
