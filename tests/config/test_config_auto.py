"""resolve_auto against hand-computed HF transformers / accelerate fills."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from stepfx.config import AUTO, ConfigError, ConfigWarning, load_config, resolve_auto, resolve_batch_sizes

HERE = Path(__file__).parent / "ds_configs"
TRAINING_ARGS = dict(learning_rate=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, warmup_steps=100,
                     total_num_steps=1000)


def load(number: str):
    (path, ) = HERE.glob(f"{number}_*.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(path)


def test_hf_zero3_file_fully_resolved():
    config = resolve_auto(load("02"), hidden_size=768, world_size=4, micro_batch_size=8,
                          gradient_accumulation_steps=2, mixed_precision="fp16", **TRAINING_ARGS)
    zero = config.zero_optimization
    assert zero.reduce_bucket_size == 768 * 768 == 589_824
    assert zero.prefetch_bucket_size == 530_841  # int(0.9 * 768 * 768)
    assert zero.param_persistence_threshold == 7_680
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) \
        == (64, 8, 2)
    assert resolve_batch_sizes(config, 4) == (64, 8, 2)
    assert config.gradient_clipping == 1.0  # max_grad_norm default, as in HF and accelerate
    assert config.fp16.enabled is True
    assert dict(config.optimizer.params) == {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    assert dict(config.scheduler.params) == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100}
    assert config.raw == load("02").raw  # raw stays what the user wrote


def test_below_stage_3_only_reduce_bucket_size_uses_hidden_size():
    config = resolve_auto(load_config({"zero_optimization": {
        "stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"}}), hidden_size=1024)
    zero = config.zero_optimization
    assert zero.reduce_bucket_size == 1024 * 1024
    assert (zero.prefetch_bucket_size, zero.param_persistence_threshold) == (50_000_000, 100_000)  # DeepSpeed's


def test_bf16_and_explicit_values_win():
    config = resolve_auto(load("12"), hidden_size=4096, micro_batch_size=2, mixed_precision="bf16",
                          learning_rate=1e-5, weight_decay=0.0)
    assert config.bf16.enabled is True and config.fp16.enabled is False
    assert config.optimizer.params["betas"] == (0.9, 0.999) and config.optimizer.params["eps"] == 1e-8
    assert config.optimizer.params["lr"] == 1e-5
    assert config.zero_optimization.max_live_parameters == 0  # explicit, untouched
    assert config.train_batch_size == 2 and config.gradient_accumulation_steps is None
    assert resolve_batch_sizes(config, 1) == (2, 2, 1)


def test_train_batch_from_explicit_micro_and_gas():
    config = resolve_auto(load("04"), world_size=8, micro_batch_size=4, hidden_size=512, mixed_precision="fp16",
                          **TRAINING_ARGS)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps) == (32, 4, 1)
    assert config.scheduler.params["total_num_steps"] == 1000


def test_accelerate_keys():
    config = load_config({"zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"},
                                                "stage3_gather_16bit_weights_on_model_save": "auto"},
                          "train_batch_size": 8})
    resolved = resolve_auto(config, zero_stage=3, offload_optimizer_device="cpu")
    zero = resolved.zero_optimization
    assert zero.stage == 3 and zero.overlap_comm is True
    assert zero.offload_optimizer.device == "cpu" and zero.gather_16bit_weights_on_model_save is False
    assert resolve_auto(config, zero_stage=1).zero_optimization.offload_optimizer.device == "none"


def test_unresolvable_values_are_all_named():
    with pytest.raises(ConfigError) as info:
        resolve_auto(load("02"))
    text = str(info.value)
    for key, arg in (("train_micro_batch_size_per_gpu", "micro_batch_size"), ("train_batch_size", "micro_batch_size"),
                     ("zero_optimization.reduce_bucket_size", "hidden_size"),
                     ("optimizer.params.lr", "learning_rate"), ("optimizer.params.betas", "betas"),
                     ("scheduler.params.warmup_num_steps", "warmup_steps")):
        assert f"{key} (pass {arg}=...)" in text
    assert info.value.path == "zero_optimization.reduce_bucket_size"


def test_stage_needs_an_argument():
    with pytest.raises(ConfigError, match=r"zero_optimization.stage \(pass zero_stage=...\)"):
        resolve_auto(load_config({"zero_optimization": {"stage": "auto"}}))


def test_mixed_precision_value_is_checked():
    with pytest.raises(ConfigError, match="mixed_precision"):
        resolve_auto(load("05"), mixed_precision="fp8")


def test_nothing_auto_is_returned_equal():
    config = load("23")
    assert resolve_auto(config) == config
    assert AUTO not in (config.train_batch_size, config.gradient_clipping)
