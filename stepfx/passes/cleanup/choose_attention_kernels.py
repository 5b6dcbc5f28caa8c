"""choose_attention_kernels: where the sequence length is symbolic, attention
runs on a kernel that needs no per-shape plan.

Why: torch's cuDNN attention builds an execution plan for each new shape
(cuDNN's graph API) and caches it. With a fixed length that is paid once;
with a new length every step it is paid every step, by every attention call
whose shape or layout the cache has not seen. Measured on the H200 (1.3B GPT,
lengths uniform in [1024, 2048], 2026-12-04): ~1.6 ms of host time per call
on a new length (77 ms a step over 48 forward and backward calls, the step's
device time being ~110 ms), and 1.6 s for the one step of length 2048, where
every call took 33-39 ms (``results/2026-12-04_dynamic_lengths_profile_call15_h200.txt``).
Flash attention launches a kernel chosen from the sizes alone. A plan whose
lengths are symbolic (``stepfx.dynamic``) exists because lengths change, so
it takes flash attention where flash attention accepts the call; a plan with
static sizes keeps cuDNN (faster per call, its plan built once).

Requires: a functional graph; ``fold_causal_masks`` ran (a folded mask is
``is_causal`` and no bias). ``options.extra[FLASH_CHECK_KEY]``: a predicate
``(dtype, head_dim, query_heads, kv_heads, is_causal) -> bool`` telling
whether this device's flash kernel takes such a call
(``compat.flash_attention_takes``); absent, nothing changes. Grouped K/V
heads (after ``unrepeat_kv_heads``) only where ``options.extra[GQA_OPS_KEY]``
lists flash attention.

Ensures: each ``_scaled_dot_product_cudnn_attention`` forward whose query
length is symbolic, with no bias and no dropout, whose log-sum-exp and
random state are read only by its ``_scaled_dot_product_cudnn_attention_backward``
calls, is replaced with ``_scaled_dot_product_flash_attention`` and those
backwards with ``_scaled_dot_product_flash_attention_backward`` (same
inputs, causality and scale; flash's own log-sum-exp and random state passed
from forward to backward). The attention output is the same function of the
inputs, computed by another kernel: bf16 results differ by rounding, not
bitwise. Anything else is left as it was.

Before / after::

    attn = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=0.125)
        ->  attn = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=0.125)
"""
from __future__ import annotations

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


def _plan(forward: fx.Node, takes, grouped_ops: frozenset) -> list[fx.Node] | None:
    """The backward calls of ``forward`` when the pair can run on flash attention, else None."""
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
    if qv.shape[1] != kv.shape[1] and not {_FLASH, _FLASH_BWD} <= grouped_ops:
        return None  # grouped K/V heads (unrepeat_kv_heads) that this device's flash kernel was not found to take
    causal = bool(_arg(forward, "is_causal", False))
    if not takes(qv.dtype, int(qv.shape[3]), int(qv.shape[1]), int(kv.shape[1]), causal):
        return None
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


def _val(target, args, kwargs):
    """The fake value of ``target`` called on the graph's values of ``args``."""
    vals, kvals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    fake = next(a for a in vals if isinstance(a, torch.Tensor))
    with fake.fake_mode:
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


def choose_attention_kernels(graph: StepGraph, options: PassOptions) -> PassResult:
    if not graph.functional:
        raise PassError("choose_attention_kernels requires a functional graph (run functionalize_graph first)")
    takes = (options.extra or {}).get(FLASH_CHECK_KEY)
    forwards = [n for n in graph.gm.graph.nodes if n.op == "call_function" and n.target is _CUDNN]
    if takes is None or not forwards:
        return PassResult(graph, False, "")
    grouped = frozenset((options.extra or {}).get(GQA_OPS_KEY, ()))
    plans = {n: b for n in forwards if (b := _plan(n, takes, grouped)) is not None}
    symbolic = sum(1 for n in forwards if compat.is_symbolic(_arg(n, "query").meta["val"].shape[2]))
    kept = symbolic - len(plans)
    note = f"; {kept} kept on cuDNN (a bias, dropout, statistics read elsewhere, or flash cannot take it)" if kept else ""
    if not plans:
        return PassResult(graph, False, note.removeprefix("; "))
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    for old_forward, old_backwards in plans.items():
        _rewrite(g, copy_of[old_forward], [copy_of[b] for b in old_backwards])
    g.lint()
    graph.gm.recompile()
    return PassResult(graph, True, f"{len(plans)} attention call(s) with symbolic lengths run flash attention "
                                   f"(no per-shape cuDNN plan to build at each new length)" + note)
