"""unscale_clip_gradients: one pass over the gradients for loss scaling,
the overflow check and global-norm clipping.

Requires: the gradients the optimizer reads carry ``grad_of`` markers (the
last marker of each parameter; ``grad_piece`` where a rank holds only a
piece of it, after ZeRO); with fp16, the loss-scale runtime input exists.

Ensures, when fp16 loss scaling or ``gradient_clipping`` is on:

- ``sumsq`` = the sum of squares of every gradient element, each counted
  once across ranks: pieces are summed locally and all-reduced (one scalar
  collective), whole gradients (identical on every rank) are summed
  locally;
- ``norm = sqrt(sumsq) / scale`` — the L2 norm of the unscaled gradients,
  what ``torch.nn.utils.clip_grad_norm_`` computes on the reference;
- ``factor = (1 / scale) * min(1, max_norm / (norm + 1e-6))`` and every
  gradient the optimizer reads is multiplied by it: unscaling and clipping
  folded into one multiply;
- the node ``found_inf = not isfinite(sumsq)`` (marked ``overflow_flag``):
  an inf or nan anywhere on any rank makes the sum non-finite everywhere,
  so no separate flag collective is needed.

Nothing here reads a value on the host: the scale, the norm and the flag
stay on the device.

Before / after (clipping, one gradient)::

    lerp = aten.lerp(s_w_exp_avg, g_w, 0.1)   ->   sumsq = aten.sum(aten.mul(g_w, g_w)) ...
                                                   factor = aten.mul(inv_scale, clip_coef)
                                                   g_w_1 = aten.mul.Tensor(g_w, factor)
                                                   lerp = aten.lerp(s_w_exp_avg, g_w_1, 0.1)
"""
from __future__ import annotations

import torch

from ..graph import META_GRAD_OF, META_GRAD_PIECE, META_OVERFLOW, META_PHASE, Phase, Role, StepGraph
from ..graph.build import clone_step_graph
from .collectives import all_reduce_sum, fake_like, make_node
from .manager import PassOptions, PassResult
from .reduce_gradients import final_gradients

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

    pieces = [n for n in grads.values() if n.meta.get(META_GRAD_PIECE)]
    whole = [n for n in grads.values() if not n.meta.get(META_GRAD_PIECE)]
    scale_in = next((n for n in g.nodes if n.op == "placeholder" and n.meta["slot"].role is Role.RUNTIME_STATE and n.meta["slot"].name == "loss_scale"), None)
    with g.inserting_before(anchor):
        total = None
        local = sumsq(pieces)
        if local is not None and options.world_size > 1:
            local = all_reduce_sum(g, local, options.group_name, **meta)
        rest = sumsq(whole)
        total = local if rest is None else rest if local is None else make_node(g, aten.add.Tensor, (local, rest), val=scalar, name="sumsq", **meta)
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
    return PassResult(graph, True, f"{len(grads)} gradients {' and '.join(what)}; one norm reduction" + (", overflow flag" if scaling else ""))
