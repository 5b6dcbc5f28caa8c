"""fuse_bias_gradients: a bias gradient summed by the kernel that writes the
gradient it sums (the concatenation of q, k, v gradients; a LayerNorm
backward).

A linear layer's bias gradient is the column sum of its output gradient,
and that gradient was just written by another kernel: in a pre-norm
transformer block by the LayerNorm backward (the residual stream's gradient:
the attention projection's and the MLP output layer's bias) and by the concatenation of
attention's q, k, v gradients (the qkv projection's bias).
``fuse_column_sums`` reads it back once more for the sum: on the 1.3B GPT
8192 x (2048 + 2048 + 6144) bf16 a layer. Here the producing kernel
sums what it stores into fp32 partials (``layer_norm_backward(...,
grad_input_sum=...)``; ``column_sum_kernels``), so the gradient is read
once, by the matmuls. (The MLP input layer's bias gradient, the sum of
the GELU backward's result, stays ``column_sum``: a Triton GELU backward that
also sums measured 208 us against 99 + 47 for aten's backward and the sum
apart on an H200 - at ~40 fp32 operations an element it is bound by the
issue rate, not by bandwidth; benchmarks/README.md.)

Requires: ``fuse_column_sums`` (the sums are ``graph_ops.column_sum``) and,
for the norms, ``fuse_layer_norm``/``fuse_residual_layer_norm``.
Ensures: every ``graph_ops.column_sum(v)`` whose ``v`` (or what ``v``
flattens to rows of its last dim) is
- an ``aten.cat`` of 2-4 contiguous float tensors of one shape along their
  last dim: is the second result of one ``graph_ops.cat_column_sum`` placed
  where the cat was, whose first result the cat's readers read;
- a ``graph_ops.layer_norm_backward``'s grad_input: is that backward's
  fourth result (``grad_input_sum``).
Matched by op identity. The sums add the same stored values in another
order (fp32 accumulation both, one rounding): within fp32 summation error
of the separate sums.

Before / after::

    lnb = graph_ops.layer_norm_backward(dy, x, ...)                  ->   lnb = graph_ops.layer_norm_backward(dy, x, ..., grad_input_sum='keepdim')
    dx = lnb[0];  v = aten.view(dx, [8192, 2048])                          dx = lnb[0];  v = aten.view(dx, [8192, 2048])
    s = graph_ops.column_sum(v, keepdim=True)                              s = lnb[3]

    cat = aten.cat([dq, dk, dv], 2)                                  ->   fused = graph_ops.cat_column_sum([dq, dk, dv], keepdim=True)
    v = aten.view(cat, [8192, 6144]);  s = graph_ops.column_sum(v)         cat = fused[0];  v = aten.view(cat, [8192, 6144]);  s = fused[1]
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ...graph import StepGraph
from ...graph.build import clone_step_graph_mapped
from ..data_parallel.collectives import make_node
from ..manager import PassOptions, PassResult

__all__ = ["fuse_bias_gradients"]

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_FLATTENS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _tensor(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _summed_input(column_sum: fx.Node) -> fx.Node | None:
    """What ``column_sum`` sums: its input, or what that input flattens to rows of its last dim."""
    v = column_sum.args[0]
    val = _tensor(v)
    if val is None or val.dim() != 2:
        return None
    if v.op == "call_function" and v.target in _FLATTENS:
        src = _tensor(v.args[0])
        if src is not None and src.dim() >= 1 and src.is_contiguous() and src.shape[-1] == val.shape[1] \
                and src.numel() == val.numel():
            return v.args[0]
        return None
    return v


def _last_dim_cat(src: fx.Node) -> bool:
    """``aten.cat`` of 2-4 contiguous tensors of one shape and dtype along their last dim."""
    if src.op != "call_function" or src.target is not aten.cat.default:
        return False
    parts = src.args[0]
    dim = src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0)
    vals = [_tensor(p) for p in parts]
    if not 2 <= len(parts) <= 4 or any(v is None for v in vals):
        return False
    first = vals[0]
    if first.dim() == 0 or dim not in (-1, first.dim() - 1) or first.dtype not in _FLOATS:
        return False
    return all(v.shape == first.shape and v.dtype == first.dtype and v.is_contiguous() for v in vals)


def _norm_grad_input(src: fx.Node) -> fx.Node | None:
    """The LayerNorm backward whose grad_input ``src`` is, when it can also sum it."""
    from ...codegen import graph_ops

    if src.op != "call_function" or src.target is not operator.getitem or src.args[1] != 0:
        return None
    backward = src.args[0]
    if backward.target is not graph_ops.layer_norm_backward or backward.kwargs.get("grad_input_sum") is not None:
        return None
    val = _tensor(src)
    return backward if val is not None and val.shape[-1] == math.prod(backward.args[2]) else None


def fuse_bias_gradients(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    cats, norms, taken = [], [], set()  # taken: producers already summing one column sum
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or node.target is not graph_ops.column_sum:
            continue
        src = _summed_input(node)
        if src is None:
            continue
        if _last_dim_cat(src) and src not in taken:
            cats.append((node, src))
            taken.add(src)
        elif (backward := _norm_grad_input(src)) is not None and backward not in taken:
            norms.append((node, backward))
            taken.add(backward)
    if not cats and not norms:
        return PassResult(graph, False)
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    for old_sum, old_cat in cats:
        cat = copy_of[old_cat]
        _swap_producer(g, copy_of[old_sum], cat, graph_ops.cat_column_sum, (list(cat.args[0]),), "cat_sum")
    for old_sum, old_backward in norms:
        total, backward = copy_of[old_sum], copy_of[old_backward]
        keepdim = bool(total.kwargs.get("keepdim", False))
        backward.kwargs = {**backward.kwargs, "grad_input_sum": "keepdim" if keepdim else "flat"}
        backward.meta["val"] = (*backward.meta["val"], total.meta["val"])
        with g.inserting_before(total):
            bias_grad = make_node(g, operator.getitem, (backward, 3), val=total.meta["val"], like=total,
                                  name=total.name + "_fused")
        total.replace_all_uses_with(bias_grad)
        g.erase_node(total)
    graph.gm.recompile()
    return PassResult(graph, True, f"{len(cats)} bias gradients summed by the concatenation that writes their input, "
                                   f"{len(norms)} by the LayerNorm backward")


def _swap_producer(g: fx.Graph, total: fx.Node, producer: fx.Node, target, args: tuple, name: str) -> None:
    """Replace ``producer`` and the column sum ``total`` of (a flattening of) its result by one call of
    ``target(*args, keepdim=...)`` placed where the producer was, returning (result, sum)."""
    with g.inserting_before(producer):
        fused = make_node(g, target, args, {"keepdim": bool(total.kwargs.get("keepdim", False))},
                          val=(producer.meta["val"], total.meta["val"]), like=producer, name=name)
        result = make_node(g, operator.getitem, (fused, 0), val=producer.meta["val"], like=producer,
                           name=producer.name + "_out")
        bias_grad = make_node(g, operator.getitem, (fused, 1), val=total.meta["val"], like=total,
                              name=total.name + "_fused")
    producer.replace_all_uses_with(result)
    total.replace_all_uses_with(bias_grad)
    g.erase_node(total)
    g.erase_node(producer)
