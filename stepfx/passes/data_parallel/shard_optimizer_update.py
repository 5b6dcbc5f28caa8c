"""shard_optimizer_update: each rank updates only its piece of every parameter.

Requires: ``plan_zero_layout`` ran; for buckets sharding "optimizer",
``reduce_gradients`` already averaged their gradients. The optimizer's
update of a parameter is elementwise (SGD, Adam, AdamW): every op of it is
pointwise over tensors shaped like the parameter, or works on scalars.

Ensures, for every bucket that shards the optimizer (stages 1-3), on rank r:

- gradients of "gradients"/"parameters" buckets (stages 2, 3) are packed,
  reduce-scattered (sum) and divided by N right after the bucket's last
  gradient exists; rank r keeps only its shard — no whole averaged
  gradient ever exists;
- each parameter's update chain runs on its piece only: parameter-shaped
  inputs become 1-D pieces (a slice of the whole parameter, a piece of the
  gradient shard, and optimizer-state slots that now hold just the piece on
  this rank), scalar state (Adam's step) stays whole;
- under tensor parallelism the "whole" parameter is this rank's Megatron
  shard (its slot's ``split``): pieces are cut from the shard, and state
  slots keep the ``split`` beside their ``piece`` (shard first, then piece);
- optimizer state is held by the rank (slots with storage "rank"); a
  parameter whose piece on this rank is empty has no state and no update
  here;
- stages 1, 2: the updated pieces of a bucket are all-gathered (the whole
  new parameters are outputs, written back to the user's module); stage 3:
  the updated pieces are outputs (``shard_parameters`` makes them the
  parameters at rest).

The update math is elementwise and unchanged, so each element gets exactly
the value the unsharded update computes from the same gradient.

Before / after (AdamW, stage 2, one parameter, rank 0 of 2)::

    lerp = aten.lerp(s_w_exp_avg, g_w, 0.1)   ->   reduce_scatter = _c10d_functional.reduce_scatter_tensor(bucket, 'sum', 2, '0')
                                                   grad_shard = aten.div.Tensor(wait, 2)
                                                   piece = aten.slice(grad_shard, 0, 0, 32)
                                                   lerp = aten.lerp(s_w_exp_avg_piece, piece, 0.1)
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ...errors import CaptureError, PassError
from ...graph import (META_GRAD_OF, META_GRAD_PIECE, META_PARAM, META_PHASE, META_SOURCE, SHARED_STEP_KEY, Phase, Role, Slot,
                     StepGraph, Storage, output_node)
from ...graph.build import bind_placeholders, clone_step_graph
from ...graph.layout import FROZEN_KEY, LAYOUT_KEY, Bucket, BucketParam, Sharding
from ...graph.ops import has_side_effect
from ..manager import PassOptions, PassResult
from .collectives import all_gather, all_reduce_avg, communication_dtype, fake_like, flat_slice, make_node, pack_flat, reduce_scatter_avg, unpack_view
from .reduce_gradients import final_gradients

__all__ = ["shard_optimizer_update", "META_PIECE_OF"]

aten = torch.ops.aten

META_PIECE_OF = "zero_piece_of"  # on the node that slices a whole parameter into this rank's piece

# Ops that make a new tensor shaped like their input (state creation on the
# first step); they are elementwise for sharding purposes.
_LIKE_OPS = frozenset(
    {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default, aten.copy.default, aten.clone.default}
)


def _elementwise(node: fx.Node) -> bool:
    target = node.target
    if target in _LIKE_OPS:
        return True
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def shard_optimizer_update(graph: StepGraph, options: PassOptions) -> PassResult:
    layout = graph.signature.extra.get(LAYOUT_KEY)
    if layout is None or not layout.updates or not any(b.shards_state for b in layout.buckets):
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    sig = graph.signature
    rank, n = options.rank, options.world_size

    placeholders = {n_.meta["slot"].ident: n_ for n_ in g.nodes if n_.op == "placeholder"}
    param_ph = {s.name: placeholders[s.ident] for s in sig.inputs if s.role is Role.PARAM}
    out = output_node(graph.gm)
    out_values = list(out.args[0])
    out_slots = list(sig.outputs)
    out_index = {s.ident: i for i, s in enumerate(out_slots)}
    grads = final_gradients(g)
    order = {n_: i for i, n_ in enumerate(g.nodes)}
    first_optimizer = next((n_ for n_ in g.nodes if n_.meta.get(META_PHASE) is Phase.OPTIMIZER), out)

    new_inputs = list(sig.inputs)
    drop_inputs: set[tuple] = set()
    gathered = 0
    for bucket in layout.buckets:
        if not bucket.shards_state:
            continue  # whole, or frozen (no gradient, no update: shard_parameters gathers it)
        grad_shard = None
        if bucket.sharding in (Sharding.GRADIENTS, Sharding.PARAMETERS):
            grad_shard = _scatter_gradients(
                g, bucket, grads, order, n, options.group_name, rank, _reduce_scatter(options), communication_dtype(options.config)
            )
        new_pieces: list[tuple[BucketParam, fx.Node | None]] = []
        for p in bucket.params:
            a, b, in_shard = bucket.piece(p, rank)
            new_piece = _shard_update(
                g, graph, p, (a, b, in_shard), bucket, param_ph[p.name], grads.get(p.name), grad_shard,
                placeholders, new_inputs, drop_inputs, out_values, out_slots, out_index, first_optimizer,
            )
            new_pieces.append((p, new_piece))
        if bucket.sharding in (Sharding.OPTIMIZER, Sharding.GRADIENTS):
            _gather_updated(g, bucket, new_pieces, param_ph, out_values, out_slots, out_index, rank, n, options.group_name, out)
            gathered += 1

    sharded = {p.name for b in layout.buckets if b.shards_state for p in b.params}
    for slot, value in zip(out_slots, out_values):
        if slot.role is Role.OPTIMIZER_STATE and slot.name in sharded and slot.storage is Storage.USER:
            raise PassError(f"shard_optimizer_update left {slot.describe()} whole: its update was not recognised ({value})")
    out.args = (tuple(out_values),)
    g.eliminate_dead_code(is_impure_node=has_side_effect)
    # inputs: drop what this rank no longer reads, keep placeholder order = slot order
    # one counter read for all (SHARED_STEP_KEY): a counter of a parameter
    # wholly on other ranks stands in for the others; one this rank holds
    # (they are equal) takes its place, never a frozen parameter's (it stays at its count)
    frozen = sig.extra.get(FROZEN_KEY, frozenset())
    held_steps = [placeholders[s.ident] for s in new_inputs if s.ident not in drop_inputs and s.name not in frozen
                  and s.role is Role.OPTIMIZER_STATE and s.key == "step" and s.ident in placeholders]
    for ident in drop_inputs:
        ph = placeholders[ident]
        slot = ph.meta["slot"]
        if ph.users and sig.extra.get(SHARED_STEP_KEY) and slot.role is Role.OPTIMIZER_STATE and slot.key == "step" and held_steps:
            ph.replace_all_uses_with(held_steps[0])
        if ph.users:
            raise CaptureError(
                f"under ZeRO, {ph.meta['slot'].describe()} is read outside the optimizer's elementwise update",
                source=next(iter(ph.users)).meta.get(META_SOURCE),
                hint="only the optimizer may read optimizer state; read the model through step.model_state_dict()",
            )
        g.erase_node(ph)
    new_inputs = [s for s in new_inputs if s.ident not in drop_inputs]
    _order_placeholders(g, new_inputs)
    bind_placeholders(graph.gm, new_inputs)
    graph = graph.replace(signature=sig.with_inputs(tuple(new_inputs)).with_outputs(tuple(out_slots)))
    graph.gm.recompile()
    kinds = sorted({str(b.sharding) for b in layout.buckets if b.shards_state})
    return PassResult(graph, True, f"optimizer updates rank {rank}'s pieces only ({', '.join(kinds)}); {gathered} buckets re-gathered")


def _scatter_gradients(g, bucket: Bucket, grads, order, n, group_name, rank, use_reduce_scatter, comm_dtype) -> fx.Node:
    bucket_grads = [grads[p.name] for p in bucket.params]
    for p, grad in zip(bucket.params, bucket_grads):
        for user in grad.users:
            if user.op == "output" or user.meta.get(META_PHASE) is not Phase.OPTIMIZER or user.meta.get(META_PARAM) != p.name:
                raise CaptureError(
                    f"ZeRO stage {2 if bucket.sharding is Sharding.GRADIENTS else 3} keeps only a shard of each gradient, "
                    f"but the step reads the gradient of {p.name} outside the optimizer's update",
                    source=user.meta.get(META_SOURCE),
                    hint="clip with \"gradient_clipping\" in the config instead of in the step, or use ZeRO stage 0/1",
                )
    last = max(bucket_grads, key=order.__getitem__)
    meta = dict(like=last, phase=Phase.BACKWARD)
    with g.inserting_before(last.next):
        flat = pack_flat(g, [(grad, p.offset) for grad, p in zip(bucket_grads, bucket.params)], bucket.padded, bucket_grads[0].meta["val"], **meta)
        if n == 1:
            shard = flat
        elif use_reduce_scatter:
            shard = reduce_scatter_avg(g, flat, n, group_name, comm_dtype=comm_dtype, **meta)[1]
        else:
            # DeepSpeed's "reduce_scatter": false: average the whole bucket, keep this rank's shard
            whole = all_reduce_avg(g, flat, n, group_name, comm_dtype=comm_dtype, **meta)[1]
            shard = make_node(
                g, aten.slice.Tensor, (whole, 0, rank * bucket.shard, (rank + 1) * bucket.shard),
                val=fake_like(whole.meta["val"], (bucket.shard,)), name="grad_shard", **meta,
            )
    return shard


def _reduce_scatter(options: PassOptions) -> bool:
    zero = getattr(options.config, "zero_optimization", None)
    return getattr(zero, "reduce_scatter", True) is not False


def _piece_shape_ok(val, p: BucketParam) -> bool:
    return isinstance(val, torch.Tensor) and tuple(val.shape) == p.shape


def _shard_update(
    g, graph, p: BucketParam, piece, bucket: Bucket, param, grad, grad_shard,
    placeholders, new_inputs, drop_inputs, out_values, out_slots, out_index, first_optimizer,
):
    """Rewrite ``p``'s update to its piece; return the node holding the new
    piece (or the old piece when the optimizer does not update p here)."""
    a, b, in_shard = piece
    length = b - a
    sig = graph.signature
    states = [s for s in sig.inputs if s.role is Role.OPTIMIZER_STATE and s.name == p.name]
    # the parameter's own slot: a tensor-parallel shard is held by the rank (its ident says so)
    param_out_i = out_index.get(param.meta["slot"].ident)
    chain = _update_chain(g, p)

    if length == 0:
        # nothing of p lives on this rank: no state, no update here (stages
        # 1-2 still get the whole new p from the all-gather), and no part of
        # its gradient counts here (norms, overflow checks)
        if grad is not None:
            grad.meta.pop(META_GRAD_OF, None)
        for s in states:
            drop_inputs.add(s.ident)
        dropped = (Role.OPTIMIZER_STATE, Role.PARAM) if bucket.sharding is Sharding.PARAMETERS else (Role.OPTIMIZER_STATE,)
        _drop_outputs(out_values, out_slots, out_index, lambda s: s.name == p.name and s.role in dropped)
        return None

    memo: dict[fx.Node, fx.Node] = {}

    def piece_of(value: fx.Node) -> fx.Node:
        if value in memo:
            return memo[value]
        if value is param:
            with g.inserting_before(first_optimizer):
                node = flat_slice(g, param, a, b, always_new=True, like=first_optimizer, phase=Phase.OPTIMIZER, param=p.name)
            node.meta[META_PIECE_OF] = p.name
        elif value is grad and grad_shard is not None:
            with g.inserting_before(grad_shard.next):
                node = flat_slice(g, grad_shard, in_shard, in_shard + length, like=grad_shard, phase=Phase.OPTIMIZER, param=p.name)
        elif value.op == "placeholder" and value.meta["slot"].role is Role.OPTIMIZER_STATE:
            old = value.meta["slot"]
            # a piece of the tensor-parallel shard when there is one (``split`` kept: the shard is cut first)
            slot = dataclasses.replace(old, storage=Storage.RANK, piece=(a, b))
            with g.inserting_before(value.next):
                node = g.placeholder(f"{value.name}_piece")
            node.meta.update(slot=slot, val=fake_like(value.meta["val"], (length,)))
            new_inputs[new_inputs.index(old)] = slot
            drop_inputs.add(old.ident)
            drop_inputs.discard(slot.ident)
        else:
            with g.inserting_before(value.next):
                node = flat_slice(g, value, a, b, like=value, phase=value.meta.get(META_PHASE, Phase.OPTIMIZER), param=p.name)
        if value is grad:
            # what this rank's update reads is now the gradient (its piece)
            value.meta.pop(META_GRAD_OF, None)
            node.meta[META_GRAD_OF] = p.name
            node.meta[META_GRAD_PIECE] = True
        memo[value] = node
        return node

    for s in states:
        ph = placeholders[s.ident]
        if ph.meta["val"].dim() == 0:
            # scalar state (the step counter): whole on every rank, held by the rank
            slot = Slot(Role.OPTIMIZER_STATE, s.name, s.key, storage=Storage.RANK)
            new_inputs[new_inputs.index(s)] = slot
            ph.meta["slot"] = slot
            placeholders[slot.ident] = ph

    def remap(x):
        if isinstance(x, fx.Node):
            if x in chain:
                return chain[x]
            if _piece_shape_ok(x.meta.get("val"), p) and x.op != "get_attr":
                return piece_of(x)
            return x
        if isinstance(x, (list, tuple)):
            return type(x)(remap(v) for v in x)
        return x

    for node in list(chain):
        if not _elementwise(node):
            raise CaptureError(
                f"the optimizer update of {p.name} uses {node.target}, which is not elementwise; ZeRO stage "
                f"{1 if bucket.sharding is Sharding.OPTIMIZER else (2 if bucket.sharding is Sharding.GRADIENTS else 3)} needs an elementwise update",
                source=node.meta.get(META_SOURCE),
                hint="use torch.optim.SGD, Adam or AdamW, or ZeRO stage 0",
            )
        with g.inserting_before(node):
            new = g.create_node("call_function", node.target, remap(node.args), remap(dict(node.kwargs)), name=node.name)
        new.meta.update(node.meta)
        new.meta["val"] = fake_like(node.meta["val"], (length,))
        chain[node] = new

    # outputs: optimizer state pieces (rank), the parameter's new piece
    new_piece = None
    for i, slot in enumerate(list(out_slots)):
        if slot.name != p.name:
            continue
        value = out_values[i]
        if slot.role is Role.OPTIMIZER_STATE and isinstance(value, fx.Node) and value in chain:
            out_slots[i] = dataclasses.replace(slot, storage=Storage.RANK, piece=(a, b))
            out_values[i] = chain[value]
        elif slot.role is Role.PARAM and value in chain:
            new_piece = chain[value]
    for i, slot in enumerate(out_slots):
        if slot.role is Role.OPTIMIZER_STATE and slot.name == p.name and slot.piece is None and slot.storage is Storage.USER:
            if isinstance(out_values[i], fx.Node) and out_values[i].meta["val"].dim() == 0:
                out_slots[i] = Slot(Role.OPTIMIZER_STATE, slot.name, slot.key, storage=Storage.RANK)
    _rebuild_index(out_slots, out_index)
    for old, new in chain.items():
        for user in list(old.users):
            if user.op != "output" and user not in chain and user not in chain.values():
                raise CaptureError(
                    f"under ZeRO, the step reads {p.name} after its optimizer update ({user.target})",
                    source=user.meta.get(META_SOURCE),
                    hint="move code that reads updated parameters out of the step, or use ZeRO stage 0",
                )
    if new_piece is None:
        new_piece = piece_of(param)  # the optimizer did not change p this step
    if bucket.sharding is Sharding.PARAMETERS and param_out_i is not None:
        out_slots[param_out_i] = Slot(Role.PARAM, p.name, storage=Storage.RANK, piece=(a, b))
        out_values[param_out_i] = new_piece
        _rebuild_index(out_slots, out_index)
    return new_piece


def _update_chain(g, p: BucketParam) -> dict[fx.Node, fx.Node | None]:
    """The optimizer-phase nodes of p's update that carry p's shape, in
    graph order (keys; values filled in as they are rewritten)."""
    return {
        node: None
        for node in g.nodes
        if node.op == "call_function"
        and node.meta.get(META_PHASE) is Phase.OPTIMIZER
        and node.meta.get(META_PARAM) == p.name
        and _piece_shape_ok(node.meta.get("val"), p)
    }


def _drop_outputs(out_values, out_slots, out_index, predicate):
    keep = [i for i, s in enumerate(out_slots) if not predicate(s)]
    out_values[:] = [out_values[i] for i in keep]
    out_slots[:] = [out_slots[i] for i in keep]
    _rebuild_index(out_slots, out_index)


def _rebuild_index(out_slots, out_index):
    out_index.clear()
    out_index.update({s.ident: i for i, s in enumerate(out_slots)})


def _gather_updated(g, bucket: Bucket, new_pieces, param_ph, out_values, out_slots, out_index, rank, n, group_name, out):
    """Stages 1-2: all-gather the bucket's updated pieces; the whole new
    parameters become the PARAM outputs."""
    at = {p.name: offset for p, _, _, offset in bucket.shard_parts(rank)}
    parts = [(piece, at[p.name]) for p, piece in new_pieces if piece is not None]
    example = param_ph[bucket.params[0].name].meta["val"]
    meta = dict(like=parts[-1][0] if parts else out, phase=Phase.OPTIMIZER)
    with g.inserting_before(out):
        shard = pack_flat(g, parts, bucket.shard, example, **meta)
        full = all_gather(g, shard, n, group_name, **meta)[1] if n > 1 else shard
        for p in bucket.params:
            view = unpack_view(g, full, p.offset, p.shape, **meta)
            view.meta[META_PARAM] = p.name
            i = out_index.get(param_ph[p.name].meta["slot"].ident)
            if i is not None:
                out_values[i] = view


def _order_placeholders(g: fx.Graph, slots) -> None:
    """Move placeholders into slot order at the top of the graph."""
    by_ident = {n.meta["slot"].ident: n for n in g.nodes if n.op == "placeholder"}
    first = next(iter(g.nodes))
    anchor = None
    for slot in slots:
        node = by_ident[slot.ident]
        if anchor is None:
            if node is not first:
                first.prepend(node)
        else:
            anchor.append(node)
        anchor = node
