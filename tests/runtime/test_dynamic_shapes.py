"""Symbolic batch sizes (stepfx.dynamic): padded variable-length batches run
with at most two captures, equal to eager (one process) and to the
data-parallel reference when every rank brings its own lengths every step."""
from __future__ import annotations

import re

import pytest
import torch

import stepfx
from stepfx.testing.equivalence import assert_data_parallel_equivalent, assert_step_equivalent
from tests.rotation import rotating
from tests.steps import (
    hf_bloom,
    hf_gpt2,
    hf_llama,
    lm_step,
    padded_rank_batches,
    padded_step,
    padded_step_bf16_reference,
    parallelized_steps,
    sgd_momentum,
    tiny_gpt,
)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def captures(explain: str) -> int:
    return int(re.search(r"(\d+) captured variant\(s\)", explain).group(1))


def _run(step, model, opt, batches):
    return [step(model, opt, *b).detach().clone() for b in batches]


# -- one process -----------------------------------------------------------------


@pytest.mark.parametrize("make_model", rotating([hf_gpt2, hf_llama, hf_bloom], 2, salt="padded-eager",
                                                  ids=["gpt2", "llama", "bloom"]))
def test_padded_lengths_are_bitwise_eager_with_two_captures(monkeypatch, make_model):
    batches = padded_rank_batches(1, 8, seed=3)[0]
    assert len({b[0]["input_ids"].shape[1] for b in batches}) > 3
    made = parallelized_steps(monkeypatch)  # the compared run's plans are the ones counted
    if make_model is not hf_llama:
        report = assert_step_equivalent(padded_step, make_model, adamw, batches, exact=True)
        assert report.bitwise
    else:
        # Llama with a padding mask is not bitwise under capture at any
        # fixed length either (HF builds its SDPA mask another way when it
        # sees a trace): compared per step at the project's fp32 bound
        report = assert_step_equivalent(padded_step, make_model, adamw, batches, rtol=1e-5, atol=1e-7, resync=True)
        assert report.steps == 8
    (step,) = made
    assert len(step.plans) <= 2, [p.created_at_call for p in step.plans]
    assert any(p.guard is not None for p in step.plans)


def test_dynamic_true_captures_once_and_false_once_per_shape():
    batches = padded_rank_batches(1, 3, seed=1)[0]  # three lengths (a capture each with dynamic false)
    shapes = {tuple(b[0]["input_ids"].shape) for b in batches}
    assert len(shapes) == 3
    counts = {}
    for mode in (True, False):
        step = stepfx.parallelize({"stepfx": {"dynamic": mode}})(padded_step)
        torch.manual_seed(0)
        model = hf_gpt2()
        opt = adamw(model)
        _run(step, model, opt, batches)
        counts[mode] = len(step.plans)
    # dynamic true: symbolic from the first call (Adam's state is created before it)
    assert counts[True] == 1
    assert counts[False] >= len(shapes)


def test_batch_size_and_length_vary_together():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (b, t), generator=g),) for b, t in [(2, 9), (3, 12), (4, 7), (2, 15), (5, 10), (3, 3)]]
    report = assert_step_equivalent(lm_step, tiny_gpt, adamw, batches, exact=True)
    assert report.bitwise


def test_a_size_the_graph_specializes_on_is_a_guard_and_recaptures():
    # lm_step slices idx[:, :-1]: a length of 2 leaves 1 token, a size torch
    # specializes (0/1): the symbolic variant's guard refuses it and the
    # call gets a variant of its own, computing the right thing
    step = stepfx.parallelize({"stepfx": {"dynamic": True}})(lm_step)
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in (9, 12):
        step(model, opt, torch.randint(0, 64, (2, t)))
    symbolic = [p for p in step.plans if p.guard is not None]
    assert len(symbolic) == 1
    text = step.explain()
    assert "guards (a call that breaks one is captured again" in text
    assert "tests/steps.py" in text and "lm_step" in text  # the user's line that made the guard
    assert re.search(r"peak during the step .* = .*s\d+", text)  # memory as an expression in the sizes
    before = len(step.plans)
    torch.manual_seed(0)
    ref = tiny_gpt()
    ref.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (2, 2))
    got = step(model, opt, idx)
    assert len(step.plans) == before + 1 and step.plan.guard is None
    expected = torch.nn.functional.cross_entropy(ref(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    assert torch.equal(got, expected.detach())


def test_explain_evaluates_symbolic_sizes_at_the_last_call():
    step = stepfx.parallelize({"stepfx": {"dynamic": True}})(lm_step)
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    peaks = []
    for t in (5, 16, 5):
        step(model, opt, torch.randint(0, 64, (2, t)))
        text = step.explain()
        assert re.search(rf"evaluated below at: s\d+ = 2, s\d+ = {t}\n", text), text[:2000]
        peaks.append(re.search(r"peak during the step +([\d.]+ \w+)", text).group(1))
    assert peaks[0] == peaks[2] != peaks[1]


# -- data parallel: every rank its own lengths, every step ------------------------

CASES = [
    # (model, stage, precision, world, clip): without clipping 2 ranks are
    # bitwise with AdamW; the clipped global norm sums the ranks' pieces in
    # another order than clip_grad_norm_ on the averaged gradients, and
    # Llama's padding mask differs from eager in the last bit under capture
    # at any fixed length too: those run SGD with momentum (Adam turns last
    # bits into 1e-5 over 20 steps at lr 1e-2) at 1e-6 relative. (bf16 with
    # clipping is not here: the clip factor's last bit moves bf16 roundings,
    # 3e-5 after 20 steps; tests/runtime/test_data_parallel.py clips bf16.)
    # Two ranks throughout (suite time): the lengths are the batches', the
    # sharding the parameters'; ZeRO over four ranks (uneven pieces) is
    # tests/runtime/test_data_parallel.py's test_stages_four_ranks_*. Stage 1 (its update on pieces, the
    # gradients whole) is stage 2's update with stage 0's gradients: both here (suite time).
    ("gpt2", 0, "fp32", 2, 0.0),
    ("gpt2", 2, "bf16", 2, 0.0),
    ("gpt2", 3, "fp32", 2, 1.0),
    ("gpt2", 3, "bf16", 2, 0.0),
    ("llama", 3, "fp32", 2, 1.0),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,stage,precision,world,clip", CASES,
                         ids=[f"{m}-z{s}-{p}-{w}ranks-clip{c:g}" for m, s, p, w, c in CASES])
def test_ranks_with_their_own_lengths_equal_the_reference(rank_pool, name, stage, precision, world, clip):
    make_model = {"gpt2": hf_gpt2, "llama": hf_llama}[name]
    batches = padded_rank_batches(world, 20, seed=stage + world)
    # ranks differ at the very first call too
    assert batches[0][0][0]["input_ids"].shape != batches[1][0][0]["input_ids"].shape
    config = {"gradient_clipping": clip, "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                                              "stage3_param_persistence_threshold": 0}}
    kwargs = {}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
        kwargs["reference_fn"] = padded_step_bf16_reference
    exact = world == 2 and not clip and name == "gpt2"
    report = assert_data_parallel_equivalent(
        rank_pool(world), padded_step, make_model, adamw if exact else sgd_momentum, batches, config=config,
        clip_norm=clip, exact=exact, rtol=1e-6, atol=1e-7, **kwargs)
    assert report.steps == 20
    for text in report.explains:
        assert captures(text) <= 2, text[:300]


def mismatched_models_with_own_lengths() -> dict:
    """Ranks with different models (and different batch shapes): still refused."""
    import torch.distributed as dist

    from stepfx.testing.models import GPT, gpt_config
    from tests.dp_workers import _outcome

    rank = dist.get_rank()
    model = GPT(gpt_config("tiny", n_layers=2 + rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = stepfx.parallelize({"gradient_clipping": 0, "zero_optimization": {"stage": 1}})(lm_step)
    return _outcome(lambda: step(model, opt, torch.randint(0, 64, (2, 9 + rank))))


def test_different_models_still_refused_on_every_rank(rank_pool):
    results = rank_pool(2).run(mismatched_models_with_own_lengths)
    assert [r["error"] for r in results] == ["RankMismatchError", "RankMismatchError"]
    assert "rank 1 has" in results[0]["message"]


# -- data-dependent sizes (MoE routing) ---------------------------------------------


def _moe_batches(world, steps):
    g = torch.Generator().manual_seed(5)
    return [[(torch.randn(12, 16, generator=g), torch.randint(0, 5, (12,), generator=g)) for _ in range(steps)]
            for _ in range(world)]


def test_top2_router_trains_bitwise_and_explains_its_data_dependent_sizes(monkeypatch):
    from tests.steps import Top2MoE, ce_step

    batches = _moe_batches(1, 4)[0]
    made = parallelized_steps(monkeypatch)  # the compared run explains itself
    report = assert_step_equivalent(ce_step, Top2MoE, adamw, batches, exact=True)
    assert report.bitwise
    (step,) = made
    text = step.explain()
    # each expert's row count is an unbacked size, counted at its bound (12 rows x top-2)
    # and named with the op and the user's line that made it
    assert re.search(r"symbolic sizes \(data-dependent.*\n"
                     r"(  u\d+: data-dependent, a size of aten.nonzero.default's output at .*torch.where\(.*\n)+"
                     r"  evaluated below at: u\d+ = 24", text), text[:3000]
    assert "peak during the step" in text


@pytest.mark.slow
def test_top2_router_at_zero_3_equals_the_reference(rank_pool):
    from tests.steps import Top2MoE, ce_step

    config = {"gradient_clipping": 0, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    report = assert_data_parallel_equivalent(rank_pool(2), ce_step, Top2MoE, adamw, _moe_batches(2, 3), config=config,
                                             exact=True)
    assert report.bitwise and all("data-dependent" in text for text in report.explains)

