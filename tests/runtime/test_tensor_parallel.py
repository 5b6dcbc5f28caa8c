"""Tensor parallelism end to end on the rank pool (CPU, gloo): the step
split over a TP group (and TP x DP) equals the single-process reference.

Fp32 on CPU: the split matmuls sum over features in another order than the
whole ones, so equality is within 1e-5 relative, not bitwise. The optimizer
is SGD with momentum: Adam divides by the gradient's magnitude, and the
key bias's gradient is rounding noise (attention is invariant to it), which
Adam turns into a full-size update of arbitrary sign."""
from __future__ import annotations

import pytest
import torch

from stepfx.testing.equivalence import data_parallel_reference
from tests.steps import MLP, ce_step, hf_llama, hf_step, lm_step, mlp_batches, one_block_gpt, token_batches
from tests.tp_workers import tp_run

TP2 = {"gradient_clipping": 0, "tensor_parallel": {"autotp_size": 2}}


def sgd_momentum(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def sgd_plain(model):
    """No lazily made state: one capture serves every call."""
    return torch.optim.SGD(model.parameters(), lr=0.1)


def linear_only():
    return MLP((8, 4))


def _check(results, step_fn, make_model, make_optimizer, batches_per_dp, tp):
    outputs, model, opt = data_parallel_reference(step_fn, make_model, make_optimizer, batches_per_dp)
    state = model.state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    opt_state = {names[id(p)]: s for p, s in opt.state.items()}
    for rank, got in enumerate(results):
        expected = [out[rank // tp].item() for out in outputs]
        assert got["losses"] == pytest.approx(expected, rel=1e-5, abs=0), (rank, got["losses"], expected)
        for name, value in state.items():
            diff = (got["state"][name] - value).abs().max() / value.abs().max().clamp_min(1e-12)
            assert diff <= 1e-5, (rank, name, diff.item())
            assert torch.equal(got["synced"][name], got["state"][name]), name
        for name, keys in opt_state.items():
            for key, value in keys.items():
                if isinstance(value, torch.Tensor) and value.dim():
                    diff = (got["optimizer"][name][key] - value).abs().max() / value.abs().max().clamp_min(1e-12)
                    assert diff <= 1e-5, (rank, name, key, diff.item())


@pytest.mark.xdist_group("tensor_parallel")
def test_gpt_tp2_equals_the_reference_with_megatron_collectives(rank_pool):
    batches = [token_batches(2, seed=0)]
    results = rank_pool(2).run(tp_run, lm_step, one_block_gpt, sgd_plain, batches, TP2, timeout=300)
    _check(results, lm_step, one_block_gpt, sgd_plain, batches, tp=2)
    assert results[0]["captures"] == 1
    # Megatron without sequence parallelism: 2 all-reduces forward and 2 backward per block
    assert results[0]["counts"] == {"tp forward": 2, "tp backward": 2}
    assert results[0]["module_emptied"]  # the user's module is not silently stale: sync_model() fills it
    placements = "\n".join(results[0]["placements"])
    assert "blocks.0.qkv.weight: column (dim 0, 3 parts)" in placements
    assert "blocks.0.proj.weight: row (dim 1)" in placements
    assert "blocks.0.fc_out.weight: row (dim 1)" in placements
    assert "tok.weight: replicated" in placements
    assert "tensor parallelism: degree 2, this rank 0 of its group; 6 parameters split" in results[0]["explain"]
    assert "blocks.0.proj.weight: row (dim 1): reads the split features" in results[0]["explain"]


@pytest.mark.xdist_group("tensor_parallel")
def test_llama_tp2_equals_the_reference(rank_pool):
    """Grouped-query attention with one key/value head (multi-query): q and
    o split by heads, k and v replicated (their gradients partial sums,
    all-reduced), SwiGLU's gate/up -> down split."""
    batches = [token_batches(2, seed=1)]
    results = rank_pool(2).run(tp_run, hf_step, hf_llama, sgd_momentum, batches, TP2, timeout=300)
    _check(results, hf_step, hf_llama, sgd_momentum, batches, tp=2)  # momentum buffers split too
    placements = "\n".join(results[0]["placements"])
    assert "model.layers.0.self_attn.q_proj.weight: column (dim 0)" in placements
    assert "model.layers.0.self_attn.k_proj.weight: replicated" in placements
    assert "model.layers.0.mlp.down_proj.weight: row (dim 1)" in placements
    # per layer: 2 forward (o, down); backward: the input gradient of q and of gate/up, plus k's and v's
    # partial gradients (multi-query)
    assert results[0]["counts"] == {"tp forward": 4, "tp backward": 8}


@pytest.mark.xdist_group("tensor_parallel")
def test_nothing_to_split_runs_replicated_with_a_note(rank_pool):
    batches = [mlp_batches(2)]
    results = rank_pool(2).run(tp_run, ce_step, linear_only, sgd_plain, batches, TP2, timeout=300)
    _check(results, ce_step, linear_only, sgd_plain, batches, tp=2)
    assert results[0]["counts"] == {}
    assert "nothing to split" in results[0]["notes"][0]
    assert "nothing to split" in results[0]["explain"]


@pytest.mark.slow
@pytest.mark.xdist_group("tensor_parallel")
def test_gpt_tp2_dp2_equals_the_data_parallel_reference(rank_pool):
    """The 2D mesh on 4 ranks: TP groups {0, 1} and {2, 3}, data
    parallelism across them at ZeRO stage 0 (gradients of the shards
    averaged over the DP group only). Each TP group reads its DP rank's
    batches; the reference averages the two DP ranks' gradients."""
    batches = [token_batches(2, seed=0), token_batches(2, seed=1)]
    results = rank_pool(4).run(tp_run, lm_step, one_block_gpt, sgd_plain, batches, TP2, timeout=500)
    _check(results, lm_step, one_block_gpt, sgd_plain, batches, tp=2)
    assert all(r["counts"] == {"tp forward": 2, "tp backward": 2} for r in results)
    assert results[0]["losses"] != results[2]["losses"]  # the DP ranks saw different batches
