"""unscale_clip_gradients: one pass over the gradients for loss scaling,
the overflow check and global-norm clipping.

Requires: the gradients the optimizer reads carry ``grad_of`` markers (the
last marker of each parameter; ``grad_piece`` where a rank holds only a
piece of it, after ZeRO); with fp16, the loss-scale runtime input exists.

Ensures, when fp16 loss scaling or ``gradient_clipping`` is on:

- ``norm`` = the L2 norm of every gradient element, each counted once
  across ranks, divided by the loss scale; computed in one of two orders:

  * where every gradient this rank reads is whole or there is one rank
    (the norm needs no collective) and all are fp32: as
    ``torch.nn.utils.clip_grad_norm_`` computes it, so a single-process
    fp32 step is bitwise eager's: ``aten._foreach_norm`` over the
    gradients in parameter order (its foreach path on CPU and CUDA; one
    device and one dtype make one group), then ``linalg_vector_norm`` of
    their stack;
  * otherwise (ZeRO pieces on several ranks, tensor-parallel shards,
    16-bit gradients) from sums of squares: pieces are squared and summed
    locally (in fp32) and all-reduced over the data-parallel group (one
    scalar collective), whole gradients (identical on every rank) are
    summed locally, ``norm = sqrt(sumsq)``. (For 16-bit gradients eager
    takes 16-bit norms; fp32 sums are the more accurate.)
  * under tensor parallelism (``options.tp_size`` > 1) each rank's sum is
    then all-reduced over its tensor-parallel group (one more scalar
    collective): a split parameter's gradient is a different shard on
    each rank, so its squares add up; a replicated parameter's gradient is
    the same on every rank of the group, so it is counted on TP rank 0
    only, as Megatron does (the other ranks add it times 0: 0 when it is
    finite, nan when it is not, so an overflow anywhere still reaches the
    flag). The sum is then the same on every rank of both groups.
- ``factor = (1 / scale) * min(1, max_norm / (norm + 1e-6))`` and every
  gradient the optimizer reads is multiplied by it: unscaling and clipping
  folded into one multiply; the factor records what it is when nothing is
  clipped (``META_UNCLIPPED``: "1/loss_scale" or "1"), for
  an update that starts before the norm is known (offload_optimizer's
  speculation);
- the node ``found_inf = not isfinite(total)`` (marked ``overflow_flag``;
  ``total`` is the scaled norm or the sum of squares): an inf or nan
  anywhere on any rank, of either group, makes it non-finite everywhere, so
  no separate flag collective is needed and every rank skips the same
  steps.

Nothing here reads a value on the host: the scale, the norm and the flag
stay on the device.

Before / after (clipping, one rank, two gradients)::

    lerp = aten.lerp(s_w_exp_avg, g_w, 0.1)   ->   grad_norms = aten._foreach_norm([g_w, g_b], 2.0)
                                                   grad_norm = aten.linalg_vector_norm(aten.stack([grad_norms[0], grad_norms[1]]), 2.0)
                                                   clip_coef = aten.clamp(aten.mul(aten.reciprocal(grad_norm + 1e-6), max_norm), None, 1.0)
                                                   g_w_1 = aten.mul.Tensor(g_w, clip_coef)
                                                   lerp = aten.lerp(s_w_exp_avg, g_w_1, 0.1)

With ZeRO pieces on several ranks the first two lines are
``sumsq = aten.sum(aten.mul(piece, piece)) ...``, an all-reduce and a sqrt;
under tensor parallelism (TP rank 1 of 2, one split and one replicated
gradient)::

    sumsq = aten.sum(aten.mul(g_fc, g_fc))            # this rank's shard
    sumsq_1 = aten.sum(aten.mul(g_ln, g_ln))          # replicated
    once = aten.mul.Tensor(sumsq_1, 0.0)              # counted on TP rank 0
    sumsq_2 = aten.add.Tensor(sumsq, once)
    tp_all_reduce = _c10d_functional.all_reduce(sumsq_2, 'sum', tp_group)
    grad_norm = aten.sqrt(wait(tp_all_reduce))
"""
from __future__ import annotations

import torch

from ...graph import META_GRAD_OF, META_GRAD_PIECE, META_OVERFLOW, META_PHASE, Phase, Role, StepGraph
from ...graph.step_graph import META_UNCLIPPED
from ...graph.build import clone_step_graph
from ..data_parallel.collectives import all_reduce_sum, fake_like, getitem, make_node
from ..data_parallel.reduce_gradients import final_gradients
from ..manager import PassOptions, PassResult
from ..pipeline.partition_stages import pipeline_settings

__all__ = ["unscale_clip_gradients", "precision_settings"]

aten = torch.ops.aten


def precision_settings(options: PassOptions) -> tuple[bool, float]:
    """(fp16 loss scaling on, clipping max norm or 0)."""
    cfg = options.config
    fp16 = getattr(cfg, "fp16", None)
    scaling = bool(fp16 is not None and fp16.enabled is True)
    clip = getattr(cfg, "gradient_clipping", 0.0)
    return scaling, float(clip) if isinstance(clip, (int, float)) else 0.0


def unscale_clip_gradients(graph: StepGraph, options: PassOptions) -> PassResult:
    scaling, max_norm = precision_settings(options)
    if not scaling and max_norm <= 0:
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    grads = final_gradients(g)
    if not grads:
        return PassResult(graph, False)  # a micro-step without update
    order = {n: i for i, n in enumerate(g.nodes)}
    readers = {name: [u for u in node.users if u.meta.get(META_PHASE) is Phase.OPTIMIZER] for name, node in grads.items()}
    anchor = min((u for us in readers.values() for u in us), key=order.__getitem__, default=None)
    if anchor is None:
        return PassResult(graph, False)
    last = max(grads.values(), key=order.__getitem__)
    if order[last] > order[anchor]:
        anchor = last.next
    example = next(iter(grads.values())).meta["val"]
    meta = dict(like=anchor, phase=Phase.OPTIMIZER)
    scalar = fake_like(example, (), torch.float32)
    tp = options.tp_size > 1
    split = {s.name for _, s in graph.signature.inputs_with(Role.PARAM) if s.split is not None}  # Megatron shards

    def sumsq(nodes):
        parts = []
        for node in nodes:
            val = node.meta["val"]
            f = node
            if val.dtype != torch.float32:  # 16-bit gradients are squared and summed in fp32
                f = make_node(g, aten._to_copy.default, (node,), {"dtype": torch.float32}, val=fake_like(val, val.shape, torch.float32), name="g32", **meta)
            sq = make_node(g, aten.mul.Tensor, (f, f), val=fake_like(val, val.shape, torch.float32), name="sq", **meta)
            parts.append(make_node(g, aten.sum.default, (sq,), val=scalar, name="sumsq", **meta))
        if not parts:
            return None
        stacked = make_node(g, aten.stack.default, (parts,), val=fake_like(example, (len(parts),), torch.float32), name="sumsqs", **meta)
        return make_node(g, aten.sum.default, (stacked,), val=scalar, name="sumsq", **meta)

    def add(a, b):
        return a if b is None else b if a is None else make_node(g, aten.add.Tensor, (a, b), val=scalar, name="sumsq", **meta)

    def tp_sum(nodes):
        # this tensor-parallel rank's share: its shards of split gradients,
        # replicated gradients on TP rank 0 only (times 0 elsewhere: nan
        # stays nan, so every rank's flag sees an overflow)
        if not tp:
            return sumsq(nodes)
        replicated = sumsq([n for n in nodes if n.meta[META_GRAD_OF] not in split])
        if replicated is not None and options.tp_rank != 0:
            replicated = make_node(g, aten.mul.Tensor, (replicated, 0.0), val=scalar, name="counted_on_tp_rank_0", **meta)
        return add(sumsq([n for n in nodes if n.meta[META_GRAD_OF] in split]), replicated)

    def torch_norm(nodes):
        # torch.nn.utils.clip_grad_norm_ (norm_type 2.0): _foreach_norm per
        # (device, dtype) group, one group here, then the norm of the stacked norms
        vals = [fake_like(example, (), torch.float32) for _ in nodes]
        norms = make_node(g, aten._foreach_norm.Scalar, (list(nodes), 2.0), val=vals, name="grad_norms", **meta)
        parts = [getitem(g, norms, i, **meta) for i in range(len(nodes))]
        stacked = make_node(g, aten.stack.default, (parts,), val=fake_like(example, (len(parts),), torch.float32), name="grad_norms", **meta)
        return make_node(g, aten.linalg_vector_norm.default, (stacked, 2.0), val=scalar, name="grad_norm", **meta)

    pieces = [n for n in grads.values() if n.meta.get(META_GRAD_PIECE)]
    whole = [n for n in grads.values() if not n.meta.get(META_GRAD_PIECE)]
    scale_in = next((n for n in g.nodes if n.op == "placeholder" and n.meta["slot"].role is Role.RUNTIME_STATE and n.meta["slot"].name == "loss_scale"), None)
    # torch's order where the norm needs no collective (one rank: pieces are
    # whole parameters; several: whole gradients are the same on every rank)
    # and eager's norms are fp32; in parameter order, as clip_grad_norm_(model.parameters())
    # (under pipeline parallelism the squared norm's parts are summed over the stages: partition_stages)
    as_torch = ((options.world_size == 1 or not pieces) and not tp and pipeline_settings(options) <= 1
                and all(n.meta["val"].dtype == torch.float32 for n in grads.values()))
    position = {s.name: i for i, (_, s) in enumerate(graph.signature.inputs_with(Role.PARAM))}
    with g.inserting_before(anchor):
        if as_torch:
            total = norm = torch_norm(sorted(grads.values(), key=lambda n: position.get(n.meta[META_GRAD_OF], len(position))))
        else:
            local = tp_sum(pieces)
            if local is not None and options.world_size > 1:
                local = all_reduce_sum(g, local, options.group_name, **meta)
            total = add(local, tp_sum(whole))
            if tp:
                total = all_reduce_sum(g, total, options.tp_group_name, name="tp_all_reduce", **meta)
            norm = make_node(g, aten.sqrt.default, (total,), val=scalar, name="grad_norm", **meta)
        factor = None
        if scaling and scale_in is not None:
            inv = make_node(g, aten.reciprocal.default, (scale_in,), val=scalar, name="inv_scale", **meta)
            norm = make_node(g, aten.mul.Tensor, (norm, inv), val=scalar, name="grad_norm", **meta)
            factor = inv
            flag = make_node(g, aten.isfinite.default, (total,), val=fake_like(example, (), torch.bool), name="finite", **meta)
            flag = make_node(g, aten.logical_not.default, (flag,), val=fake_like(example, (), torch.bool), name="found_inf", **meta)
            flag.meta[META_OVERFLOW] = True
        if max_norm > 0:
            coef = make_node(g, aten.add.Tensor, (norm, 1e-6), val=scalar, name="clip_denominator", **meta)
            coef = make_node(g, aten.reciprocal.default, (coef,), val=scalar, name="clip_coef", **meta)
            coef = make_node(g, aten.mul.Tensor, (coef, max_norm), val=scalar, name="clip_coef", **meta)
            coef = make_node(g, aten.clamp.default, (coef, None, 1.0), val=scalar, name="clip_coef", **meta)
            factor = coef if factor is None else make_node(g, aten.mul.Tensor, (factor, coef), val=scalar, name="grad_factor", **meta)
        if factor is not None:
            factor.meta[META_UNCLIPPED] = "1/loss_scale" if scaling and scale_in is not None else "1"
        for name, node in grads.items():
            if factor is None or not readers[name]:
                continue
            val = node.meta["val"]
            scaled = make_node(g, aten.mul.Tensor, (node, factor), val=fake_like(val, val.shape), name="grad", **meta, param=name)
            for user in readers[name]:
                user.replace_input_with(node, scaled)
            node.meta.pop(META_GRAD_OF, None)
            scaled.meta[META_GRAD_OF] = name
            if node.meta.get(META_GRAD_PIECE):
                scaled.meta[META_GRAD_PIECE] = True
    what = [w for w, on in (("unscaled", scaling), (f"clipped to norm {max_norm:g}", max_norm > 0)) if on]
    reduced = [w for w, on in (("one all-reduce over ZeRO pieces", pieces and options.world_size > 1),
                               ("one over the tensor-parallel group", tp)) if on]
    order = ("norm as torch.nn.utils.clip_grad_norm_ (per-tensor norms, then their norm)" if as_torch
             else "norm from sums of squares" + (f" ({', '.join(reduced)})" if reduced else ""))
    return PassResult(graph, True, f"{len(grads)} gradients {' and '.join(what)}; {order}" + (", overflow flag" if scaling else ""))
