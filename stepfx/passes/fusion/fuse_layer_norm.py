"""fuse_layer_norm: LayerNorm forward and backward run stepfx's Triton kernels.

Requires: nothing beyond a functional graph (aten.native_layer_norm and
aten.native_layer_norm_backward are what ``nn.LayerNorm`` and
``F.layer_norm`` capture as).

Ensures: every such node whose input is contiguous, 16/32-bit floating
point and at most 16384 wide calls :mod:`stepfx.codegen.graph_ops`'
``layer_norm`` / ``layer_norm_backward``, which have exactly the aten
op's arguments and results (so the swap is by identity, and nothing else
changes); the others stay aten ops, recorded with the reason. The backward
kernel reduces the weight and bias gradients across rows in one launch
instead of aten's separate column reductions.

Before / after::

    ln = aten.native_layer_norm(x, [32], w, b, 1e-05)   ->   ln = stepfx.codegen.graph_ops.layer_norm(x, [32], w, b, 1e-05)
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ...graph import StepGraph
from ...graph.build import clone_step_graph
from ..manager import PassOptions, PassResult
from .fuse_optimizer_update import FUSION_REPORT_KEY

__all__ = ["fuse_layer_norm", "MAX_WIDTH"]

aten = torch.ops.aten
MAX_WIDTH = 16384  # columns one kernel program normalizes


def _why_not(node) -> str | None:
    x = node.args[1] if node.target is aten.native_layer_norm_backward.default else node.args[0]
    shape = node.args[2] if node.target is aten.native_layer_norm_backward.default else node.args[1]
    val = x.meta.get("val")
    if val.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"input dtype {val.dtype}"
    if not val.is_contiguous():
        return "input not contiguous"
    width = math.prod(shape)
    if width > MAX_WIDTH:
        return f"rows of {width} elements (kernel handles up to {MAX_WIDTH})"
    return None


def fuse_layer_norm(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    swap = {aten.native_layer_norm.default: graph_ops.layer_norm,
            aten.native_layer_norm_backward.default: graph_ops.layer_norm_backward}
    nodes = [n for n in graph.gm.graph.nodes if n.op == "call_function" and n.target in swap]
    if not nodes:
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    report = list(graph.signature.extra.get(FUSION_REPORT_KEY, ()))
    done = 0
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or node.target not in swap:
            continue
        why = _why_not(node)
        if why is not None:
            report.append(("fuse_layer_norm", node.name, why))
            continue
        node.target = swap[node.target]
        done += 1
    graph.gm.recompile()
    graph = graph.replace(signature=dataclasses.replace(graph.signature, extra={**graph.signature.extra, FUSION_REPORT_KEY: report}))
    return PassResult(graph, bool(done) or bool(report), f"{done} LayerNorm forward/backward nodes on stepfx kernels; {len(nodes) - done} left to aten")
