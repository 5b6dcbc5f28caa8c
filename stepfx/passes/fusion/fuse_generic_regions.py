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

from ...graph import META_PHASE, Phase, StepGraph
from ...graph.build import clone_step_graph
from ...graph.ops import has_side_effect, is_generic_fusible
from ..data_parallel.collectives import make_node
from ..manager import PassOptions, PassResult

__all__ = ["fuse_generic_regions", "regions_apply", "REGIONS_KEY"]

aten = torch.ops.aten
REGIONS_KEY = "generic_regions"
# inductor's CPU backend compiles C++ (seconds per region): CPU steps keep
# these ops unless a test asks for them
ON_CPU = False


def regions_apply(options) -> bool:
    """Codegen is on and the step runs on CUDA (or ``ON_CPU``)."""
    from ..declared import codegen_enabled

    return codegen_enabled(options) and (options.device_type == "cuda" or ON_CPU)


_VIEWS = frozenset({aten.slice.Tensor, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default,
                    aten.transpose.int, aten.permute.default, aten.view.default, aten._unsafe_view.default,
                    aten.select.int})


def _phase(node: fx.Node):
    return node.meta.get(META_PHASE)


def _computes(node: fx.Node) -> bool:
    return is_generic_fusible(node)


def _candidate(node: fx.Node) -> bool:
    """What a region may hold: the ops above, and views read only by them in the same phase (a view inside a
    region costs nothing; one read outside would make the region write a copy)."""
    if _computes(node):
        return True
    if node.op != "call_function" or node.target not in _VIEWS or _phase(node) not in (Phase.FORWARD, Phase.BACKWARD):
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_floating_point() or not node.users:
        return False
    if not all(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):
        return False  # a view to a symbolic size reads the size's node: a region's inputs are tensors
    return all(_phase(u) == _phase(node) and _candidate(u) for u in node.users)


@dataclasses.dataclass
class _Region:
    nodes: list
    at_first: bool = True  # every value it reads from outside exists before its first op
    at_last: bool = True  # nothing outside reads its values before its last op


def _placement(nodes: list, members: set, order: dict) -> tuple[bool, bool]:
    """(at_first, at_last) for a region of ``nodes`` (in program order)."""
    first, last = order[nodes[0]], order[nodes[-1]]
    at_first = all(a in members or order[a] < first for n in nodes for a in n.all_input_nodes)
    at_last = all(u in members or order[u] > last for n in nodes for u in n.users)
    return at_first, at_last


def _regions(g: fx.Graph) -> list[_Region]:
    """Regions grown in program order; a candidate reading several regions of its phase merges them when the
    merged region can still be placed (SwiGLU's silu(gate) * up, rotary's q*cos + rotate_half(q)*sin)."""
    order = {n: i for i, n in enumerate(g.nodes)}
    region_of: dict[fx.Node, _Region] = {}
    regions: list[_Region] = []
    for node in g.nodes:
        if not _candidate(node):
            continue
        owners = list({id(region_of[a]): region_of[a] for a in node.all_input_nodes
                       if a in region_of and _phase(region_of[a].nodes[0]) == _phase(node)}.values())
        joined = None
        # all of them at once, else the one made last that can take it (the others' values are then its inputs)
        tries = [owners] + [[r] for r in sorted(owners, key=lambda r: order[r.nodes[-1]], reverse=True)] if len(owners) > 1 else [owners]
        for group in tries if owners else ():
            nodes = sorted([n for r in group for n in r.nodes] + [node], key=order.__getitem__)
            at_first, at_last = _placement(nodes, set(nodes), order)
            if at_first or at_last:
                joined = group[0]
                joined.nodes, joined.at_first, joined.at_last = nodes, at_first, at_last
                for other in group[1:]:
                    regions.remove(other)
                for n in nodes:
                    region_of[n] = joined
                break
        if joined is None:
            joined = _Region([node])
            regions.append(joined)
            region_of[node] = joined
    # worth a call: two ops that compute something (views alone move nothing)
    return [r for r in regions if sum(_computes(n) for n in r.nodes) > 1]


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
    from ...codegen import graph_ops
    from ...codegen.regions import register_region

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
