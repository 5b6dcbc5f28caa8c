"""ZeRO stages 0-3 on real ranks (gloo, through the persistent rank pool)
against the single-process reference whose gradient is the mean of the
ranks' gradients.

Tolerances, and why:
- 2 ranks: bitwise. The all-reduce adds two values (commutative, exact
  order), /2 is exact, and the sharded update is the same elementwise math.
- 4 ranks: the all-reduce sums in ring order, the reference in rank order,
  so the averaged gradient can differ in its last bit. SGD passes that on
  unchanged: 1e-6 relative (normwise; measured 2.7e-7). Adam divides by
  sqrt(v): on elements whose gradient is ~0 a last-bit difference becomes
  an O(lr) difference in the update, so losses are checked to 1e-6 and
  state to 5e-3 normwise after 5 steps at lr 1e-2 (measured 1.5e-3).
"""
from __future__ import annotations

import functools

import pytest
import torch

from stepfx.testing.equivalence import assert_data_parallel_equivalent
from tests import dp_workers as W
from tests.steps import CONFIG_ADAMW, ce_step, CONFIG_WARMUP, adam, config_adamw, config_warmup, adamw, dp_batches, hf_gpt2, hf_llama, hf_step, lm_step, sgd, tiny_gpt


def _cfg(stage, bucket=500, persist=0, reuse=0, **extra):
    # reuse=0: re-gather every bucket for backward (the most collectives)
    return {"gradient_clipping": 0, "zero_optimization": {
        "stage": stage, "reduce_bucket_size": bucket, "stage3_param_persistence_threshold": persist,
        "stage3_max_reuse_distance": reuse, **extra,
    }}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("opt", [sgd, adamw], ids=["sgd", "adamw"])
def test_stages_two_ranks_bitwise(rank_pool, stage, opt):
    report = assert_data_parallel_equivalent(rank_pool(2), lm_step, tiny_gpt, opt, dp_batches(2), config=_cfg(stage), exact=True)
    assert report.bitwise and report.steps == 3


# Four ranks cost four processes on CI's two cores: one run per collective
# pattern. SGD at stage 3 (pieces reduce-scattered over four ranks, as at
# stage 2, and parameters gathered), AdamW at stage 1 (whole buckets
# all-reduced, as at stage 0, and Adam's state sharded four ways).
@pytest.mark.parametrize("stage", [3])
def test_stages_four_ranks_sgd(rank_pool, stage):
    report = assert_data_parallel_equivalent(rank_pool(4), lm_step, tiny_gpt, sgd, dp_batches(4, steps=4), config=_cfg(stage), rtol=1e-6, atol=0)
    assert max(report.state_rel) <= 1e-6


@pytest.mark.parametrize("stage", [1])
def test_stages_four_ranks_adamw(rank_pool, stage):
    report = assert_data_parallel_equivalent(
        rank_pool(4), lm_step, tiny_gpt, adamw, dp_batches(4, steps=5), config=_cfg(stage), rtol=5e-3, atol=0
    )
    assert max(report.output_rel) <= 1e-6


@pytest.mark.parametrize("make_model", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
def test_hugging_face_models_at_stage_3(rank_pool, make_model):
    report = assert_data_parallel_equivalent(
        rank_pool(2), hf_step, make_model, adamw, dp_batches(2), config=_cfg(3, bucket=2000), exact=True
    )
    assert report.bitwise


def test_frozen_params_and_param_groups_at_stage_3(rank_pool):
    report = assert_data_parallel_equivalent(
        rank_pool(2), lm_step, W.gpt_with_frozen_embedding, W.two_groups, dp_batches(2), config=_cfg(3), exact=True
    )
    assert report.bitwise
    assert "(frozen: gathered only)" in report.explains[0]  # the frozen embedding is sharded too


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_frozen_params_are_sharded_at_stage_3(rank_pool, bf16):
    """As DeepSpeed's ZeRO-3: a parameter without gradient is held in
    pieces (each rank its half, the module's copy released), gathered for
    the step, never updated; sync_model() writes back the value it had."""
    held = rank_pool(2).run(W.frozen_held, bf16)
    full = held[0]["full"]
    assert sum(h["held"] for h in held) == full and all(0 < h["held"] < full for h in held)
    assert all(h["module_numel"] == 0 and h["unchanged"] and not h["in_optimizer"] for h in held)
    assert held[0]["frozen_buckets"] and held[0]["frozen_buckets"] == held[1]["frozen_buckets"]


def test_freezing_and_unfreezing_between_steps_reshards(rank_pool):
    """Which parameters train changes the buckets (stages 1-2: only trained
    ones are bucketed; stage 3: frozen ones go to frozen buckets): the
    pieces held under the old layout are gathered back and re-cut, and the
    run equals the eager data-parallel reference bitwise (what stage 0
    computes: test_stages_two_ranks_bitwise), optimizer state included."""
    for rank_result in rank_pool(2).run(W.freeze_schedule, (1, 3)):
        for stage, r in rank_result.items():
            assert r["losses"] == 0 and r["params"] == 0 and r["state"] == 0 and r["same_state_keys"], (stage, r)


def test_persistent_params_stay_whole(rank_pool):
    # with the default threshold (1e5 elements) nothing of the tiny GPT is sharded at stage 3
    report = assert_data_parallel_equivalent(
        rank_pool(2), lm_step, tiny_gpt, adam, dp_batches(2), config=_cfg(3, persist=100_000), exact=True
    )
    assert "sharding none" in report.explains[0] and "sharding parameters" not in report.explains[0]


def test_explain_shows_collectives_memory_and_communication(rank_pool):
    report = assert_data_parallel_equivalent(rank_pool(2), lm_step, tiny_gpt, adamw, dp_batches(2, steps=2), config=_cfg(3), exact=True)
    text = report.explains[1]
    assert "world size: 2    rank: 1" in text
    assert "ZeRO stage 3 over 2 ranks" in text
    assert "_c10d_functional.all_gather_into_tensor" in text and "_c10d_functional.reduce_scatter_tensor" in text
    assert "param at rest" in text and "optimizer_state at rest" in text and "peak during the step" in text
    assert "all_gather" in text and "reduce_scatter" in text and "sent (ring)" in text


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_rank_state_matches_the_zero_formula(rank_pool, stage):
    held = rank_pool(2).run(W.held_bytes, stage)
    full = held[0]["full"]
    for rank, h in enumerate(held):
        # optimizer state: exactly the rank's pieces — 1/N of it up to
        # padding and alignment gaps ("slack", per state tensor)
        assert abs(h["state_elements"] - full["state_elements"] / 2) <= 2 * h["slack"]
        if stage == 3:
            assert abs(h["param_elements"] - full["param_elements"] / 2) <= h["slack"]
            assert h["module_param_elements"] == 0  # the module's copies are released
        else:
            assert h["param_elements"] == full["param_elements"]  # whole, in the user's module
    assert sum(h["state_elements"] for h in held) == full["state_elements"]


def test_ranks_may_bring_different_batch_shapes(rank_pool):
    # every collective is the same on both ranks: the pre-flight lets them run
    # (tests/runtime/test_dynamic_shapes.py checks what they compute)
    results = rank_pool(2).run(W.mismatched_batches)
    assert [r["error"] for r in results] == [None, None], results


def test_preflight_catches_different_models(rank_pool):
    results = rank_pool(2).run(W.mismatched_models)
    assert all(r["error"] == "RankMismatchError" for r in results)
    assert "rank 1 has" in results[0]["message"]


def test_a_rank_failing_to_compile_stops_every_rank(rank_pool):
    results = rank_pool(2).run(W.one_rank_fails_capture)
    assert results[1]["error"] == "CaptureError"
    assert results[0]["error"] == "RankMismatchError" and "rank 1: CaptureError" in results[0]["message"]


def test_a_rank_failing_mid_step_stops_every_rank_quickly(rank_pool):
    results = rank_pool(2).run(W.one_rank_fails_mid_step, timeout=60)
    assert [r["error"] for r in results] == ["ExecutionError", "ExecutionError"]
    assert "rank 1" in results[1]["message"]
    assert all(r["seconds"] < 20 for r in results), results
    # the failing step changed nothing
    assert all(r["params_unchanged"] for r in results)
    # another decorated step of the process shared the aborted group: it says so instead of hanging
    assert all("aborted stepfx's data-parallel group" in r["other_step_after"] for r in results), results


def test_reduce_scatter_false_averages_whole_buckets(rank_pool):
    report = assert_data_parallel_equivalent(
        rank_pool(2), lm_step, tiny_gpt, adamw, dp_batches(2), config=_cfg(2, reduce_scatter=False), exact=True
    )
    assert report.bitwise
    assert "all_reduce" in report.explains[0] and "reduce_scatter " not in report.explains[0]


def test_stage_3_keeping_forward_gathers_for_backward(rank_pool):
    report = assert_data_parallel_equivalent(rank_pool(2), lm_step, tiny_gpt, adamw, dp_batches(2), config=_cfg(3, reuse=10**9), exact=True)
    assert report.bitwise and "0 buckets again before backward" in report.explains[0]


# -- with mixed precision, clipping and accumulation ----------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_stages_equal_the_mixed_precision_reference(rank_pool, stage):
    from tests.steps import lm_step_bf16_reference

    report = assert_data_parallel_equivalent(
        rank_pool(2), lm_step, tiny_gpt, adamw, dp_batches(2), config={**_cfg(stage), "bf16": {"enabled": True}},
        reference_fn=lm_step_bf16_reference, exact=True,
    )
    assert report.bitwise


@pytest.mark.parametrize("make_model", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
def test_hugging_face_models_in_bf16_at_stage_3(rank_pool, make_model):
    from tests.steps import hf_step_bf16_reference

    report = assert_data_parallel_equivalent(
        rank_pool(2), hf_step, make_model, adamw, dp_batches(2), config={**_cfg(3, bucket=2000), "bf16": {"enabled": True}},
        reference_fn=hf_step_bf16_reference, exact=True,
    )
    assert report.bitwise


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clipping_is_global_across_shards(rank_pool, stage):
    # the norm of the averaged gradient, summed over every rank's pieces once
    report = assert_data_parallel_equivalent(
        rank_pool(2), lm_step, tiny_gpt, sgd, dp_batches(2), config={**_cfg(stage), "gradient_clipping": 0.05},
        clip_norm=0.05, rtol=1e-6, atol=1e-7,
    )
    assert max(report.state_rel) <= 1e-6


# stages 1-2 with plain SGD left out (suite time): with momentum they accumulate the same way and hold state too
@pytest.mark.parametrize("stage,optimizer", [(0, "sgd"), (3, "sgd"), (1, "sgd_momentum"), (2, "sgd_momentum")])
def test_accumulation_under_zero_equals_the_k_times_batch(rank_pool, stage, optimizer):
    # SGD with momentum makes its buffer from the accumulated gradient on the first update (a clone
    # that ZeRO's update rewrite must recognise as the parameter's: it raised a PassError before)
    results = rank_pool(2).run(W.accumulate, stage, 2, optimizer)
    assert results[0]["max_rel"] <= 2e-6 and results[1]["max_rel"] <= 2e-6, results


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_overflow_skips_on_every_rank(rank_pool, stage):
    results = rank_pool(2).run(W.fp16_overflow_on_one_rank, stage)
    # rank 1's batch overflows: both ranks skip, halve the scale, keep their state
    assert all(r["skipped"] == 1 and r["scale_halved"] and r["unchanged"] for r in results), results


@pytest.mark.parametrize("stage", [1, 3])
def test_config_optimizer_and_scheduler_under_zero(rank_pool, stage):
    # the step builds AdamW and WarmupLR from the config's blocks (the user passes None)
    config = {**_cfg(stage), "optimizer": CONFIG_ADAMW, "scheduler": CONFIG_WARMUP}
    report = assert_data_parallel_equivalent(
        rank_pool(2), lm_step, tiny_gpt, config_adamw, dp_batches(2, steps=4), config=config,
        make_scheduler=config_warmup, config_builds=True, exact=True,
    )
    assert report.bitwise and report.steps == 4


# -- bf16 / fp16 against fp32 over 20 steps -------------------------------------
# Tolerance: each step's loss within 2e-2 relative of the fp32 data-parallel
# reference (bf16 keeps 8 mantissa bits; alone, bf16 measured <= 7.1e-3).


@functools.cache
def _fp32_reference_20_steps():
    """The fp32 single-process losses every 16-bit run below is compared
    with: the same for all of them, made once (callers only read it)."""
    from stepfx.testing.equivalence import data_parallel_reference

    return data_parallel_reference(lm_step, tiny_gpt, adamw, dp_batches(2, steps=20))[0]


# (suite time: stage 3 bf16 without a communication dtype and stage 1 fp16 left out;
# stage 3 bf16/bf16 and stages 2-3 fp16 cover those passes)
@pytest.mark.parametrize("stage, precision, comm", [
    (1, "bf16", None), (2, "bf16", "bf16"), (3, "bf16", "bf16"),
    (2, "fp16", "fp16"), (3, "fp16", None),
])
def test_16_bit_tracks_fp32_over_20_steps(rank_pool, stage, precision, comm):
    results = rank_pool(2).run(W.precision_run, stage, precision, comm, 20)
    reference = _fp32_reference_20_steps()
    for rank, result in enumerate(results):
        assert result["skipped"] == 0
        worst = max(abs(a - b[rank].item()) / abs(b[rank].item()) for a, b in zip(result["losses"], reference))
        assert worst < 2e-2, (rank, worst)
    moved = results[0]["moved"]
    # gradients travel in communication_data_type, fp32 by default
    reduce = "reduce_scatter_tensor" if stage >= 2 else "all_reduce"
    assert moved[reduce] == [{"bf16": "bfloat16", "fp16": "float16", None: "float32"}[comm]]
    if stage == 3:  # parameters are gathered as 16-bit copies, each before its first use
        assert moved["all_gather_into_tensor"] == [{"bf16": "bfloat16", "fp16": "float16"}[precision]]
        assert results[0]["interleaved"]


# -- codegen (Triton's interpreter on CPU) ------------------------------------------
# Tolerance: 1e-5 relative, normwise, over 3 steps (the fused kernels round
# like torch's CUDA kernels, not its CPU ones: a few ulps).


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_codegen_under_zero(rank_pool, stage):
    from tests.steps import ce_step, small_mlp

    config = {**_cfg(stage, bucket=200), "gradient_clipping": 1.0, "stepfx": {"codegen": True}}
    report = assert_data_parallel_equivalent(
        rank_pool(2), ce_step, small_mlp, adamw, dp_batches(2, kind="mlp"), config=config, clip_norm=1.0,
        rtol=1e-5, atol=1e-7,
    )
    explain = report.explains[0]
    assert "adam_step" in explain and "sum_squares" in explain
    in_place = "updates write in place" in explain
    assert in_place == (stage in (0, 3))  # stages 1-2 all-gather after the update: new tensors instead


def test_parameter_copies_are_not_carried_across_ranks(rank_pool):
    """carry_parameter_copies stays off with several ranks (c10d's
    collectives, a parameter broadcast between steps, write without bumping
    version counters): the pass says why, the steps are those with it off."""
    on = rank_pool(2).run(W.carried_copies_run, True)
    off = rank_pool(2).run(W.carried_copies_run, False)
    for c, p in zip(on, off):
        assert c["losses"] == p["losses"] and not c["carried"]
        assert "not carried: several ranks" in c["summary"]


@pytest.mark.parametrize("stage", [1, 3])
def test_first_parameter_wholly_on_the_other_rank(rank_pool, stage):
    """One bucket for the whole MLP: its first (small) parameter lies wholly
    in rank 0's half, so rank 1 holds no step counter for it. The step count
    the ranks share is read from a counter each rank holds (hypothesis found
    rank 1 reading rank 0's: a capture error)."""
    batches = W.mlp_rank_batches(2, 3, 3, 4, 5)
    config = {"gradient_clipping": 0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 10_000,
                                                           "stage3_param_persistence_threshold": 0}}
    report = assert_data_parallel_equivalent(rank_pool(2), ce_step, W.MLPFactory((3, 13, 11, 4)), W.OptimizerFactory("adam"),
                                             batches, config=config, exact=True, seed=5)
    assert report.bitwise and report.steps == 3


_RUNS: dict = {}


def _run_once(pool, fn, *args) -> list:
    """``pool.run(fn, *args)``, once per session: for deterministic runs
    (seeded inside) that several tests read; callers only read the results."""
    key = (pool.world_size, fn.__name__, args)
    if key not in _RUNS:
        _RUNS[key] = pool.run(fn, *args)
    return _RUNS[key]


@pytest.mark.xdist_group("bucket_packing_runs")  # one test process: it shares _run_once's runs
def test_sharded_updates_run_as_one_launch(rank_pool):
    """ZeRO-3 with parameters that lie wholly on the other rank: their step
    counters (which this rank never holds) do not keep the rank's updates
    from sharing one step count, so the in-place updates are one
    multi-tensor call (on the H200 they were 252 launches per step)."""
    for r in _run_once(rank_pool(2), W.bucket_packing_run, 3, True):
        assert r["adam_step_many"] == 1 and r["adam_step"] == 0, r


# stage 1 packs as stage 0 does (gradient buckets all-reduced whole) and as
# stage 2 does (fp32 parameter buckets gathered): 0, 2 and 3 cover its buckets
@pytest.mark.xdist_group("bucket_packing_runs")
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_buckets_packed_by_the_cast_kernel_are_the_same_bits(rank_pool, stage):
    """fuse_bucket_packing: bf16 gradients (and at stage 3 the 16-bit
    parameter shards) cast and packed into their buckets by one cast_pack
    call each give bitwise the losses and parameters of the aten casts and
    concatenation they replace, the gradient buckets also scaled by 1/2 in
    the pack instead of divided by 2 after the sum."""
    packed = _run_once(rank_pool(2), W.bucket_packing_run, stage, True)
    plain = rank_pool(2).run(W.bucket_packing_run, stage, False)
    for a, b in zip(packed, plain):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
        # every bucket with a conversion in it is packed; buckets of fp32 parameters (gathered at stages 1-2,
        # and at stage 3 those the step uses in fp32: norms, biases) have none and stay concatenations
        assert a["packs"] > 0 and a["packs"] + a["cats"] == b["cats"] and b["packs"] == 0
        assert (a["cats"] == 0) == (stage == 0), a["cats"]
        # gradient buckets (all-reduced at 0-1, reduce-scattered at 2-3) are scaled by 1/2 in the pack, not divided after
        assert a["scaled"] > 0 and a["divisions"] == b["divisions"] - a["scaled"]


# codegen (Triton's interpreter here, ~3x the step's time) at stage 3, whose
# graphs hold the most (sharded multi-tensor updates, packed buckets, gathers);
# stage 0's codegen steps are replayed as real CUDA graphs in tests/gpu/test_cuda.py
# (test_cuda_graph_replay_equals_the_eager_step, ..._under_zero_with_nccl[0-True])
# stages 0 and 2, and stage 3 without codegen, left out (suite time): the whole all-reduce runs at stage 1,
# the reduce-scatter and gathers at stage 3 with codegen
@pytest.mark.parametrize("stage,codegen", [(1, False), (3, True)])
def test_steps_replayed_as_graphs_are_the_same_bits(rank_pool, stage, codegen):
    """CUDA-graph replay (emulated on the CPU: runtime/graphs.py) of ZeRO
    steps on 2 ranks, collectives inside the captured segments: losses and
    parameters bitwise those of the eager run, with a learning rate that
    changes every step (a host value the graphs must not freeze)."""
    graphed = rank_pool(2).run(W.graphs_run, stage, True, codegen)
    eager = rank_pool(2).run(W.graphs_run, stage, False, codegen)
    for a, b in zip(graphed, eager):
        assert a["note"].startswith("CUDA graphs (captured)"), a["note"]
        assert b["note"].startswith("off")
        assert a["losses"] == b["losses"]
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_fresh_adam_captures_once_on_every_rank(rank_pool, stage):
    """Adam's state is described before the first capture (each rank reads
    zeros for its pieces), and under stage 3 the parameters as the rank
    will hold them: the first call's program is every call's."""
    batches = W.mlp_rank_batches(2, 4, 3, 4, 5)
    config = {"gradient_clipping": 0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 100,
                                                           "stage3_param_persistence_threshold": 20}}
    report = assert_data_parallel_equivalent(rank_pool(2), ce_step, W.MLPFactory((3, 13, 11, 4)), W.OptimizerFactory("adam"),
                                             batches, config=config, exact=True, seed=5)
    assert report.bitwise and report.steps == 4
    for text in report.explains:
        assert "stepfx plan for ce_step: 1 captured variant(s)" in text, text[:200]


def test_the_memory_planner_chooses_the_zero_stage_when_it_is_auto(rank_pool):
    # a budget that stage 3 meets and stage 2 does not, on either rank: "auto" becomes 3, the step is
    # captured again with stage 3's state layout, and it is the eager step's bits
    peaks = rank_pool(2).run(W.predicted_peaks_by_stage)
    assert all(p[2] > p[3] for p in peaks), peaks
    budget = max(p[3] for p in peaks)
    config = {"gradient_clipping": 0, "stepfx": {"memory_budget_gib": budget / 2**30}, "zero_optimization": {
        "stage": "auto", "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}}
    report = assert_data_parallel_equivalent(rank_pool(2), lm_step, tiny_gpt, adamw, dp_batches(2), config=config,
                                             exact=True)
    assert report.bitwise
    for text in report.explains:
        assert "ZeRO stage 3, recompute 'none' (predicted peak" in text, text
        assert "ZeRO stage 3 taken (the highest any rank chose: [3, 3])" in text, text
        assert "ZeRO stage 2, recompute 'none': predicted peak" in text and "(over the budget)" in text
