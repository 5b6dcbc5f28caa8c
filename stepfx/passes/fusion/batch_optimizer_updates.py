"""batch_optimizer_updates: the fused in-place Adam updates of a step become
one multi-tensor call (one kernel launch per gradient dtype).

``fuse_optimizer_update`` leaves one ``adam_step`` per parameter (or ZeRO
piece): ~300 launches for a 24-layer transformer, each passing through
Python and Triton's launcher (~30 us of host time apiece), while the GPU
needs ~30 us per update: the optimizer phase ends up waiting on the host.
Updates that share everything but their tensors (lr, betas, step count,
grad factor, overflow flag, and the rule's constants) and that write in
place, read by nothing but the step's outputs, run as one
``graph_ops.adam_step_many`` placed where the last of them was: every
gradient exists there, and only the outputs read the results.

Requires: ``fuse_optimizer_update`` ran. Ensures: no two in-place
``adam_step`` calls with equal scalar arguments and constants whose results
only the output reads remain; each group is one ``adam_step_many`` whose
donated arguments are its parameters and states.

Before / after::

    u1 = adam_step(p1, g1, m1, v1, lr, b1, b2, t, f, inf, inplace=True)    u = adam_step_many(2, p1, p2, g1, g2, m1, m2,
    u2 = adam_step(p2, g2, m2, v2, lr, b1, b2, t, f, inf, inplace=True) ->       v1, v2, lr, b1, b2, t, f, inf)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...graph import META_DONATED, StepGraph
from ...graph.build import clone_step_graph_mapped
from ..data_parallel.collectives import make_node
from ..manager import PassOptions, PassResult

__all__ = ["batch_optimizer_updates"]

aten = torch.ops.aten


def _batchable(node: fx.Node, output: fx.Node) -> bool:
    from ...codegen import graph_ops

    if node.op != "call_function" or node.target is not graph_ops.adam_step or not node.kwargs.get("inplace"):
        return False
    if not node.meta.get(META_DONATED) or len(node.args) != 10:
        return False
    return all(u.target is operator.getitem and all(r is output for r in u.users) for u in node.users)


def _step_count(node: fx.Node):
    """What the update's step argument counts, the same for the two forms
    fuse_optimizer_update passes: the counter before this step's increment
    (``step_is_new=False``) or the host read of that counter plus one."""
    step = node.args[7]
    if node.kwargs.get("step_is_new") and isinstance(step, fx.Node) and step.target is aten._local_scalar_dense.default:
        inner = step.args[0]
        if isinstance(inner, fx.Node) and inner.target is aten.add.Tensor and inner.args[1] == 1:
            return ("counter", inner.args[0].name)
    if not node.kwargs.get("step_is_new") and isinstance(step, fx.Node) and step.op == "placeholder":
        return ("counter", step.name)
    return ("as given", step.name if isinstance(step, fx.Node) else step, node.kwargs.get("step_is_new"))


def _key(node: fx.Node):
    scalars = tuple(("node", a.name) if isinstance(a, fx.Node) else ("value", a) for i, a in enumerate(node.args[4:]) if i != 3)
    constants = tuple(sorted((k, v) for k, v in node.kwargs.items() if k not in ("inplace", "step_is_new")))
    return scalars, _step_count(node), constants


def batch_optimizer_updates(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    output = next(n for n in reversed(graph.gm.graph.nodes) if n.op == "output")
    groups: dict = {}
    for node in graph.gm.graph.nodes:
        if _batchable(node, output):
            groups.setdefault(_key(node), []).append(node)
    groups = {k: v for k, v in groups.items() if len(v) > 1}
    if not groups:
        return PassResult(graph, False)
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    batched = 0
    for matches in groups.values():
        nodes = [copy_of[n] for n in matches]
        count = len(nodes)
        columns = [[n.args[i] for n in nodes] for i in range(4)]  # params, grads, exp_avgs, exp_avg_sqs
        flat = tuple(a for column in columns for a in column) + tuple(nodes[0].args[4:])
        # one step argument for all (equal counts, see _step_count): the first update's, with its form
        kwargs = {k: v for k, v in nodes[0].kwargs.items() if k != "inplace"}
        vals = tuple(v for n in nodes for v in n.meta["val"])
        with g.inserting_after(nodes[-1]):
            call = make_node(g, graph_ops.adam_step_many, (count, *flat), kwargs, val=vals, like=nodes[-1],
                             name="fused_updates")
        # the params (args 1..count) and both states (after the grads) are written in place
        call.meta[META_DONATED] = tuple(range(1, 1 + count)) + tuple(range(1 + 2 * count, 1 + 4 * count))
        with g.inserting_after(call):
            for i, node in enumerate(nodes):
                for getter in list(node.users):
                    j = getter.args[1]
                    new = make_node(g, operator.getitem, (call, 3 * i + j), val=vals[3 * i + j], like=getter,
                                    name=getter.name + "_b")
                    getter.replace_all_uses_with(new)
                    g.erase_node(getter)
        for node in nodes:
            g.erase_node(node)
        batched += count
    graph.gm.recompile()
    return PassResult(graph, True, f"{batched} Adam updates in {len(groups)} multi-tensor calls")
