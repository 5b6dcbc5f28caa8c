"""Hugging Face decoders the other tests do not build, under DeepSpeed
configs as projects publish them (../shared/ds_configs), on two ranks with
padded batches whose lengths differ per rank and per step.

- ``09_llamafactory_ds_z3_e11_act_ckpt.json``: bf16, ZeRO-3, DeepSpeed's
  activation-checkpointing block (partition_activations,
  contiguous_memory_optimization), "auto" clipping (1.0), with the model's
  own gradient checkpointing on: bitwise the mixed-precision reference.
- ``14_alpaca_default_offload_opt_param.json`` in fp32 (its "auto" bf16
  off; the optimizer the step's own): ZeRO-3 with optimizer and parameters
  offloaded to the host, clipped: within 1e-5 of the fp32 reference (the
  global norm summed in another order). AdamW with eps 1e-3: the key
  projections' biases have a gradient that is rounding noise (attention is
  invariant to them), which the default eps would scale to +-lr.

The architectures: ALiBi through ``baddbmm`` (Bloom), parallel attention
and MLP (Falcon, GPT-J, Phi), partial rotary (Phi, GPT-NeoX), logit
soft-capping and alternating sliding windows (Gemma 2), OPT's learned
offset positions, StarCoder2's biased GQA.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stepfx.testing.equivalence import assert_data_parallel_equivalent
from tests.rotation import rotating
from tests.steps import padded_rank_batches, padded_step, padded_step_bf16_reference

CONFIGS = Path(__file__).resolve().parents[1] / "config" / "ds_configs"  # the 40 published configs (SOURCES.md)
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _checkpointed(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def bloom():
    from transformers import BloomConfig, BloomForCausalLM
    return _checkpointed(BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=16, n_layer=2, n_head=2,
                                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)))


def falcon():
    from transformers import FalconConfig, FalconForCausalLM
    return _checkpointed(FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                                        num_attention_heads=2, bos_token_id=0, eos_token_id=0,
                                                        pad_token_id=0)))


def gptj():
    from transformers import GPTJConfig, GPTJForCausalLM
    return _checkpointed(GPTJForCausalLM(GPTJConfig(vocab_size=64, n_embd=16, n_layer=2, n_head=2, rotary_dim=4,
                                                    n_positions=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)))


def phi():
    from transformers import PhiConfig, PhiForCausalLM
    return _checkpointed(PhiForCausalLM(PhiConfig(**TINY)))


def neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return _checkpointed(GPTNeoXForCausalLM(GPTNeoXConfig(**TINY)))


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return _checkpointed(Gemma2ForCausalLM(Gemma2Config(num_key_value_heads=1, head_dim=8, **TINY)))


def opt():
    from transformers import OPTConfig, OPTForCausalLM
    return _checkpointed(OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=2,
                                                  num_attention_heads=2, max_position_embeddings=32,
                                                  word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0,
                                                  pad_token_id=0, bos_token_id=0, eos_token_id=0)))


def starcoder2():
    from transformers import Starcoder2Config, Starcoder2ForCausalLM
    return _checkpointed(Starcoder2ForCausalLM(Starcoder2Config(num_key_value_heads=1, **TINY)))


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.1)


MODELS = [bloom, falcon, gptj, phi, neox, gemma2, opt, starcoder2]


@pytest.mark.slow
@pytest.mark.parametrize("make_model", rotating(MODELS, 3, salt="bf16-zero3-act-ckpt", ids=[m.__name__ for m in MODELS]))
def test_bf16_zero3_activation_checkpointing_config_is_the_mixed_precision_reference(rank_pool, make_model):
    config = json.loads((CONFIGS / "09_llamafactory_ds_z3_e11_act_ckpt.json").read_text())
    report = assert_data_parallel_equivalent(rank_pool(2), padded_step, make_model, adamw,
                                             padded_rank_batches(2, 4, seed=3, hi=20), config=config, clip_norm=1.0,
                                             reference_fn=padded_step_bf16_reference, exact=True)
    assert report.bitwise and report.steps == 4


@pytest.mark.slow
# the offload path on one layout a run, drawn from all of them (tests/rotation.py: the suite's time)
@pytest.mark.parametrize("make_model", rotating(MODELS, 1, salt="fp32-offload", ids=[m.__name__ for m in MODELS]))
def test_fp32_offloaded_optimizer_and_parameters_config_is_the_reference(rank_pool, make_model):
    config = json.loads((CONFIGS / "14_alpaca_default_offload_opt_param.json").read_text())
    config["bf16"] = {"enabled": False}
    del config["optimizer"], config["scheduler"]  # the step's own AdamW
    report = assert_data_parallel_equivalent(rank_pool(2), padded_step, make_model, adamw,
                                             padded_rank_batches(2, 4, seed=3, hi=20), config=config, clip_norm=1.0,
                                             rtol=1e-5, atol=1e-7)
    assert report.steps == 4
    assert "run on the host" in report.explains[0]
