from __future__ import annotations

import torch

from stepfx.graph import verify_step_graph
from stepfx.graph.ops import is_mutating
from stepfx.passes import PassOptions
from stepfx.passes.functionalize_graph import functionalize_graph
from tests.steps import captured_mlp, run_graph

aten = torch.ops.aten


def test_in_place_updates_become_outputs_with_the_same_values():
    graph, model, opt, batch = captured_mlp()
    assert any(is_mutating(n) for n in graph.gm.graph.nodes)
    result = functionalize_graph(graph, PassOptions())
    assert result.changed and result.graph.functional
    new = result.graph
    assert not any(n.target is aten.copy_.default for n in new.gm.graph.nodes)
    assert verify_step_graph(new) == []
    assert new.signature == graph.signature
    before = run_graph(graph, model, opt, batch)
    after = run_graph(new, model, opt, batch)
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_views_stay_views_so_matmul_layouts_do_not_change():
    graph, *_ = captured_mlp()
    new = functionalize_graph(graph, PassOptions()).graph
    targets = {n.target for n in new.gm.graph.nodes}
    assert aten.t.default in targets and aten.t_copy.default not in targets


def test_phases_and_sources_survive_the_retrace():
    graph, *_ = captured_mlp()
    new = functionalize_graph(graph, PassOptions()).graph
    phases = {str(n.meta["phase"]) for n in new.gm.graph.nodes if n.op == "call_function"}
    assert phases == {"forward", "backward", "optimizer"}
    addmm = next(n for n in new.gm.graph.nodes if n.target is aten.addmm.default)
    assert "steps.py" in addmm.meta["source"] and "model(x)" in addmm.meta["source"]
    lerp = next(n for n in new.gm.graph.nodes if n.target is aten.lerp.Scalar)
    assert lerp.meta["param"] is not None and "optimizer.step()" in lerp.meta["source"]


def test_already_functional_graph_is_unchanged():
    graph, *_ = captured_mlp()
    new = functionalize_graph(graph, PassOptions()).graph
    again = functionalize_graph(new, PassOptions())
    assert not again.changed and again.graph is new


class WithCounter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.register_buffer("hist", torch.zeros(3))

    def forward(self, x):
        return self.fc(x)


def _write_through_view_then_read_base(model, optimizer, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        model.hist[0].add_(1)  # a write through a view ...
        total = model.hist.sum()  # ... that the base, read afterwards, must see
    return loss, total


def test_writes_another_alias_must_see_fall_back_to_torch_functionalization():
    from stepfx.capture import capture_step
    from stepfx.testing.equivalence import assert_step_equivalent
    from tests.steps import mlp_batches

    model = WithCounter()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = mlp_batches(1)[0]
    graph = capture_step(_write_through_view_then_read_base, model, opt, (x, y), {})
    result = functionalize_graph(graph, PassOptions())
    assert result.summary.startswith("torch functionalization (")
    assert "is read after" in result.summary
    report = assert_step_equivalent(
        _write_through_view_then_read_base, WithCounter, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), mlp_batches(3), exact=True
    )
    assert report.bitwise


def test_direct_rewrite_is_used_for_ordinary_steps():
    graph, *_ = captured_mlp()
    result = functionalize_graph(graph, PassOptions())
    assert result.summary.endswith("in-place ops rewritten out of place")
