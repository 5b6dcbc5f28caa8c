"""fold_gradient_casts: the fused kernels and the host optimizer read 16-bit
gradients themselves, so the fp32 copy of each gradient that mixed precision
makes is dropped.

Under bf16/fp16 the fp32 master parameter's gradient is the backward of the
forward's cast: ``_to_copy(g16, dtype=float32)``, one kernel and 4 bytes per
element written, then read again by the norm and the update. The fused
kernels (``sum_squares``, ``adam_step``, ``sgd_step``) load a bf16/fp16
gradient and widen it to fp32 in registers, the exact same values (the
widening is exact), and ``host_adam_start`` (optimizer offload) widens a
16-bit gradient on the host, so when those are the copy's only readers, at
their gradient arguments, directly or through reshapes (a weight's flat
gradient piece), they take ``g16`` instead and the copy goes: one kernel
per parameter less, 6 bytes per element less traffic, no fp32 gradient
buffers at the peak, and under offload half the bytes down. The sums of
squares add the same fp32 values in the same order (each tensor's lanes
and tree are the same whatever the dtype it loads), so the clipping norm is
bitwise what it was; where a reshape would lay the 16-bit values out
otherwise than the fp32 ones, the copy stays.

(Without clipping ``offload_optimizer`` narrows the host update's gradients
itself; with it, the norm reads them too, and only after the norm's own
fusion is the host update the copy's other reader: here.)

Requires: the fusion passes ran (``fuse_sum_squares``,
``fuse_optimizer_update``). Ensures: no ``_to_copy`` to fp32 of a 16-bit
tensor is read, directly or through reshapes, only by fused kernels and host
updates at their gradient arguments.

Before / after::

    g32 = aten._to_copy(g16, dtype=torch.float32)     ->   sumsq = graph_ops.sum_squares(g16)
    sumsq = graph_ops.sum_squares(g32)                     upd = graph_ops.adam_step(p, g16, ...)
    upd = graph_ops.adam_step(p, g32, ...)

    g32 = aten._to_copy(g16, dtype=torch.float32)     ->   flat = aten.reshape(g16, [-1])
    flat = aten.reshape(g32, [-1])                         sumsq = graph_ops.sum_squares(flat)
    sumsq = graph_ops.sum_squares(flat)                    job = host_adam_start(1, piece, flat, ...)
    job = host_adam_start(1, piece, flat, ...)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...graph import StepGraph
from ...graph.build import clone_step_graph_mapped
from ...graph.ops import RESHAPE_OPS, dtype_cast
from ...runtime.host_optimizer import host_adam_start
from ..manager import PassOptions, PassResult

__all__ = ["fold_gradient_casts"]

aten = torch.ops.aten
_NARROW = (torch.bfloat16, torch.float16)


def _grad_position(user: fx.Node, value: fx.Node) -> bool:
    """``value`` is read by ``user`` only as a fused kernel's or a host update's gradient."""
    from ...codegen import graph_ops

    if user.op != "call_function" or user.kwargs and value in user.kwargs.values():
        return False
    positions = [i for i, a in enumerate(user.args) if a is value]
    if user.target is graph_ops.sum_squares:
        return positions == [0]
    if user.target in (graph_ops.adam_step, graph_ops.sgd_step):
        return positions == [1]
    if user.target is host_adam_start:
        count = user.args[0]
        return bool(positions) and all(1 + count <= i < 1 + 2 * count for i in positions)
    return False


def _narrowed(node: fx.Node, narrow: torch.Tensor, chain: list) -> bool:
    """Whether every reader of ``node`` (fp32; ``narrow``: its value were it computed from the 16-bit gradient)
    takes the 16-bit value: a kernel or host update at a gradient argument, with the same strides, or a reshape
    whose readers do; the reshapes, with their 16-bit values, appended to ``chain``."""
    wide = node.meta["val"]
    if not node.users or narrow.shape != wide.shape or narrow.stride() != wide.stride():
        return False
    for user in node.users:
        if user.op == "call_function" and user.target in RESHAPE_OPS and user.args[0] is node \
                and not any(isinstance(a, fx.Node) for a in user.args[1:]) and not user.kwargs:
            try:
                value = user.target(narrow, *user.args[1:])
            except RuntimeError:  # a view the 16-bit layout does not allow
                return False
            chain.append((user, value))
            if not _narrowed(user, value, chain):
                return False
        elif not _grad_position(user, node):
            return False
    return True


def _foldable(node: fx.Node) -> list | None:
    """The reshapes between ``node`` (a cast to fp32 of a 16-bit gradient) and its readers, with their 16-bit
    values, when it can go; else None."""
    vals = dtype_cast(node)
    if vals is None:
        return None
    src, out = vals
    if src.dtype not in _NARROW or out.dtype != torch.float32:
        return None
    chain: list = []
    return chain if _narrowed(node, src, chain) else None


def fold_gradient_casts(graph: StepGraph, options: PassOptions) -> PassResult:
    found = [(n, chain) for n in graph.gm.graph.nodes if (chain := _foldable(n)) is not None]
    if not found:
        return PassResult(graph, False)
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    host = 0
    for match, chain in found:
        cast = copy_of[match]
        for reshape, value in chain:
            copy_of[reshape].meta["val"] = value
        readers = [match, *(r for r, _ in chain)]
        if any(u.target is host_adam_start for r in readers for u in r.users):
            host += 1
        cast.replace_all_uses_with(cast.args[0])
        g.erase_node(cast)
    graph.gm.recompile()
    return PassResult(graph, True, f"{len(found)} fp32 gradient copies dropped: the fused kernels read the 16-bit gradients"
                                   + (f"; {host} of them go down to the host update in 16 bits" if host else ""))
