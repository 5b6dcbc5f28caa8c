"""fuse_generic_regions: chains of pointwise ops (and the row reductions
between them) in forward and backward, handed to inductor as one region each.

What stepfx writes itself (optimizer updates, norms of gradients, casts,
LayerNorm, linear + cross-entropy) is fused by the passes before this one;
what is left and generic — an RMSNorm written out by hand, rotary
embeddings, SwiGLU, GELU after a bias, their backward — is what inductor
already fuses well, so it goes there (see :mod:`stepfx.codegen.regions`).

A region grows in graph order from a candidate op: a candidate joins the
region of the candidate it reads when the region can still become one call
placed either where its first op was (every value it reads from outside
was made before that) or where its last op is (nothing outside reads its
values before that: SwiGLU's ``silu(gate) * up``, whose ``up`` is made
after ``silu``). Either keeps the graph acyclic. Regions of one op are
left alone: a single pointwise op is one aten kernel already.

Candidates, by op identity: ops tagged ``torch.Tag.pointwise``, dtype-only
``_to_copy``, ``mean.dim`` and ``sum.dim_IntList``; in the forward and
backward phases only (the optimizer's ops belong to ``fuse_optimizer_update``),
never random ops or ops reading host scalars (the learning rate, step
counts: they change every step, a compiled region would not see it).

Requires: the other fusion passes ran (their patterns must not be cut up
here). Ensures: no two candidates that could share a region are left as
separate ops; every region is a ``graph_ops.run_region(key, ...)`` call
whose outputs are read through getitem, listed in
``signature.extra["generic_regions"]``.

Before / after::

    pow_1 = aten.pow(x, 2)                       region = graph_ops.run_region('region_3f2a', x, w)
    mean = aten.mean.dim(pow_1, [-1], True)  ->  y = getitem(region, 0)
    add = aten.add(mean, 1e-6)
    rsqrt = aten.rsqrt(add)
    y = aten.mul(aten.mul(x, rsqrt), w)
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ..graph import META_PHASE, Phase, StepGraph
from ..graph.build import clone_step_graph
from ..graph.ops import dtype_cast, has_side_effect, is_random
from .collectives import make_node
from .manager import PassOptions, PassResult

__all__ = ["fuse_generic_regions", "regions_apply", "REGIONS_KEY"]

aten = torch.ops.aten
REGIONS_KEY = "generic_regions"
# inductor's CPU backend compiles C++ (seconds per region): CPU steps keep
# these ops unless a test asks for them
ON_CPU = False


def regions_apply(options) -> bool:
    """Codegen is on and the step runs on CUDA (or ``ON_CPU``)."""
    from .pipeline import codegen_enabled

    return codegen_enabled(options) and (options.device_type == "cuda" or ON_CPU)


_REDUCTIONS = frozenset({aten.mean.dim, aten.sum.dim_IntList})


def _candidate(node: fx.Node) -> bool:
    if node.op != "call_function" or node.meta.get(META_PHASE) not in (Phase.FORWARD, Phase.BACKWARD):
        return False
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if not (torch.Tag.pointwise in target.tags or target in _REDUCTIONS or dtype_cast(node) is not None):
        return False
    if has_side_effect(node) or is_random(node):
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not (val.is_floating_point() or val.dtype == torch.bool):
        return False
    return all(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes)


@dataclasses.dataclass
class _Region:
    nodes: list
    at_first: bool = True  # every value it reads from outside exists before its first op
    at_last: bool = True  # nothing outside reads its values before its last op


def _regions(g: fx.Graph) -> list[_Region]:
    order = {n: i for i, n in enumerate(g.nodes)}
    region_of: dict[fx.Node, _Region] = {}
    regions: list[_Region] = []
    for node in g.nodes:
        if not _candidate(node):
            continue
        owners = {id(region_of[a]): region_of[a] for a in node.all_input_nodes if a in region_of}
        joined = None
        if len(owners) == 1:
            (r,) = owners.values()
            first = order[r.nodes[0]]
            at_first = r.at_first and all(region_of.get(a) is r or order[a] < first for a in node.all_input_nodes)
            at_last = r.at_last and all(u is node or region_of.get(u) is r or order[u] > order[node]
                                        for m in r.nodes for u in m.users)
            if at_first or at_last:
                r.at_first, r.at_last = at_first, at_last
                joined = r
        if joined is None:
            joined = _Region([])
            regions.append(joined)
        joined.nodes.append(node)
        region_of[node] = joined
    return [r for r in regions if len(r.nodes) > 1]


def _cut(g: fx.Graph, nodes: list[fx.Node]):
    """(the region as a GraphModule, its external inputs, its outputs)."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, a in enumerate(inputs):
        env[a] = sub.placeholder(f"in_{i}")
    for i, n in enumerate(nodes):  # canonical names: the same region in every layer is the same code
        env[n] = sub.create_node("call_function", n.target, fx.node.map_arg(n.args, env.__getitem__),
                                 fx.node.map_arg(n.kwargs, env.__getitem__), name=f"v{i}")
        env[n].meta["val"] = n.meta["val"]
    sub.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(torch.nn.Module(), sub), inputs, outputs


def fuse_generic_regions(graph: StepGraph, options: PassOptions) -> PassResult:
    from ..codegen import graph_ops
    from ..codegen.regions import register_region

    if not _regions(graph.gm.graph):
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    record = []
    for region in _regions(g):
        nodes = region.nodes
        gm, inputs, outputs = _cut(g, nodes)
        key = register_region(gm, [a.meta["val"] for a in inputs])
        vals = tuple(n.meta["val"] for n in outputs)
        # where every input exists and no outside reader has come yet
        with g.inserting_before(nodes[0] if region.at_first else nodes[-1]):
            call = make_node(g, graph_ops.run_region, (key, *inputs), val=vals, like=nodes[0], name="region")
            results = [make_node(g, operator.getitem, (call, i), val=v, like=n, name=f"{n.name}_out")
                       for i, (n, v) in enumerate(zip(outputs, vals))]
        for n, new in zip(outputs, results):
            n.replace_all_uses_with(new, delete_user_cb=lambda user: user not in nodes)
        for n in reversed(nodes):
            g.erase_node(n)
        record.append((key, len(nodes)))
    graph.gm.recompile()
    extra = {**graph.signature.extra, REGIONS_KEY: record}
    graph = graph.replace(signature=dataclasses.replace(graph.signature, extra=extra))
    distinct = len({k for k, _ in record})
    ops = sum(n for _, n in record)
    return PassResult(graph, True, f"{len(record)} regions of {ops} ops handed to inductor ({distinct} distinct)")
