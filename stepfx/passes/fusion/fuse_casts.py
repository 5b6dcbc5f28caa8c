"""fuse_casts: large fp32 -> bf16/fp16 casts (mixed precision's compute
copies of the parameters, once per step) by stepfx's vectorized cast kernel.

torch's dtype-converting copy (``aten._to_copy``) runs an unrolled,
unvectorized elementwise loop: on the 1.3B GPT's parameters it moves ~1.6
TB/s on an H200, where the cast kernel (``cast_pack`` with one part) moves
~3.5 TB/s; both round to nearest even (tested bitwise against torch). Small
tensors (under ``MIN_NUMEL`` elements) stay aten ops: there the launch costs
more than the bytes, and Triton's Python launcher costs more than aten's.

Requires: nothing beyond a functional graph. Ensures: every
``_to_copy(x, dtype=bf16|fp16)`` of a contiguous fp32 ``x`` of at least
``MIN_NUMEL`` elements, on the same device and layout, is a call of
:func:`stepfx.codegen.graph_ops.cast` — except, where generic regions
apply, a cast of an op such a region computes (it joins that region).
Matched by op identity.

Before / after::

    w16 = aten._to_copy(p_w, dtype=torch.bfloat16)   ->   w16 = stepfx.codegen.graph_ops.cast(p_w, dtype=torch.bfloat16)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...graph import StepGraph
from ...graph.build import swap_calls
from ...graph.ops import dtype_cast, is_generic_fusible
from ..manager import PassOptions, PassResult

__all__ = ["fuse_casts", "MIN_NUMEL"]

MIN_NUMEL = 1 << 18  # 256K elements: ~1 MB of fp32, a few microseconds of traffic


def _castable(node: fx.Node) -> bool:
    vals = dtype_cast(node)
    if vals is None:
        return False
    src, out = vals
    return (src.dtype == torch.float32 and out.dtype in (torch.bfloat16, torch.float16) and src.is_contiguous()
            and src.numel() >= MIN_NUMEL)


def fuse_casts(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops
    from .fuse_generic_regions import regions_apply

    # a cast of what a generic region computes (an RMSNorm's fp32 result) is left to join that region: cast
    # apart, the fp32 tensor would be written out and read back
    leave = regions_apply(options)
    found = [n for n in graph.gm.graph.nodes if _castable(n) and not (leave and is_generic_fusible(n.args[0]))]
    if not found:
        return PassResult(graph, False)
    graph = swap_calls(graph, found, graph_ops.cast,
                       lambda node: ((node.args[0],), {"dtype": node.meta["val"].dtype}), "cast")
    return PassResult(graph, True, f"{len(found)} casts by the vectorized cast kernel")
