"""The 40 published DeepSpeed configs (tests/config/ds_configs, provenance in SOURCES.md)."""
from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import pytest

from stepfx.config import AUTO, ConfigError, ConfigWarning, load_config

HERE = Path(__file__).parent / "ds_configs"
FILES = sorted(HERE.glob("*.json"))
REJECTED = {"18", "35"}  # DeepSpeed itself rejects these two


def file(number: str) -> Path:
    (path, ) = HERE.glob(f"{number}_*.json")
    return path


def load_warned(source, pattern: str):
    """Load, assert a ConfigWarning matching ``pattern`` was raised, and swallow the rest."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        config = load_config(source)
    messages = [str(w.message) for w in record if issubclass(w.category, ConfigWarning)]
    assert any(re.search(pattern, m) for m in messages), messages
    return config


def load_quietly(source):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(source)


def test_all_forty_files_are_here():
    assert len(FILES) == 40
    assert (HERE / "SOURCES.md").exists()


@pytest.mark.parametrize("path", [p for p in FILES if p.name[:2] not in REJECTED], ids=lambda p: p.name[:2])
def test_accepted_file_loads(path):
    config = load_quietly(path)
    assert config.source == str(path)
    assert dict(config.raw).keys() == json.loads(path.read_text()).keys()
    assert set(config.ignored_keys) <= set(config.raw)
    again = load_quietly(config.raw)  # the read-only raw view reads back to the same config
    assert dataclasses.replace(again, source=config.source) == config


def test_file_18_misspelt_zero_key_names_path_value_and_suggestion():
    with pytest.raises(ConfigError) as info:
        load_config(file("18"))
    message = str(info.value)
    assert message.startswith("zero_optimization.stage3_param_persitence_threshold:")
    assert "100000.0" in message
    assert "Did you mean 'stage3_param_persistence_threshold'?" in message
    assert info.value.suggestion == "stage3_param_persistence_threshold"


def test_file_35_invalid_communication_data_type():
    with pytest.raises(ConfigError) as info:
        load_config(file("35"))
    message = str(info.value)
    assert message.startswith("communication_data_type:")
    assert "'bfp16'" in message
    assert "'fp32', 'fp16', 'bf16'" in message
    assert isinstance(info.value, ValueError)


def test_file_11_unprefixed_aliases_land_in_canonical_fields():
    zero = load_quietly(file("11")).zero_optimization
    assert (zero.max_live_parameters, zero.max_reuse_distance) == (0, 0)
    assert zero.gather_16bit_weights_on_model_save is True
    assert zero.reduce_bucket_size is AUTO and zero.prefetch_bucket_size is AUTO
    assert zero.param_persistence_threshold is AUTO
    assert zero.offload_param.device == "cpu" and zero.offload_param.buffer_count == 5  # offload_param default
    assert zero.offload_optimizer.buffer_count == 4  # offload_optimizer default


def test_file_02_stage3_prefixed_spellings_and_deprecated_fp16_save():
    with pytest.warns(ConfigWarning, match="stage3_gather_fp16_weights_on_model_save: deprecated"):
        zero = load_config(file("02")).zero_optimization
    assert zero.max_live_parameters == 1_000_000_000 and isinstance(zero.max_live_parameters, int)
    assert zero.sub_group_size == 10**14
    assert zero.gather_16bit_weights_on_model_save is True
    assert zero.overlap_comm is True


def test_file_37_legacy_cpu_offload_becomes_offload_optimizer_cpu():
    config = load_warned(file("37"), "cpu_offload: deprecated; use 'offload_optimizer'")
    zero = config.zero_optimization
    assert zero.stage == 2
    assert zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu"
    assert zero.offload_param is None
    assert "zero_optimization.offload_optimizer.device" not in config.not_applied  # passes/memory/offload_optimizer
    assert config.optimizer.type == "OneBitAdam" and config.optimizer.name == "onebitadam"
    assert config.optimizer.params["cuda-aware"] is True  # constructor kwargs are kept as given
    assert config.ignored_keys == ("logging", )


def test_file_16_float_steps_per_print_is_an_int():
    config = load_quietly(file("16"))
    assert config.steps_per_print == 100_000 and type(config.steps_per_print) is int
    assert config.zero_optimization.sub_group_size == 1_000_000_000


def test_file_03_bfloat16_alias_is_bf16():
    config = load_quietly(file("03"))
    assert config.bf16.enabled is AUTO
    assert config.fp16.enabled is False
    # canonical path, and applied: nothing under either name is left over
    assert not any(k.startswith(("bf16", "bfloat16")) for k in config.not_applied)


def test_file_35_bfloat16_alias_once_the_bad_dtype_is_fixed():
    raw = json.loads(file("35").read_text())
    raw["communication_data_type"] = "bf16"
    with pytest.warns(ConfigWarning, match=r"bfloat16\.loss_scale: unknown key, ignored"):
        config = load_config(raw)
    assert config.bf16.enabled is True and config.communication_data_type == "bf16"
    assert not any(p.startswith("fp16.") for p in config.not_applied)  # fp16 is disabled there


def test_file_40_extra_fp16_key_is_warned_and_ignored():
    config = load_warned(file("40"), r"fp16\.fp16: unknown key, ignored")
    assert config.fp16.enabled is True and config.fp16.initial_scale_power == 12
    assert config.zero_optimization.reduce_bucket_size == 1_260_000_000
    assert "hidden_size" in config.ignored_keys and "tensorboard-dir" in config.ignored_keys


def test_file_07_unknown_top_level_blocks_are_ignored_and_listed():
    with pytest.warns(ConfigWarning, match="comms_config, monitor_config: not DeepSpeed config keys"):
        config = load_config(file("07"))
    assert config.ignored_keys == ("comms_config", "monitor_config")
    assert config.fp16.enabled is False and config.bf16.enabled is AUTO
    assert not any(p.startswith("fp16") for p in config.not_applied)


def test_file_19_auto_where_hf_does_not_fill_takes_deepspeed_default():
    with pytest.warns(ConfigWarning) as record:
        config = load_config(file("19"))
    messages = " ".join(str(w.message) for w in record)
    assert "stage3_max_live_parameters: 'auto' is not filled in" in messages
    assert "offload_param.buffer_size: 'auto'" in messages
    zero = config.zero_optimization
    assert zero.max_live_parameters == 1_000_000_000 and zero.offload_param.buffer_size == 100_000_000
    assert zero.prefetch_bucket_size is AUTO and zero.offload_param.device == "nvme"


def test_file_10_old_compile_keys_warn():
    config = load_warned(file("10"), r"compile\.disable: unknown key, ignored")
    assert "compile.backend" in config.not_applied
    assert config.fp16.auto_cast is False and config.fp16.initial_scale_power == 32


def test_file_27_and_30_current_schema_keys():
    config = load_quietly(file("27"))
    assert config.bf16.bf16_master_weights_and_grads and config.bf16.bf16_optimizer_states
    assert config.zero_optimization.reduce_bucket_size == 50_000_000
    zenflow = load_quietly(file("30")).zero_optimization.zenflow
    assert zenflow["topk_ratio"] == 0.1 and zenflow["update_interval"] == 4 and zenflow["select_strategy"] == "auto"


def test_file_38_old_flops_profiler_schema_warns_but_loads():
    config = load_warned(file("38"), r"flops_profiler\.start_step: unknown key")
    assert config.optimizer.params["max_grad_norm"] == 1.0
    assert "flops_profiler.start_step" in config.not_applied


def test_disabled_blocks_add_nothing_to_not_applied():
    config = load_quietly(file("34"))  # wandb enabled false, comms_logger and flops_profiler enabled
    assert not any(p.startswith("wandb") for p in config.not_applied)
    assert "comms_logger.enabled" in config.not_applied and "flops_profiler.profile_step" in config.not_applied
    config = load_quietly(file("25"))  # fp16 enabled false; data_efficiency is opaque
    assert not any(p.startswith("fp16") for p in config.not_applied)
    assert "data_efficiency" in config.not_applied


def test_warning_points_at_the_caller():
    with pytest.warns(ConfigWarning) as record:
        load_config(file("08"))
    assert record[0].filename == __file__
    assert any("_comment" in str(w.message) for w in record)
