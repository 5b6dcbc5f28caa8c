"""fuse_linear_cross_entropy: the output projection and the cross-entropy loss,
forward and backward, become one chunked kernel that never holds all logits.

Requires: a functional graph; the loss written the usual way —
``F.cross_entropy(hidden @ W.T, target)``, optionally with ``.float()`` on the
logits — which captures as::

    forward:   mm(H, t(W)) -> views -> [_to_copy(f32) -> views] -> _log_softmax -> nll_loss_forward
    backward:  nll_loss_backward -> _log_softmax_backward_data -> [views -> _to_copy] -> views
               -> mm(t(dL), H) (the weight's gradient) and mm(dL, t(t(W))) (the hidden state's)

Ensures: each such chain (matched by op identity, every intermediate read
only inside the chain) is replaced by one call of
:func:`stepfx.codegen.graph_ops.linear_cross_entropy` in forward, which
returns the loss and the gradients of the loss for a unit upstream gradient
(computed chunk by chunk from the same logits); backward multiplies them by
the upstream gradient (the loss scale or accumulation factor; for a plain
``loss.backward()``, whose upstream gradient is ``ones_like``, they are the
gradients as they are). The
logits and their fp32 log-softmax — at the GPT workload 8192 x 50304 x 6
bytes, 2.5 GB — are never stored. Chains that do not match (logits read
elsewhere, a bias, reduction "none") are left as ops, with the reason.

Before / after (abridged)::

    mm = aten.mm(h, t_w)                         lce = stepfx.codegen.graph_ops.linear_cross_entropy(h, w, target, ...)
    _log_softmax = aten._log_softmax(...)   ->   loss = lce[0]
    nll_loss_forward = aten.nll_loss_forward(...)  ...
    mm_1 = aten.mm(t_9, h)                       grad_w = aten.mul.Tensor(lce[2], ones_like)
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ...graph import META_PARAM, Phase, StepGraph
from ...graph.build import clone_step_graph
from ...graph.ops import has_side_effect
from ..data_parallel.collectives import fake_like, make_node
from ..manager import PassOptions, PassResult
from .fuse_optimizer_update import FUSION_REPORT_KEY

__all__ = ["fuse_linear_cross_entropy"]

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_TRANSPOSES = (aten.t.default,)
_REDUCTIONS = {1: "mean", 2: "sum"}


@dataclasses.dataclass
class _Match:
    nll: fx.Node
    hidden: fx.Node
    weight: fx.Node
    target: fx.Node
    reduction: str
    ignore_index: int
    logits_dtype: torch.dtype | None
    upstream: fx.Node  # nll_loss_backward's incoming gradient (0-d)
    grad_weight: fx.Node  # mm giving d loss / d weight   [V, d]
    grad_hidden: fx.Node  # mm giving d loss / d hidden   [N, d]


def _through_views(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node


def _view_users(node: fx.Node) -> list[fx.Node]:
    """The non-view readers of ``node``, looking through views that read only it."""
    out = []
    for user in node.users:
        if user.op == "call_function" and user.target in _VIEWS:
            out.extend(_view_users(user))
        else:
            out.append(user)
    return out


def _is_weight(node, wt: fx.Node) -> bool:
    """``node`` is ``t(W.T)``: the weight again (under ZeRO-3 a copy gathered for backward, tagged with the same parameter)."""
    if node.target not in _TRANSPOSES:
        return False
    inner = node.args[0]
    if inner is wt:
        return True
    name = wt.meta.get(META_PARAM)
    return name is not None and inner.target in _TRANSPOSES and inner.meta.get(META_PARAM) == name


def _match(nll: fx.Node) -> _Match | str:
    logp, target, weight_arg, reduction, ignore_index = nll.args[:5]
    if weight_arg is not None:
        return "class weights"
    if reduction not in _REDUCTIONS:
        return "reduction 'none'"
    if not (isinstance(logp, fx.Node) and logp.target is aten._log_softmax.default and logp.args[1:] == (1, False)):
        return "the loss does not read a log-softmax over classes"
    # views may sit on either side of the upcast (Hugging Face: mm -> [B, S, V] -> float() -> [B*S, V])
    logits = _through_views(logp.args[0])
    cast = None
    if logits.target is aten._to_copy.default and set(logits.kwargs) <= {"dtype", "layout", "device"}:
        cast, logits = logits, logits.args[0]
    logits_dtype = cast.kwargs.get("dtype") if cast is not None else None
    mm = _through_views(logits)
    if mm.target is not aten.mm.default:
        return "the logits are not one matmul"
    hidden, wt = mm.args
    if wt.target not in _TRANSPOSES:
        return "the matmul does not read a transposed weight"
    weight = wt.args[0]
    if tuple(mm.meta["val"].shape) != tuple(logp.args[0].meta["val"].shape):
        return "the logits are reshaped"
    if _view_users(mm) != [cast if cast is not None else logp] or (cast is not None and _view_users(cast) != [logp]):
        return "the logits are read elsewhere"
    for value in (hidden, weight):
        if not value.meta["val"].is_contiguous():
            return f"{value.name} is not contiguous"
    if hidden.meta["val"].dtype != weight.meta["val"].dtype:
        return "hidden state and weight differ in dtype"
    # backward: logp read by the loss and its backward only
    nll_bwd = [u for u in logp.users if u.target is aten.nll_loss_backward.default]
    if len(nll_bwd) != 1:
        return "no single backward of the loss"
    (nb,) = nll_bwd
    upstream, nb_logp, nb_target, nb_w, nb_red, nb_ii, total_weight = nb.args
    if nb_target is not target or nb_red != reduction or nb_ii != ignore_index or nb_w is not None:
        return "its backward is another loss"
    if not (total_weight.target is operator.getitem and total_weight.args == (nll, 1)):
        return "its backward reads another total weight"
    (sm,) = nb.users if len(nb.users) == 1 else (None,)
    if sm is None or sm.target is not aten._log_softmax_backward_data.default or sm.args[1] is not logp:
        return "the loss gradient is read elsewhere"
    if set(logp.users) != {nll, nb, sm}:
        return "the log-softmax is read elsewhere"
    dl = sm
    if logits_dtype is not None:
        (cast,) = readers if len(readers := _view_users(sm)) == 1 else (None,)
        if cast is None or cast.target is not aten._to_copy.default or cast.kwargs.get("dtype") != mm.meta["val"].dtype:
            return "the logits gradient is not cast back like the logits"
        dl = cast
    readers = _view_users(dl)
    grad_w = grad_h = None
    for reader in readers:
        if reader.target in _TRANSPOSES and len(reader.users) == 1:
            (m,) = reader.users
            if m.target is aten.mm.default and m.args[0] is reader and m.args[1] is hidden:
                grad_w = m
                continue
        if reader.target is aten.mm.default and reader.args[0] is not hidden and _is_weight(reader.args[1], wt):
            grad_h = reader
            continue
        return "the logits gradient is read by more than the two matmuls"
    if grad_w is None or grad_h is None:
        return "the backward matmuls were not found"
    if hidden.meta["val"].dtype == torch.float16 and not (upstream.target is aten.ones_like.default):
        # the kernel's gradients are for an upstream gradient of 1; fp16 loss
        # scaling multiplies afterwards, too late: p/count underflows fp16
        return "fp16 with a scaled upstream gradient (its per-element gradients would underflow before the scale)"
    return _Match(nll, hidden, weight, target, _REDUCTIONS[reduction], int(ignore_index), logits_dtype, upstream, grad_w, grad_h)


def fuse_linear_cross_entropy(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    losses = [n for n in graph.gm.graph.nodes if n.op == "call_function" and n.target is aten.nll_loss_forward.default]
    if not losses:
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    report = list(graph.signature.extra.get(FUSION_REPORT_KEY, ()))
    done = 0
    for nll in [n for n in g.nodes if n.op == "call_function" and n.target is aten.nll_loss_forward.default]:
        m = _match(nll)
        if isinstance(m, str):
            report.append(("fuse_linear_cross_entropy", nll.name, m))
            continue
        h, w = m.hidden.meta["val"], m.weight.meta["val"]
        loss_val = [u for u in nll.users if u.args[1] == 0]
        with g.inserting_before(nll):
            vals = (nll.meta["val"][0], h, w)
            call = make_node(g, graph_ops.linear_cross_entropy, (m.hidden, m.weight, m.target),
                             {"ignore_index": m.ignore_index, "reduction": m.reduction, "logits_dtype": m.logits_dtype},
                             val=vals, like=nll, phase=Phase.FORWARD, name="linear_cross_entropy")
            loss = make_node(g, operator.getitem, (call, 0), val=vals[0], like=nll, phase=Phase.FORWARD, name="loss")
            unit_h = make_node(g, operator.getitem, (call, 1), val=h, like=nll, phase=Phase.FORWARD, name="unit_grad_hidden")
            unit_w = make_node(g, operator.getitem, (call, 2), val=w, like=nll, phase=Phase.FORWARD, name="unit_grad_weight")
        for getitem in loss_val:
            getitem.replace_all_uses_with(loss)
        if m.upstream.target is aten.ones_like.default:
            # loss.backward() itself: x * 1 rounds to x in every dtype, so the
            # unit gradients are the gradients (the multiply was a 103M-element
            # mixed-dtype pass, ~0.4 ms per step on the 1.3B GPT's tied weight)
            grad_w, grad_h = unit_w, unit_h
        else:
            first = min((m.grad_weight, m.grad_hidden), key=lambda n: list(g.nodes).index(n))
            with g.inserting_before(first):
                meta = dict(like=first, phase=Phase.BACKWARD)
                grad_w = make_node(g, aten.mul.Tensor, (unit_w, m.upstream), val=fake_like(w, w.shape), name="grad_weight",
                                   **meta)
                grad_h = make_node(g, aten.mul.Tensor, (unit_h, m.upstream), val=fake_like(h, h.shape), name="grad_hidden",
                                   **meta)
        m.grad_weight.replace_all_uses_with(grad_w)
        m.grad_hidden.replace_all_uses_with(grad_h)
        done += 1
    g.eliminate_dead_code(is_impure_node=has_side_effect)
    graph.gm.recompile()
    graph = graph.replace(signature=dataclasses.replace(graph.signature, extra={**graph.signature.extra, FUSION_REPORT_KEY: report}))
    return PassResult(graph, True, f"{done} linear + cross-entropy chains fused (logits never stored); {len(losses) - done} left as ops")
