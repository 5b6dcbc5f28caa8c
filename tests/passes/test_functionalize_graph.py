from __future__ import annotations

import torch

from stepfx.graph import verify_step_graph
from stepfx.graph.ops import is_mutating
from stepfx.passes import PassOptions
from stepfx.passes.cleanup.functionalize_graph import functionalize_graph
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


def _shifted_labels(model, optimizer, x, y):
    # Hugging Face's shift_tokens_right: writes through views of a fresh tensor, read afterwards
    shifted = y.new_zeros((2, y.shape[0]))
    shifted[:, 1:] = y[:-1].clone()
    shifted[1][0] = 3                   # a select of a select: two views out to the tensor
    shifted.masked_fill_(shifted == 2, 0)
    loss = torch.nn.functional.cross_entropy(model(x), shifted[1] % 4)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss, shifted


def _sibling_view_read_after(model, optimizer, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        first, last = model.hist[0:2], model.hist[1:3]   # two views sharing hist[1]
        first.add_(1)
        total = last.sum()                              # the other view must see the write
    return loss, total


def _functionalized(step_fn):
    from stepfx.capture import capture_step
    from tests.steps import mlp_batches

    model = WithCounter()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = mlp_batches(1)[0]
    return functionalize_graph(capture_step(step_fn, model, opt, (x, y), {}), PassOptions())


def _bitwise(step_fn):
    from stepfx.testing.equivalence import assert_step_equivalent
    from tests.steps import mlp_batches

    report = assert_step_equivalent(step_fn, WithCounter, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                                    mlp_batches(3), exact=True)
    assert report.bitwise


def test_writes_through_view_chains_are_scattered_back_into_their_tensors():
    for step_fn, scatter in ((_write_through_view_then_read_base, aten.select_scatter.default),
                             (_shifted_labels, aten.slice_scatter.default)):
        result = _functionalized(step_fn)
        assert result.summary.startswith(tuple("0123456789")) and "torch functionalization" not in result.summary
        assert scatter in {n.target for n in result.graph.gm.graph.nodes}
        assert verify_step_graph(result.graph) == []
        _bitwise(step_fn)


def test_writes_another_alias_must_see_fall_back_to_torch_functionalization():
    result = _functionalized(_sibling_view_read_after)
    assert result.summary.startswith("torch functionalization (")
    assert "is read after" in result.summary
    _bitwise(_sibling_view_read_after)


def test_direct_rewrite_is_used_for_ordinary_steps():
    graph, *_ = captured_mlp()
    result = functionalize_graph(graph, PassOptions())
    assert result.summary.endswith("in-place ops rewritten out of place")
