"""fuse_attention: flash attention calls by stepfx's Triton attention (``codegen/attention_kernels.py``).

Why: with symbolic sequence lengths cuDNN would build an execution plan per new length (~100 ms each, forward
and backward), so ``choose_attention_kernels`` runs those calls on flash attention, which chooses its kernel
from the sizes alone but is 1.5-1.8x slower than cuDNN on the H200. stepfx's kernels compile once for every
length too (the lengths are kernel arguments, never specialized on) and run faster than flash there
(benchmarks/README.md, "Variable sequence lengths").

Requires: a functional graph; after ``choose_attention_kernels`` (whose flash calls this takes) and the memory
passes (recomputed attention is a flash call like any other here). Ensures: every flash attention forward
(``aten._scaled_dot_product_flash_attention`` on CUDA, ``..._for_cpu`` on the CPU, where the kernels run in
Triton's interpreter, for tests) without dropout, debug mask or attention mask, on inputs the kernels take
(``attention_kernels.unsupported_reason``), whose statistics (the logsumexp, the random state) are read only by
its own flash backwards, is a call of ``graph_ops.attention`` (``attention_cpu``), and those backwards are
calls of ``graph_ops.attention_backward`` (``attention_cpu_backward``). A swap by identity: same arguments,
same outputs, each output in the memory order the graph recorded; only the logsumexp's meaning changes (base 2,
read by nothing else). The results differ from flash's in the last bits (another summation order).

Before / after::

    flash_attention = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=0.088)
        ->  attention = graph_ops.attention(q, k, v, 0.0, True, scale=0.088, out_order=(0, 2, 1, 3))
    flash_attention_backward = aten._scaled_dot_product_flash_attention_backward(g, q, k, v, out, lse, ...)
        ->  attention_backward = graph_ops.attention_backward(g, q, k, v, out, lse, ..., grad_orders=(...))
"""
from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from ... import compat
from ...graph import StepGraph
from ...graph.build import clone_step_graph_mapped
from ..cleanup.choose_attention_kernels import _arg
from ..manager import PassOptions, PassResult

__all__ = ["fuse_attention", "memory_order"]

aten = torch.ops.aten
_FLASH = aten._scaled_dot_product_flash_attention.default
_FLASH_BWD = aten._scaled_dot_product_flash_attention_backward.default
_FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_BACKWARD_OF = {_FLASH: _FLASH_BWD, _FLASH_CPU: _FLASH_CPU_BWD}


def _nonempty(expr):
    """``expr`` where every size in it is at least 1: ``Max(1, n)`` is ``n`` (torch's stride of a dim whose
    size may be 0; the strides of an empty tensor do not matter)."""
    def floor_one(e):  # sympy's Max or torch's own (torch.utils._sympy.functions.Max)
        return getattr(e.func, "__name__", "") == "Max" and sympy.Integer(1) in e.args

    def without_one(e):
        rest = [a for a in e.args if a != 1]
        return rest[0] if len(rest) == 1 else e.func(*rest)
    return expr.replace(floor_one, without_one)


def memory_order(val: torch.Tensor) -> tuple[int, ...] | None:
    """``val``'s dims outermost first when it is dense in that order (strides compared as expressions: the same
    order at every size of a symbolic capture); None when it is not dense in any order (a slice, a broadcast)."""
    order = tuple(sorted(range(val.dim()), key=lambda d: (-compat.size_hint(val.stride(d)), d)))
    expected = sympy.Integer(1)
    for d in reversed(order):
        size = val.shape[d]
        if compat.is_symbolic(size) or int(size) != 1:
            if sympy.expand(_nonempty(sympy.sympify(compat.size_expr(val.stride(d)))) - expected) != 0:
                return None
        expected = sympy.expand(expected * compat.size_expr(size))
    return order


def _same_value_kind(a, b) -> bool:
    """``a`` is ``b``, or a tensor of the same shape, strides and dtype (a recomputed copy of it)."""
    if a is b:
        return True
    va, vb = (x.meta.get("val") if isinstance(x, fx.Node) else None for x in (a, b))
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor) or va.dtype != vb.dtype:
        return False
    exprs = [tuple(sympy.sympify(compat.size_expr(x)) for x in xs)
             for xs in (va.shape, vb.shape, va.stride(), vb.stride())]
    return exprs[0] == exprs[1] and exprs[2] == exprs[3]


def _items(node: fx.Node) -> dict[int, list[fx.Node]] | None:
    items: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if user.target is not operator.getitem:
            return None
        items.setdefault(user.args[1], []).append(user)
    return items


def _match(forward: fx.Node) -> tuple[list[fx.Node], tuple[int, ...], list[tuple]] | str:
    """(its backwards, the output's memory order, each backward's gradients' orders), or why not."""
    from ...codegen.attention_kernels import unsupported_reason

    q, k, v = (_arg(forward, n) for n in ("query", "key", "value"))
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in (q, k, v)]
    if not all(isinstance(t, torch.Tensor) for t in vals):
        return "its inputs have no recorded values"
    mask = _arg(forward, "attn_mask") if forward.target is _FLASH_CPU else None
    debug = _arg(forward, "return_debug_mask") if forward.target is _FLASH else False
    causal = bool(_arg(forward, "is_causal"))
    why = unsupported_reason(*vals, causal, attn_mask=mask, dropout_p=float(_arg(forward, "dropout_p") or 0.0))
    if why is None and debug:
        why = "a debug mask"
    if why is not None:
        return why
    items = _items(forward)
    if items is None or 0 not in items:
        return "its outputs are read whole"
    out_order = memory_order(items[0][0].meta["val"])
    if out_order is None:
        return "its output is not dense"
    backwards: list[fx.Node] = []
    for index, nodes in items.items():
        for user in (u for n in nodes for u in n.users):
            if index == 0 and user.target is not _BACKWARD_OF[forward.target]:
                continue  # the output is read by the model too
            if user.target is not _BACKWARD_OF[forward.target]:
                return f"its output {index} is read by {user.name}, not its backward"
            if user not in backwards:
                backwards.append(user)
    orders = []
    for backward in backwards:
        # q/k/v may be other nodes of the same values (recompute_activations' copies): the same shapes suffice,
        # as for flash, whose backward reads them as given; the statistics must be this forward's own (below)
        same = all(_same_value_kind(_arg(backward, n), _arg(forward, n)) for n in ("query", "key", "value"))
        if not same or bool(_arg(backward, "is_causal")) != causal or _arg(backward, "scale") != _arg(forward, "scale"):
            return f"{backward.name} is not this forward's backward"
        if _arg(backward, "out") not in items[0] or _arg(backward, "logsumexp") not in items.get(1, ()):
            return f"{backward.name} reads another forward's output"
        grads = _items(backward)
        if grads is None:
            return f"{backward.name}'s gradients are read whole"
        order = []
        for index in range(3):
            if index not in grads:
                order.append(None)  # not read: the kernels' own layout
                continue
            val = grads[index][0].meta.get("val")
            order.append(memory_order(val) if isinstance(val, torch.Tensor) else None)
            if order[-1] is None:
                return f"{backward.name}'s gradient {index} is not dense"
        orders.append(tuple(order))
    return backwards, out_order, orders


def fuse_attention(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    g = graph.gm.graph
    forwards = [n for n in g.nodes if n.op == "call_function" and n.target in _BACKWARD_OF]
    if not forwards:
        return PassResult(graph, False)
    taken, skipped, calls = [], [], {}
    for forward in forwards:
        found = _match(forward)
        if isinstance(found, str):
            skipped.append(f"{forward.name}: {found}")
            continue
        backwards, out_order, orders = found
        taken.append(forward)
        calls[forward] = {"out_order": out_order}
        for backward, order in zip(backwards, orders, strict=True):
            taken.append(backward)
            calls[backward] = {"grad_orders": order}
    note = f"; kept on flash: {'; '.join(skipped)}" if skipped else ""
    if not taken:
        return PassResult(graph, False, note.removeprefix("; "))
    targets = {_FLASH: graph_ops.attention, _FLASH_BWD: graph_ops.attention_backward,
               _FLASH_CPU: graph_ops.attention_cpu, _FLASH_CPU_BWD: graph_ops.attention_cpu_backward}
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    for node in taken:
        old = copy_of[node]
        backward = node.target not in _BACKWARD_OF
        with g.inserting_before(old):
            new = g.create_node("call_function", targets[node.target], tuple(old.args),
                                {**old.kwargs, **calls[node]}, name="attention_backward" if backward else "attention")
        new.meta.update(old.meta)
        old.replace_all_uses_with(new)
        g.erase_node(old)
    graph.gm.recompile()
    pairs = sum(1 for n in taken if n.target in _BACKWARD_OF)
    return PassResult(graph, True, f"{pairs} attention call(s) and their backwards by stepfx's Triton attention "
                                   f"(one compile for every length){note}")
