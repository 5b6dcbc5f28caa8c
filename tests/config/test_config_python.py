"""Configs built in Python: the same checks and messages as the JSON path; frozen, hashable data."""
from __future__ import annotations

import dataclasses

import pytest

import stepfx.config as cfg
from stepfx.config import (AUTO, BF16Config, Config, ConfigError, FP16Config, OffloadConfig, OptimizerConfig,
                           SchedulerConfig, StepfxOptions, ZeroConfig, load_config)
from stepfx.config.applied import APPLIED, is_applied


def message(fn) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    return str(info.value)


def test_public_names():
    for name in ("Config", "StepfxOptions", "ZeroConfig", "OffloadConfig", "FP16Config", "BF16Config",
                 "OptimizerConfig", "SchedulerConfig", "load_config", "ConfigError", "ConfigWarning", "AUTO",
                 "resolve_batch_sizes", "resolve_auto"):
        assert hasattr(cfg, name), name
    assert issubclass(cfg.ConfigError, ValueError)


def test_python_config_equals_the_loaded_one():
    built = Config(zero_optimization=ZeroConfig(stage=3, sub_group_size=10**6), bf16=BF16Config(enabled=True))
    loaded = load_config({"zero_optimization": {"stage": 3, "sub_group_size": 10**6}, "bf16": {"enabled": True}})
    assert built.zero_optimization == loaded.zero_optimization and built.bf16 == loaded.bf16
    assert built.zero_optimization.overlap_comm is True
    assert built.source == "<python>" and built.not_applied == loaded.not_applied
    assert built.not_applied == ("zero_optimization.sub_group_size",)  # the stage and bf16 are applied


@pytest.mark.parametrize("build, raw", [
    (lambda: ZeroConfig(reduce_bucket_size=5.5), {"zero_optimization": {"reduce_bucket_size": 5.5}}),
    (lambda: ZeroConfig(stage=7), {"zero_optimization": {"stage": 7}}),
    (lambda: FP16Config(loss_scale=-1), {"fp16": {"loss_scale": -1}}),
    (lambda: FP16Config(enabled=True, min_loss_scale=0), {"fp16": {"enabled": True, "min_loss_scale": 0}}),
    (lambda: BF16Config(enabled="yes please"), {"bf16": {"enabled": "yes please"}}),
    (lambda: Config(communication_data_type="bfp16"), {"communication_data_type": "bfp16"}),
    (lambda: Config(train_micro_batch_size_per_gpu=0), {"train_micro_batch_size_per_gpu": 0}),
    (lambda: Config(fp16=FP16Config(enabled=True), bf16=BF16Config(enabled=True)),
     {"fp16": {"enabled": True}, "bf16": {"enabled": True}}),
    (lambda: OptimizerConfig(type="Adamm"), {"optimizer": {"type": "Adamm"}}),
    (lambda: SchedulerConfig(type="WarmupLR", params={"warmup_num_steps": -3}),
     {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -3}}}),
    (lambda: StepfxOptions(cache_size=0), {"stepfx": {"cache_size": 0}}),
    (lambda: ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="cpu", ratio=0.5)),
     {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}),
    (lambda: Config(steps_per_print="auto"), {"steps_per_print": "auto"}),
    (lambda: StepfxOptions(verify="auto"), {"stepfx": {"verify": "auto"}}),
])
def test_same_messages_as_the_json_path(build, raw):
    assert message(build) == message(lambda: load_config(raw))


def test_auto_where_deepspeed_drops_it_is_the_default_in_python_too():
    with pytest.warns(cfg.ConfigWarning, match="zero_optimization.sub_group_size: 'auto' is not filled in"):
        zero = ZeroConfig(sub_group_size="auto")
    assert zero.sub_group_size == 1_000_000_000
    with pytest.warns(cfg.ConfigWarning, match="zero_optimization.sub_group_size: 'auto' is not filled in"):
        assert load_config({"zero_optimization": {"sub_group_size": "auto"}}).zero_optimization == zero


def test_offload_config_checked_against_its_block():
    text = message(lambda: ZeroConfig(offload_param=OffloadConfig(device="cpu", ratio=0.5)))
    assert text.startswith("zero_optimization.offload_param.ratio:")
    assert "device" in message(lambda: OffloadConfig(device="gpu"))
    zero = ZeroConfig(stage=3, offload_param=OffloadConfig(device="nvme", nvme_path="/nvme"))
    assert zero.offload_param.buffer_count == 5 and zero.offload_param.nvme_path == "/nvme"
    assert ZeroConfig(offload_optimizer=OffloadConfig(device="cpu")).offload_optimizer.buffer_count == 4


def test_nested_blocks_must_be_the_typed_classes():
    assert "a ZeroConfig" in message(lambda: Config(zero_optimization={"stage": 3}))
    assert "OffloadConfig" in message(lambda: ZeroConfig(offload_param={"device": "cpu"}))


def test_python_values_are_coerced_like_json():
    zero = ZeroConfig(reduce_bucket_size=5e8, contiguous_gradients="false", zenflow={"topk_ratio": 0.2})
    assert zero.reduce_bucket_size == 500_000_000 and zero.contiguous_gradients is False
    assert zero.zenflow["topk_ratio"] == 0.2 and zero.zenflow["select_strategy"] == "auto"
    assert StepfxOptions(disable=["fuse_adam"]).disable == ("fuse_adam", )
    assert Config(gradient_clipping=AUTO).gradient_clipping is AUTO
    assert Config(gradient_clipping="auto").gradient_clipping is AUTO


def test_defaults_are_deepspeeds():
    c = Config()
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (None,) * 3
    assert c.gradient_clipping == 1.0  # DeepSpeed v0.19.5 (#8068); 0 turns clipping off
    assert c.steps_per_print is None and c.zero_force_ds_cpu_optimizer is True
    z = c.zero_optimization
    assert (z.stage, z.reduce_bucket_size, z.allgather_bucket_size, z.prefetch_bucket_size) == (0, 5e8, 5e8, 5e7)
    assert (z.param_persistence_threshold, z.max_live_parameters, z.sub_group_size) == (100_000, 10**9, 10**9)
    assert z.overlap_comm is False and z.offload_param is None
    assert (c.fp16.initial_scale_power, c.fp16.loss_scale_window, c.fp16.hysteresis) == (16, 1000, 2)
    assert c.bf16.check_grad_overflow is True
    assert c.stepfx == StepfxOptions(codegen=None, disable=(), dump_dir=None, cache_size=8, verify=True)


def test_frozen_and_hashable():
    c = load_config({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.99]}}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.train_batch_size = 4
    assert hash(c) == hash(load_config({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.99]}}}))
    assert c != load_config({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.98]}}})


def test_applied_paths():
    assert "stepfx.*" in APPLIED
    assert is_applied("stepfx.cache_size") and is_applied("zero_optimization.stage")
    assert not is_applied("zero_optimization.allgather_bucket_size")
    assert is_applied("zero_optimization.offload_param.device", frozenset({"zero_optimization.offload_param.*"}))
    config = load_config({"stepfx": {"verify": False}, "zero_optimization": {"stage": 1, "allgather_bucket_size": 10}})
    assert config.stepfx.verify is False
    assert config.not_applied == ("zero_optimization.allgather_bucket_size", )
