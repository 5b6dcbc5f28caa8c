from __future__ import annotations

import torch

from stepfx.graph import META_PHASE, Role, Slot, verify_step_graph
from stepfx.graph.build import clone_step_graph
from stepfx.passes import PIPELINE, PassManager, PassOptions
from tests.steps import captured_mlp

aten = torch.ops.aten


def _final():
    graph, *_ = captured_mlp()
    return PassManager(PIPELINE).run(graph, PassOptions())[-1].graph


def test_captured_and_passed_graphs_are_clean():
    graph, *_ = captured_mlp()
    assert verify_step_graph(graph) == []
    assert verify_step_graph(_final()) == []


def test_missing_phase_is_reported_with_context():
    g = clone_step_graph(_final())
    node = next(n for n in g.gm.graph.nodes if n.target is aten.addmm.default)
    del node.meta[META_PHASE]
    (problem,) = verify_step_graph(g)
    assert f"node {node.name} lacks meta ['phase']" in problem
    assert ">> addmm = aten.addmm(" in problem  # the offending line, among its neighbours


def test_placeholder_and_signature_mismatch():
    g = _final()
    sig = g.signature.with_inputs(g.signature.inputs[:-1])
    problems = verify_step_graph(g.replace(signature=sig))
    assert any("placeholders but" in p for p in problems)


def test_output_arity_and_duplicate_slots():
    g = _final()
    outs = g.signature.outputs
    problems = verify_step_graph(g.replace(signature=g.signature.with_outputs(outs + (outs[0],))))
    assert any("returns" in p and "outputs" in p for p in problems)
    assert any("duplicate output slot" in p for p in problems)


def test_functional_graph_must_not_write_inputs():
    g = clone_step_graph(_final())
    ph = next(n for n in g.gm.graph.nodes if n.op == "placeholder" and n.meta["slot"].role is Role.PARAM)
    first = next(n for n in g.gm.graph.nodes if n.op == "call_function")
    with g.gm.graph.inserting_before(first):
        bad = g.gm.graph.call_function(aten.mul_.Tensor, (ph, 2.0))
    bad.meta.update(val=ph.meta["val"], phase=first.meta[META_PHASE])
    problems = verify_step_graph(g)
    assert any(f"writes placeholder {ph.name} in place" in p for p in problems)
    # the same graph not marked functional is fine (capture output looks like that)
    assert verify_step_graph(g.replace(functional=False)) == []


def test_slot_on_placeholder_must_match():
    g = clone_step_graph(_final())
    ph = next(n for n in g.gm.graph.nodes if n.op == "placeholder")
    ph.meta["slot"] = Slot(Role.BUFFER, "nope")
    assert any("carries slot" in p for p in verify_step_graph(g))
