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

Over a vocabulary split by tensor parallelism (``tensor_parallel/vocabulary.py``
made the chain: the rank's logits, a max and a sum of exponentials all-reduced
per row, the log-likelihood of the targets the rank holds, its backward with one
more all-reduce), the chain becomes two kernel halves around the group's two
all-reduces of one value per row: ``vocab_cross_entropy_stats`` (per row over
the rank's columns: max, sum of exponentials, the held target's logit; it keeps
the chunk's logits when the rows are one chunk), the group's log-sum-exp made
from them in the graph, the rank's partial loss (the rows whose target it
holds), and ``vocab_cross_entropy_grads`` (the unit gradients: the rank's
summand of the hidden state's, its rows of the weight's; it writes over the
kept logits, which nothing else reads). The backward's all-reduce of the
gradient's row sums is gone: for the log-likelihood's gradient that sum is
known (-1 per counted row, times the scale). The logits are neither gathered
nor stored beyond a chunk.

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

from ... import compat
from ...graph import META_GRAD_OF, META_GRAD_PIECE, META_PARAM, Phase, StepGraph
from ...graph.build import clone_step_graph
from ...graph.ops import RESHAPE_OPS, allocates_nothing, has_side_effect
from ..data_parallel.collectives import fake_like, make_node
from ..manager import PassOptions, PassResult
from .fuse_optimizer_update import FUSION_REPORT_KEY

__all__ = ["fuse_linear_cross_entropy", "fusable_head"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
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
    while node.op == "call_function" and node.target in RESHAPE_OPS:
        node = node.args[0]
    return node


def _view_users(node: fx.Node) -> list[fx.Node]:
    """The non-view readers of ``node``, looking through views that read only it."""
    out = []
    for user in node.users:
        if user.op == "call_function" and user.target in RESHAPE_OPS:
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
    found = _logits_matmul(logp.args[0], {logp})
    if isinstance(found, str):
        return found
    mm, hidden, wt, cast = found
    weight = wt.args[0]
    logits_dtype = cast.kwargs.get("dtype") if cast is not None else None
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
    found = _backward_matmuls(sm, logits_dtype, mm, hidden, wt, upstream)
    if isinstance(found, str):
        return found
    grad_w, grad_h = found
    return _Match(nll, hidden, weight, target, _REDUCTIONS[reduction], int(ignore_index), logits_dtype, upstream, grad_w, grad_h)


def _backward_matmuls(sm: fx.Node, logits_dtype, mm: fx.Node, hidden: fx.Node, wt: fx.Node, upstream: fx.Node):
    """From the logits' gradient ``sm`` (through the cast back of a cast
    logits, and views): the matmuls giving the weight's and the hidden
    state's gradients, or why not."""
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
    return grad_w, grad_h


def _logits_matmul(x: fx.Node, readers: set):
    """``x`` (what the log-softmax reads: ``readers``) back through views
    and the user's upcast to the head's matmul: (mm, hidden, transposed
    weight, cast or None), or why not."""
    logits = _through_views(x)
    cast = None
    if logits.target is aten._to_copy.default and set(logits.kwargs) <= {"dtype", "layout", "device"}:
        cast, logits = logits, logits.args[0]
    mm = _through_views(logits)
    if mm.target is not aten.mm.default:
        return "the logits are not one matmul"
    hidden, wt = mm.args
    if wt.target not in _TRANSPOSES:
        return "the matmul does not read a transposed weight"
    if tuple(mm.meta["val"].shape) != tuple(x.meta["val"].shape):
        return "the logits are reshaped"
    if set(_view_users(cast if cast is not None else mm)) != readers or (cast is not None and _view_users(mm) != [cast]):
        return "the logits are read elsewhere"
    for value in (hidden, wt.args[0]):
        if not value.meta["val"].is_contiguous():
            return f"{value.name} is not contiguous"
    if hidden.meta["val"].dtype != wt.args[0].meta["val"].dtype:
        return "hidden state and weight differ in dtype"
    return mm, hidden, wt, cast


@dataclasses.dataclass
class _VocabMatch:
    """The split-vocabulary chain ``tensor_parallel/vocabulary.py`` made of a head and its loss."""

    loss: fx.Node  # the rank's (partial) loss: the mean's division, or the sum
    hidden: fx.Node
    weight: fx.Node  # the rank's rows of the head's weight
    target: fx.Node  # whole-vocabulary targets
    held: fx.Node  # bool [N]: this rank holds the row's target and it is counted
    total_weight: fx.Node  # the count of counted targets (its dtype the loss's)
    offset: int
    ignore_index: int
    mean: bool
    logits_dtype: torch.dtype | None
    group: str
    upstream: fx.Node
    grad_weight: fx.Node
    grad_hidden: fx.Node
    collectives: list  # the chain's all-reduces and waits (the fused chain makes its own)


def _reduced(node: fx.Node, op: str):
    """``node`` is wait(all_reduce(x, op, group)): (x, group, [both nodes]), else None."""
    if node.target is not c10d.wait_tensor.default:
        return None
    issued = node.args[0]
    if issued.target is not c10d.all_reduce.default or issued.args[1] != op:
        return None
    return issued.args[0], issued.args[2], [issued, node]


def _match_vocab(nll: fx.Node) -> _VocabMatch | str | None:
    """None when ``nll`` is not the negative log-likelihood of a log-softmax
    over a split vocabulary; else the match or why it cannot fuse."""
    logp, picked, weight_arg, reduction, ignore = nll.args[:5]
    # logp = (x - M) - log(S), M = all-reduced max of x, S = all-reduced sum of exp(x - M)
    if not (logp.target is aten.sub.Tensor and isinstance(logp.args[1], fx.Node) and logp.args[1].target is aten.log.default):
        return None
    shifted, log_sum = logp.args
    total = _reduced(log_sum.args[0], "sum")
    if shifted.target is not aten.sub.Tensor or total is None or not isinstance(shifted.args[1], fx.Node):
        return None
    top = _reduced(shifted.args[1], "max")
    if top is None or top[0].target is not aten.amax.default or total[0].target is not aten.sum.dim_IntList:
        return None
    x = shifted.args[0]
    if top[0].args[0] is not x or total[0].args[0].target is not aten.exp.default or total[0].args[0].args[0] is not shifted:
        return None
    group = top[1]
    if weight_arg is not None or reduction != 2 or ignore != -1:
        return "the split vocabulary's loss is not the rank's sum over its targets"
    if logp.meta["val"].dtype != torch.float32:
        return "log-probabilities in 16 bits over a split vocabulary (no .float() before the loss)"
    # picked = where(held and counted, target - offset, -1)
    origin = _origin(picked)
    if origin is None or not isinstance(origin[1], int):
        return "the split vocabulary's targets are not the rank's"
    target, offset, ignore_index = origin
    held = picked.args[0]
    found = _logits_matmul(x, {top[0], shifted})
    if isinstance(found, str):
        return found
    mm, hidden, wt, cast = found
    logits_dtype = cast.kwargs.get("dtype") if cast is not None else None
    sums = [u for u in nll.users if u.target is operator.getitem and u.args[1] == 0]
    if len(sums) != 1 or any(u.target is not operator.getitem for u in nll.users):
        return "the split vocabulary's loss is read elsewhere"
    (loss,) = sums
    divs = list(loss.users)
    mean = len(divs) == 1 and divs[0].target is aten.div.Tensor and divs[0].args[0] is loss
    total_weight = divs[0].args[1] if mean else None
    if mean:
        loss = divs[0]
    # backward: nb = nll_loss_backward(upstream, logp, ...); result = nb - exp(logp) * all_reduce(sum(nb))
    nbs = [u for u in logp.users if u.target is aten.nll_loss_backward.default]
    exps = [u for u in logp.users if u.target is aten.exp.default]
    if len(nbs) != 1 or len(exps) != 1 or set(logp.users) != {nll, nbs[0], exps[0]}:
        return "the split vocabulary's log-probabilities are read elsewhere"
    (nb,), (softmax,) = nbs, exps
    upstream = nb.args[0]
    if _origin(nb.args[2]) != (target, offset, ignore_index):
        return "its backward reads other targets"
    if mean and nb.args[6] is not total_weight:
        return "its backward reads another total weight"
    scaled = [u for u in softmax.users if u.target is aten.mul.Tensor]
    if len(scaled) != 1 or len(softmax.users) != 1:
        return "the split vocabulary's softmax is read elsewhere"
    grad_total = _reduced(scaled[0].args[1], "sum")
    if grad_total is None or grad_total[0].target is not aten.sum.dim_IntList or grad_total[0].args[0] is not nb:
        return "the split vocabulary's backward is not the rank's log-softmax backward"
    results = [u for u in scaled[0].users if u.target is aten.sub.Tensor and u.args == (nb, scaled[0])]
    if len(results) != 1 or len(scaled[0].users) != 1 or set(nb.users) != {grad_total[0], results[0]}:
        return "the split vocabulary's backward is read elsewhere"
    found = _backward_matmuls(results[0], logits_dtype, mm, hidden, wt, upstream)
    if isinstance(found, str):
        return found
    grad_w, grad_h = found
    collectives = top[2] + total[2] + grad_total[2]
    return _VocabMatch(loss, hidden, wt.args[0], target, held, total_weight, int(offset), int(ignore_index), mean,
                       logits_dtype, group, upstream, grad_w, grad_h, collectives)


def _origin(picked: fx.Node):
    """(target, offset, ignore_index) of where(held and counted, target - offset, -1), or None."""
    if picked.target is not aten.where.ScalarOther or picked.args[2] != -1:
        return None
    held, local = picked.args[:2]
    if local.target is not aten.sub.Tensor or held.target is not aten.logical_and.default \
            or held.args[1].target is not aten.ne.Scalar:
        return None
    return local.args[0], local.args[1], held.args[1].args[1]


def _fuse_vocab(g: fx.Graph, m: _VocabMatch, graph_ops) -> set:
    """The split-vocabulary chain as the two kernel halves around the
    group's two all-reduces of one value per row; returns the chain's old
    collectives (now unread) for removal."""
    from ...codegen.cross_entropy_kernels import default_chunk_rows

    h, w = m.hidden.meta["val"], m.weight.meta["val"]
    n = h.shape[0]
    rows = fake_like(h, (n,), dtype=torch.float32)
    # the stats half keeps its logits for the grads half when the rows are one chunk (as the kernel decides)
    hint = compat.size_hint(n)
    one_chunk = hint <= default_chunk_rows(hint, int(w.shape[0]), h.dtype, h.device.type)
    kw = {"offset": m.offset, "ignore_index": m.ignore_index, "logits_dtype": m.logits_dtype}
    with g.inserting_before(m.loss):
        meta = dict(like=m.loss, phase=Phase.FORWARD)
        logits = fake_like(h, (n if one_chunk else 0, w.shape[0]))
        stats = make_node(g, graph_ops.vocab_cross_entropy_stats, (m.hidden, m.weight, m.target), kw,
                          val=(rows, rows, rows, logits), name="vocab_cross_entropy_stats", **meta)
        local_max, local_sum, picked, kept = (
            make_node(g, operator.getitem, (stats, i), val=v, name=name, **meta)
            for i, (v, name) in enumerate(zip(stats.meta["val"], ("row_max", "row_sum", "target_logit", "kept_logits"))))

        def all_reduce(value, op):
            issued = make_node(g, c10d.all_reduce.default, (value, op, m.group), val=rows, name="tp_vocab_all_reduce", **meta)
            return make_node(g, c10d.wait_tensor.default, (issued,), val=rows, name="tp_vocab_wait", **meta)

        def op(target, *args, name):
            return make_node(g, target, args, val=fake_like(rows, rows.shape), name=name, **meta)

        top = all_reduce(local_max, "max")
        rescaled = op(aten.mul.Tensor, local_sum, op(aten.exp.default, op(aten.sub.Tensor, local_max, top, name="vocab_gap"),
                                                    name="vocab_rescale"), name="vocab_rescaled_sum")
        total = all_reduce(rescaled, "sum")
        lse = op(aten.add.Tensor, top, op(aten.log.default, total, name="vocab_log_sum"), name="vocab_lse")
        row_loss = op(aten.where.ScalarOther, m.held, op(aten.sub.Tensor, lse, picked, name="vocab_row_loss"),
                      0.0, name="vocab_held_loss")
        loss_val = m.loss.meta["val"]
        loss = make_node(g, aten.sum.default, (row_loss,), val=fake_like(loss_val, ()), name="vocab_loss_sum", **meta)
        scale = None
        if m.mean:
            loss = make_node(g, aten.div.Tensor, (loss, m.total_weight), val=fake_like(loss_val, ()), name="vocab_loss",
                             **meta)
            scale = make_node(g, aten.reciprocal.default, (m.total_weight,), val=fake_like(loss_val, ()),
                              name="vocab_loss_scale", **meta)
        grads = make_node(g, graph_ops.vocab_cross_entropy_grads, (m.hidden, m.weight, m.target, lse, scale, kept), kw,
                          val=(h, w), name="vocab_cross_entropy_grads", **meta)
        unit_h = make_node(g, operator.getitem, (grads, 0), val=h, name="unit_grad_hidden", **meta)
        unit_w = make_node(g, operator.getitem, (grads, 1), val=w, name="unit_grad_weight", **meta)
    m.loss.replace_all_uses_with(loss)
    _install_gradients(g, m, unit_w, unit_h)
    return set(m.collectives)


def _install_gradients(g: fx.Graph, m, unit_w: fx.Node, unit_h: fx.Node) -> None:
    """The fused call's unit gradients in place of the backward's two
    matmuls, times the upstream gradient (made before the first of them);
    for ``loss.backward()`` itself (``ones_like``) x * 1 rounds to x in every
    dtype, so the unit gradients are the gradients (the multiply was a
    103M-element mixed-dtype pass, ~0.4 ms per step on the 1.3B GPT's tied
    weight)."""
    grad_w, grad_h = unit_w, unit_h
    if m.upstream.target is not aten.ones_like.default:
        order = {n: i for i, n in enumerate(g.nodes)}
        first = min((m.grad_weight, m.grad_hidden), key=order.__getitem__)
        with g.inserting_before(first):
            meta = dict(like=first, phase=Phase.BACKWARD)
            w, h = unit_w.meta["val"], unit_h.meta["val"]
            grad_w = make_node(g, aten.mul.Tensor, (unit_w, m.upstream), val=fake_like(w, w.shape), name="grad_weight",
                               **meta)
            grad_h = make_node(g, aten.mul.Tensor, (unit_h, m.upstream), val=fake_like(h, h.shape), name="grad_hidden",
                               **meta)
    for old, new in ((m.grad_weight, grad_w), (m.grad_hidden, grad_h)):
        for key in (META_GRAD_OF, META_GRAD_PIECE):
            if key in old.meta:
                new.meta[key] = old.meta[key]
        old.replace_all_uses_with(new)


def fusable_head(nll: fx.Node) -> set:
    """The forward nodes of ``nll``'s chain this pass fuses, which backward must read as they are (a pass that
    would recompute them, recompute_activations, leaves them): the loss and its total weight, its targets
    (through views and copies of the batch), the log-softmax, the views and upcast between it and the logits'
    matmul, the matmul, and the hidden state it reads (through views). Empty where the forward is not the
    fused shape."""
    logp = nll.args[0]
    if not isinstance(logp, fx.Node) or logp.target is not aten._log_softmax.default:
        return set()
    found = _logits_matmul(logp.args[0], {logp})
    if isinstance(found, str):
        return set()
    mm, hidden = found[0], found[1]
    head = {nll, logp, mm, *(u for u in nll.users if u.target is operator.getitem)}
    x = logp.args[0]
    while x is not mm:  # the views and the upcast _logits_matmul walked
        head.add(x)
        x = x.args[0]
    x = hidden
    head.add(x)
    while x.op == "call_function" and x.target in RESHAPE_OPS:
        x = x.args[0]
        head.add(x)
    x = nll.args[1]  # the targets (labels[:, 1:].contiguous().view(-1))
    while isinstance(x, fx.Node) and x.op == "call_function" and (
            allocates_nothing(x) or x.target in (*RESHAPE_OPS, aten.clone.default, aten._to_copy.default)):
        head.add(x)
        x = x.args[0]
    return head


def fuse_linear_cross_entropy(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    losses = [n for n in graph.gm.graph.nodes if n.op == "call_function" and n.target is aten.nll_loss_forward.default]
    if not losses:
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    report = list(graph.signature.extra.get(FUSION_REPORT_KEY, ()))
    done = 0
    retired: set = set()  # the split-vocabulary chains' all-reduces, unread once fused
    for nll in [n for n in g.nodes if n.op == "call_function" and n.target is aten.nll_loss_forward.default]:
        vm = _match_vocab(nll)
        if isinstance(vm, str):
            report.append(("fuse_linear_cross_entropy", nll.name, vm))
            continue
        if vm is not None:
            retired |= _fuse_vocab(g, vm, graph_ops)
            done += 1
            continue
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
        _install_gradients(g, m, unit_w, unit_h)
        done += 1
    g.eliminate_dead_code(is_impure_node=lambda node: has_side_effect(node) and node not in retired)
    graph.gm.recompile()
    graph = graph.replace(signature=dataclasses.replace(graph.signature, extra={**graph.signature.extra, FUSION_REPORT_KEY: report}))
    return PassResult(graph, True, f"{done} linear + cross-entropy chains fused (logits never stored); {len(losses) - done} left as ops")
