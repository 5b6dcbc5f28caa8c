"""resolve_batch_sizes against hand-computed cases and every error DeepSpeed raises
(runtime/config.py: _set_batch_related_parameters, _batch_assertion)."""
from __future__ import annotations

import pytest

from stepfx.config import AUTO, Config, ConfigError, resolve_batch_sizes


def config(train=None, micro=None, gas=None) -> Config:
    return Config(train_batch_size=train, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)


@pytest.mark.parametrize("given, world, expected", [
    ((32, 4, 2), 4, (32, 4, 2)),  # all three: only checked
    ((32, 4, None), 4, (32, 4, 2)),  # gas = 32 // 4 // 4
    ((32, None, 2), 4, (32, 4, 2)),  # micro = 32 // 4 // 2
    ((None, 4, 2), 4, (32, 4, 2)),  # train = 4 * 2 * 4
    ((32, None, None), 4, (32, 8, 1)),  # gas = 1, micro = 32 // 4
    ((None, 4, None), 4, (16, 4, 1)),  # train = 4 * 4, gas = 1
    ((1280, None, 80), 16, (1280, 1, 80)),  # gpt-neox deepspeed_zero2.json on 16 ranks
    ((65536, 64, None), 64, (65536, 64, 16)),  # bing_bert lamb config on 64 ranks
])
def test_derivations(given, world, expected):
    assert resolve_batch_sizes(config(*given), world) == expected


@pytest.mark.parametrize("given, world, key, text", [
    ((None, None, None), 1, "train_batch_size", "neither train_batch_size nor train_micro_batch_size_per_gpu"),
    ((None, None, 4), 2, "train_batch_size", "neither train_batch_size nor train_micro_batch_size_per_gpu"),
    ((4, 8, None), 1, "gradient_accumulation_steps", "Gradient accumulation steps: 0 has to be greater than 0"),
    ((2, None, 4), 1, "train_micro_batch_size_per_gpu", "Micro batch size per gpu: 0 has to be greater than 0"),
    ((4, None, None), 8, "train_micro_batch_size_per_gpu", "Micro batch size per gpu: 0 has to be greater than 0"),
    ((10, 3, None), 1, "train_batch_size", "10 != 3 * 3 * 1"),  # gas = 3 by floor division
    ((10, None, None), 4, "train_batch_size", "10 != 2 * 1 * 4"),
    ((32, 4, 2), 2, "train_batch_size", "32 != 4 * 2 * 2"),
    ((30, None, 4), 2, "train_batch_size", "30 != 3 * 4 * 2"),
])
def test_deepspeed_errors(given, world, key, text):
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(config(*given), world)
    assert info.value.path == key and text in str(info.value)


def test_auto_must_be_resolved_first():
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu: is still 'auto'; call resolve_auto"):
        resolve_batch_sizes(config(micro=AUTO), 1)


@pytest.mark.parametrize("world", [0, -1, 1.5, True])
def test_world_size_must_be_a_positive_int(world):
    with pytest.raises(ConfigError, match="dp_world_size"):
        resolve_batch_sizes(config(8), world)
