"""reduce_gradients: average whole gradients across data-parallel ranks.

Requires: ``plan_zero_layout`` ran (the layout is in the signature); each
trainable parameter's gradient carries ``grad_of`` markers.

Ensures: for every bucket that keeps gradients whole (sharding "none" —
stage 0 and stage-3 persistent parameters — and "optimizer" — stage 1),
the bucket's gradients are packed into one flat buffer, all-reduced (sum)
and divided by N right after the last of them is produced, and every later
reader of a gradient (clipping, the optimizer, a returned ``.grad``) reads
the average (``communication_data_type``: the sum travels in that dtype
and is converted back before the division). This is DDP's semantics: the step equals a single-process step
on the mean of the ranks' gradients. With one rank no collective is
emitted.

Before / after (one bucket of two gradients, 2 ranks)::

    t_8 = aten.t(t_7)          # grad_of fc.weight     t_8 = aten.t(t_7)
    view_1 = aten.view(...)    # grad_of fc.bias       view_1 = aten.view(...)
                                                       bucket = aten.cat([flat, view_1])
                                                       all_reduce = _c10d_functional.all_reduce(bucket, 'sum', '0')
                                                       wait = _c10d_functional.wait_tensor(all_reduce)
                                                       grad_avg = aten.div.Tensor(wait, 2)
    lerp = aten.lerp(s, t_8)   ->                      lerp = aten.lerp(s, unpack)
"""
from __future__ import annotations

import torch.fx as fx

from ...graph import META_GRAD_OF, Phase, StepGraph
from ...graph.build import clone_step_graph
from ...graph.layout import LAYOUT_KEY, Sharding
from ..manager import PassOptions, PassResult
from .collectives import all_reduce_avg, communication_dtype, pack_flat, unpack_view

__all__ = ["reduce_gradients", "final_gradients"]

META_REDUCED = "zero_reduced"  # on the averaged flat buffer of a bucket: the bucket index


def final_gradients(g: fx.Graph) -> dict[str, fx.Node]:
    """Parameter name -> the node holding its gradient after the last
    backward (the last ``grad_of`` marker in graph order)."""
    found: dict[str, fx.Node] = {}
    for node in g.nodes:
        name = node.meta.get(META_GRAD_OF)
        if name is not None:
            found[name] = node
    return found


def reduce_gradients(graph: StepGraph, options: PassOptions) -> PassResult:
    layout = graph.signature.extra.get(LAYOUT_KEY)
    if layout is None or not layout.updates:
        return PassResult(graph, False)
    buckets = [b for b in layout.buckets if b.sharding in (Sharding.NONE, Sharding.OPTIMIZER)]
    if not buckets:
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    grads = final_gradients(g)
    n = options.world_size
    comm = communication_dtype(options.config)
    for bucket in buckets:
        bucket_grads = [grads[p.name] for p in bucket.params]
        last = max(bucket_grads, key=order.__getitem__)
        # readers after the bucket is complete read the average; decided
        # before the packing nodes (which read the local gradients) exist
        readers = [[u for u in grad.users if u.op == "output" or order[u] > order[last]] for grad in bucket_grads]
        example = bucket_grads[0].meta["val"]
        meta = dict(like=last, phase=Phase.BACKWARD)
        # (fx inserts each new node right after an "inserting_after" anchor,
        # reversing their order; inserting before the next node keeps it)
        with g.inserting_before(last.next):
            flat = pack_flat(g, [(grad, p.offset) for grad, p in zip(bucket_grads, bucket.params)], bucket.padded, example, **meta)
            avg = all_reduce_avg(g, flat, n, options.group_name, comm_dtype=comm, **meta)[1] if n > 1 else flat
            avg.meta[META_REDUCED] = bucket.index
            for p, grad, users in zip(bucket.params, bucket_grads, readers):
                view = unpack_view(g, avg, p.offset, p.shape, **meta)
                view.meta[META_GRAD_OF] = p.name
                grad.meta.pop(META_GRAD_OF, None)
                for user in users:
                    user.replace_input_with(grad, view)
    where = "across ranks" if n > 1 else "(one rank: no collective)"
    return PassResult(graph, True, f"{len(buckets)} gradient buckets all-reduced {where}")

