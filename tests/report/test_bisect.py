"""bisect_divergence: the first pass whose program computes something else, and the first node in it."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import stepfx.api
from stepfx.graph.build import clone_step_graph
from stepfx.passes import PIPELINE, PassManager, PassOptions, PassResult, PipelineEntry
from stepfx.report import bisect_records
from stepfx.testing import bisect_divergence as from_testing
from tests.report.report_workers import bisect_data_parallel
from tests.steps import captured_mlp, ce_step, mlp_batches, small_mlp


def _perturbed(op, *args, **kwargs):
    return op(*args, **kwargs) * 1.01 + 1e-3


def _loss_ancestors(graph) -> list:
    """Forward nodes holding float tensors that the loss depends on (a perturbation there cannot vanish)."""
    out = next(n for n in graph.gm.graph.nodes if n.op == "output")
    (values,) = out.args
    slots = graph.signature.outputs
    loss = next(v for v, s in zip(values, slots) if str(s.role) == "user_output")
    seen, stack = set(), [loss]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in graph.gm.graph.nodes if n in seen and isinstance(n.target, torch._ops.OpOverload)
            and str(n.meta.get("phase")) == "forward"
            and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point()]


def perturb_one_node(fraction: float):
    """A test-only pass: the node at ``fraction`` of the loss's forward ancestors computes ``x * 1.01 + 1e-3``
    instead of ``x``; the node keeps its name, phase and source."""
    chosen = {}

    def perturb_one_node(graph, options):
        graph = clone_step_graph(graph)
        candidates = _loss_ancestors(graph)
        node = candidates[min(int(fraction * len(candidates)), len(candidates) - 1)]
        node.args, node.target = (node.target, *node.args), _perturbed
        graph.gm.recompile()
        chosen["node"], chosen["source"] = node.name, node.meta.get("source")
        return PassResult(graph, True, f"perturbed {node.name}")

    return perturb_one_node, chosen


@pytest.fixture(scope="module")
def captured():
    return captured_mlp()


@settings(max_examples=20, deadline=None)
@given(position=st.integers(0, len(PIPELINE)), fraction=st.floats(0, 1))
def test_bisection_names_the_broken_pass_and_node(captured, position, fraction):
    graph, model, opt, batch = captured
    fn, chosen = perturb_one_node(fraction)
    pipeline = list(PIPELINE)
    pipeline.insert(position, PipelineEntry("perturb_one_node", fn, "test: a wrong rewrite"))
    records = PassManager(pipeline).run(graph, PassOptions(), first=_capture_record(graph))
    found = bisect_records(records, model, opt, list(batch), rtol=1e-4, atol=1e-6)
    assert found.pass_name == "perturb_one_node", str(found)
    assert found.node == chosen["node"] and found.op.endswith("_perturbed"), str(found)
    assert found.source == chosen["source"], str(found)


def test_a_correct_plan_has_no_divergence(captured):
    graph, model, opt, batch = captured
    records = PassManager(PIPELINE).run(graph, PassOptions(), first=_capture_record(graph))
    found = bisect_records(records, model, opt, list(batch), rtol=1e-4, atol=1e-6)
    assert not found.diverged and "no divergence" in str(found)
    assert found.per_pass and all(diff <= 1e-4 for _, diff in found.per_pass)


def test_bisect_divergence_from_the_users_inputs(monkeypatch):
    fn, chosen = perturb_one_node(0.5)
    pipeline = list(PIPELINE)
    pipeline.insert(5, PipelineEntry("perturb_one_node", fn, "test: a wrong rewrite"))
    monkeypatch.setattr(stepfx.api, "PIPELINE", tuple(pipeline))
    x, y = mlp_batches(1)[0]
    found = from_testing(ce_step, small_mlp, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), (x, y),
                         config={"gradient_clipping": 0})
    assert found.pass_name == "perturb_one_node" and found.node == chosen["node"], str(found)
    assert "first divergent pass" in str(found) and chosen["node"] in str(found)


def _capture_record(graph):
    from stepfx.passes import PassRecord

    return PassRecord(0, "capture", graph, True, 0.0, "captured")


def test_clipping_the_config_asks_for_is_named_as_such(captured):
    graph, model, opt, batch = captured
    from stepfx.config import load_config

    options = PassOptions(config=load_config({"gradient_clipping": 1e-3}))
    records = PassManager(PIPELINE).run(graph, options, first=_capture_record(graph))
    found = bisect_records(records, model, opt, list(batch), rtol=1e-4, atol=1e-6)
    assert found.pass_name == "unscale_clip_gradients" and "set gradient_clipping to 0" in str(found), str(found)


# data parallelism: (ZeRO stage, the pass a perturbation follows (None: a correct plan), where, clipping)
DP_CASES = [
    (1, None, 0.0, 0.01),  # clipping that bites
    (2, "remove_aliases", 0.3, 0.0),
    (3, "shard_parameters", 0.7, 0.01),
]


@pytest.mark.parametrize("stage,after,fraction,clip", DP_CASES)
def test_data_parallel_plans_are_bisected_on_every_rank(rank_pool, stage, after, fraction, clip):
    """Every rank runs each pass's program with the others; before the first collective the
    reference is the rank's captured step, from it on the data-parallel step (all ranks' batches,
    gradients averaged, the config's clipping), pieces compared with their range of the whole. A
    correct plan shows no divergence (the ZeRO passes and clipping included); a perturbation before
    or after the ZeRO passes is named with its node, the same on both ranks."""
    results = rank_pool(2).run(bisect_data_parallel, stage, after, fraction, clip, timeout=300)
    for r in results:
        assert r == {**results[0], "text": r["text"]} or r["text"] == results[0]["text"]
    found = results[0]
    if after is None:
        assert found["pass"] is None, found["text"]
        assert found["per_pass"] and all(diff <= 1e-4 for _, diff in found["per_pass"]), found["per_pass"]
    else:
        assert found["pass"] == "perturb_one_node", found["text"]
        assert found["node"] == found["chosen"]["node"] and found["op"].endswith("_perturbed"), found["text"]
        assert found["rank"] == 0 and "on rank 0" in found["text"]


def test_the_reference_clips_where_the_plan_does():
    """From the pass that clips gradients on, bisect_divergence judges against the step clipped as
    the config asks (here it bites: 0.01), so a correct plan with clipping shows no divergence."""
    x, y = mlp_batches(1)[0]
    found = from_testing(ce_step, small_mlp, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), (x, y),
                         config={"gradient_clipping": 0.01})
    assert not found.diverged, str(found)
    labels = [label for label, _ in found.per_pass]
    assert any("unscale_clip_gradients" in label for label in labels)
