"""batch_parameter_casts: the 16-bit compute copies of the parameters are
made by one kernel launch into one buffer, each copy a view of it.

Mixed precision casts every fp32 parameter to bf16/fp16 at the start of the
step: on the 1.3B GPT 98 ``cast`` kernels (``fuse_casts``, ~20 us each) and
195 aten copies for the biases and norms. The host launches a Triton kernel
in ~60 us, three times what the kernel takes, so the GPU sat idle between
them for ~3 ms of every step (2026-11-30 trace, one H200: 55-70 us gaps
before each cast). One ``pack`` writes all of them in one launch per source
dtype (``cast_pack``'s address tables), rounding as torch does (tested
bitwise).

Requires: ``fuse_casts`` ran (large casts are ``graph_ops.cast``). Ensures:
the conversions fp32 -> bf16/fp16 of contiguous graph inputs (``cast`` or
aten ``_to_copy``), when there are at least two of one target dtype, are
one ``graph_ops.pack`` placed where the first of them was (the parameters'
in one, other inputs' in another: ``carry_parameter_copies`` may keep the
parameters' between steps), each at an
offset aligned to ``ALIGN`` elements (128 bytes in bf16: the alignment
cuBLAS's fastest kernels need), and every former cast is a view of it.
Matched by op identity; the values are the same bits.

The buffer lives until its last view is dead: the copies the backward
reads last (the first layers') keep all of them. They are all alive at the
peak (the end of the forward) anyway, and explain()'s memory plan counts
the buffer as one allocation.

Before / after::

    w16 = graph_ops.cast(p_w, dtype=torch.bfloat16)   ->   params16 = graph_ops.pack([p_w, p_b], [0, 4096], 4160, dtype=torch.bfloat16)
    b16 = aten._to_copy(p_b, dtype=torch.bfloat16)         w16 = aten.view(aten.slice(params16, 0, 0, 4096), [64, 64])
                                                           b16 = aten.view(aten.slice(params16, 0, 4096, 4160), [64])
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...graph import Role, StepGraph
from ...graph.build import clone_step_graph
from ...graph.layout import ALIGN, align
from ...graph.ops import dtype_cast
from ..data_parallel.collectives import fake_like, make_node
from ..manager import PassOptions, PassResult

__all__ = ["batch_parameter_casts"]

aten = torch.ops.aten


def _conversion(node: fx.Node) -> tuple[fx.Node, torch.dtype] | None:
    """(the graph input converted, the target dtype) for a cast this pass batches."""
    from ...codegen import graph_ops

    if node.op != "call_function":
        return None
    if node.target is graph_ops.cast:
        source, dtype = node.args[0], node.kwargs.get("dtype")
    elif dtype_cast(node) is not None:
        source, dtype = node.args[0], node.meta["val"].dtype
    else:
        return None
    if not isinstance(source, fx.Node) or source.op != "placeholder" or dtype not in (torch.bfloat16, torch.float16):
        return None
    val = source.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.float32 or not val.is_contiguous() or val.numel() == 0:
        return None
    return source, dtype


def batch_parameter_casts(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    groups: dict[tuple, list[fx.Node]] = {}
    for node in graph.gm.graph.nodes:
        found = _conversion(node)
        if found is not None:
            source, dtype = found
            # the parameters' copies apart from other inputs' (batch tensors): carry_parameter_copies
            # keeps a pack of parameters from one step to the next
            is_param = getattr(source.meta.get("slot"), "role", None) is Role.PARAM
            groups.setdefault((dtype, source.meta["val"].device, is_param), []).append(node)
    groups = {k: v for k, v in groups.items() if len(v) >= 2}
    if not groups:
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    by_name = {n.name: n for n in g.nodes}
    done = []
    for (dtype, _, _), old_nodes in groups.items():
        casts = [by_name[n.name] for n in old_nodes]
        # one place per parameter: a parameter cast twice (the forward's cast and the copy that
        # recompute_activations makes for the backward) reads one piece of the buffer, so a buffer
        # carried between steps (carry_parameter_copies) has one copy of each to keep current
        sources = list(dict.fromkeys(c.args[0] for c in casts))
        offset_of, at = {}, 0
        for source in sources:
            offset_of[source] = at
            at = align(at + source.meta["val"].numel())
        example = casts[0].meta["val"]
        with g.inserting_before(casts[0]):
            packed = make_node(g, graph_ops.pack, (sources, [offset_of[s] for s in sources], at), {"dtype": dtype},
                               val=fake_like(example, (at,), dtype), like=casts[0], name="params16")
            for cast in casts:
                source = cast.args[0]
                offset, numel = offset_of[source], source.meta["val"].numel()
                shape = tuple(cast.meta["val"].shape)
                piece = make_node(g, aten.slice.Tensor, (packed, 0, offset, offset + numel),
                                  val=fake_like(example, (numel,), dtype), like=cast, name="params16_piece")
                view = make_node(g, aten.view.default, (piece, list(shape)), val=fake_like(example, shape, dtype),
                                 like=cast, name=f"{source.name}_16")
                cast.replace_all_uses_with(view)
        for cast in casts:  # after the loop: the insertion point is the first of them
            g.erase_node(cast)
        done.append(f"{len(sources)} to {str(dtype).removeprefix('torch.')} ({at * dtype.itemsize / 2**20:.1f} MiB)")
    graph.gm.recompile()
    return PassResult(graph, True, "parameter casts packed into one buffer each: " + ", ".join(done)
                      + f" (offsets aligned to {ALIGN} elements)")
