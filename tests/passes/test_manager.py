from __future__ import annotations

import os

import pytest
import torch

from stepfx.errors import PassError
from stepfx.graph import META_PHASE
from stepfx.graph.build import clone_step_graph
from stepfx.passes import PIPELINE, PassManager, PassOptions, PassResult, PipelineEntry, pass_names
from tests.steps import captured_mlp

aten = torch.ops.aten


def _breaks_meta(graph, options):
    graph = clone_step_graph(graph)
    node = next(n for n in graph.gm.graph.nodes if n.target is aten.addmm.default)
    del node.meta[META_PHASE]
    return PassResult(graph, True, "dropped a phase")


def _raises(graph, options):
    raise KeyError("boom")


def _quiet(graph, options):
    return PassResult(graph, False)


def test_pipeline_order_and_reasons_are_declared():
    names = pass_names()
    assert names[0] == "functionalize_graph"
    assert names.index("eliminate_dead_code") < names.index("plan_zero_layout") < names.index("shard_parameters")
    assert len(set(names)) == len(names)
    assert all(e.reason and len(e.reason) > 20 for e in PIPELINE)


def test_a_pass_breaking_invariants_is_named_with_its_predecessors():
    graph, *_ = captured_mlp()
    pipeline = PIPELINE[:2] + (PipelineEntry("break_meta", _breaks_meta, "test"),)
    with pytest.raises(PassError) as info:
        PassManager(pipeline).run(graph, PassOptions())
    msg = str(info.value)
    assert "pass 'break_meta' broke" in msg
    assert "passes before it: functionalize_graph, drop_profiler_nodes" in msg
    assert "lacks meta ['phase']" in msg


def test_verification_can_be_turned_off():
    graph, *_ = captured_mlp()
    records = PassManager(PIPELINE[:1] + (PipelineEntry("break_meta", _breaks_meta, "test"),), verify=False).run(graph, PassOptions())
    assert records[-1].changed


def test_a_crashing_pass_is_named():
    graph, *_ = captured_mlp()
    with pytest.raises(PassError, match=r"(?s)pass 'explode' failed: KeyError.*passes before it: functionalize_graph"):
        PassManager(PIPELINE[:1] + (PipelineEntry("explode", _raises, "test"),)).run(graph, PassOptions())


def test_disable_by_name_and_applicability():
    graph, *_ = captured_mlp()
    pipeline = PIPELINE + (PipelineEntry("never", _quiet, "test", applies=lambda o: o.world_size > 1),)
    records = PassManager(pipeline, disable=["remove_aliases"]).run(graph, PassOptions())
    by_name = {r.name: r for r in records}
    assert by_name["remove_aliases"].skipped == "disabled"
    assert by_name["never"].skipped == "not applicable"
    assert any(n.target is aten.detach.default for n in records[-1].graph.gm.graph.nodes)


def test_unknown_pass_name_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown pass 'remove_alias'; did you mean 'remove_aliases'"):
        PassManager(PIPELINE, disable=["remove_alias"])


def test_records_keep_every_graph_and_time_each_pass():
    graph, *_ = captured_mlp()
    records = PassManager(PIPELINE).run(graph, PassOptions())
    assert [r.name for r in records] == list(pass_names())
    assert all(r.seconds >= 0 for r in records)
    # passes are pure: earlier graphs are untouched by later passes
    assert any(n.target is aten.detach.default for n in records[1].graph.gm.graph.nodes)
    assert not any(n.target is aten.detach.default for n in records[-1].graph.gm.graph.nodes)
    assert not graph.functional and records[0].graph.functional  # the input graph was not edited


def test_dumps_are_numbered_python_files_with_provenance(tmp_path):
    graph, *_ = captured_mlp()
    PassManager(PIPELINE, dump_dir=str(tmp_path)).run(graph, PassOptions())
    files = sorted(os.listdir(tmp_path))
    assert files == [f"{i:02d}_{name}.py" for i, name in enumerate(pass_names())]
    for f in files:
        text = (tmp_path / f).read_text()
        assert text.startswith(f"# {f[:-3]}: ")
        assert "took" in text.splitlines()[0] or "skipped (not applicable)" in text.splitlines()[0]
        compile(text, f, "exec")


def test_a_run_resumes_after_the_cleanups_of_an_earlier_one():
    """The memory planner runs the cleanups once and each candidate's
    pipeline after them: the records are the earlier run's, the rest runs
    on their last graph, and the final graph is the full run's."""
    from stepfx.passes import CLEANUP_PASSES
    from stepfx.graph.printer import format_graph

    assert all(e.fn.__module__.startswith("stepfx.passes.cleanup.") for e in PIPELINE[:CLEANUP_PASSES])
    assert PIPELINE[CLEANUP_PASSES - 1].name == "hoist_symbolic_sizes"
    graph, *_ = captured_mlp()
    manager = PassManager(PIPELINE)
    cleaned = PassManager(PIPELINE[:CLEANUP_PASSES]).run(graph, PassOptions())
    resumed = manager.run(graph, PassOptions(), resume=cleaned)
    whole = manager.run(graph, PassOptions())
    assert all(a is b for a, b in zip(resumed, cleaned))
    assert [r.name for r in resumed] == [r.name for r in whole]
    assert format_graph(resumed[-1].graph) == format_graph(whole[-1].graph)
    with pytest.raises(ValueError, match="is not of pass 'functionalize_graph'"):
        manager.run(graph, PassOptions(), resume=cleaned[1:])
