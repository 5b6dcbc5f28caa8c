"""choose_attention_kernels: where the sequence length is symbolic, attention
runs without building a cuDNN plan for each new length.

Why: torch's cuDNN attention builds an execution plan for each new shape
(cuDNN's graph API) and caches it. With a fixed length that is paid once;
with a new length every step it is paid every step, by every attention call
whose shape or layout the cache has not seen. Measured on the H200 (1.3B GPT,
lengths uniform in [1024, 2048], 2026-12-04): ~1.6 ms of host time per call
on a new length (77 ms a step over 48 forward and backward calls, the step's
device time being ~110 ms), and 1.6 s for the one step of length 2048, where
every call took 33-39 ms (``results/2026-12-04_dynamic_lengths_profile_call15_h200.txt``).
Flash attention builds no plan, but on the H200 it is 1.5-1.8x slower than
cuDNN's kernel (forward + backward at [4, 16, L, 128] bf16, causal:
1.06 against 0.69 ms at L = 1678, 1.39 against 0.76 at 2048;
``results/2026-12-05_attention_lengths_h200.jsonl``): 8.8 ms of a 112 ms step
at length 1674 (``results/2026-12-05_dynamic_gap_h200.txt``).

So, for a plan whose lengths are symbolic (``stepfx.dynamic``):

- attention flash attention takes runs as flash attention (the default),
  which chooses its kernel from the sizes alone; a plan with static sizes
  keeps cuDNN;
- with ``stepfx.attention_pad_multiple`` (a number, or "auto": the next
  power of two at or above an eighth of the traced length, within
  [64, 512]), causal self-attention (query and key lengths the same symbol)
  stays on cuDNN with q, k, v padded with zeros up to that multiple: cuDNN
  builds one plan per bucket, not per length, and the output and the
  gradients are cut back to the length (and laid out as before: later views
  were traced on that layout). Exact: a causal query never reads a later
  key, so the real rows' outputs are the unpadded call's; the padded rows'
  output gradients are zeros, so they add nothing to the keys' and values'
  gradients. On the H200 the step is then bitwise equal to the one that
  builds a cuDNN plan per length (``results/2026-12-05_gpu_padded_attention_test_h200.txt``)
  but slower than flash: 0.889x the fixed-length step's tokens/s
  (``results/2026-12-05_dynamic_lengths_padded_cudnn_h200.jsonl``) against
  flash's 0.915x (the same command, 2026-12-04, ``results/2026-12-04_dynamic_lengths_h200.jsonl``):
  the four pads and four cuts (copies) a layer cost more than cuDNN's kernel
  saves. Hence opt-in, for runs that want the per-length step's bits.

Requires: a functional graph; ``fold_causal_masks`` ran (a folded mask is
``is_causal`` and no bias). ``options.extra[FLASH_CHECK_KEY]``: a predicate
``(dtype, head_dim, query_heads, kv_heads, is_causal) -> bool`` telling
whether this device's flash kernel takes such a call
(``compat.flash_attention_takes``); absent, nothing changes. Grouped K/V
heads (after ``unrepeat_kv_heads``) go to flash attention only where
``options.extra[GQA_OPS_KEY]`` lists it (cuDNN took them already).

Ensures: each ``_scaled_dot_product_cudnn_attention`` forward whose query
length is symbolic, with no bias and no dropout, whose log-sum-exp and
random state are read only by its ``_scaled_dot_product_cudnn_attention_backward``
calls, is either (causal self-attention) the same pair on padded inputs
(``cat`` with zeros along the length; ``narrow`` back), or replaced with
``_scaled_dot_product_flash_attention`` and those backwards with
``_scaled_dot_product_flash_attention_backward`` (same inputs, causality and
scale; flash's own log-sum-exp and random state passed from forward to
backward). Every value the rest of the step reads keeps its shape; no guard
is added. bf16 results differ from the unpadded cuDNN call by rounding at
most (another kernel configuration), not bitwise. Anything else is left as
it was.

Before / after::

    attn = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=0.125)
        ->  q_padded = aten.cat([q, aten.new_zeros(q, [4, 16, padded - length, 128])], 2)  (k, v alike)
            attn = aten._scaled_dot_product_cudnn_attention(q_padded, k_padded, v_padded, None, True, 0.0, True, ...)
            out = aten.narrow(attn[0], 2, 0, length)
        or  attn = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=0.125)
"""
from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from ... import compat
from ...errors import PassError
from ...graph import StepGraph
from ...graph.build import clone_step_graph_mapped
from ..data_parallel.collectives import make_node
from ..manager import PassOptions, PassResult
from .unrepeat_kv_heads import GQA_OPS_KEY

__all__ = ["FLASH_CHECK_KEY", "choose_attention_kernels"]

aten = torch.ops.aten
FLASH_CHECK_KEY = "flash_attention_takes"
_CUDNN = aten._scaled_dot_product_cudnn_attention.default
_CUDNN_BWD = aten._scaled_dot_product_cudnn_attention_backward.default
_FLASH = aten._scaled_dot_product_flash_attention.default
_FLASH_BWD = aten._scaled_dot_product_flash_attention_backward.default
_ZEROS = aten.new_zeros.default
_CAT = aten.cat.default
_NARROW = aten.narrow.default
_PERMUTE = aten.permute.default
_CLONE = aten.clone.default
# cuDNN forward outputs: 0 output, 1 logsumexp, 2 cum_seq_q, 3 cum_seq_k, 4 max_q, 5 max_k, 6 philox_seed,
# 7 philox_offset, 8 debug mask. Flash's: the same places, 6/7 its random state. Only the output may be read by
# anything but the backward (cuDNN's logsumexp is [B, H, S, 1], flash's [B, H, S]).
_BACKWARD_ONLY = {1, 2, 3, 4, 5, 6, 7, 8}


def _arg(node: fx.Node, name: str, default=None):
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            if i < len(node.args) and not arg.kwarg_only:
                return node.args[i]
            return node.kwargs.get(name, arg.default_value if arg.has_default_value() else default)
    raise KeyError(name)


def _items(node: fx.Node) -> dict[int, fx.Node] | None:
    """index -> getitem node for a multi-output node read only through getitems (one per index)."""
    items = {}
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] in items:
            return None
        items[user.args[1]] = user
    return items


def _pairable(forward: fx.Node) -> list[fx.Node] | None:
    """The backward calls of ``forward`` when the pair can move to another kernel or another length: no
    bias, no dropout, static heads and head size, cuDNN's statistics read only by its backwards (which read
    the forward's own inputs, output and statistics, causal and scaled alike); else None."""
    q, k = _arg(forward, "query"), _arg(forward, "key")
    qv, kv = q.meta.get("val"), k.meta.get("val")
    if not isinstance(qv, torch.Tensor) or qv.dim() != 4 or not compat.is_symbolic(qv.shape[2]):
        return None
    if _arg(forward, "attn_bias") is not None or _arg(forward, "dropout_p", 0.0) != 0.0:
        return None
    if _arg(forward, "return_debug_mask", False):
        return None
    if isinstance(qv.shape[3], torch.SymInt) or isinstance(qv.shape[1], torch.SymInt) or isinstance(kv.shape[1], torch.SymInt):
        return None
    causal = bool(_arg(forward, "is_causal", False))
    items = _items(forward)
    if items is None:
        return None
    backwards: list[fx.Node] = []
    for index, item in items.items():
        if index not in _BACKWARD_ONLY:
            continue
        for user in item.users:
            if user.target is not _CUDNN_BWD:
                return None  # cuDNN's statistics read elsewhere: their layout would change
            if user not in backwards:
                backwards.append(user)
    for backward in backwards:
        same = all(_arg(backward, n) is _arg(forward, n) for n in ("query", "key", "value"))
        if not same or _arg(backward, "out") is not items.get(0) or _arg(backward, "logsumexp") is not items.get(1):
            return None
        if bool(_arg(backward, "is_causal", False)) != causal or _arg(backward, "scale") != _arg(forward, "scale"):
            return None
        if _arg(backward, "attn_bias") is not None or _arg(backward, "dropout_p", 0.0) != 0.0:
            return None
        if _items(backward) is None:
            return None
    return backwards


def pad_multiple(length, asked) -> int:
    """The multiple a symbolic attention length is padded up to: ``asked`` (``stepfx.attention_pad_multiple``)
    when it is a number, for "auto" the next power of two at or above an eighth of the traced length
    (``length``'s hint), within [64, 512]: at most 8 buckets per doubling of the length, each padding at most
    an eighth of it."""
    if asked != "auto":
        return int(asked)
    eighth = -(-compat.size_hint(length) // 8)
    return min(512, max(64, 1 << max(0, eighth - 1).bit_length()))


def _plan(forward: fx.Node, takes, grouped_ops: frozenset, asked) -> tuple[str, list[fx.Node], int] | None:
    """(how, the backward calls, the pad multiple) for a cuDNN forward with a symbolic length: "pad" (cuDNN on
    the length padded to a multiple: causal self-attention), "flash" (flash attention), or None (kept)."""
    backwards = _pairable(forward)
    if backwards is None:
        return None
    q, k = _arg(forward, "query"), _arg(forward, "key")
    qv, kv = q.meta["val"], k.meta["val"]
    causal = bool(_arg(forward, "is_causal", False))
    if asked != 0 and causal and compat.size_expr(qv.shape[2]) == compat.size_expr(kv.shape[2]):
        return "pad", backwards, pad_multiple(qv.shape[2], asked)
    if qv.shape[1] != kv.shape[1] and not {_FLASH, _FLASH_BWD} <= grouped_ops:
        return None  # grouped K/V heads (unrepeat_kv_heads) that this device's flash kernel was not found to take
    if not takes(qv.dtype, int(qv.shape[3]), int(qv.shape[1]), int(kv.shape[1]), causal):
        return None
    return "flash", backwards, 0


def _val(target, args, kwargs):
    """The fake value of ``target`` called on the graph's values of ``args``."""
    vals, kvals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    flat = [b for a in vals for b in (a if isinstance(a, (list, tuple)) else (a,))]
    fake = next(a for a in flat if isinstance(a, torch.Tensor))
    shape_env = getattr(fake.fake_mode, "shape_env", None)
    # what the padded rewrite's ops check is true at every length (a padded length is at least the length):
    # no guard for a later call to test
    quiet = shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext()
    with fake.fake_mode, quiet:
        return target(*vals, **kvals)


def _rewrite(g: fx.Graph, forward: fx.Node, backwards: list[fx.Node]) -> None:
    """``forward`` (cuDNN) and its ``backwards`` replaced with flash attention's."""
    items = _items(forward)
    q, k, v = (_arg(forward, n) for n in ("query", "key", "value"))
    scale, causal = _arg(forward, "scale"), bool(_arg(forward, "is_causal", False))
    args, kwargs = (q, k, v, 0.0, causal, False), {"scale": scale}
    with g.inserting_after(forward):
        flash = make_node(g, _FLASH, args, kwargs, val=_val(_FLASH, args, kwargs), like=forward, name="flash_attention")
    flash_items: dict[int, fx.Node] = {}

    def item(index: int) -> fx.Node:
        if index not in flash_items:
            with g.inserting_after(flash):
                flash_items[index] = make_node(g, operator.getitem, (flash, index), val=flash.meta["val"][index],
                                               like=forward)
        return flash_items[index]

    def size(value):
        """max_q / max_k: the forward's own output mapped to flash's, a size read elsewhere kept."""
        if isinstance(value, fx.Node) and value.target is operator.getitem and value.args[0] is forward:
            return item(value.args[1])
        return value

    if 0 in items:
        items[0].replace_all_uses_with(item(0))
    for backward in backwards:
        bargs = (_arg(backward, "grad_out"), q, k, v, item(0), item(1), None, None,
                 size(_arg(backward, "max_q")), size(_arg(backward, "max_k")), 0.0, causal, item(6), item(7))
        with g.inserting_after(backward):
            new = make_node(g, _FLASH_BWD, bargs, {"scale": scale}, val=_val(_FLASH_BWD, bargs, {"scale": scale}),
                            like=backward, name="flash_attention_backward")
        for user in list(backward.users):
            user.args = (new, user.args[1])
            user.meta["val"] = new.meta["val"][user.args[1]]
        g.erase_node(backward)
    for old_item in items.values():
        if not old_item.users:
            g.erase_node(old_item)
    if not forward.users:
        g.erase_node(forward)


def _with(node: fx.Node, **replace) -> tuple[tuple, dict]:
    """``node``'s arguments as its schema orders them (positional, then keyword-only), some replaced."""
    args, kwargs = [], {}
    for arg in node.target._schema.arguments:
        value = replace[arg.name] if arg.name in replace else _arg(node, arg.name)
        if arg.kwarg_only:
            kwargs[arg.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def _rewrite_padded(g: fx.Graph, forward: fx.Node, backwards: list[fx.Node], multiple: int) -> None:
    """``forward`` (cuDNN, causal self-attention) and its ``backwards`` on the length padded with zeros up to a
    ``multiple``; the output and the gradients cut back to the length. Exact: a causal query never reads a
    later key, so the real rows' outputs are those of the unpadded call, and the padded rows' output
    gradients are zeros, so they add nothing to the keys' and values' gradients."""
    items = _items(forward)
    q, k, v = (_arg(forward, n) for n in ("query", "key", "value"))
    length_val = q.meta["val"].shape[2]

    def sym(target, args, val, like, name=None):
        return make_node(g, target, args, val=val, like=like, name=name)

    with g.inserting_before(forward):
        length = sym(aten.sym_size.int, (q, 2), length_val, forward, "attention_length")
        rounded = sym(operator.add, (length, multiple - 1), length_val + (multiple - 1), forward)
        buckets = sym(operator.floordiv, (rounded, multiple), rounded.meta["val"] // multiple, forward)
        padded = sym(operator.mul, (buckets, multiple), buckets.meta["val"] * multiple, forward, "attention_padded_length")
        extra = sym(operator.sub, (padded, length), padded.meta["val"] - length_val, forward)

    def pad(x: fx.Node, like: fx.Node) -> fx.Node:
        shape = x.meta["val"].shape
        zargs = (x, [int(shape[0]), int(shape[1]), extra, int(shape[3])])
        zeros = make_node(g, _ZEROS, zargs, val=_val(_ZEROS, zargs, {}), like=like, name=f"{x.name}_pad")
        args = ([x, zeros], 2)
        return make_node(g, _CAT, args, val=_val(_CAT, args, {}), like=like, name=f"{x.name}_padded")

    def cut(x: fx.Node, like: fx.Node, original) -> fx.Node:
        """``x`` cut back to the length, laid out as the unpadded call's value was (``original``: its fake
        value): the step's later ops were traced on that layout (a ``view`` that merges the batch and the
        length needs the batch's rows to be adjacent, which a cut of the padded rows is not)."""
        order = sorted(range(4), key=lambda d: (-compat.size_hint(original.stride(d)), d))  # outermost first
        back = [order.index(d) for d in range(4)]
        made = x
        for target, args, kwargs, name in ((_NARROW, (2, 0, length), {}, f"{x.name}_cut"), (_PERMUTE, (order,), {}, None),
                                           (_CLONE, (), {"memory_format": torch.contiguous_format}, None),
                                           (_PERMUTE, (back,), {}, f"{x.name}_dense")):
            with g.inserting_after(made):
                made = make_node(g, target, (made, *args), kwargs, val=_val(target, (made, *args), kwargs), like=like,
                                 name=name)
        return made

    with g.inserting_before(forward):
        qp, kp, vp = pad(q, forward), pad(k, forward), pad(v, forward)
        args, kwargs = _with(forward, query=qp, key=kp, value=vp)
        new = make_node(g, _CUDNN, args, kwargs, val=_val(_CUDNN, args, kwargs), like=forward, name="padded_attention")
    new_items: dict[int, fx.Node] = {}

    def item(index: int) -> fx.Node:
        if index not in new_items:
            with g.inserting_after(new):
                new_items[index] = make_node(g, operator.getitem, (new, index), val=new.meta["val"][index], like=forward)
        return new_items[index]

    def mapped(value):
        if isinstance(value, fx.Node) and value.target is operator.getitem and value.args[0] is forward:
            return item(value.args[1])
        return value

    for backward in backwards:
        with g.inserting_before(backward):
            grad = pad(_arg(backward, "grad_out"), backward)
            replace = {n: mapped(_arg(backward, n)) for n in ("out", "logsumexp", "philox_seed", "philox_offset",
                                                                "cum_seq_q", "cum_seq_k")}
            args, kwargs = _with(backward, grad_out=grad, query=qp, key=kp, value=vp, max_q=padded, max_k=padded, **replace)
            bwd = make_node(g, _CUDNN_BWD, args, kwargs, val=_val(_CUDNN_BWD, args, kwargs), like=backward,
                            name="padded_attention_backward")
        for user in list(backward.users):
            with g.inserting_after(user):
                whole = make_node(g, operator.getitem, (bwd, user.args[1]), val=bwd.meta["val"][user.args[1]], like=user)
            grad_in = cut(whole, backward, user.meta["val"])
            user.replace_all_uses_with(grad_in)
            g.erase_node(user)
        g.erase_node(backward)
    if 0 in items and items[0].users:  # the rest of the step reads the output cut back to the length
        out = cut(item(0), forward, items[0].meta["val"])
        items[0].replace_all_uses_with(out)
    for old_item in items.values():
        if not old_item.users:
            g.erase_node(old_item)
    if not forward.users:
        g.erase_node(forward)


def choose_attention_kernels(graph: StepGraph, options: PassOptions) -> PassResult:
    if not graph.functional:
        raise PassError("choose_attention_kernels requires a functional graph (run functionalize_graph first)")
    takes = (options.extra or {}).get(FLASH_CHECK_KEY)
    forwards = [n for n in graph.gm.graph.nodes if n.op == "call_function" and n.target is _CUDNN]
    if takes is None or not forwards:
        return PassResult(graph, False, "")
    grouped = frozenset((options.extra or {}).get(GQA_OPS_KEY, ()))
    asked = getattr(getattr(options.config, "stepfx", None), "attention_pad_multiple", 0)
    plans = {n: p for n in forwards if (p := _plan(n, takes, grouped, asked)) is not None}
    symbolic = sum(1 for n in forwards if compat.is_symbolic(_arg(n, "query").meta["val"].shape[2]))
    kept = symbolic - len(plans)
    note = f"; {kept} kept on cuDNN (a bias, dropout, statistics read elsewhere, or flash cannot take it)" if kept else ""
    if not plans:
        return PassResult(graph, False, note.removeprefix("; "))
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    for old_forward, (how, old_backwards, multiple) in plans.items():
        forward, backwards = copy_of[old_forward], [copy_of[b] for b in old_backwards]
        if how == "pad":
            _rewrite_padded(g, forward, backwards, multiple)
        else:
            _rewrite(g, forward, backwards)
    g.lint()
    graph.gm.recompile()
    padded = sorted({m for how, _, m in plans.values() if how == "pad"})
    flash = sum(1 for how, _, _ in plans.values() if how == "flash")
    said = []
    if padded:
        said.append(f"{len(plans) - flash} causal attention call(s) with symbolic lengths run cuDNN on the length padded "
                    f"to a multiple of {'/'.join(map(str, padded))} (one cuDNN plan per bucket, not per length)")
    if flash:
        said.append(f"{flash} attention call(s) with symbolic lengths run flash attention "
                    f"(no per-shape cuDNN plan to build at each new length)")
    return PassResult(graph, True, "; ".join(said) + note)
