"""fuse_column_sums: bias gradients (sums over a 2-D tensor's rows) by
stepfx's column-sum kernel.

A linear layer's bias gradient is ``aten.sum(dy, [0], keepdim)`` over the
M x N output gradient. torch's reduction kernel took 3.3 ms per step for
the 1.3B GPT's 96 bias gradients on one H200 (34 us each, about half the
copy bandwidth), each after a memset of its own; stepfx's kernel reads
``dy`` once into fp32 partial sums per row group and adds those up, rounding
once (``reduction_kernels.column_sum``). Small sums (under ``MIN_NUMEL``
elements) stay aten ops: Triton's launcher costs more than their bytes.

Requires: nothing beyond a functional graph. Ensures: every
``aten.sum.dim_IntList(x, [0] | [-2], keepdim)`` without a dtype argument,
of a contiguous 2-D fp32/bf16/fp16 ``x`` of at least ``MIN_NUMEL``
elements, is a call of :func:`stepfx.codegen.graph_ops.column_sum`.
Matched by op identity. The sum's order differs from torch's (fp32
accumulation both; 16-bit results are correctly rounded sums of the same
fp32 partial values within fp32 rounding).

Before / after::

    sum_1 = aten.sum.dim_IntList(view_29, [0], True)   ->   sum_1 = graph_ops.column_sum(view_29, keepdim=True)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...graph import StepGraph
from ...graph.build import swap_calls
from ..manager import PassOptions, PassResult
from .fuse_casts import MIN_NUMEL

__all__ = ["fuse_column_sums"]

aten = torch.ops.aten


def _column_sum(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not aten.sum.dim_IntList or node.kwargs.get("dtype") is not None:
        return False
    x = node.args[0]
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or list(dims or []) not in ([0], [-2]):
        return False
    return (val.dtype in (torch.float32, torch.bfloat16, torch.float16) and val.is_contiguous()
            and val.numel() >= MIN_NUMEL and node.meta["val"].dtype == val.dtype)


def fuse_column_sums(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    found = [n for n in graph.gm.graph.nodes if _column_sum(n)]
    if not found:
        return PassResult(graph, False)

    def call(node):
        return (node.args[0],), {"keepdim": bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))}

    graph = swap_calls(graph, found, graph_ops.column_sum, call, "column_sum")
    return PassResult(graph, True, f"{len(found)} row sums (bias gradients) by the column-sum kernel")
