"""fuse_linear_gelu: a linear layer's GELU(tanh) applied by its matmul's
epilogue where nothing else reads the pre-activation.

An MLP's up-projection writes its pre-activation (M x 4d: on the 1.3B GPT
at micro-batch 48, 1.6 GB in bf16) and the GELU reads it back and writes
its output: 1.1 ms a call on an H200, at ~2.9 TB/s. cuBLASLt applies
GELU(tanh) to the accumulator before it stores the tile
(``torch._addmm_activation``): 0.35 ms over the matmul alone on an H100
where the two ops took 1.23 (benchmarks/README.md, "cuBLASLt's bias +
GELU epilogue"). The backward reads the pre-activation (GELU's
derivative), so the fusion applies only where the backward does not read
this one: where ``recompute_activations`` recomputes the MLP (its first
forward: every block at level ``all``), and in a step without a backward.
The epilogue rounds once from the fp32 accumulator where the two ops round
the pre-activation first: on 16-bit values within half a unit in the last
place of the exact value, more accurate than the two ops (an H100, bf16,
pre-activation in [1, 3): max error 0.0078 against 0.0162;
benchmarks/probe_gelu_epilogue_numerics.py); fp32 within fp32 rounding.

Requires: ``recompute_activations`` ran (it decides which pre-activations
the backward reads). Ensures: every ``aten.gelu(approximate='tanh')`` of
an ``aten.addmm(bias, x, w)`` (bias 1-D, no beta/alpha; possibly through
one reshape) that is the addmm's only reader, directly or through the
reshape, reads a ``graph_ops.addmm_gelu(bias, x, w)`` in the addmm's place
instead, and the GELU is gone. Matched by op identity; on the CPU
``addmm_gelu`` computes the two ops as they were (bitwise: torch's CPU
``_addmm_activation`` applies the erf GELU, so the epilogue is CUDA only).

Before / after::

    addmm_2 = aten.addmm(fc_bias, view_8, t_2)             addmm_2 = graph_ops.addmm_gelu(fc_bias, view_8, t_2)
    view_9 = aten.view(addmm_2, [48, 2048, 8192])    ->    view_9 = aten.view(addmm_2, [48, 2048, 8192])
    gelu = aten.gelu(view_9, approximate='tanh')           (view_9's readers read it as they read gelu)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...graph import StepGraph
from ...graph.build import clone_step_graph_mapped
from ..manager import PassOptions, PassResult

__all__ = ["fuse_linear_gelu"]

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _approximate(node: fx.Node) -> str:
    return node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def _matmul_of(gelu: fx.Node) -> fx.Node | None:
    """The addmm whose result only this tanh GELU reads (directly or through one reshape), or None."""
    if gelu.op != "call_function" or gelu.target is not aten.gelu.default or _approximate(gelu) != "tanh":
        return None
    src = gelu.args[0]
    if not isinstance(src, fx.Node) or len(src.users) != 1:
        return None
    if src.target in _RESHAPES:
        src = src.args[0]
        if not isinstance(src, fx.Node) or len(src.users) != 1:
            return None
    if src.op != "call_function" or src.target is not aten.addmm.default or src.kwargs or len(src.args) != 3:
        return None
    bias, x, w, out = (_val(a) for a in (*src.args, src))
    if not all(isinstance(v, torch.Tensor) for v in (bias, x, w, out)):
        return None
    return src if (bias.dim() == 1 and x.dim() == 2 and w.dim() == 2 and out.dtype in _FLOATS
                   and bias.dtype == x.dtype == w.dtype == out.dtype) else None


def fuse_linear_gelu(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    found = [n for n in graph.gm.graph.nodes if _matmul_of(n) is not None]
    if not found:
        return PassResult(graph, False)
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    for match in found:
        gelu = copy_of[match]
        matmul = _matmul_of(gelu)
        matmul.target = graph_ops.addmm_gelu  # same arguments, same shape and dtype: its meta holds
        gelu.replace_all_uses_with(gelu.args[0])
        g.erase_node(gelu)
    g.lint()
    graph.gm.recompile()
    return PassResult(graph, True, f"{len(found)} GELU(tanh) by their matmul's epilogue (pre-activation not kept: "
                                   "cuBLASLt on CUDA)")
