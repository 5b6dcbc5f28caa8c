"""Offload and recomputation on Hugging Face models with padded batches whose
lengths differ per rank and per step (as a DataCollatorWithPadding run brings
them): the features of issue 18 together with issue 17's symbolic lengths,
on two ranks at ZeRO-3, against the single-process reference on the global
batch.

Tolerances: without clipping the host's "exact" Adam is the device's
arithmetic, so the runs are bitwise; clipped runs sum the global norm in
another order than ``clip_grad_norm_`` on the averaged gradients, which
AdamW carries to ~1e-6 relative: the standard 1e-5. (Llama in bf16 is not
here: under capture its library builds the padding mask on its tracing path,
which differs from eager's in the last bit; explain() names it. GPT-2 with
AdamW and clipping neither: its key bias's gradient is rounding noise that
AdamW scales to +-lr, so the summation order sets its sign.)
"""
from __future__ import annotations

import pytest

from stepfx.testing.equivalence import assert_data_parallel_equivalent
from tests.steps import adamw, hf_gpt2, hf_llama, padded_rank_batches, padded_step, padded_step_bf16_reference


def hf_llama_checkpointed():
    model = hf_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def hf_gpt2_checkpointed():
    model = hf_gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


CASES = [
    # (id, model, offload keys of zero_optimization, other config, clipping)
    ("llama-ckpt-offload-opt-and-param", hf_llama_checkpointed,
     {"offload_optimizer": {"device": "cpu", "pin_memory": True}, "offload_param": {"device": "cpu"}}, {}, 1.0),
    ("llama-nvme-recompute-all", hf_llama, {"offload_optimizer": {"device": "nvme", "nvme_path": "NVME"}},
     {"stepfx": {"activation_memory_budget": 0}}, 1.0),
    ("gpt2-ckpt-cpu-checkpointing", hf_gpt2_checkpointed, {"offload_optimizer": {"device": "cpu"}},
     {"activation_checkpointing": {"cpu_checkpointing": True}}, 0.0),
    ("gpt2-half-offloaded-update-across-steps", hf_gpt2, {"offload_optimizer": {"device": "cpu", "ratio": 0.5}},
     {"stepfx": {"host_update_across_steps": True}}, 0.0),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,make_model,offload,extra,clip", CASES, ids=[c[0] for c in CASES])
def test_offloaded_hf_models_with_their_own_lengths_per_rank_equal_the_reference(rank_pool, tmp_path, name, make_model,
                                                                                 offload, extra, clip):
    offload = {k: ({**v, "nvme_path": str(tmp_path)} if v.get("nvme_path") == "NVME" else v) for k, v in offload.items()}
    config = {"gradient_clipping": clip, **extra,
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0,
                                    **offload}}
    config.setdefault("stepfx", {})["host_adam"] = "exact"
    batches = padded_rank_batches(2, 6, seed=5)
    assert batches[0][0][0]["input_ids"].shape != batches[1][0][0]["input_ids"].shape
    report = assert_data_parallel_equivalent(rank_pool(2), padded_step, make_model, adamw, batches, config=config,
                                             clip_norm=clip, exact=not clip, rtol=1e-5, atol=1e-7)
    assert report.steps == 6
    assert report.bitwise or clip
    assert "run on the host" in report.explains[0]


@pytest.mark.slow
def test_bf16_checkpointed_gpt2_updating_across_steps_with_its_own_lengths_per_rank_is_the_reference(rank_pool):
    config = {"gradient_clipping": 0.0, "bf16": {"enabled": True}, "stepfx": {"host_adam": "exact",
                                                                             "host_update_across_steps": True},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0,
                                    "offload_optimizer": {"device": "cpu"}}}
    report = assert_data_parallel_equivalent(rank_pool(2), padded_step, hf_gpt2_checkpointed, adamw,
                                             padded_rank_batches(2, 6, seed=7), config=config,
                                             reference_fn=padded_step_bf16_reference, exact=True)
    assert report.bitwise and report.steps == 6
