"""CUDA-graph replay (runtime/graphs.py), driven on the CPU by its
emulation: "capture" records each segment, "replay" re-runs it on the
recorded tensors and writes every result into the tensor recorded for it,
as a graph's kernels write their captured addresses. What this checks is
the runtime's side: which ops run eagerly, inputs copied into the captured
buffers, state copied back, outputs cloned, a failed capture. The real
thing runs in tests/gpu (CUDA and NCCL)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stepfx
from stepfx.config import ConfigError
from stepfx.runtime import graphs
from tests.steps import lm_step, mlp_batches, small_mlp, tiny_gpt, token_batches


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setattr(graphs, "EMULATE", True)


def _step_with_logits(model, optimizer, idx):
    """Returns, besides the loss, a slice of the logits: tensors a segment
    makes, which the next replay overwrites unless they are cloned."""
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss, logits.detach()[0, :2]


def _mlp_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss, model(x).detach()


OPTIMIZERS = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
}


def _run(on: bool, make_model, make_opt, step_fn, batches, config=None, between=None):
    torch.manual_seed(0)
    model = make_model()
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.8)
    step = stepfx.parallelize({**(config or {}), "stepfx": {"cuda_graphs": on}})(step_fn)
    results = []
    for i, batch in enumerate(batches):
        results.append(step(model, opt, *batch))
        sched.step()
        if between is not None:
            between(i, model)
    return results, [p.detach().clone() for p in model.parameters()], step


def _leaves(results):
    return [t for r in results for t in (r if isinstance(r, tuple) else (r,))]


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(model=st.sampled_from(["gpt", "mlp"]), opt=st.sampled_from(sorted(OPTIMIZERS)), clip=st.sampled_from([0.0, 1.0]),
       min_segment=st.sampled_from([1, graphs.MIN_SEGMENT_OPS]))
def test_replayed_steps_are_the_same_bits(emulate, monkeypatch, model, opt, clip, min_segment):
    """Capture on the third run of the steady plan, then replays: losses,
    the segment-made outputs of every step (kept across steps: a replay
    must not overwrite what an earlier call returned) and the parameters
    are bitwise the eager run's, with a learning rate that changes every
    step. ``min_segment`` 1 captures every run of device ops between eager
    ones (without codegen Adam's host arithmetic cuts the update into dozens
    of segments, which read eager results through their captured buffers)."""
    monkeypatch.setattr(graphs, "MIN_SEGMENT_OPS", min_segment)
    if model == "gpt":
        args = (tiny_gpt, OPTIMIZERS[opt], _step_with_logits, token_batches(6))
    else:
        args = (small_mlp, OPTIMIZERS[opt], _mlp_step, mlp_batches(6))
    config = {"gradient_clipping": clip}
    batches = [tuple(t.clone() for t in b) for b in args[3]]
    graphed, params, step = _run(True, *args, config=config)
    # the user's batches are read, never written (the graphs read copies of them)
    assert all(torch.equal(a, b) for x, y in zip(batches, args[3]) for a, b in zip(x, y))
    eager, eager_params, _ = _run(False, *args, config=config)
    assert step.plan.executor.graphs_note.startswith("CUDA graphs (captured)")
    # one plan from the first call (the optimizer's state is created before capture, SGD's momentum too):
    # 2 eager, 1 capture, 3 replays
    assert step.plan.executor.runs == 6
    assert all(torch.equal(a, b) for a, b in zip(_leaves(graphed), _leaves(eager)))
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


def test_parameters_the_user_replaces_between_steps_are_read(emulate, caplog):
    """``p.data = ...`` between replays (what loading a checkpoint may do):
    the graphs read where the old tensors were, so the step is captured
    again, and the old tensors are left as they were."""
    kept = []

    def replace(i, model):
        if i in (3, 4):
            for p in model.parameters():
                kept.append((p.data, p.data.clone()))
                p.data = p.data * 0.5

    args = (tiny_gpt, OPTIMIZERS["adamw"], lm_step, token_batches(6))
    graphed, params, step = _run(True, *args, between=replace)
    assert all(torch.equal(old, copy) for old, copy in kept)
    assert caplog.text.count("capturing the CUDA graphs again") == 2  # calls 5 and 6 (captured on call 4)
    eager, eager_params, _ = _run(False, *args, between=replace)
    assert all(torch.equal(a, b) for a, b in zip(graphed, eager))
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


def test_segments_keep_program_order_and_eager_ops_only_move_later():
    """The partition of a real plan: every op once; each op after what it
    reads; an eager op never before its place in the graph; a collective's
    wait in its collective's segment (checked by partition itself)."""
    torch.manual_seed(0)
    model, opt = tiny_gpt(), OPTIMIZERS["adamw"](tiny_gpt())
    model = tiny_gpt()
    opt = OPTIMIZERS["adamw"](model)
    step = stepfx.parallelize({"gradient_clipping": 1.0})(lm_step)
    for batch in token_batches(2):
        step(model, opt, *batch)
    gm = step.plan.graph.gm
    program = graphs.partition(gm, "cpu")
    order = [n for item in program for n in (item.nodes if isinstance(item, graphs.Segment) else [item])]
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert sorted(n.name for n in order) == sorted(n.name for n in ops)
    pos = {n: i for i, n in enumerate(order)}
    original = {n: i for i, n in enumerate(ops)}
    assert all(pos[a] < pos[n] for n in order for a in n.all_input_nodes if a in pos)
    eager = [n for n in program if not isinstance(n, graphs.Segment)]
    for n in eager:  # moved later: everything originally after it that it did not wait for is still after it
        # (over the eager ops themselves, every one of them among ops as checked above: the same pairs as
        # scanning ops for members of the list eager, which took seconds)
        assert all(pos[m] > pos[n] for m in eager if original[m] > original[n])
    assert any(isinstance(item, graphs.Segment) and len(item.nodes) > 50 for item in program)


def test_a_failed_capture_finishes_the_step_eagerly(emulate, monkeypatch, caplog):
    """A segment whose capture raises: that step still completes (the rest
    runs eagerly), the plan stays eager, the log and explain() say why."""

    def broken(self, segment, env):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.GraphedStep, "_capture", broken)
    args = (tiny_gpt, OPTIMIZERS["adamw"], lm_step, token_batches(6))
    graphed, params, step = _run(True, *args)
    eager, eager_params, _ = _run(False, *args)
    assert all(torch.equal(a, b) for a, b in zip(graphed, eager))
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))
    note = step.plan.executor.graphs_note
    assert "not captured: RuntimeError: operation not permitted" in note
    assert "could not capture the step as CUDA graphs" in caplog.text
    assert note in step.explain()


def test_cuda_graphs_on_the_cpu_is_a_config_error():
    step = stepfx.parallelize({"stepfx": {"cuda_graphs": True}})(lm_step)
    model = tiny_gpt()
    with pytest.raises(ConfigError, match=r"stepfx.cuda_graphs.*CUDA graphs need CUDA"):
        step(model, OPTIMIZERS["sgd"](model), *token_batches(1)[0])
