"""Hugging Face mixture-of-experts models (Mixtral, Qwen2-MoE; tiny configs,
no download) with their default experts, which multiply through
``torch._grouped_mm``. Torch's fake kernel for it demanded bf16 (the CUDA
kernel's rule) where the CPU kernel takes fp32; compat registers one that
follows the CPU kernel.

Tolerances: fp32 and bf16 single process bitwise (bf16 against the eager
mixed-precision step: the same ops in the same order); ZeRO-3 on two ranks
bitwise against the data-parallel reference (as tests/runtime/test_data_parallel.py).
"""
from __future__ import annotations

import pytest
import torch

from stepfx.testing.equivalence import assert_data_parallel_equivalent, assert_step_equivalent, mixed_precision_reference
from tests.steps import adamw, dp_batches, hf_step, parallelized_steps, token_batches

BF16 = {"bf16": {"enabled": True}, "gradient_clipping": 0}


def tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        bos_token_id=0, eos_token_id=0,
    ))


def tiny_qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
    ))


def hf_step_bf16_reference(model, optimizer, input_ids):
    return mixed_precision_reference(hf_step, torch.bfloat16)(model, optimizer, input_ids)


MODELS = pytest.mark.parametrize("make", [tiny_mixtral, tiny_qwen2_moe], ids=["mixtral", "qwen2_moe"])


@MODELS
def test_moe_uses_grouped_mm_and_is_bitwise_in_fp32(monkeypatch, make):
    made = parallelized_steps(monkeypatch)
    report = assert_step_equivalent(hf_step, make, adamw, token_batches(3), exact=True)
    assert report.bitwise
    # the experts of the run compared really went through grouped_mm (not a fallback loop)
    (step,) = made
    assert any(n.target is torch.ops.aten._grouped_mm.default for n in step.graphs["capture"].gm.graph.nodes)


@MODELS
def test_moe_in_bf16_equals_the_eager_mixed_precision_step(make):
    report = assert_step_equivalent(
        hf_step, make, adamw, token_batches(3), config=BF16, reference_fn=hf_step_bf16_reference, exact=True
    )
    assert report.bitwise


@pytest.mark.slow
@MODELS
def test_moe_at_zero_stage_3_on_two_ranks(rank_pool, make):
    config = {"gradient_clipping": 0, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    report = assert_data_parallel_equivalent(rank_pool(2), hf_step, make, adamw, dp_batches(2), config=config, exact=True)
    assert report.bitwise and report.steps == 3
