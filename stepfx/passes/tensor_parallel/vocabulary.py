"""The rewrites of ops over a split vocabulary (not a pass; used by
``shard_tensor_parallel``).

Rank ``r`` of a tensor-parallel group of ``tp`` holds rows ``[r * V/tp,
(r + 1) * V/tp)`` of an embedding table, or those output features of an LM
head (so those columns of the logits). ``placements`` marks the ops that
read such a split over the vocabulary; each becomes its Megatron form:

- lookup: the rank's own tokens are looked up, the others read as zeros
  (the sum over the group, all-reduced by the caller, is the lookup);
- lookup backward: the gradient rows of the rank's own tokens;
- log-softmax over the vocabulary: the group's max, then the group's sum of
  exponentials (two all-reduces of one value per row), so each rank holds
  its slice of the normalized log-probabilities; its backward all-reduces
  the gradient's row sums;
- negative log-likelihood: each rank picks the targets it holds (the rest
  are ignored locally), and a mean divides by the count of targets that
  are not ``ignore_index`` over all of them; the result is partial.

The arithmetic is aten's own (the same ops on slices), so the sums over
the vocabulary differ from the whole step's only in their order.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...graph import META_GRAD_OF, META_GRAD_PIECE, META_PHASE
from ..data_parallel.collectives import fake_result, make_node

__all__ = ["rewrite_vocabulary_op"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_LOCAL_IGNORE = -1  # a target index no rank holds: rows of targets held elsewhere are ignored locally


def rewrite_vocabulary_op(g: fx.Graph, node: fx.Node, kind: str, tp: int, rank: int, group: str) -> int:
    """Replace ``node`` by its split-vocabulary form; returns the number of
    all-reduces added."""
    emit = _Emitter(g, node)
    with g.inserting_before(node):
        if kind == "log_softmax":
            return _log_softmax(emit, node, group)
        if kind == "log_softmax_backward":
            return _log_softmax_backward(emit, node, group)
        if kind in ("nll_loss", "nll_loss_backward"):
            _nll_loss(emit, node, rank, backward=kind == "nll_loss_backward")
            return 0
        if kind == "embedding":
            _lookup(emit, node, rank)
            return 0
        if kind == "embedding_backward":
            _lookup_backward(emit, node, rank)
            return 0
    raise AssertionError(kind)


def _replace(node: fx.Node, new: fx.Node) -> None:
    """``new`` stands for ``node``: its readers, and its marks as a parameter's gradient."""
    for key in (META_GRAD_OF, META_GRAD_PIECE):
        if key in node.meta:
            new.meta[key] = node.meta[key]
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)


class _Emitter:
    """Makes nodes before the rewritten one, with its metadata and a fake
    value computed from the inputs'."""

    def __init__(self, g: fx.Graph, like: fx.Node):
        self.g, self.like = g, like

    def __call__(self, target, *args, name: str, **kwargs) -> fx.Node:
        return make_node(self.g, target, args, kwargs, val=fake_result(target, args, kwargs), like=self.like,
                         phase=self.like.meta.get(META_PHASE), name=name)

    def all_reduce(self, value: fx.Node, op: str, group: str) -> fx.Node:
        issued = self(c10d.all_reduce.default, value, op, group, name="tp_vocab_all_reduce")
        return self(c10d.wait_tensor.default, issued, name="tp_vocab_wait")


_LOW = (torch.bfloat16, torch.float16)  # computed in fp32 and rounded once, as aten's kernels accumulate


def _log_softmax(emit: _Emitter, node: fx.Node, group: str) -> int:
    x, dim, half_to_float = node.args[:3]
    dtype = x.meta["val"].dtype
    if dtype in _LOW:
        x = emit(aten._to_copy.default, x, dtype=torch.float32, name="vocab_upcast")
    top = emit.all_reduce(emit(aten.amax.default, x, [dim], True, name="vocab_max"), "max", group)
    shifted = emit(aten.sub.Tensor, x, top, name="vocab_shifted")
    total = emit(aten.sum.dim_IntList, emit(aten.exp.default, shifted, name="vocab_exp"), [dim], True, name="vocab_sum")
    total = emit.all_reduce(total, "sum", group)
    out = emit(aten.sub.Tensor, shifted, emit(aten.log.default, total, name="vocab_log_sum"), name="vocab_log_softmax")
    if dtype in _LOW and not half_to_float:
        out = emit(aten._to_copy.default, out, dtype=dtype, name="vocab_log_softmax_cast")
    _replace(node, out)
    return 2


def _log_softmax_backward(emit: _Emitter, node: fx.Node, group: str) -> int:
    grad, out, dim, input_dtype = node.args[:4]
    dtype = grad.meta["val"].dtype
    if dtype in _LOW:
        grad = emit(aten._to_copy.default, grad, dtype=torch.float32, name="vocab_grad_upcast")
        out = emit(aten._to_copy.default, out, dtype=torch.float32, name="vocab_out_upcast")
    total = emit.all_reduce(emit(aten.sum.dim_IntList, grad, [dim], True, name="vocab_grad_sum"), "sum", group)
    scaled = emit(aten.mul.Tensor, emit(aten.exp.default, out, name="vocab_softmax"), total, name="vocab_scaled")
    result = emit(aten.sub.Tensor, grad, scaled, name="vocab_log_softmax_backward")
    if input_dtype != result.meta["val"].dtype:
        result = emit(aten._to_copy.default, result, dtype=input_dtype, name="vocab_grad_cast")
    _replace(node, result)
    return 1


def _held(emit: _Emitter, indices: fx.Node, rows: int, rank: int, ignore_index: int | None = None):
    """(indices local to this rank's rows, whether the rank holds each one
    and it is not ``ignore_index``)."""
    local = emit(aten.sub.Tensor, indices, rank * rows, name="vocab_local_index")
    held = emit(aten.logical_and.default, emit(aten.ge.Scalar, local, 0, name="vocab_from"),
                emit(aten.lt.Scalar, local, rows, name="vocab_to"), name="vocab_held")
    if ignore_index is not None:
        counted = emit(aten.ne.Scalar, indices, ignore_index, name="vocab_counted")
        held = emit(aten.logical_and.default, held, counted, name="vocab_held_counted")
        return local, held, counted
    return local, held, None


def _nll_loss(emit: _Emitter, node: fx.Node, rank: int, *, backward: bool) -> None:
    if backward:
        grad, logp, target, _weight, reduction, ignore_index, total_weight = node.args[:7]
    else:
        logp, target, _weight, reduction, ignore_index = node.args[:5]
    rows = logp.meta["val"].shape[1]
    local, held, counted = _held(emit, target, rows, rank, ignore_index)
    picked = emit(aten.where.ScalarOther, held, local, _LOCAL_IGNORE, name="vocab_targets")
    if backward:
        out = emit(aten.nll_loss_backward.default, grad, logp, picked, None, reduction, _LOCAL_IGNORE, total_weight,
                   name="vocab_nll_loss_backward")
        _replace(node, out)
        return
    # reduction 0 none, 1 mean, 2 sum: a mean is this rank's sum over the count of every counted target
    pair = emit(aten.nll_loss_forward.default, logp, picked, None, 0 if reduction == 0 else 2, _LOCAL_IGNORE,
                name="vocab_nll_loss")
    loss = emit(operator.getitem, pair, 0, name="vocab_nll_sum")
    count = emit(aten._to_copy.default, emit(aten.sum.default, counted, name="vocab_count"),
                 dtype=logp.meta["val"].dtype, name="vocab_total_weight")
    if reduction == 1:
        loss = emit(aten.div.Tensor, loss, count, name="vocab_nll_mean")
    for user in list(node.users):
        user.replace_all_uses_with(loss if user.args[1] == 0 else count)
        node.graph.erase_node(user)
    node.graph.erase_node(node)


def _lookup(emit: _Emitter, node: fx.Node, rank: int) -> None:
    weight, indices = node.args[:2]
    rows = weight.meta["val"].shape[0]
    local, held, _ = _held(emit, indices, rows, rank)
    safe = emit(aten.where.ScalarOther, held, local, 0, name="vocab_lookup_index")
    found = emit(aten.embedding.default, weight, safe, name="vocab_lookup")
    mask = emit(aten.unsqueeze.default, held, -1, name="vocab_lookup_held")
    out = emit(aten.where.ScalarOther, mask, found, 0.0, name="vocab_lookup_partial")
    _replace(node, out)


def _lookup_backward(emit: _Emitter, node: fx.Node, rank: int) -> None:
    grad, indices, rows, padding_idx, scale = node.args[:5]  # rows already per rank
    local, held, _ = _held(emit, indices, rows, rank)
    safe = emit(aten.where.ScalarOther, held, local, 0, name="vocab_lookup_index")
    mask = emit(aten.unsqueeze.default, held, -1, name="vocab_lookup_held")
    kept = emit(aten.where.ScalarOther, mask, grad, 0.0, name="vocab_lookup_grad")
    padding = padding_idx - rank * rows if 0 <= padding_idx - rank * rows < rows else -1
    out = emit(aten.embedding_dense_backward.default, kept, safe, rows, padding, scale, name="vocab_lookup_backward")
    _replace(node, out)
