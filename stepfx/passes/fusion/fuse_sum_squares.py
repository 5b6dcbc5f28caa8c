"""fuse_sum_squares: each gradient's sum of squares (the clipping norm and the
fp16 overflow check) becomes one kernel that reads the gradient once.

Requires: ``unscale_clip_gradients`` ran (it emits, per gradient,
``sum(mul(g32, g32))`` with ``g32 = _to_copy(g, float32)`` for 16-bit
gradients; or, where the norm needs no collective, the norm in
``torch.nn.utils.clip_grad_norm_``'s order: ``linalg_vector_norm`` of the
stacked ``_foreach_norm`` of the fp32 gradients).

Ensures:

- a norm in torch's order over fp32 copies of 16-bit gradients (mixed
  precision) is ``sqrt(sum(stack([sum(mul(g32, g32)), ...])))``, so the sums
  below read the 16-bit gradients and ``fold_gradient_casts`` can drop the
  copies (6 bytes per element and a kernel per parameter less). This gives
  up torch's order, which buys nothing measurable there: the fused 16-bit
  step is not eager's bits anyway (the tiny GPT's bf16 SGD step with
  codegen: losses 3e-4 apart with clipping off; without codegen it is
  bitwise, clipped too). A norm over fp32 gradients keeps
  torch's order: ``_foreach_norm`` is already one read of each gradient (a
  multi-tensor kernel on CUDA), and on CPU an fp32 SGD step with codegen
  on stays bitwise eager's with clipping (measured on an MLP; AdamW's
  fused update rounds differently with or without clipping). Disable this
  pass to keep torch's order under mixed precision too.
- every ``aten.sum(aten.mul(a, a))`` over a whole tensor, where ``a`` is a
  gradient or its fp32 copy, is one call of
  :func:`stepfx.codegen.graph_ops.sum_squares` on the gradient: no fp32
  copy, no squared temporary (eager reads the gradient, writes and reads
  the copy, writes and reads the squares). Matched by op identity.

Before / after::

    g32 = aten._to_copy(g_w, dtype=torch.float32)
    sq = aten.mul.Tensor(g32, g32)              ->   sumsq = stepfx.codegen.graph_ops.sum_squares(g_w)
    sumsq = aten.sum(sq)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...graph import StepGraph
from ...graph.build import clone_step_graph
from ...graph.ops import dtype_cast, has_side_effect
from ..data_parallel.collectives import fake_like, make_node
from ..manager import PassOptions, PassResult

__all__ = ["fuse_sum_squares"]

aten = torch.ops.aten


def _squared(node: fx.Node) -> fx.Node | None:
    """The tensor whose fp32 squares ``node`` sums, or None."""
    if node.target is not aten.sum.default or len(node.args) != 1 or node.kwargs:
        return None
    sq = node.args[0]
    if not (isinstance(sq, fx.Node) and sq.target is aten.mul.Tensor and len(sq.args) == 2 and sq.args[0] is sq.args[1]):
        return None
    base = sq.args[0]
    if base.target is aten._to_copy.default and dict(base.kwargs) == {"dtype": torch.float32}:
        base = base.args[0]
    val = base.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return base


def _torch_order_norm(node: fx.Node) -> list[fx.Node] | None:
    """The tensors of ``linalg_vector_norm(stack([_foreach_norm(ts, 2.0)[i]
    ...]), 2.0)`` (unscale_clip_gradients' norm in torch's order) when
    ``node`` is that norm and some of them are fp32 copies of 16-bit
    tensors; else None."""
    if node.op != "call_function" or node.target is not aten.linalg_vector_norm.default or node.args[1:] != (2.0,) or node.kwargs:
        return None
    stack = node.args[0]
    if not (isinstance(stack, fx.Node) and stack.target is aten.stack.default and len(stack.args) == 1
            and not stack.kwargs and len(stack.users) == 1):
        return None
    items = stack.args[0]
    norms = items[0].args[0] if items and isinstance(items[0], fx.Node) and items[0].target is operator.getitem else None
    if not (isinstance(norms, fx.Node) and norms.target is aten._foreach_norm.Scalar and norms.args[1:] == (2.0,) and not norms.kwargs):
        return None
    tensors = list(norms.args[0])
    if [(i.target, i.args, len(i.users)) for i in items] != [(operator.getitem, (norms, k), 1) for k in range(len(tensors))]:
        return None
    if len(norms.users) != len(tensors):
        return None
    copies = [vals for t in tensors if (vals := dtype_cast(t)) is not None
              and vals[0].dtype in (torch.bfloat16, torch.float16) and vals[1].dtype == torch.float32]
    return tensors if copies else None


def _as_sums_of_squares(g: fx.Graph, norm: fx.Node, tensors: list[fx.Node]) -> None:
    """Replace the norm by ``sqrt(sum(stack([sum(mul(t, t)), ...])))``."""
    scalar = norm.meta["val"]
    with g.inserting_before(norm):
        parts = []
        for t in tensors:
            sq = make_node(g, aten.mul.Tensor, (t, t), val=fake_like(scalar, t.meta["val"].shape), like=norm, name="sq")
            parts.append(make_node(g, aten.sum.default, (sq,), val=scalar, like=norm, name="sumsq"))
        stacked = make_node(g, aten.stack.default, (parts,), val=fake_like(scalar, (len(parts),)), like=norm, name="sumsqs")
        total = make_node(g, aten.sum.default, (stacked,), val=scalar, like=norm, name="sumsq")
        new = make_node(g, aten.sqrt.default, (total,), val=scalar, like=norm, name="grad_norm")
    norm.replace_all_uses_with(new)
    g.erase_node(norm)  # the stack, its items and _foreach_norm go with dead code below


def fuse_sum_squares(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    def found(g):
        norms = [(n, ts) for n in g.nodes if (ts := _torch_order_norm(n)) is not None]
        matches = [(n, _squared(n)) for n in g.nodes if n.op == "call_function"]
        return norms, [(n, base) for n, base in matches if base is not None and base.meta["val"].is_contiguous()]

    norms, matches = found(graph.gm.graph)
    if not norms and not matches:
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    for node, tensors in found(g)[0]:
        _as_sums_of_squares(g, node, tensors)
    matches = found(g)[1]
    for node, base in matches:
        with g.inserting_before(node):
            new = g.create_node("call_function", graph_ops.sum_squares, (base,), {}, name="sumsq")
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        g.erase_node(node)
    g.eliminate_dead_code(is_impure_node=has_side_effect)
    graph.gm.recompile()
    unfolded = f"; {len(norms)} clipping norm(s) over fp32 copies of 16-bit gradients taken as sums of squares, not in torch's order" if norms else ""
    return PassResult(graph, True, f"{len(matches)} sums of squares fused (one read of each gradient){unfolded}")
