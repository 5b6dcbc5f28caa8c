"""plan_zero_layout: decide buckets and each rank's pieces (no graph change).

Requires: a functional graph without alias ops whose parameter gradients
carry ``grad_of`` markers (capture puts them after every backward).

Ensures: ``signature.extra["zero_layout"]`` holds a :class:`ZeroLayout`:
every parameter that has a gradient (and, at stage 3, every parameter with
``requires_grad=False``, in *frozen* buckets of their own), in the model's
parameter order, grouped into buckets of at most
``zero_optimization.reduce_bucket_size`` elements (one dtype and device per
bucket; parameters start at multiples of ``layout.ALIGN`` elements), each
marked with what it shards for the configured stage. At
stage 3, parameters smaller than ``param_persistence_threshold`` stay whole
(buckets with sharding "none"), as DeepSpeed keeps them. Buckets of one
kind (dtype, device, sharding) take parameters in model order; the small
whole parameters between sharded ones fill buckets of their own kind, so
they neither cut the sharded buckets short nor cost a collective each.

An evaluator (``ParallelStep.evaluator``: a forward-only step over the
pieces a training step holds) takes that step's sharded buckets as they are
(``EVALUATED_LAYOUT_KEY``), marked frozen: gathered for its forward, never
reduced or updated.

The layout depends only on the parameters and the config, never on the
graph's op order, so every captured variant of a step agrees on it and the
state a rank holds carries over between variants.

Before / after: the graph is unchanged; ``explain()`` shows the buckets.
"""
from __future__ import annotations

import dataclasses

from ...errors import CaptureError, PassError
from ...graph import META_GRAD_OF, Role, StepGraph, Storage
from ...graph.layout import EVALUATED_LAYOUT_KEY, FROZEN_KEY, LAYOUT_KEY, Bucket, BucketParam, Sharding, ZeroLayout, align
from ..manager import PassOptions, PassResult

__all__ = ["plan_zero_layout", "zero_settings"]

_STAGE_SHARDING = {0: Sharding.NONE, 1: Sharding.OPTIMIZER, 2: Sharding.GRADIENTS, 3: Sharding.PARAMETERS}


def zero_settings(options: PassOptions) -> tuple[int, int, int]:
    """(stage, bucket size in elements, persistence threshold) from the
    config; "auto" values must have been resolved (the public face does it
    from the model on the first call)."""
    zero = getattr(options.config, "zero_optimization", None)
    if zero is None:
        return 0, 500_000_000, 0
    for key in ("stage", "reduce_bucket_size", "param_persistence_threshold"):
        if not isinstance(getattr(zero, key), int):
            raise PassError(f"zero_optimization.{key} is {getattr(zero, key)!r}; 'auto' must be resolved before the passes run")
    return zero.stage, max(1, zero.reduce_bucket_size), zero.param_persistence_threshold


def stays_whole(stage: int, numel: int, dim: int, persist: int) -> bool:
    """Whether a trained parameter's bucket is not sharded (its optimizer
    state stays in the user's optimizer): under stage 3 those smaller than
    the persistence threshold, and 0-d ones at any stage."""
    return (stage == 3 and numel < persist) or dim == 0


def plan_zero_layout(graph: StepGraph, options: PassOptions) -> PassResult:
    stage, bucket_size, persist = zero_settings(options)
    sig = graph.signature
    if stage >= 2:
        # gradients the user's .grad keeps across calls; accumulators the rank
        # holds (gradient accumulation) are fine
        kept = [s.describe() for s in (*sig.inputs, *sig.outputs) if s.role is Role.GRAD and s.storage is Storage.USER]
        if kept:
            raise CaptureError(
                f"ZeRO stage {stage} shards gradients, but the step keeps whole gradients across calls ({kept[0]}, ...)",
                hint="end the step with optimizer.zero_grad() (and start it without .grad set), or use stage 0/1",
            )

    evaluated = options.extra.get(EVALUATED_LAYOUT_KEY)
    if evaluated is not None and stage == 3:
        buckets = tuple(dataclasses.replace(b, frozen=True) for b in evaluated.buckets if b.sharding is Sharding.PARAMETERS)
        layout = ZeroLayout(stage, options.world_size, options.rank, buckets, False)
        return PassResult(graph.replace(signature=dataclasses.replace(sig, extra={**sig.extra, LAYOUT_KEY: layout})),
                          True, f"stage 3: the evaluated step's {len(buckets)} sharded buckets, gathered only")

    graded = {n.meta[META_GRAD_OF] for n in graph.gm.graph.nodes if META_GRAD_OF in n.meta}
    # stage 3 shards the parameters that take no gradient too (gathered only)
    frozen = sig.extra.get(FROZEN_KEY, frozenset()) if stage == 3 else frozenset()
    updates = any(s.role is Role.PARAM for s in sig.outputs)
    params = []
    for node in graph.gm.graph.nodes:
        slot = node.meta.get("slot") if node.op == "placeholder" else None
        if slot is not None and slot.role is Role.PARAM and (slot.name in graded or slot.name in frozen):
            params.append((slot.name, node.meta["val"], slot.name not in graded))

    # One open bucket per (dtype, device, sharding): a run of small
    # persistent parameters between sharded ones joins the other small ones
    # instead of closing the sharded bucket and making a bucket of its own
    # (on a transformer: one all-reduce for all norms and biases instead of
    # one per layer norm, and sharded buckets cut only by their size).
    closed: list[tuple[tuple, list[BucketParam]]] = []
    open_buckets: dict[tuple, tuple[list[BucketParam], int]] = {}
    position = {name: i for i, (name, _, _) in enumerate(params)}

    def close(group) -> None:
        closed.append((group, open_buckets.pop(group)[0]))

    for name, val, no_grad in params:
        numel = val.numel()
        mode = _STAGE_SHARDING[stage]
        if stays_whole(stage, numel, val.dim(), persist):
            # small (and 0-d) parameters stay whole: sharding them saves
            # nothing and a 0-d piece is not worth a collective
            if no_grad:
                continue  # a small frozen parameter: whole, read from the module, no bucket at all
            mode = Sharding.NONE
        group = (val.dtype, str(val.device), mode, no_grad)
        if group in open_buckets and open_buckets[group][1] + numel > bucket_size:
            close(group)
        members, offset = open_buckets.setdefault(group, ([], 0))
        members.append(BucketParam(name, tuple(val.shape), offset))
        open_buckets[group] = (members, align(offset + numel))
    for group in list(open_buckets):
        close(group)
    # numbered by their first parameter's place in the model
    closed.sort(key=lambda item: position[item[1][0].name])
    buckets = [Bucket(i, tuple(members), group[2], options.world_size, str(group[0]), group[1], frozen=group[3])
               for i, (group, members) in enumerate(closed)]

    layout = ZeroLayout(stage, options.world_size, options.rank, tuple(buckets), updates)
    new_sig = dataclasses.replace(sig, extra={**sig.extra, LAYOUT_KEY: layout})
    sharded = sum(1 for b in buckets if b.sharding is not Sharding.NONE)
    summary = f"stage {stage}: {len(params)} parameters in {len(buckets)} buckets ({sharded} sharded over {options.world_size} ranks)"
    if any(b.frozen for b in buckets):
        summary += f"; {sum(len(b.params) for b in buckets if b.frozen)} without gradients in {sum(b.frozen for b in buckets)} frozen buckets (gathered only)"
    if not updates:
        summary += "; a micro-step without update (gradients accumulate locally)"
    return PassResult(graph.replace(signature=new_sig), True, summary)
