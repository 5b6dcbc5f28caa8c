from __future__ import annotations

import torch
import torch.fx as fx

from stepfx.graph import format_graph
from stepfx.graph.printer import format_target
from stepfx.passes import PIPELINE, PassManager, PassOptions
from tests.steps import captured_mlp, run_graph

aten = torch.ops.aten


def _final_graph():
    graph, model, opt, batch = captured_mlp()
    records = PassManager(PIPELINE).run(graph, PassOptions())
    return records[-1].graph, model, opt, batch


def test_printed_graph_is_python_that_computes_the_same_values():
    graph, model, opt, batch = _final_graph()
    text = format_graph(graph)
    namespace: dict = {}
    exec(compile(text, "<printed step>", "exec"), namespace)
    from stepfx.runtime import ModuleBinding

    inputs = [t.detach().clone() for t in ModuleBinding(graph.signature, model, opt).inputs(list(batch))]
    with torch.no_grad():
        printed = namespace["step"](graph.gm, *inputs)
    expected = run_graph(graph, model, opt, batch)
    assert len(printed) == len(expected)
    for a, b in zip(printed, expected):
        assert torch.equal(a, b)


def test_phases_params_and_roles_are_trailing_comments():
    graph, *_ = _final_graph()
    text = format_graph(graph, header="05_eliminate_dead_code: demo")
    assert text.startswith("# 05_eliminate_dead_code: demo")
    assert any(line.rstrip().endswith("# forward  net.0.weight") for line in text.splitlines())
    assert "# backward" in text and "# optimizer  net.2.bias" in text
    assert "# param net.0.weight" in text and "# optimizer_state net.0.weight[exp_avg]" in text
    assert "torch.ops.aten" not in text.replace("aten = torch.ops.aten", "")


def test_schema_defaults_are_elided_and_overloads_shortened():
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.addcmul.default, (x, x, x), {"value": 1}, name="a")
    b = g.call_function(aten.addcmul.default, (a, x, x), {"value": 0.5}, name="b")
    c = g.call_function(aten.add.Tensor, (b, x), name="c")
    g.output((c,))
    from stepfx.graph import Role, Slot, StepGraph, StepSignature

    x.meta["slot"] = Slot(Role.BATCH, "x")
    gm = fx.GraphModule(torch.nn.Module(), g)
    sg = StepGraph(gm, StepSignature(inputs=(Slot(Role.BATCH, "x"),), outputs=(Slot(Role.USER_OUTPUT, "y"),)))
    text = format_graph(sg)
    assert "    a = aten.addcmul(x, x, x)\n" in text
    assert "    b = aten.addcmul(a, x, x, value=0.5)\n" in text
    assert "    c = aten.add.Tensor(b, x)\n" in text
    assert format_target(aten.mm.default) == "aten.mm"
    assert format_target(torch.ops._c10d_functional.all_reduce.default) == "torch.ops._c10d_functional.all_reduce"
