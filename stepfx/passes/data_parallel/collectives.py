"""Helpers the ZeRO passes share to build graph nodes (not a pass).

Every node made here gets the metadata the invariants require: a fake
``val`` of the right shape (made in the graph's own fake mode), a phase, and
the annotations of the node it stands in for. Collectives are emitted as
``torch.ops._c10d_functional`` ops followed by ``wait_tensor``: ordinary
graph nodes that run under gloo and NCCL and that a scheduler can move.
"""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from ...graph import META_PARAM, META_PHASE, Phase
from ...graph.build import copy_node_meta

__all__ = [
    "fake_like",
    "make_node",
    "flat_slice",
    "pack_flat",
    "all_reduce_avg",
    "all_reduce_sum",
    "reduce_scatter_avg",
    "all_gather",
    "unpack_view",
    "cast",
    "communication_dtype",
    "COLLECTIVE_OPS",
]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

COLLECTIVE_OPS = (c10d.all_reduce.default, c10d.all_reduce_.default, c10d.reduce_scatter_tensor.default,
                  c10d.all_gather_into_tensor.default)


def fake_like(example, shape, dtype=None):
    """A fake tensor of ``shape`` in the fake mode (and on the device) of
    ``example``, a fake tensor already in the graph."""
    mode = example.fake_mode
    with mode:
        return torch.empty(tuple(shape), dtype=dtype or example.dtype, device=example.device)


def fake_result(target, args: tuple, kwargs: dict | None = None):
    """What ``target`` makes of ``args`` (nodes read as their fake values),
    run in the fake mode of the first tensor among them: a new node's value."""
    def val(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    fake_args, fake_kwargs = torch.utils._pytree.tree_map(val, (tuple(args), dict(kwargs or {})))
    mode = next(v for v in torch.utils._pytree.tree_leaves((fake_args, fake_kwargs))
                if isinstance(v, torch.Tensor)).fake_mode
    with mode:
        return target(*fake_args, **fake_kwargs)


def make_node(
    g: fx.Graph,
    target,
    args: tuple,
    kwargs: dict | None = None,
    *,
    val: Any,
    like: fx.Node | None = None,
    phase: Phase | None = None,
    param: str | None = None,
    name: str | None = None,
) -> fx.Node:
    """Insert a call at the graph's current insertion point with full metadata."""
    node = g.create_node("call_function", target, tuple(args), kwargs or {}, name=name)
    if like is not None:
        copy_node_meta(like, node)
    if phase is not None:
        node.meta[META_PHASE] = phase
    node.meta.pop(META_PARAM, None)
    if param is not None:
        node.meta[META_PARAM] = param
    node.meta["val"] = val
    return node


def flat_slice(g: fx.Graph, value: fx.Node, start: int, stop: int, *, always_new: bool = False, **meta) -> fx.Node:
    """``value`` flattened, elements ``[start, stop)`` (views when the
    value is contiguous). ``always_new``: return a new node even when that
    is all of a 1-D ``value``."""
    val = value.meta["val"]
    flat = value
    if val.dim() != 1:
        flat = make_node(g, aten.reshape.default, (value, [-1]), val=fake_like(val, (val.numel(),)), name="flat", **meta)
    if start == 0 and stop == val.numel() and (flat is not value or not always_new):
        return flat
    return make_node(g, aten.slice.Tensor, (flat, 0, start, stop), val=fake_like(val, (stop - start,)), name="piece", **meta)


def pack_flat(g: fx.Graph, parts: Sequence[tuple[fx.Node, int]], total: int, example, **meta) -> fx.Node:
    """One flat buffer of ``total`` elements holding each ``(value, offset)``
    flattened at its offset, zeros elsewhere (alignment gaps, padding): the
    copy every bucketed collective needs."""
    flats: list[fx.Node] = []
    at = 0

    def zeros(n):
        return make_node(
            g, aten.zeros.default, ([n],), {"dtype": example.dtype, "device": example.device},
            val=fake_like(example, (n,)), name="pad", **meta,
        )

    for part, offset in parts:
        if offset > at:
            flats.append(zeros(offset - at))
        pval = part.meta["val"]
        if pval.dim() != 1:
            part = make_node(g, aten.reshape.default, (part, [-1]), val=fake_like(pval, (pval.numel(),)), name="flat", **meta)
        flats.append(part)
        at = offset + pval.numel()
    if at < total:
        flats.append(zeros(total - at))
    if len(flats) == 1:
        return flats[0]
    return make_node(g, aten.cat.default, (flats,), val=fake_like(example, (total,)), name="bucket", **meta)


def _wait(g, node, **meta):
    return make_node(g, c10d.wait_tensor.default, (node,), val=node.meta["val"], name="wait", **meta)


_COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def communication_dtype(config) -> torch.dtype | None:
    """The dtype gradients travel in (``communication_data_type``); None:
    their own dtype (fp32: the gradients of the fp32 masters)."""
    return _COMM_DTYPES.get(getattr(config, "communication_data_type", None))


def cast(g: fx.Graph, value: fx.Node, dtype: torch.dtype, *, name: str = "cast", **meta) -> fx.Node:
    """``value`` converted to ``dtype`` (a new tensor)."""
    val = value.meta["val"]
    return make_node(g, aten._to_copy.default, (value,), {"dtype": dtype}, val=fake_like(val, val.shape, dtype), name=name, **meta)


def all_reduce_avg(
    g: fx.Graph, flat: fx.Node, world_size: int, group_name: str, *, comm_dtype: torch.dtype | None = None, **meta
) -> tuple[fx.Node, fx.Node]:
    """Sum over ranks, then divide by N (the mean of the ranks' gradients).
    ``comm_dtype``: the sum travels (and is added) in that dtype, and is
    converted back before the division. Returns (the collective, the
    averaged value)."""
    val = flat.meta["val"]
    sent = cast(g, flat, comm_dtype, name="to_comm", **meta) if comm_dtype not in (None, val.dtype) else flat
    sval = sent.meta["val"]
    # A bucket made here for the collective alone is reduced in place: the
    # out-of-place all_reduce clones its input first (a copy of every
    # gradient byte per step, and a second buffer held until the wait).
    op = c10d.all_reduce_.default if _fresh(sent) else c10d.all_reduce.default
    issued = make_node(g, op, (sent, "sum", group_name), val=fake_like(sval, sval.shape), name="all_reduce", **meta)
    done = _wait(g, issued, **meta)
    if sent is not flat:
        done = cast(g, done, val.dtype, name="from_comm", **meta)
    avg = make_node(g, aten.div.Tensor, (done, world_size), val=fake_like(val, val.shape), name="grad_avg", **meta)
    return issued, avg


def _fresh(node: fx.Node) -> bool:
    """A buffer just made for a collective (a packed bucket or a dtype
    conversion) that nothing else reads yet: safe to reduce in place."""
    return node.op == "call_function" and node.target in (aten.cat.default, aten._to_copy.default) and not node.users


def reduce_scatter_avg(
    g: fx.Graph, flat: fx.Node, world_size: int, group_name: str, *, comm_dtype: torch.dtype | None = None, **meta
) -> tuple[fx.Node, fx.Node]:
    """Each rank gets the sum of its shard over ranks, divided by N
    (``comm_dtype`` as in :func:`all_reduce_avg`)."""
    val = flat.meta["val"]
    shard = val.numel() // world_size
    sent = cast(g, flat, comm_dtype, name="to_comm", **meta) if comm_dtype not in (None, val.dtype) else flat
    issued = make_node(
        g, c10d.reduce_scatter_tensor.default, (sent, "sum", world_size, group_name), val=fake_like(sent.meta["val"], (shard,)),
        name="reduce_scatter", **meta
    )
    done = _wait(g, issued, **meta)
    if sent is not flat:
        done = cast(g, done, val.dtype, name="from_comm", **meta)
    avg = make_node(g, aten.div.Tensor, (done, world_size), val=fake_like(val, (shard,)), name="grad_shard", **meta)
    return issued, avg


def all_gather(g: fx.Graph, shard: fx.Node, world_size: int, group_name: str, **meta) -> tuple[fx.Node, fx.Node]:
    """Concatenation of every rank's shard, in rank order."""
    val = shard.meta["val"]
    issued = make_node(
        g, c10d.all_gather_into_tensor.default, (shard, world_size, group_name), val=fake_like(val, (val.numel() * world_size,)), name="all_gather", **meta
    )
    return issued, _wait(g, issued, **meta)


def unpack_view(g: fx.Graph, flat: fx.Node, offset: int, shape: tuple[int, ...], **meta) -> fx.Node:
    """The tensor of ``shape`` stored at ``flat[offset:]`` (a view)."""
    val = flat.meta["val"]
    n = 1
    for d in shape:
        n *= d
    part = make_node(g, aten.slice.Tensor, (flat, 0, offset, offset + n), val=fake_like(val, (n,)), name="unpack", **meta)
    if tuple(shape) == (n,):
        return part
    return make_node(g, aten.view.default, (part, list(shape)), val=fake_like(val, shape), name="unpack", **meta)


def getitem(g: fx.Graph, node: fx.Node, i: int, **meta) -> fx.Node:
    return make_node(g, operator.getitem, (node, i), val=node.meta["val"][i], **meta)


def all_reduce_sum(g: fx.Graph, value: fx.Node, group_name: str, *, name: str = "all_reduce", **meta) -> fx.Node:
    """The sum over ranks of a (small) tensor."""
    val = value.meta["val"]
    issued = make_node(g, c10d.all_reduce.default, (value, "sum", group_name), val=fake_like(val, val.shape), name=name, **meta)
    return _wait(g, issued, **meta)
