"""clone_step_graph copies a captured step exactly as fx's own graph_copy
does (stepfx.compat.copy_graph skips only create_node's argument scan)."""
from __future__ import annotations

import torch
import torch.fx as fx

import stepfx
from stepfx import compat
from stepfx.graph.build import clone_step_graph_mapped
from tests.steps import hf_llama, padded_batch, padded_step


def _captured():
    torch.manual_seed(0)
    model = hf_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = stepfx.parallelize({"gradient_clipping": 1.0, "stepfx": {"dynamic": True}})(padded_step)
    step(model, opt, padded_batch([7, 5], generator=torch.Generator().manual_seed(0)))
    return step.plan.records[0].graph  # the capture: symbolic sizes, SymInts in node arguments


def test_the_copy_is_graph_copy_s_node_for_node():
    graph = _captured()
    src = graph.gm.graph
    theirs_map: dict = {}
    theirs = fx.Graph()
    theirs.output(theirs.graph_copy(src, theirs_map))
    clone, ours_map = clone_step_graph_mapped(graph)
    ours = clone.gm.graph
    assert len(list(ours.nodes)) == len(list(theirs.nodes)) == len(list(src.nodes))
    for old, a, b in zip(src.nodes, ours.nodes, theirs.nodes):
        assert (a.name, a.op, a.target, str(a.args), str(a.kwargs)) == (b.name, b.op, b.target, str(b.args), str(b.kwargs))
        if old.op != "output":
            assert ours_map[old] is a and a.meta == old.meta and a.meta is not old.meta
            assert [ours_map[n] for n in old.all_input_nodes] == a.all_input_nodes
    ours.lint()
    # the copy is a graph of its own: its lookup tables find its nodes, new names do not clash
    calls = ours.find_nodes(op="call_function", target=torch.ops.aten.mm.default)
    assert calls and all(n.graph is ours for n in calls)
    first = next(iter(ours.nodes))
    with ours.inserting_after(first):
        extra = ours.call_function(torch.ops.aten.neg.default, (first,), name=first.name)
    assert extra.name != first.name
    ours.erase_node(extra)
    assert clone.gm.code == fx.GraphModule(graph.gm, theirs).code  # the same program


def test_a_graph_that_is_not_empty_is_copied_by_fx():
    graph = _captured()
    dst = fx.Graph()
    dst.placeholder("already_there")
    out = compat.copy_graph(dst, graph.gm.graph, {})
    assert out is not None and len(list(dst.nodes)) == len(list(graph.gm.graph.nodes))  # fx's: the one there + all but the output
