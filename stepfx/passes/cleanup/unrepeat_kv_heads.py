"""unrepeat_kv_heads: grouped-query attention reads its key/value heads
unrepeated, where the attention kernel takes fewer K/V heads than query
heads.

Why: a model with H query heads and H/r key/value heads (Llama, Mistral,
Qwen2: r = 4, 4, 6) repeats K and V r times before SDPA
(``repeat_kv``: unsqueeze, expand, a contiguous clone, a view) whenever it
passes a mask — under tracing transformers builds one (see
``fold_causal_masks``), eager does not and passes ``enable_gqa``. The
clones are saved for the backward (r times K and V per layer: ~1.4 GB at
the Qwen2.5-1.5B shape, micro-batch 4 x 2048) and the backward sums the r
copies' gradients back. cuDNN's and flash attention's kernels (and the
CPU flash kernel) take the unrepeated heads themselves, as eager's
``enable_gqa`` path gives them.

Requires: a functional graph; ``fold_causal_masks`` ran (a kernel that
takes a mask may not take grouped heads). ``options.extra[GQA_OPS_KEY]``:
the attention ops (forward and backward) the runtime found to take
grouped K/V heads on this device (``compat.attention_ops_taking_grouped_kv``);
none listed, nothing changes.

Ensures: for each such forward whose key and value are both
``view([clone](expand(unsqueeze(x, 2), [B, Hkv, r, S, D])), [B, Hkv*r, S, D])``
read only by attention ops, and each backward reading the same repeated
key and value whose key/value gradients are only summed back over the r
copies (``view`` to [B, Hkv, r, S, D], ``sum`` over dim 2, ``squeeze``, and
the backward of whole-dimension slices, which symbolic captures keep),
the ops read ``x`` directly and the summed gradients are the kernel's
own. Anything else is left as it was. The repeats are left for
``eliminate_dead_code``. With a mask (padding) only the forward does:
eager, which repeats there, sums each copy's K/V gradient after the
kernel (in 16 bits rounding each first, where the kernel sums in fp32 and
rounds once; in fp32 in another order than the kernel's: the last bits of
the K/V projections' gradients differed), so the backward keeps reading
the repeats and summing their gradients, the repeat moved to just before
it (made again from ``x``, not kept from the forward: the memory saved is
the same). Bitwise eager on every batch with padding; on one without,
eager drops the mask and passes grouped heads itself, which a captured
step cannot follow.

Before / after::

    expand = aten.expand(aten.unsqueeze(k, 2), [2, 2, 2, 9, 4])
    k_rep = aten._unsafe_view(aten.clone(expand), [2, 4, 9, 4])
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu(q, k_rep, v_rep, 0.0, True)
        ->  sdpa = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ... import compat
from ...errors import PassError
from ...graph import StepGraph
from ...graph.build import clone_step_graph_mapped
from ...graph.step_graph import META_PHASE, Phase
from ...graph.ops import RESHAPE_OPS
from ..manager import PassOptions, PassResult
from .fold_causal_masks import attention_ops

__all__ = ["unrepeat_kv_heads", "GQA_OPS_KEY"]

aten = torch.ops.aten
GQA_OPS_KEY = "gqa_attention_ops"


def _arg(node: fx.Node, name: str):
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) and not arg.kwarg_only else node.kwargs.get(name)
    raise KeyError(name)


def _mask(node: fx.Node):
    """The attention op's mask argument, under the name ``fold_causal_masks.attention_ops`` records for the op
    (``attn_mask`` for CPU's flash kernel, ``attn_bias`` for CUDA's cuDNN and memory-efficient kernels); None for
    an op that takes none (CUDA's flash kernel)."""
    entry = attention_ops().get(node.target)
    return _arg(node, entry[0]) if entry is not None else None


def _set_arg(node: fx.Node, name: str, value) -> None:
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            if i < len(node.args) and not arg.kwarg_only:
                args = list(node.args)
                args[i] = value
                node.args = tuple(args)
            else:
                node.kwargs = {**node.kwargs, name: value}
            return
    raise KeyError(name)


def _same(a, b) -> bool:
    return compat.size_expr(a) == compat.size_expr(b)


def _through_full_slices(node: fx.Node) -> fx.Node:
    """``node`` past whole-dimension slices read only once (``x[:, :, None]`` with symbolic sizes keeps them)."""
    while (node.target is aten.slice.Tensor and len(node.users) == 1 and len(node.args) >= 4
           and node.args[2] in (0, None) and isinstance(node.args[3], int) and node.args[3] >= 2**62
           and (len(node.args) < 5 or node.args[4] == 1)):
        node = node.args[0]
    return node


def _repeated(node) -> tuple[fx.Node, object] | None:
    """(x, r) when ``node`` is ``x``'s heads repeated r times (transformers' repeat_kv), else None."""
    if not isinstance(node, fx.Node) or node.target not in RESHAPE_OPS:
        return None
    expand = node.args[0]
    if expand.target is aten.clone.default:  # a view of the expand where there is one key/value head
        if len(expand.users) != 1:
            return None
        expand = expand.args[0]
    if expand.target is not aten.expand.default or len(expand.users) != 1:
        return None
    unsq = _through_full_slices(expand.args[0])
    if unsq.target is not aten.unsqueeze.default or unsq.args[1] != 2 or len(unsq.users) != 1:
        return None
    x = _through_full_slices(unsq.args[0])
    xv, ev, nv = x.meta.get("val"), expand.meta.get("val"), node.meta.get("val")
    if not all(isinstance(v, torch.Tensor) for v in (xv, ev, nv)) or xv.dim() != 4 or ev.dim() != 5 or nv.dim() != 4:
        return None
    b, hkv, s, d = xv.shape
    if not (_same(ev.shape[0], b) and _same(ev.shape[1], hkv) and _same(ev.shape[3], s) and _same(ev.shape[4], d)):
        return None
    if not (_same(nv.shape[0], b) and _same(nv.shape[1], hkv * ev.shape[2]) and _same(nv.shape[2], s)
            and _same(nv.shape[3], d)):
        return None
    return x, compat.size_expr(ev.shape[2])


def _summed_back(grad: fx.Node, hkv_shape) -> fx.Node | None:
    """The node holding ``grad`` (a repeated K/V gradient) summed back over its copies, when that is all that reads it."""
    if len(grad.users) != 1:
        return None
    (view,) = grad.users
    if view.target not in RESHAPE_OPS or view.meta["val"].dim() != 5:
        return None
    (total,) = view.users if len(view.users) == 1 else (None,)
    if total is None or total.target is not aten.sum.dim_IntList or list(total.args[1]) not in ([2], [-3]):
        return None
    keepdim = total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
    out = total
    while True:  # the squeeze of a kept dim, and the backward of whole-dimension slices (identities)
        (nxt,) = out.users if len(out.users) == 1 else (None,)
        if nxt is None:
            break
        if keepdim and nxt.target is aten.squeeze.dim and nxt.args[1] in (2, -3):
            keepdim, out = False, nxt
        elif (nxt.target is aten.slice_backward.default and nxt.args[3] in (0, None) and isinstance(nxt.args[4], int)
              and nxt.args[4] >= 2**62 and nxt.args[5] == 1):
            out = nxt
        else:
            break
    if keepdim:
        return None
    val = out.meta["val"]
    if tuple(compat.size_expr(s) for s in val.shape) != tuple(compat.size_expr(s) for s in hkv_shape):
        return None
    return out


def _plan(forward: fx.Node, ops: frozenset) -> tuple | None:
    """(k, v, [(backward, summed key grad, summed value grad)]) for an attention forward that can read K/V unrepeated."""
    rk, rv = _arg(forward, "key"), _arg(forward, "value")
    found_k, found_v = _repeated(rk), _repeated(rv)
    if found_k is None or found_v is None or found_k[1] != found_v[1]:
        return None
    backwards = []
    for rep in (rk, rv):
        for user in rep.users:
            if user is forward:
                continue
            if user.target not in ops or _arg(user, "key") is not rk or _arg(user, "value") is not rv:
                return None  # the repeated tensor is needed elsewhere
    for user in rk.users:
        if user is forward:
            continue
        items = {u.args[1]: u for u in user.users if u.target is operator.getitem}
        if set(items) - {0, 1, 2} or len(items) != len(user.users):
            return None
        sums = []
        for index, x in ((1, found_k[0]), (2, found_v[0])):
            if index not in items:
                sums.append(None)
                continue
            out = _summed_back(items[index], x.meta["val"].shape)
            if out is None:
                return None
            sums.append(out)
        backwards.append((user, items, *sums))
    return found_k[0], found_v[0], backwards, rk, rv


def _repeat_chain(rep: fx.Node, x: fx.Node) -> list[fx.Node]:
    """The ops from ``x`` to ``rep`` (its heads repeated), in graph order."""
    chain, node = [], rep
    while node is not x:
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def _repeat_before(chain: list[fx.Node], backward: fx.Node) -> None:
    """Move the repeat (each op read only by the next, the last by the attention ops) to just before
    ``backward``: made again there from the unrepeated K/V the forward read, not kept from the forward."""
    for node in chain:
        backward.prepend(node)
        node.meta[META_PHASE] = Phase.BACKWARD


def unrepeat_kv_heads(graph: StepGraph, options: PassOptions) -> PassResult:
    if not graph.functional:
        raise PassError("unrepeat_kv_heads requires a functional graph (run functionalize_graph first)")
    ops = frozenset((options.extra or {}).get(GQA_OPS_KEY, ()))
    forwards = [n for n in graph.gm.graph.nodes if n.op == "call_function" and n.target in ops
                and "grad_out" not in [a.name for a in n.target._schema.arguments]]
    plans = {n: p for n in forwards if (p := _plan(n, ops)) is not None}
    kept = sum(1 for n in forwards if n not in plans and _repeated(_arg(n, "key")) is not None)
    note = f"; {kept} kept their repeated K/V (read elsewhere, or gradients not only summed back)" if kept else ""
    if not plans:
        return PassResult(graph, False, note.removeprefix("; "))
    graph, copy_of = clone_step_graph_mapped(graph)
    position = {n: i for i, n in enumerate(graph.gm.graph.nodes)}
    rewired = 0
    narrow = 0
    for old_forward, (old_k, old_v, old_backwards, old_rk, old_rv) in plans.items():
        forward, k, v = copy_of[old_forward], copy_of[old_k], copy_of[old_v]
        _set_arg(forward, "key", k)
        _set_arg(forward, "value", v)
        rewired += 1
        if _mask(forward) is not None:
            # with a padding mask eager repeats K/V (transformers' repeat_kv) and sums the copies' K/V gradients
            # after the kernel: in 16 bits it rounds each copy's to 16 bits first, where the kernel would sum in
            # fp32 and round once; in fp32 it adds them in another order than the kernel's own sum. So the
            # backward keeps the repeats, made again just before it. (Without a mask eager passes the heads
            # grouped, enable_gqa, and the kernel's sum is eager's.)
            narrow += 1
            if old_backwards:
                first = min((copy_of[b] for b, *_ in old_backwards), key=position.__getitem__)
                for rep, x in ((copy_of[old_rk], k), (copy_of[old_rv], v)):
                    _repeat_before(_repeat_chain(rep, x), first)
            continue
        for old_backward, old_items, old_sum_k, old_sum_v in old_backwards:
            backward = copy_of[old_backward]
            _set_arg(backward, "key", k)
            _set_arg(backward, "value", v)
            vals = list(backward.meta["val"])
            for index, old_sum in ((1, old_sum_k), (2, old_sum_v)):
                if old_sum is None:
                    continue
                item, summed = copy_of[old_items[index]], copy_of[old_sum]
                item.meta["val"] = vals[index] = summed.meta["val"]  # the kernel's gradient is already [B, Hkv, S, D]
                summed.replace_all_uses_with(item)
                chain, node = [], summed
                while node is not item:  # view -> sum [-> squeeze]: read by nothing now
                    chain.append(node)
                    node = node.args[0]
                for dead in chain:
                    graph.gm.graph.erase_node(dead)
            backward.meta["val"] = tuple(vals)
    graph.gm.recompile()
    if narrow:
        note = (f"; with a padding mask ({narrow} of them) the backward reads the repeats, made again just before "
                f"it, and sums the copies' gradients as eager does there (bitwise eager: the kernel would sum them "
                f"in its own order, and in fp32 where eager rounds 16-bit copies first; eager itself passes grouped "
                f"heads to a batch without padding, whose mask transformers drops)") + note
    return PassResult(graph, True, f"{rewired} grouped-query attention call(s) read K/V heads unrepeated "
                                   f"(the repeats are not kept for the backward, nor, without a mask, their "
                                   f"gradients' sums)" + note)
