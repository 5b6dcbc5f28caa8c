"""The ZeRO passes on real captured graphs, one process (mesh facts as data:
world size and rank come in PassOptions; no collective runs here)."""
from __future__ import annotations

import operator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stepfx
from stepfx.config import load_config
from stepfx.errors import CaptureError
from stepfx.graph import Role, Storage, verify_step_graph
from stepfx.graph.layout import ALIGN, LAYOUT_KEY, Bucket, BucketParam, Sharding, align
from stepfx.passes import PIPELINE, PassManager, PassOptions
from tests.steps import lm_step, tiny_gpt, token_batches

c10d = torch.ops._c10d_functional


# Tests that read the same plan share one compile (_compile's cache): one test process for them.
shares_plans = pytest.mark.xdist_group("zero_pass_plans")
_COMPILED: dict = {}


def _compile(stage, rank=0, world=2, bucket=500, persist=0, step=lm_step, warm=True, device_type="cpu", reuse=0, bf16=False,
             disable=()):
    """(pass records, model) of the tiny GPT's step captured and planned for
    ``rank`` of ``world``. Cached per argument values: several tests read
    the same plan (the stage-3 one five times), which is deterministic
    (seeded here); callers only read it."""
    key = (stage, rank, world, bucket, persist, step, warm, device_type, reuse, bf16, tuple(disable))
    if key not in _COMPILED:
        _COMPILED[key] = _compile_uncached(stage, rank, world, bucket, persist, step, warm, device_type, reuse, bf16, disable)
    return _COMPILED[key]


def _compile_uncached(stage, rank, world, bucket, persist, step, warm, device_type, reuse, bf16, disable):
    from stepfx.capture import capture_step
    from stepfx.capture.trace import CaptureOptions

    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (batch,) = token_batches(1)[0]
    if warm:
        lm_step(model, opt, batch)
    graph = capture_step(step, model, opt, (batch,), {}, options=CaptureOptions(compute_dtype=torch.bfloat16 if bf16 else None))
    # codegen off: these tests are about the collectives, planned as for CUDA
    config = load_config({"gradient_clipping": 0, "bf16": {"enabled": bf16}, "stepfx": {"codegen": False}, "zero_optimization": {
        "stage": stage, "reduce_bucket_size": bucket, "stage3_param_persistence_threshold": persist, "stage3_max_reuse_distance": reuse,
    }})
    options = PassOptions(config=config, world_size=world, rank=rank, group_name="test", device_type=device_type)
    records = PassManager(PIPELINE, disable=disable).run(graph, options)
    return records, model


def _targets(graph):
    return [n.target for n in graph.gm.graph.nodes if n.op == "call_function"]


@given(numels=st.lists(st.integers(1, 300), min_size=1, max_size=6), world=st.integers(1, 5))
@settings(max_examples=60, deadline=None)
def test_pieces_partition_every_parameter_exactly_once(numels, world):
    params, offset = [], 0
    for i, n in enumerate(numels):
        params.append(BucketParam(f"p{i}", (n,), offset))
        offset = align(offset + n)
    bucket = Bucket(0, tuple(params), Sharding.GRADIENTS, world, "torch.float32", "cpu")
    assert bucket.padded % (world * ALIGN) == 0 and bucket.padded - bucket.numel < world * ALIGN
    for p in params:
        covered = []
        for r in range(world):
            a, b, in_shard = bucket.piece(p, r)
            if b > a:
                assert 0 <= in_shard and in_shard + (b - a) <= bucket.shard
                assert p.offset + a == r * bucket.shard + in_shard  # same element, two coordinates
                # aligned: SIMD kernels round each element of a piece as in the whole tensor
                assert a % ALIGN == 0 and (b == p.numel or b % ALIGN == 0)
                covered.append((a, b))
        assert sorted(covered)[0][0] == 0 and sorted(covered)[-1][1] == p.numel
        assert sum(b - a for a, b in covered) == p.numel


def test_layout_follows_bucket_size_and_persistence_threshold():
    records, model = _compile(3, bucket=500, persist=100)
    layout = records[-1].graph.signature.extra[LAYOUT_KEY]
    assert all(b.numel <= 500 + ALIGN * len(b.params) or len(b.params) == 1 for b in layout.buckets)
    for b in layout.buckets:
        for p in b.params:
            numel = dict(model.named_parameters())[p.name].numel()
            assert (b.sharding is Sharding.NONE) == (numel < 100)
    # every parameter once; buckets of one kind take them in model order, numbered by their first one
    names = [n for n, _ in model.named_parameters()]
    assert sorted(p.name for _, p in layout.params()) == sorted(names)
    for kind in (Sharding.NONE, Sharding.PARAMETERS):
        mine = [p.name for b, p in layout.params() if b.sharding is kind]
        assert mine == [n for n in names if n in mine]
    firsts = [names.index(b.params[0].name) for b in layout.buckets]
    assert firsts == sorted(firsts) and [b.index for b in layout.buckets] == list(range(len(layout.buckets)))


@shares_plans
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_stage_emits_its_collectives(stage):
    records, _ = _compile(stage)
    graph = records[-1].graph
    assert verify_step_graph(graph) == []
    t = _targets(graph)
    # gradient buckets are all-reduced in place (all_reduce_: no clone of the bucket); the clipping norm out of place
    assert (c10d.all_reduce_.default in t) == (stage in (0, 1))
    assert (c10d.reduce_scatter_tensor.default in t) == (stage in (2, 3))
    assert (c10d.all_gather_into_tensor.default in t) == (stage >= 1)
    collectives = (c10d.all_reduce.default, c10d.all_reduce_.default, c10d.reduce_scatter_tensor.default,
                   c10d.all_gather_into_tensor.default)
    assert t.count(c10d.wait_tensor.default) == sum(t.count(op) for op in collectives)


def _late_reductions(graph) -> tuple[list[str], int]:
    """(the gradient reductions issued only after a backward matmul that ran
    when the last gradient they read was already computed; how many gradient
    reductions there are). Packing (views, casts, padding, concatenation)
    does not count as computing a gradient."""
    from stepfx.graph.ops import dtype_cast, is_view

    nodes = [n for n in graph.gm.graph.nodes if n.op == "call_function"]
    index = {n: i for i, n in enumerate(nodes)}
    packing = (torch.ops.aten.cat.default, torch.ops.aten.zeros.default, operator.getitem)
    reductions = [n for n in nodes if str(n.meta.get("phase")) == "backward"
                  and n.target in (c10d.all_reduce_.default, c10d.reduce_scatter_tensor.default)]
    late = []
    for reduction in reductions:
        computed, stack = [], [reduction]
        while stack:  # back through the packing to the ops that computed the gradients
            for arg in stack.pop().all_input_nodes:
                if arg.op != "call_function":
                    continue
                if is_view(arg) or dtype_cast(arg) is not None or arg.target in packing:
                    stack.append(arg)
                else:
                    computed.append(index[arg])
        ready = max(computed, default=-1)
        if any(n.target is torch.ops.aten.mm.default for n in nodes[ready + 1:index[reduction]]):
            late.append(reduction.name)
    return late, len(reductions)


@shares_plans
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("bf16", [False, True])
def test_gradient_buckets_are_reduced_during_backward(stage, bf16):
    """A bucket's all-reduce / reduce-scatter is issued right after its last
    gradient, before the backward's next matmul. Under bf16 the gradients
    are fp32 casts that the captured graph puts after the whole backward:
    without place_gradients_early every reduction came after it (on 2xH200,
    11 ms per step of idle compute stream at ZeRO-3)."""
    records, _ = _compile(stage, bf16=bf16, device_type="cuda")
    late, total = _late_reductions(records[-1].graph)
    assert total >= 4 and late == [], (late, total)
    if bf16:
        records, _ = _compile(stage, bf16=True, device_type="cuda", disable=("place_gradients_early",))
        late, total = _late_reductions(records[-1].graph)
        assert len(late) > total // 2, (late, total)


@shares_plans
def test_stage_3_gathers_before_forward_and_again_before_backward():
    records, model = _compile(3)
    graph = records[-1].graph
    layout = graph.signature.extra[LAYOUT_KEY]
    gathers = [n for n in graph.gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    forward = [n for n in gathers if str(n.meta["phase"]) == "forward"]
    backward = [n for n in gathers if str(n.meta["phase"]) == "backward"]
    assert len(forward) == len(layout.buckets)
    # again before backward, for buckets backward reads (a Linear's bias is not read there)
    assert 0 < len(backward) < len(layout.buckets)
    params = [s for s in graph.signature.inputs if s.role is Role.PARAM]
    assert params and all(s.storage is Storage.RANK and s.piece is not None for s in params)
    total = sum(p.numel() for p in model.parameters())
    held = sum(s.piece[1] - s.piece[0] for s in params)
    # 1/N of the parameters, up to padding and alignment gaps
    slack = sum(b.padded - sum(p.numel for p in b.params) for b in layout.buckets)
    assert abs(held - total / 2) <= slack


@shares_plans
def test_ranks_hold_complementary_pieces():
    held = []
    for rank in (0, 1):
        records, _ = _compile(2, rank=rank)
        sig = records[-1].graph.signature
        held.append({(s.name, s.key, s.piece) for s in sig.inputs if s.role is Role.OPTIMIZER_STATE and s.piece})
    assert held[0] and held[1] and not (held[0] & held[1])


def test_stage_2_refuses_gradient_clipping_in_the_step():
    def clipped(model, optimizer, idx):
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    with pytest.raises(CaptureError, match="reads the gradient of .* outside the optimizer") as info:
        _compile(2, step=clipped)
    assert "clip_grad_norm_" in info.value.source and "gradient_clipping" in str(info.value)
    # stage 1 keeps whole averaged gradients: clipping in the step is fine there
    _compile(1, step=clipped)


def test_stage_2_needs_the_step_to_zero_its_gradients():
    def keeps_grads(model, optimizer, idx):
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        return loss

    with pytest.raises(CaptureError, match="keeps whole gradients across calls"):
        _compile(2, step=keeps_grads)


def test_single_process_stages_equal_eager_bitwise():
    for stage in (1, 2, 3):
        cfg = {"gradient_clipping": 0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0}}
        report = stepfx.testing.assert_step_equivalent(
            lm_step, tiny_gpt, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), token_batches(3), config=cfg, exact=True
        )
        assert report.bitwise


def test_zero_3_module_params_are_released_and_sync_model_restores_them():
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize({"gradient_clipping": 0, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})(lm_step)
    for (batch,) in token_batches(2):
        step(model, opt, batch)
    assert all(p.numel() == 0 for p in model.parameters())
    assert not opt.state  # the rank holds the optimizer state
    with pytest.raises(RuntimeError):
        model(batch)  # loud, not stale
    state = step.model_state_dict()
    step.sync_model()
    assert all(torch.equal(p, state[n]) for n, p in model.named_parameters())
    model(batch)
    (batch2,) = token_batches(1, seed=9)[0]
    step(model, opt, batch2)  # training continues from the rank's pieces
    assert all(p.numel() == 0 for p in model.parameters())


@shares_plans
def test_schedule_prefetches_gathers_and_waits_late():
    # scheduling applies to CUDA steps; the graph is the same, so plan one as if for CUDA
    records, _ = _compile(3, bucket=500, device_type="cuda")
    before = next(r.graph for r in records if r.name == "shard_parameters")
    scheduled = next(r for r in records if r.name == "schedule_collectives")
    after = scheduled.graph
    assert scheduled.changed

    def positions(graph):
        order = {n: i for i, n in enumerate(graph.gm.graph.nodes)}
        gathers = [n for n in graph.gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default and str(n.meta["phase"]) == "forward"]
        waits = [next(u for u in n.users if u.target is c10d.wait_tensor.default) for n in gathers]
        return order, gathers, waits

    order, gathers, waits = positions(before)
    # before scheduling every gather is waited for right away, nothing in flight
    assert all(order[w] == order[g] + 1 for g, w in zip(gathers, waits))
    order, gathers, waits = positions(after)
    # after: bucket k+1 is requested before bucket k's forward runs
    assert all(order[gathers[k + 1]] < order[waits[k + 1]] for k in range(len(gathers) - 1))
    assert sum(order[gathers[k + 1]] < min(order[u] for u in waits[k].users) for k in range(len(gathers) - 1)) >= len(gathers) - 1
    # reduce-scatters: issued in backward, waited for only where the optimizer needs them
    for rs in [n for n in after.gm.graph.nodes if n.target is c10d.reduce_scatter_tensor.default]:
        wait = next(u for u in rs.users if u.target is c10d.wait_tensor.default)
        assert str(rs.meta["phase"]) == "backward"
        assert order[wait] - order[rs] > 1
        first_reader = min(order[u] for u in wait.users)
        assert first_reader == order[wait] + 1


@shares_plans
def test_schedule_only_reorders():
    plain, _ = _compile(3, bucket=500)
    scheduled, _ = _compile(3, bucket=500, device_type="cuda")
    assert plain[-1].skipped and plain[-1].graph.count_ops() == scheduled[-1].graph.count_ops()
    key = lambda g: sorted(str(n.target) for n in g.gm.graph.nodes if n.op == "call_function")
    assert key(plain[-1].graph) == key(scheduled[-1].graph)


@shares_plans
def test_cpu_steps_are_not_scheduled():
    records, _ = _compile(3, bucket=500)
    assert next(r for r in records if r.name == "schedule_collectives").skipped == "not applicable"


@shares_plans
def test_buckets_reused_soon_are_not_gathered_again():
    gathers = lambda g: [n for n in g.gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default and str(n.meta["phase"]) == "backward"]
    regather = gathers(_compile(3, reuse=0)[0][-1].graph)
    # the last blocks' parameters are read again a few hundred elements later: keep them
    some = _compile(3, reuse=3000)[0]
    kept = gathers(some[-1].graph)
    assert 0 < len(kept) < len(regather)
    assert "kept: reused within max_reuse_distance" in next(r.summary for r in some if r.name == "shard_parameters")
    everything = gathers(_compile(3, reuse=10**9)[0][-1].graph)
    assert everything == []  # DeepSpeed's default keeps every gather of a small model
