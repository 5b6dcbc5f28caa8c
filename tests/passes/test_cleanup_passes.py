"""drop_profiler_nodes, remove_aliases, prune_unchanged_outputs, eliminate_dead_code."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from stepfx.errors import PassError
from stepfx.graph import Role, Slot, StepGraph, StepSignature, verify_step_graph
from stepfx.graph.ops import ALIAS_OPS, PROFILER_OPS
from stepfx.passes import PassOptions
from stepfx.passes.cleanup.drop_profiler_nodes import drop_profiler_nodes
from stepfx.passes.cleanup.eliminate_dead_code import eliminate_dead_code
from stepfx.passes.cleanup.functionalize_graph import functionalize_graph
from stepfx.passes.cleanup.prune_unchanged_outputs import prune_unchanged_outputs
from stepfx.passes.cleanup.remove_aliases import remove_aliases
from tests.steps import captured_mlp, run_graph

aten = torch.ops.aten
OPTS = PassOptions()


def _functional(**kw):
    graph, model, opt, batch = captured_mlp(**kw)
    return functionalize_graph(graph, OPTS).graph, model, opt, batch


def _same_outputs(a, b, model, opt, batch):
    for x, y in zip(run_graph(a, model, opt, batch), run_graph(b, model, opt, batch)):
        assert torch.equal(x, y)


def test_drop_profiler_nodes():
    graph, model, opt, batch = _functional()
    assert any(n.target in PROFILER_OPS for n in graph.gm.graph.nodes)
    result = drop_profiler_nodes(graph, OPTS)
    assert result.changed and "removed 4" in result.summary
    assert not any(n.target in PROFILER_OPS for n in result.graph.gm.graph.nodes)
    assert verify_step_graph(result.graph) == []
    _same_outputs(graph, result.graph, model, opt, batch)
    assert not drop_profiler_nodes(result.graph, OPTS).changed


def test_remove_aliases_requires_functional_and_keeps_values():
    captured, *_ = captured_mlp()
    with pytest.raises(PassError, match="requires a functional graph"):
        remove_aliases(captured, OPTS)
    graph, model, opt, batch = _functional()
    result = remove_aliases(graph, OPTS)
    assert result.changed
    assert not any(n.target in ALIAS_OPS for n in result.graph.gm.graph.nodes)
    t = next(n for n in result.graph.gm.graph.nodes if n.target is aten.t.default)
    assert t.args[0].op == "placeholder"  # t(detach(p)) -> t(p)
    _same_outputs(graph, result.graph, model, opt, batch)


def test_prune_unchanged_outputs_drops_frozen_parameter():
    graph, model, opt, batch = _functional(frozen=True)
    graph = remove_aliases(graph, OPTS).graph
    assert any(s == Slot(Role.PARAM, "net.0.bias") for s in graph.signature.outputs)
    result = prune_unchanged_outputs(graph, OPTS)
    assert result.changed and "1 unchanged" in result.summary
    assert Slot(Role.PARAM, "net.0.bias") not in result.graph.signature.outputs
    assert Slot(Role.PARAM, "net.0.weight") in result.graph.signature.outputs
    assert verify_step_graph(result.graph) == []


def _tiny_graph(build) -> StepGraph:
    g = fx.Graph()
    x = g.placeholder("in_x")
    x.meta.update(slot=Slot(Role.BATCH, "x"), val=torch.empty(4))
    out = build(g, x)
    g.output((out,))
    for n in g.nodes:
        if n.op == "call_function":
            n.meta.update(phase="forward", val=torch.empty(4))
    gm = fx.GraphModule(torch.nn.Module(), g)
    sig = StepSignature(inputs=(Slot(Role.BATCH, "x"),), outputs=(Slot(Role.USER_OUTPUT, "y"),))
    return StepGraph(gm, sig, functional=True)


def test_dead_code_goes_but_random_ops_stay():
    def build(g, x):
        g.call_function(aten.sin.default, (x,), name="unused")
        g.call_function(aten.bernoulli.p, (x, 0.5), name="unused_random")
        return g.call_function(aten.cos.default, (x,), name="used")

    result = eliminate_dead_code(_tiny_graph(build), OPTS)
    names = {n.name for n in result.graph.gm.graph.nodes}
    assert "unused" not in names
    # dropping an unread random draw would shift every later draw: eager parity needs it
    assert "unused_random" in names and "used" in names
    assert "removed 1" in result.summary


def test_dead_code_keeps_collectives():
    def build(g, x):
        g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"), name="ar")
        return g.call_function(aten.cos.default, (x,), name="used")

    result = eliminate_dead_code(_tiny_graph(build), OPTS)
    assert not result.changed
    assert "ar" in {n.name for n in result.graph.gm.graph.nodes}
