"""partition_stages and the stage programs, in one process (no ranks): where
the forward is cut, how each partition method balances, what the programs
cover, and the config that asks for it. The programs are also run here in
a pipeline's order, all stages in this process, against the captured step:
the cut changes no value (bitwise)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from stepfx.capture import CaptureOptions, capture_step, collect_inputs
from stepfx.capture.initial_state import create_initial_state
from stepfx.config import ConfigError, load_config
from stepfx.config.pipeline import pipeline_degree
from stepfx.graph.signature import Role
from stepfx.passes import PIPELINE, PassManager, PassOptions
from stepfx.passes.pipeline.partition_stages import (
    META_STAGE,
    META_TASK,
    MODULE_CLASSES_KEY,
    PIPELINE_KEY,
    STAGES_KEY,
    module_classes,
)
from stepfx.passes.pipeline.stage_programs import split_programs
from stepfx.runtime.binding import ModuleBinding, RankStore
from stepfx.testing.models import GPT, gpt_config
from tests.steps import lm_step, token_batches


def _partitioned(stages, micro=2, config=None, layers=2, d_model=32, heads=4, rows=4, with_optimizer=False):
    """The final graph of lm_step on a GPT, cut into ``stages``, and the
    model, optimizer and first micro-batch it was captured with."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_layers=layers, d_model=d_model, n_heads=heads))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    create_initial_state(opt, None)
    (batch,) = token_batches(1, batch=rows, seed=5)[0]
    first = batch[: rows // micro]
    fp16 = bool((config or {}).get("fp16", {}).get("enabled"))
    options = CaptureOptions(grad_accumulation=micro, compute_dtype=torch.float16 if fp16 else None, cast_inputs=fp16,
                             loss_scale=fp16)
    inputs = collect_inputs(model, opt, (first,), {}, held={}, options=options)
    captured = capture_step(lm_step, model, opt, (first,), {}, inputs=inputs, options=options)
    cfg = load_config({"gradient_clipping": 0, "gradient_accumulation_steps": micro, **(config or {})})
    records = PassManager(PIPELINE).run(captured, PassOptions(config=cfg, extra={
        STAGES_KEY: stages, MODULE_CLASSES_KEY: module_classes(model)}))
    if with_optimizer:
        return records[-1].graph, model, batch, opt
    return records[-1].graph, model, batch


def _forward_stages(graph):
    return [n.meta[META_STAGE] for n in graph.gm.graph.nodes
            if n.op == "call_function" and n.meta.get(META_TASK) == "F"]


def _check_cover(graph, programs):
    """Every op of the step is in exactly one program, or copied (replicated)
    into those that read it, or a sum over the stages the runtime makes."""
    counts = {}
    for prog in programs.programs.values():
        for n in prog.gm.graph.nodes:
            if n.op == "call_function":
                counts[n.name] = counts.get(n.name, 0) + 1
    for n in graph.gm.graph.nodes:
        if n.op != "call_function":
            continue
        task = n.meta.get(META_TASK)
        if task == "X":
            assert n.name not in counts, n.name
        elif n.name in programs.replicated:
            assert n.meta.get(META_STAGE) is None or n.meta.get(META_TASK) == "O", n.name
        else:
            assert counts.get(n.name) == 1, (n.name, task, counts.get(n.name))


def test_the_forward_is_cut_between_blocks_where_only_the_residual_stream_crosses():
    graph, _, _ = _partitioned(2)
    plan = graph.signature.extra[PIPELINE_KEY]
    assert plan.stages == 2 and len(plan.crossing) == 1
    assert len(plan.crossing[0]) == 1  # one tensor: the residual stream, (2 rows, 8 positions, 32 features) fp32
    assert plan.crossing_bytes == (2 * 8 * 32 * 4,)
    stages = _forward_stages(graph)
    assert stages == sorted(stages) and set(stages) == {0, 1}
    # the embedding and first block on stage 0, the second block, the head and the loss on stage 1
    assert plan.owner["tok.weight"] == 0 and plan.owner["blocks.0.fc_out.weight"] == 0
    assert plan.owner["blocks.1.qkv.weight"] == 1 and plan.owner["ln_f.weight"] == 1


def test_programs_cover_every_op_and_send_one_tensor_each_way():
    graph, _, _ = _partitioned(2)
    programs = split_programs(graph)
    _check_cover(graph, programs)
    assert [len(s) for s in programs.send_forward] == [1, 0]
    assert [len(s) for s in programs.send_backward] == [0, 1]
    # the tied head: its gradient part once a step to the embedding's stage, the new weight back
    assert [(src, dst) for _, src, dst in programs.step_sends] == [(1, 0)]
    assert [(src, dst) for _, _, src, dst in programs.param_sends] == [(0, 1)]


def _pipeline_in_process(graph, programs, values_in, batch, micro):
    """Every stage's programs in this process, in a pipeline's order: per
    micro-batch the forwards F0..F{S-1}, then the backwards (B, or BI then
    BW) from the last stage down, the gradients the updates read summed over
    the micro-batches; then each stage's update around the sums over the
    stages, and the replicated outputs. Returns (losses, summed gradients,
    the step's outputs)."""
    sig, stages = graph.signature, programs.stages
    pieces = batch.split(batch.shape[0] // micro)
    batch_at = [i for i, s in enumerate(sig.inputs) if s.role is Role.BATCH]
    backward = ("BI", "BW") if programs.split_backward else ("B",)
    acc, losses = {}, []
    for m in range(micro):
        inputs = list(values_in)
        for i in batch_at:
            inputs[i] = pieces[m]
        store = {}
        order = [("F", s) for s in range(stages)] + [(k, s) for s in reversed(range(stages)) for k in backward]
        for key in order:
            prog = programs.programs.get(key)
            if prog is not None:
                args = [inputs[i] if src == "graph" else store[i] for src, i in prog.inputs]
                store.update(zip(prog.outputs, prog.gm(*args)))
        for s in range(stages):
            for name in programs.accumulated[s]:
                acc[name] = store[name].clone() if name not in acc else acc[name] + store[name]
        losses.append(store[programs.outputs[programs.user_outputs[0]][1]])
    values = dict(acc)

    def run(kind, s):
        prog = programs.programs.get((kind, s))
        if prog is not None:
            args = [values_in[i] if src == "graph" else values[i] for src, i in prog.inputs]
            values.update(zip(prog.outputs, prog.gm(*args)))

    for s in range(stages):
        run("O", s)
    for name, parts in programs.cross_sums:
        values[name] = torch.stack([values[p] for p in parts]).sum()
    for s in range(stages):
        run("O2", s)
    run("R", -1)
    outputs = [ref if src == "const" else values_in[ref] if src == "graph" else values.get(ref)
               for src, ref in programs.outputs]
    return losses, acc, outputs


def _whole_in_process(graph, accumulated, values_in, batch, micro):
    """The whole graph on the same micro-batches one after the other (its
    forward and backward), the values the update reads (``accumulated``)
    summed, then its update on the sums: (losses, summed gradients, the
    step's outputs)."""
    gm, sig = graph.gm, graph.signature
    pieces = batch.split(batch.shape[0] // micro)
    batch_at = [i for i, s in enumerate(sig.inputs) if s.role is Role.BATCH]
    loss_name = None
    acc, losses, env = {}, [], {}
    for m in range(micro):
        inputs = list(values_in)
        for i in batch_at:
            inputs[i] = pieces[m]
        env = _run_phases(gm, inputs, update=False)
        for name in accumulated:
            acc[name] = env[name].clone() if name not in acc else acc[name] + env[name]
        (out,) = [n for n in gm.graph.nodes if n.op == "output"]
        loss_name = next(a.name for a, slot in zip(out.args[0], sig.outputs) if slot.role is Role.USER_OUTPUT)
        losses.append(env[loss_name])
    final = _run_phases(gm, list(values_in), update=True, known={**env, **acc})
    return losses, acc, final["__outputs__"]


def _run_phases(gm: fx.GraphModule, inputs: list, *, update: bool, known: dict | None = None) -> dict:
    """Run the whole graph node by node (fx's Interpreter): without
    ``update``, the forward and backward only; with it, the optimizer's ops
    only, every other value read from ``known``."""
    env = {}

    class Phases(fx.Interpreter):
        def run_node(self, n):
            # the update: the optimizer's ops, and a tied parameter's gradient sum (partition_stages moves it
            # to the update, where it adds the parts summed over the micro-batches)
            optimizer = n.op == "call_function" and (str(n.meta.get("phase")) == "optimizer"
                                                     or n.meta.get(META_TASK) in ("O", "O2"))
            if n.op == "output":
                if update:
                    env["__outputs__"] = [self.env[a] if isinstance(a, fx.Node) else a for a in n.args[0]]
                return None
            if n.op == "call_function" and update and not optimizer:
                return known[n.name]
            if n.op == "call_function" and not update and optimizer:
                return None
            value = super().run_node(n)
            env[n.name] = value
            return value

    Phases(gm).run(*inputs)
    return env


def _assert_same_step(graph, programs, model, opt, batch, micro):
    values_in = ModuleBinding(graph.signature, model, opt, RankStore()).inputs([batch])
    losses, acc, outs = _pipeline_in_process(graph, programs, values_in, batch, micro)
    accumulated = sorted({n for s in range(programs.stages) for n in programs.accumulated[s]})
    whole_losses, whole_acc, whole_outs = _whole_in_process(graph, accumulated, values_in, batch, micro)
    for a, b in zip(losses, whole_losses):
        assert torch.equal(a, b)
    for name in accumulated:
        assert torch.equal(acc[name], whole_acc[name]), name
    for slot, a, b in zip(graph.signature.outputs, outs, whole_outs):
        if slot.role is not Role.USER_OUTPUT:
            assert isinstance(a, torch.Tensor) and torch.equal(a, b), slot.describe()


def test_the_programs_run_in_pipeline_order_equal_the_captured_step_bitwise():
    """All stages in this process in a pipeline's order equal the whole
    graph run on the same micro-batches with the gradients summed: the same
    losses, summed gradients and updated parameters and optimizer state,
    bitwise (every op the same; only the order of the stages' ops changed)."""
    graph, model, batch, opt = _partitioned(2, micro=2, with_optimizer=True)
    _assert_same_step(graph, split_programs(graph), model, opt, batch, 2)


@pytest.mark.parametrize("method", ["parameters", "uniform", "type:Block", "best"])
def test_partition_methods_balance_what_they_say(method):
    graph, model, _ = _partitioned(2, config={"pipeline": {"partition": method}}, layers=4)
    plan = graph.signature.extra[PIPELINE_KEY]
    assert plan.method == method
    blocks = {s: sorted({int(n.split(".")[1]) for n, o in plan.owner.items() if n.startswith("blocks.") and o == s})
              for s in range(2)}
    if method in ("uniform", "type:Block"):
        assert blocks == {0: [0, 1], 1: [2, 3]}  # two blocks each
    if method == "parameters":
        assert abs(plan.params[0] - plan.params[1]) <= 0.2 * sum(plan.params)
    if method == "best":
        assert max(plan.costs) <= 0.6 * sum(plan.costs)


def test_the_cost_model_counts_every_op_of_a_micro_batch_once_where_it_runs():
    """The plan's per-stage costs are the forward and backward ops of each stage plus the
    parameters' casts with their first reader; their sum is the whole micro-batch's; a view
    costs only the host's time to issue it; a causal attention half a full one, its backward
    2.5 times its forward."""
    from stepfx.graph.ops import ATTENTION_OPS, is_view
    from stepfx.graph.step_graph import META_PHASE
    from stepfx.graph.step_graph import Phase as StepPhase
    from stepfx.passes.pipeline.partition_stages import DeviceRates, op_cost, stage_costs

    graph, _, _ = _partitioned(3, layers=3)
    plan = graph.signature.extra[PIPELINE_KEY]
    g = graph.gm.graph
    fwd, bwd = stage_costs(g)
    assert plan.forward_costs == tuple(fwd) and plan.backward_costs == tuple(bwd)
    assert all(f > 0 and b > 0 for f, b in zip(fwd, bwd))
    ops = [n for n in g.nodes if n.op == "call_function" and n.meta.get(META_TASK) in ("F", "B")]
    replicated_fwd = [n for n in g.nodes if n.op == "call_function" and n.meta.get(META_TASK) is None
                      and n.meta.get(META_PHASE) is StepPhase.FORWARD]
    total = sum(op_cost(n) for n in ops)
    assert total <= sum(fwd) + sum(bwd) <= total + sum(op_cost(n) for n in replicated_fwd) * 1.0001 + 1e-12
    rates = DeviceRates(flops=1e12, bandwidth=1e9, op_overhead=1e-3)
    views = [n for n in ops if is_view(n)]
    assert views and all(op_cost(n, rates) == 1e-3 for n in views)
    attention = [n for n in ops if n.target in ATTENTION_OPS]
    assert len(attention) == 6  # 3 blocks, forward and backward
    for n in attention:
        q = n.kwargs.get("query", n.args[0] if "backward" not in str(n.target) else n.args[1])
        b, h, t, d = q.meta["val"].shape
        full = 4 * b * h * t * t * d / 1e12 * (2.5 if "backward" in str(n.target) else 1.0)
        causal = n.kwargs.get("is_causal", False) or any(a is True for a in n.args[3:8])
        cost = op_cost(n, DeviceRates(flops=1e12, bandwidth=1e30, op_overhead=0.0))
        assert cost == pytest.approx(full / 2 if causal else full)


def test_split_points_name_where_stages_start():
    graph, _, _ = _partitioned(3, config={"stepfx": {"pipeline": {"split_points": ["blocks.1", "blocks.3"]}}},
                               layers=4)
    plan = graph.signature.extra[PIPELINE_KEY]
    assert plan.method == "split_points"
    assert plan.owner["blocks.0.qkv.weight"] == 0 and plan.owner["blocks.1.qkv.weight"] == 1
    assert plan.owner["blocks.2.fc.weight"] == 1 and plan.owner["blocks.3.ln1.weight"] == 2
    with pytest.raises(ConfigError, match="stepfx.pipeline.split_points: no parameter is under module 'blocks.9'"):
        _partitioned(2, config={"stepfx": {"pipeline": {"split_points": ["blocks.9"]}}})
    with pytest.raises(ConfigError, match="stepfx.pipeline.split_points: names 2 modules; 2 stages need 1"):
        _partitioned(2, config={"stepfx": {"pipeline": {"split_points": ["blocks.1", "blocks.0"]}}})


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # a capture a second: no shrinking
@given(layers=st.integers(1, 3), width=st.sampled_from([(16, 2), (32, 4)]), stages=st.integers(2, 4),
       method=st.sampled_from(["best", "parameters", "uniform"]), clip=st.booleans(), micro=st.sampled_from([1, 2, 4]),
       split=st.booleans())
def test_property_every_op_has_one_place_and_the_step_is_the_same(layers, width, stages, method, clip, micro, split):
    """Over generated GPTs, stage counts, methods, micro-batch counts, with
    and without clipping and the zero-bubble split of the backward: forward
    stages are contiguous and non-empty, every op is in exactly one program
    (or copied where read), each stage sends its successor only what
    crosses, and the programs run in a pipeline's order equal the whole
    graph bitwise (losses, summed gradients, updated state)."""
    d_model, heads = width
    config = {"pipeline": {"partition": method}, "gradient_clipping": 0.5 if clip else 0}
    try:
        graph, model, batch, opt = _partitioned(stages, micro=micro, config=config, layers=layers, d_model=d_model,
                                                heads=heads, with_optimizer=True)
    except ConfigError as exc:  # more stages than the model has layers (uniform) or cut points
        assert "fewer than" in str(exc)
        return
    fwd = _forward_stages(graph)
    assert fwd == sorted(fwd) and set(fwd) == set(range(stages))
    programs = split_programs(graph, split_backward=split)
    _check_cover(graph, programs)
    _assert_same_step(graph, programs, model, opt, batch, micro)
    assert bool(programs.cross_sums) == clip
    for s in range(stages - 1):
        assert programs.send_forward[s], s  # something crosses every cut
    assert programs.send_forward[stages - 1] == [] and programs.send_backward[0] == []


def test_config_reads_the_pipeline_block_as_deepspeed_does():
    cfg = load_config({"pipeline": {"stages": 2, "partition_method": "type:Block", "pipe_partitioned": False}})
    assert (cfg.pipeline.stages, cfg.pipeline.partition, cfg.pipeline.pipe_partitioned) == (2, "type:Block", False)
    assert cfg.pipeline.activation_checkpoint_interval == 0 and cfg.pipeline.grad_partitioned is True
    assert "pipeline.pipe_partitioned" not in cfg.not_applied and "pipeline.stages" not in cfg.not_applied
    assert "pipeline.seed_layers" in load_config({"pipeline": {"seed_layers": True}}).not_applied
    with pytest.raises(ConfigError, match="pipeline.partition: got 'type:\\('"):
        load_config({"pipeline": {"partition": "type:("}})
    with pytest.raises(ConfigError, match="two spellings of the same key"):
        load_config({"pipeline": {"partition": "uniform", "partition_method": "uniform"}})
    with pytest.raises(ConfigError, match="did you mean '1f1b'"):
        load_config({"stepfx": {"pipeline": {"schedule": "1fb1"}}})
    with pytest.raises(ConfigError, match="stepfx.pipeline.virtual_stages: virtual stages are for the interleaved"):
        load_config({"stepfx": {"pipeline": {"schedule": "1f1b", "virtual_stages": 2}}})
    with pytest.warns(UserWarning, match="pipeline.stage: unknown key"):
        load_config({"pipeline": {"stage": 2}})


def test_pipeline_degree_against_the_world():
    cfg = load_config({"pipeline": {"stages": 3}})
    with pytest.raises(ConfigError, match="pipeline.stages: 3 pipeline stages x tensor-parallel 1 do not divide the world size 4"):
        pipeline_degree(cfg.pipeline, cfg.stepfx.pipeline, 4)
    assert pipeline_degree(cfg.pipeline, cfg.stepfx.pipeline, 6) == 3
    auto = load_config({})
    assert pipeline_degree(auto.pipeline, auto.stepfx.pipeline, 8) == 1  # DeepSpeed's "auto" alone: off
    asked = load_config({"stepfx": {"pipeline": {"data_parallel": 2}}})
    assert pipeline_degree(asked.pipeline, asked.stepfx.pipeline, 8) == 4


def test_zero_stages_and_symbolic_sizes_compose_with_a_pipeline(monkeypatch):
    from stepfx.api import _pipeline_degree

    monkeypatch.setenv("WORLD_SIZE", "4")
    for stage in (1, 2, 3):  # (stage 3: runtime/pipeline_params.py)
        assert _pipeline_degree(load_config({"pipeline": {"stages": 2}, "zero_optimization": {"stage": stage}})) == 2
    assert _pipeline_degree(load_config({"pipeline": {"stages": 2}, "stepfx": {"dynamic": True}})) == 2


def test_the_embedding_output_s_gradient_summed_over_two_stages_stays_in_the_backward():
    """A first stage holding the embedding and the first layer's attention
    (Qwen2, bf16, cut before its MLP): the gradient of the embedding's output
    is a sum of a part from each stage (the residual stream's and the
    attention branch's), read by the embedding's backward. It was taken for a
    tied weight's gradient parts (a sum across stages whose readers lead only
    to the update) and moved into the optimizer: an activation-sized value
    summed over micro-batches, all-reduced over data-parallel ranks (a size
    mismatch when their lengths differ) and read with the whole batch's
    indices. The embedding's backward stays in the backward, and only
    parameter-sized values are summed for the update."""
    from stepfx.passes.pipeline.partition_stages import META_TASK
    from tests.pp_workers import hf_qwen2
    from tests.steps import padded_rank_batches, padded_step

    torch.manual_seed(0)
    model = hf_qwen2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    create_initial_state(opt, None)
    (batch,) = padded_rank_batches(1, 1, batch=2, lo=5, hi=8, seed=7)[0][0]
    options = CaptureOptions(grad_accumulation=2, compute_dtype=torch.bfloat16)
    inputs = collect_inputs(model, opt, (batch,), {}, held={}, options=options)
    captured = capture_step(padded_step, model, opt, (batch,), {}, inputs=inputs, options=options)
    cfg = load_config({"gradient_accumulation_steps": 2, "bf16": {"enabled": True},
                       "stepfx": {"pipeline": {"split_points": ["model.layers.0.post_attention_layernorm"]}}})
    graph = PassManager(PIPELINE).run(captured, PassOptions(config=cfg, extra={
        STAGES_KEY: 2, MODULE_CLASSES_KEY: module_classes(model)}))[-1].graph
    lookups = [n for n in graph.gm.graph.nodes if n.target is torch.ops.aten.embedding_dense_backward.default]
    assert lookups and all(n.meta[META_TASK] == "B" for n in lookups)
    programs = split_programs(graph)
    params = {tuple(n.meta["val"].shape) for n in graph.gm.graph.nodes
              if n.op == "placeholder" and n.meta["slot"].role is Role.PARAM}
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    for names in programs.accumulated.values():
        for name in names:
            assert tuple(nodes[name].meta["val"].shape) in params, (name, nodes[name].meta["val"].shape)


def test_a_capture_with_symbolic_lengths_cuts_the_same_stages_whatever_length_it_traced():
    """Data-parallel replicas that bring different lengths capture with a
    symbolic length at the first call, each tracing its own: the cost model
    counts a symbolic size as one value on every rank (SYMBOLIC_SIZE), so
    every replica computes the same costs and cuts the same stages."""
    from stepfx.passes.pipeline.partition_stages import PIPELINE_KEY
    from tests.pp_workers import hf_qwen2
    from tests.steps import padded_batch, padded_step

    owners = []
    for lengths in ([2, 2], [32, 30]):
        torch.manual_seed(0)
        model = hf_qwen2()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        create_initial_state(opt, None)
        batch = padded_batch(lengths, generator=torch.Generator().manual_seed(1))
        options = CaptureOptions(grad_accumulation=1)
        inputs = collect_inputs(model, opt, (batch,), {}, held={}, options=options)
        dims = {s.name: frozenset({1}) for s in inputs.slots if s.role is Role.BATCH}
        captured = capture_step(padded_step, model, opt, (batch,), {}, inputs=inputs, options=options,
                                dynamic_dims=dims)
        cfg = load_config({"pipeline": {"stages": 3}})
        graph = PassManager(PIPELINE).run(captured, PassOptions(config=cfg, extra={
            STAGES_KEY: 3, MODULE_CLASSES_KEY: module_classes(model)}))[-1].graph
        plan = graph.signature.extra[PIPELINE_KEY]
        owners.append((plan.owner, plan.costs, plan.crossing_bytes))
    assert owners[0] == owners[1] and len(set(owners[0][0].values())) == 3  # (the costs too: every decision)
