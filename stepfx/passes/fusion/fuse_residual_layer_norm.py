"""fuse_residual_layer_norm: a residual add and the LayerNorm that reads its
result run as one kernel, forward and backward.

A pre-norm transformer block computes ``x = x + attn(...)`` and then
``ln2(x)``, and the next block ``x + mlp(...)`` then ``ln1``: the add
reads two M x D tensors and writes one, and the norm reads that one back.
``norm_kernels.add_layer_norm_forward`` reads the two addends, writes the
sum (the residual stream, which later ops still read) and the normalized
rows, saving one M x D read and a launch per block boundary (on the 1.3B
GPT: 49 per step, 8192 x 2048 bf16 each).

In backward the mirror image: the norm's input gradient is added to the
residual stream's gradient, ``add(r, dx)``; the backward kernel adds ``r``
before it stores (``residual_grad``), so dx is never written and read back.

Requires: ``fuse_layer_norm`` ran (the norm is ``graph_ops.layer_norm``).
Ensures: every ``graph_ops.layer_norm(s, ...)`` whose input ``s`` is
``aten.add.Tensor(x, r)`` of two contiguous tensors of ``s``'s shape and
dtype (no ``alpha``), whose other readers all come after the norm, is one
``graph_ops.add_layer_norm`` placed where the norm was; its first output
replaces the add for the other readers, the rest the norm's outputs.
And every ``aten.add.Tensor`` of a ``graph_ops.layer_norm_backward``'s
grad_input (read by nothing else) and a contiguous tensor ``r`` of its
shape and dtype made before the backward is that backward with
``residual_grad=r``. Matched by op identity; the same bits (the sum is
rounded to its dtype before the norm reads it, dx before it is added, as
apart).

Before / after::

    add_1 = aten.add.Tensor(add, view_7)                           ->   fused = graph_ops.add_layer_norm(add, view_7, [32], w, b, 1e-05)
    ln = graph_ops.layer_norm(add_1, [32], w, b, 1e-05)                  add_1 = fused[0]
    out = ln[0]                                                          out = fused[1]

    lnb = graph_ops.layer_norm_backward(dy, x, ...)                ->   lnb = graph_ops.layer_norm_backward(dy, x, ..., residual_grad=r)
    dx = lnb[0]                                                          dx = lnb[0]
    add_9 = aten.add.Tensor(r, dx)                                       (add_9's readers read dx)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...graph import StepGraph
from ...graph.build import clone_step_graph_mapped
from ..data_parallel.collectives import make_node
from ..manager import PassOptions, PassResult

__all__ = ["fuse_residual_layer_norm"]

aten = torch.ops.aten


def _addends(norm: fx.Node) -> fx.Node | None:
    """The add whose result ``norm`` (a graph_ops.layer_norm) normalizes, when the two can be one kernel."""
    from ...codegen import graph_ops

    if norm.op != "call_function" or norm.target is not graph_ops.layer_norm:
        return None
    add = norm.args[0]
    if not (isinstance(add, fx.Node) and add.op == "call_function" and add.target is aten.add.Tensor):
        return None
    if len(add.args) != 2 or add.kwargs:
        return None
    out = add.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return None
    for arg in add.args:
        val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if not (isinstance(val, torch.Tensor) and val.shape == out.shape and val.dtype == out.dtype
                and val.is_contiguous() and val.device == out.device):
            return None
    if not all(u.op == "call_function" and u.target is operator.getitem for u in norm.users):
        return None
    return add


def _residual_add(getitem: fx.Node, order: dict) -> tuple[fx.Node, fx.Node] | None:
    """(the add, the residual gradient r) when ``getitem`` is a LayerNorm backward's grad_input whose only
    reader adds it to ``r``, made before the backward."""
    from ...codegen import graph_ops

    if getitem.op != "call_function" or getitem.target is not operator.getitem or getitem.args[1] != 0:
        return None
    backward = getitem.args[0]
    if backward.target is not graph_ops.layer_norm_backward or backward.kwargs.get("residual_grad") is not None:
        return None
    if len(getitem.users) != 1:
        return None
    (add,) = getitem.users
    if add.op != "call_function" or add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs:
        return None
    if list(add.args).count(getitem) != 1:
        return None
    (r,) = [a for a in add.args if a is not getitem]
    val, rval = getitem.meta.get("val"), r.meta.get("val") if isinstance(r, fx.Node) else None
    if not (isinstance(rval, torch.Tensor) and isinstance(val, torch.Tensor) and rval.shape == val.shape
            and rval.dtype == val.dtype and rval.is_contiguous() and add.meta["val"].dtype == val.dtype):
        return None
    return (add, r) if order[r] < order[backward] else None


def fuse_residual_layer_norm(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    order = {n: i for i, n in enumerate(graph.gm.graph.nodes)}
    backward = [(n, *found) for n in graph.gm.graph.nodes if (found := _residual_add(n, order)) is not None]
    # the fused node goes where the norm is (its weight may be made after the add, e.g. gathered under
    # ZeRO-3), so every other reader of the sum must come after the norm
    pairs = [(n, add) for n in graph.gm.graph.nodes if (add := _addends(n)) is not None
             and all(order[u] > order[n] for u in add.users if u is not n)]
    if not pairs and not backward:
        return PassResult(graph, False)
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    replaced: dict[fx.Node, fx.Node] = {}  # an add fused away -> what its readers read now
    for old_norm, old_add in pairs:
        norm, add = copy_of[old_norm], copy_of[old_add]
        vals = (add.meta["val"], *norm.meta["val"])
        with g.inserting_before(norm):
            fused = make_node(g, graph_ops.add_layer_norm, (*add.args, *norm.args[1:]), dict(norm.kwargs),
                              val=tuple(vals), like=norm, name="add_layer_norm")
            total = make_node(g, operator.getitem, (fused, 0), val=vals[0], like=add, name=add.name + "_sum")
        # every reader of the norm takes an element of its tuple: shift them by the sum in front
        for user in list(norm.users):
            user.args = (fused, user.args[1] + 1)
        add.replace_all_uses_with(total)
        replaced[add] = total
        g.erase_node(norm)
        g.erase_node(add)
    for old_dx, old_add, old_r in backward:
        dx, add, r = copy_of[old_dx], copy_of[old_add], copy_of[old_r]
        while r in replaced:  # r was itself such an add (a chain of blocks)
            r = replaced[r]
        norm_backward = dx.args[0]
        norm_backward.kwargs = {**norm_backward.kwargs, "residual_grad": r}
        add.replace_all_uses_with(dx)
        replaced[add] = dx
        g.erase_node(add)
    graph.gm.recompile()
    return PassResult(graph, True, f"{len(pairs)} residual adds fused into the LayerNorm that reads them, "
                                   f"{len(backward)} into the LayerNorm backward that produces their addend")
