"""Pipeline parallelism end to end on the rank pool (CPU, gloo): the step cut
into stages, run by every schedule, equals the single-process reference
with DeepSpeed's gradient accumulation (each micro-batch's loss divided by
their number, the gradients summed, one update; over data-parallel ranks
the mean), and the step returns the mean of the micro-batches' losses.

Fp32: the stages compute the captured ops unchanged; the micro-batches'
gradients are summed in another order than the reference's (and a tied
embedding's two parts are summed once per step, not per micro-batch), so
equality is within 1e-5 relative (normwise per tensor), losses within 1e-6.
The optimizer is SGD with momentum: Adam divides by the gradient's
magnitude, and the key bias's gradient is rounding noise (attention is
invariant to it), which Adam turns into a full-size update of arbitrary sign
(the same reason as the tensor-parallel tests)."""
from __future__ import annotations

import math

import pytest
import torch

import stepfx

from stepfx.testing.equivalence import data_parallel_reference
from tests.pp_workers import (
    failing_run,
    fp16_overflow_run,
    hf_gpt2_no_dropout,
    hf_qwen2,
    memory_run,
    monitored_run,
    pp_run,
    train_and_save,
)
from tests.steps import hf_llama, hf_step, lm_loss, lm_step, tiny_gpt, token_batches


def sgd_momentum(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _config(stages, micro, schedule, virtual=1, clip=0, **extra):
    pipe = {"schedule": schedule}
    if virtual > 1:
        pipe["virtual_stages"] = virtual
    return {"pipeline": {"stages": stages}, "gradient_accumulation_steps": micro, "gradient_clipping": clip,
            "stepfx": {"pipeline": pipe}, **extra}


def _batches(dp, steps=2, rows=12, seed=3, vocab=64):
    return [[(b,) for (b,) in token_batches(steps, batch=rows, seed=seed + d, vocab=vocab)] for d in range(dp)]


def _micro(batches_per_dp, micro):
    """The reference's ranks: one per (data-parallel rank, micro-batch), as DeepSpeed averages them."""
    return [[tuple(t.split(t.shape[0] // micro)[m] for t in batch) for batch in batches]
            for batches in batches_per_dp for m in range(micro)]


def _check(results, step_fn, make_model, make_optimizer, batches_per_dp, micro, clip=None, tp=1):
    """Every rank's losses and every parameter (from the rank whose stage owns it) against the reference."""
    virtual = _micro(batches_per_dp, micro)
    outputs, model, opt = data_parallel_reference(step_fn, make_model, make_optimizer, virtual, clip_norm=clip)
    per_stage = len(batches_per_dp)
    for rank, got in enumerate(results):
        d = (rank // tp) % per_stage  # (rank = stage x dp x tp + data-parallel place x tp + tensor-parallel place)
        expected = [torch.stack([outputs[i][d * micro + m] for m in range(micro)]).mean().item()
                    for i in range(len(outputs))]
        assert got["losses"] == pytest.approx(expected, rel=1e-6, abs=0), (rank, got["losses"], expected)
    names = {id(p): n for n, p in model.named_parameters()}
    reference_state = {n: p.detach() for n, p in model.named_parameters()}
    reference_opt = {names[id(p)]: s for p, s in opt.state.items()}
    covered = set()
    for rank, got in enumerate(results):
        for name, value in got["state"].items():
            ref = reference_state[name]
            diff = (value - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
            assert diff <= 1e-5, (rank, name, diff.item())
            covered.add(name)
            for key, v in got["optimizer"].get(name, {}).items():
                r = reference_opt[name][key]
                d = (v - r).abs().max() / r.abs().max().clamp_min(1e-30) if r.dim() else (v - r).abs()
                assert d <= 1e-5, (rank, name, key, d.item())
    assert covered == set(reference_state), set(reference_state) - covered


@pytest.fixture(scope="module")
def two_ranks(rank_pool):
    return rank_pool(2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,micro,virtual", [("gpipe", 1, 1), ("1f1b", 3, 1), ("zero_bubble", 8, 1),
                                                    ("interleaved_1f1b", 4, 2)])
def test_two_stages_every_schedule_equals_the_reference(rank_pool, schedule, micro, virtual):
    batches = _batches(1, rows=24)
    config = _config(2, micro, schedule, virtual)
    results = rank_pool(2).run(pp_run, lm_step, tiny_gpt, sgd_momentum, batches, config, timeout=300)
    _check(results, lm_step, tiny_gpt, sgd_momentum, batches, micro)
    assert results[0]["captures"] == 1  # SGD's momentum buffers exist before the first capture (dampening 0)
    assert results[0]["stages"] == ([0, 2] if virtual == 2 else [0])
    explain = results[0]["explain"]
    assert f"pipeline parallelism: schedule {schedule}, 2 ranks, {2 * virtual} stages" in explain
    assert "predicted bubble" in explain and "rank 1 |" in explain
    # the standard GPT ties its head to the token embedding: one part of the gradient from each end
    assert "shared parameters: 1 gradient part(s) to the owner, 1 updated value(s) back" in explain


@pytest.mark.slow
def test_four_stages_and_two_stages_times_two_data_parallel(rank_pool):
    pool = rank_pool(4)
    batches = _batches(1)
    results = pool.run(pp_run, lm_step, tiny_gpt, sgd_momentum, batches, _config(4, 4, "1f1b"), timeout=400)
    _check(results, lm_step, tiny_gpt, sgd_momentum, batches, 4)
    assert sorted(s for r in results for s in r["stages"]) == [0, 1, 2, 3]
    batches = _batches(2)
    results = pool.run(pp_run, lm_step, tiny_gpt, sgd_momentum, batches, _config(2, 2, "gpipe"), timeout=400)
    _check(results, lm_step, tiny_gpt, sgd_momentum, batches, 2)
    assert [r["stages"] for r in results] == [[0], [0], [1], [1]]


@pytest.mark.slow
@pytest.mark.parametrize("make_model,schedule", [(hf_gpt2_no_dropout, "1f1b"), (hf_llama, "zero_bubble")])
def test_hugging_face_models(rank_pool, make_model, schedule):
    """GPT-2 (its head tied to the token embedding) and Llama (rotary tables
    from a buffer: every stage computes them), unchanged."""
    batches = _batches(1, rows=4)
    results = rank_pool(2).run(pp_run, hf_step, make_model, sgd_momentum, batches, _config(2, 2, schedule),
                               timeout=300)
    _check(results, hf_step, make_model, sgd_momentum, batches, 2)


@pytest.mark.slow
def test_gradient_clipping_takes_the_norm_over_every_stage(rank_pool):
    """The squared norm's parts are summed on each stage and all-reduced over
    the pipeline: every stage scales by the same factor, as one process would."""
    batches = _batches(1)
    clip = 0.05
    torch.manual_seed(0)
    model = tiny_gpt()
    for (idx,) in [b[0] for b in _micro(batches, 2)]:  # the first step's gradient
        (lm_loss(model(idx[:, :-1]), idx[:, 1:]) / 2).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert norm > 4 * clip  # the clip bites
    results = rank_pool(2).run(pp_run, lm_step, tiny_gpt, sgd_momentum, batches, _config(2, 2, "1f1b", clip=clip),
                               timeout=300)
    _check(results, lm_step, tiny_gpt, sgd_momentum, batches, 2, clip=clip)


@pytest.mark.slow
def test_bf16_tracks_fp32(rank_pool):
    """bf16 compute copies of the fp32 masters on each stage, the activations
    and their gradients sent in bf16: losses within 2e-2 relative of the
    fp32 reference per step (8 mantissa bits), as the precision tests hold bf16."""
    batches = _batches(1, steps=4)
    config = _config(2, 2, "1f1b", clip=1.0, bf16={"enabled": True})
    results = rank_pool(2).run(pp_run, lm_step, tiny_gpt, sgd_momentum, batches, config, timeout=300)
    outputs, _, _ = data_parallel_reference(lm_step, tiny_gpt, sgd_momentum, _micro(batches, 2), clip_norm=1.0)
    reference = [torch.stack([o for o in out]).mean().item() for out in outputs]
    for got in results:
        worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], reference))
        assert worst < 2e-2, worst
    assert results[0]["losses"] == results[1]["losses"]
    assert set(results[0]["sent_dtypes"]) == {"torch.bfloat16"}  # the residual stream and its gradient


@pytest.mark.slow
def test_fp16_overflow_skips_the_step_on_every_stage(rank_pool):
    """The overflow flag comes from the squared norm summed over the stages:
    when any stage's gradients overflow, every stage keeps its parameters and
    every rank halves its loss scale, so the stages never disagree."""
    config = _config(2, 2, "1f1b", fp16={"enabled": True, "initial_scale_power": 40, "hysteresis": 1})
    results = rank_pool(2).run(fp16_overflow_run, config, timeout=300)
    for got in results:
        assert got["scales"][:2] == [2.0 ** 39, 2.0 ** 38], got["scales"]
        assert got["changed"][0] == [] and got["changed"][1] == []  # skipped on both stages
    assert results[0]["scales"] == results[1]["scales"]
    assert results[0]["skipped"] == results[1]["skipped"] >= 2


def test_a_stage_that_fails_stops_every_rank_within_seconds_and_changes_nothing(rank_pool):
    """Rank 1's backward raises while rank 0 waits for its gradient: rank 1
    aborts stepfx's groups, rank 0's receive fails at once (not at the
    600-s timeout), both raise, and neither rank's model changed."""
    results = rank_pool(2).run(failing_run, _config(2, 2, "1f1b"), 1, timeout=120)
    assert "injected failure in the backward" in results[1]["error"]
    assert results[0]["error"] is not None and "failed on rank 0" in results[0]["error"]
    for got in results:
        assert got["seconds"] < 30, got
        assert got["unchanged"]


@pytest.mark.slow
def test_activation_checkpointing_inside_each_stage(rank_pool):
    """DeepSpeed's pipeline.activation_checkpoint_interval > 0: the backward
    of each stage recomputes forward values instead of keeping them (the
    recomputed copies land in the stage that reads them), and the step is
    the same."""
    batches = _batches(1)
    config = _config(2, 2, "1f1b")
    config["pipeline"]["activation_checkpoint_interval"] = 1
    results = rank_pool(2).run(pp_run, lm_step, tiny_gpt, sgd_momentum, batches, config, timeout=300)
    _check(results, lm_step, tiny_gpt, sgd_momentum, batches, 2)
    assert "level 'all'" in results[0]["explain"] and "ops recomputed" in results[0]["explain"]


def test_codegen_inside_each_stage(rank_pool):
    """stepfx's kernels under a pipeline: the fusions that stay within a stage (layer norms with
    the residual add, the chunked linear + cross-entropy on the last stage, the sums of squares of
    the clipping norm) run inside the stage programs; those that batch parameters of every stage
    into one launch stay off. The step equals the reference (clipping at 0.05 bites)."""
    batches = _batches(1)
    config = _config(2, 2, "1f1b", clip=0.05)
    config["stepfx"]["codegen"] = True
    results = rank_pool(2).run(pp_run, lm_step, tiny_gpt, sgd_momentum, batches, config, timeout=300)
    _check(results, lm_step, tiny_gpt, sgd_momentum, batches, 2, clip=0.05)
    assert "layer_norm" in results[0]["explain"] and "linear_cross_entropy" in results[1]["explain"]


@pytest.mark.slow
@pytest.mark.parametrize("tp,zero3", [(1, False), (2, False), (1, True)])
def test_a_checkpoint_holds_each_stage_s_parameters_from_their_stage(rank_pool, tmp_path, tp, zero3):
    """Every rank binds the whole model but updates only its stages': each
    tensor is written by a rank whose stage owns it (with TP 2, each its
    Megatron shards of them; with ZeRO-3 over 2 data-parallel ranks, the
    rank that keeps it), and one process without a pipeline loads the run
    exactly (bitwise)."""
    config = _config(2, 2, "1f1b", **({"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {}),
                     **({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}} if zero3 else {}))
    results = rank_pool(4 if zero3 else 2 * tp).run(train_and_save, config, str(tmp_path), timeout=300)
    torch.manual_seed(1)
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = stepfx.parallelize({"gradient_clipping": 0})(lm_step)
    step.load_checkpoint(str(tmp_path), tag="t", model=model, optimizer=opt)
    params = dict(model.named_parameters())
    seen = set()
    for got in results:
        for name, value in got["params"].items():
            assert torch.equal(params[name].detach(), value), name
            assert torch.equal(opt.state[params[name]]["momentum_buffer"], got["momentum"][name]), name
            seen.add(name)
    assert seen == set(params)


@pytest.mark.slow
def test_each_rank_keeps_only_its_stages_parameters_and_state(rank_pool):
    """After the first step a rank empties the parameters and optimizer
    state its programs never read (kept as descriptions, as ZeRO-3 does), so
    it holds its stages' part of the model; the later steps are not captured
    again; model_state_dict() and optimizer_state() gather the whole back
    from the owning stages, the same on every rank."""
    results = rank_pool(2).run(memory_run, _config(2, 2, "1f1b"), timeout=300)
    for got in results:
        assert got["captures"] == 1
        assert got["kept"] < 0.75 * got["whole"], (got["kept"], got["whole"])  # the tied embedding stays on both
        assert got["state_kept"] < 0.75 * 2 * got["whole"]
    assert results[0]["kept"] + results[1]["kept"] < 1.3 * results[0]["whole"]
    for got in results:  # every rank gathers the same whole model
        for name, value in got["gathered"].items():
            assert torch.equal(value, results[0]["gathered"][name]), name
        assert set(got["optimizer"]) == set(results[0]["optimizer"])
        for name, state in got["optimizer"].items():
            for key, value in state.items():
                assert torch.equal(value, results[0]["optimizer"][name][key]), (name, key)
    torch.manual_seed(0)
    assert results[0]["gathered"].keys() == tiny_gpt().state_dict().keys()
    assert all(v.numel() > 0 for v in results[0]["gathered"].values())


@pytest.mark.slow
def test_zero3_ranks_keep_a_share_of_their_stage_and_gather_the_whole_back(rank_pool):
    """PP 2 x DP 2 at ZeRO-3 with AdamW: after the first step each rank
    keeps about a quarter of the model's parameters (a stage's share; the
    tied embedding whole where read), not captured again; model_state_dict()
    and optimizer_state() gather the same whole model on every rank."""
    config = _config(2, 2, "1f1b", zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    results = rank_pool(4).run(memory_run, config, timeout=300)
    for got in results:
        assert got["captures"] == 1
        assert got["kept"] < 0.4 * got["whole"], (got["kept"], got["whole"])
        for name, value in got["gathered"].items():
            assert torch.equal(value, results[0]["gathered"][name]), name
        for name, state in got["optimizer"].items():
            for key, value in state.items():
                assert torch.equal(value, results[0]["optimizer"][name][key]), (name, key)
    # every parameter kept by exactly one rank, but the tied embedding (read by both stages): by all four
    tied = results[0]["gathered"]["tok.weight"].numel()
    assert sum(got["kept"] for got in results) == results[0]["whole"] + 3 * tied
    assert all(v.numel() > 0 for v in results[0]["gathered"].values())


@pytest.mark.slow
# DP 1 left out (suite time, 16 s): DP 2 has its capture path and more (replicas of other lengths)
@pytest.mark.parametrize("dp", [2])
def test_padded_variable_length_batches_with_deepspeed_defaults(rank_pool, dp):
    """Hugging Face Qwen2 on dict batches padded to each batch's longest
    sequence (attention masks, labels -100 on the padding), lengths changing
    every step and, at DP 2, differing between the data-parallel replicas,
    with a config that says nothing of shapes or clipping (DeepSpeed's
    default 1.0 clips): the sequence length becomes symbolic once seen to
    vary, as torch.compile's automatic dynamic (2 captures over 4 steps:
    the second when it varies; at DP 2 the replicas differ at the first
    call, so symbolic from the start: 1 capture, SGD's momentum existing
    before it), the
    stages each capture keeps are the first capture's, what one stage sends
    the next is sized by the micro-batch's length; equal to the reference
    micro-batch by micro-batch."""
    from tests.steps import padded_rank_batches, padded_step

    batches = padded_rank_batches(dp, 4, batch=4, lo=3, hi=12, seed=5)
    config = {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2, "stepfx": {"pipeline": {"schedule": "1f1b"}}}
    results = rank_pool(2 * dp).run(pp_run, padded_step, hf_qwen2, sgd_momentum, batches, config, timeout=300)
    assert len({tuple(b["input_ids"].shape) for (b,) in batches[0]}) > 2
    micro = [[({k: v.split(2)[m] for k, v in batch.items()},) for (batch,) in batches[d]] for d in range(dp)
             for m in range(2)]
    outputs, model, _ = data_parallel_reference(padded_step, hf_qwen2, sgd_momentum, micro, clip_norm=1.0)
    for rank, got in enumerate(results):
        d = rank % dp
        expected = [torch.stack(out[2 * d:2 * d + 2]).mean().item() for out in outputs]
        assert got["losses"] == pytest.approx(expected, rel=1e-6, abs=0)
        assert got["captures"] == (2 if dp == 1 else 1)
    reference = dict(model.named_parameters())
    for got in results:
        for name, value in got["state"].items():
            assert (value - reference[name]).abs().max() <= 1e-5 * reference[name].abs().max(), name


@pytest.mark.slow
def test_adamw_with_padded_batches_of_changing_lengths(rank_pool):
    """AdamW (its state exists from the first call) on padded batches whose
    length changes: after the first step a rank releases the other stage's
    moments but keeps its step counters; the capture the new length needs
    reads them (it raised KeyError 'step' in Adam before), keeps the first
    capture's stages and then serves every length: 2 captures over 5 steps;
    the first step's loss is the reference's (later ones are Adam's, which
    turns rounding noise in the key bias's gradient into full-size updates:
    see the module docstring)."""
    from tests.steps import padded_rank_batches, padded_step

    batches = padded_rank_batches(1, 5, batch=4, lo=3, hi=12, seed=5)
    config = {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2, "stepfx": {"pipeline": {"schedule": "1f1b"}}}
    results = rank_pool(2).run(pp_run, padded_step, hf_qwen2, adamw, batches, config, timeout=300)
    micro = [[({k: v.split(2)[m] for k, v in batch.items()},) for (batch,) in batches[0][:1]] for m in range(2)]
    outputs, _, _ = data_parallel_reference(padded_step, hf_qwen2, adamw, micro, clip_norm=1.0)
    for got in results:
        assert got["captures"] == 2
        assert got["losses"][0] == pytest.approx(torch.stack(outputs[0]).mean().item(), rel=1e-6, abs=0)
        assert all(math.isfinite(x) for x in got["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_over_each_stage_s_data_parallel_ranks(rank_pool, stage):
    """PP 2 x DP 2 at ZeRO stages 1 and 2, with clipping: each data-parallel
    rank of a stage updates and keeps the optimizer state of its share of
    the stage's parameters (whole parameters, largest first to the least
    loaded, as torch's ZeroRedundancyOptimizer) and broadcasts the new
    values; at stage 2 each summed gradient is reduced to that rank alone
    (the others free it) and the clip norm's parts are summed over the
    data-parallel ranks too. Equal to the reference; every momentum buffer
    kept by exactly one rank of its stage."""
    batches = _batches(2)
    config = _config(2, 2, "1f1b", clip=0.05, zero_optimization={"stage": stage})
    results = rank_pool(4).run(pp_run, lm_step, tiny_gpt, sgd_momentum, batches, config, timeout=400)
    _check(results, lm_step, tiny_gpt, sgd_momentum, batches, 2, clip=0.05)
    for stage_ranks in ((0, 1), (2, 3)):
        kept = [set(results[r]["optimizer"]) for r in stage_ranks]
        assert kept[0] and kept[1] and not kept[0] & kept[1]
        assert kept[0] | kept[1] == set(results[stage_ranks[0]]["state"])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_zero3_partitions_each_stage_s_parameters_and_fetches_them_per_program(rank_pool, schedule):
    """PP 2 x DP 2 at ZeRO-3 (which DeepSpeed refuses with a pipeline): each
    data-parallel rank of a stage keeps only its share of the stage's
    parameters between steps (the others are emptied), and every forward and
    backward program broadcasts each other parameter from its keeper before
    its first reader, a prefetch of stage3_prefetch_bucket_size elements
    ahead, inside the program (never the stage gathered at its start).
    Parameters under stage3_param_persistence_threshold stay whole on both
    ranks. Equal to the reference with clipping, under 1F1B and the
    zero-bubble schedule (whose backward is two programs)."""
    batches = _batches(2)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 64, "stage3_prefetch_bucket_size": 1000}
    config = _config(2, 2, schedule, clip=0.05, zero_optimization=zero)
    results = rank_pool(4).run(pp_run, lm_step, tiny_gpt, sgd_momentum, batches, config, timeout=400)
    _check(results, lm_step, tiny_gpt, sgd_momentum, batches, 2, clip=0.05)
    torch.manual_seed(0)
    sizes = {n: p.numel() for n, p in tiny_gpt().named_parameters()}
    for stage_ranks in ((0, 1), (2, 3)):
        kept = [results[r]["kept"] for r in stage_ranks]
        stage_params = set(results[stage_ranks[0]]["state"])
        small = {n for n in stage_params if sizes[n] < 64} | {"tok.weight"}  # (tied: read by both stages)
        assert kept[0] & kept[1] == small & stage_params
        assert kept[0] | kept[1] == stage_params
        shares = [sum(sizes[n] for n in k - small) for k in kept]  # balanced: within the largest one's size
        assert min(shares) > 0 and abs(shares[0] - shares[1]) <= max(sizes[n] for n in stage_params - small)
        for r in stage_ranks:
            assert results[r]["fetched"] == results[stage_ranks[0]]["fetched"]
            for program, order in results[r]["fetch_order"].items():
                in_flight, largest, ops_between = 0, 0, 0
                for event in order:
                    if event[0] == "start":
                        in_flight += event[1]
                        largest = max(largest, event[1])
                        assert in_flight <= max(1000, event[1]), (program, order)
                    elif event[0] == "wait":
                        in_flight -= event[1]
                starts = [i for i, e in enumerate(order) if e[0] == "start"]
                assert any(e[0] == "op" for e in order[starts[0]:starts[-1]]), (program, order)  # not all at once
    assert "ZeRO-3 over each stage's 2 data-parallel ranks" in results[0]["explain"]
    assert "cost against ZeRO-2" in results[0]["explain"]


@pytest.mark.slow
def test_pipeline_times_tensor_parallel(rank_pool):
    """PP 2 x TP 2 on 4 ranks: each stage's Megatron pairs split over its
    tensor-parallel group (the TP all-reduces run inside the stage programs),
    the residual stream sent between the stages' ranks of the same TP place;
    gradient clipping's norm summed over the stages and the TP shards (0.05:
    it bites, see test_gradient_clipping_takes_the_norm_over_every_stage).
    DeepSpeed's pipe_partitioned / grad_partitioned (on by default): what the
    TP group holds alike crosses as each rank's half, gathered at the
    receiving stage (half the bytes between stages); off: sent whole. Both
    equal the reference."""
    batches = _batches(1)
    sent = {}
    for partitioned in (True, False):
        config = _config(2, 2, "1f1b", clip=0.05, tensor_parallel={"autotp_size": 2},
                         pipeline={"stages": 2, "pipe_partitioned": partitioned, "grad_partitioned": partitioned})
        results = rank_pool(4).run(pp_run, lm_step, tiny_gpt, sgd_momentum, batches, config, timeout=400)
        _check(results, lm_step, tiny_gpt, sgd_momentum, batches, 2, clip=0.05, tp=2)  # norm over stages, TP shards
        assert [r["stages"] for r in results] == [[0], [0], [1], [1]]
        assert "tensor parallelism: degree 2" in results[0]["explain"]
        sent[partitioned] = [r["p2p_bytes"] for r in results]
    assert all(b > 0 for b in sent[False])
    assert [2 * b for b in sent[True]] == sent[False], sent


def test_the_monitor_logs_the_loss_the_step_returns(rank_pool, tmp_path):
    """DeepSpeed's csv_monitor under a pipeline: one update per call, its
    loss the mean over the micro-batches the step returned (not divided
    again by their number)."""
    import csv

    config = _config(2, 2, "1f1b", steps_per_print=1,
                     csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "pp"})
    losses = rank_pool(2).run(monitored_run, config, timeout=300)[0]
    with open(tmp_path / "pp" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))[1:]
    assert [float(v) for _, v in rows] == pytest.approx(losses, rel=1e-6)
