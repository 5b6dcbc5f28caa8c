"""Key rules (strict / tightened / lenient / unknown top-level), "auto", coercion, aliases and file reading."""
from __future__ import annotations

import warnings

import pytest

from stepfx.config import AUTO, ConfigError, ConfigWarning, load_config


def load_quietly(source):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(source)


def error_of(source) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_quietly(source)
    return info.value


# --- unknown keys --------------------------------------------------------------------------------


def test_unknown_top_level_key_is_warned_listed_and_suggested():
    with pytest.warns(ConfigWarning, match="zero_optimisation: .*Did you mean 'zero_optimization'"):
        config = load_config({"zero_optimisation": {"stage": 3}, "train_batch_size": 8})
    assert config.ignored_keys == ("zero_optimisation", )
    assert config.zero_optimization.stage == 0  # ignored, as DeepSpeed ignores it
    assert "zero_optimisation" not in config.not_applied


@pytest.mark.parametrize("raw, path, suggestion", [
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "zero_optimization.overlap_com", "overlap_comm"),
    ({"zero_optimization": {"offload_param": {"device": "cpu", "pin_memroy": True}}},
     "zero_optimization.offload_param.pin_memroy", "pin_memory"),
    ({"zero_optimization": {"offload_param": {"ratio": 0.5}}}, "zero_optimization.offload_param.ratio", None),
    ({"zero_optimization": {"zenflow": {"topk_ration": 0.2}}}, "zero_optimization.zenflow.topk_ration",
     "topk_ratio"),
    ({"tensorboard": {"enabled": True, "job_nam": "x"}}, "tensorboard.job_nam", "job_name"),
    ({"timers": {"throughput": {"enable": True}}}, "timers.throughput.enable", "enabled"),
    ({"stepfx": {"cache_sise": 4}}, "stepfx.cache_sise", "cache_size"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 10}}, "fp16.loss_scale_windw", "loss_scale_window"),
    ({"compile": {"deepcompil": True}}, "compile.deepcompil", "deepcompile"),
])
def test_unknown_key_in_strict_block_raises_with_suggestion(raw, path, suggestion):
    error = error_of(raw)
    assert error.path == path
    assert str(error).startswith(f"{path}: unknown key")
    assert error.suggestion == suggestion
    if suggestion:
        assert f"Did you mean {suggestion!r}?" in str(error)


@pytest.mark.parametrize("raw, message", [
    ({"activation_checkpointing": {"partition_activation": True}},
     r"activation_checkpointing\.partition_activation: unknown key, ignored .* Did you mean 'partition_activations'"),
    ({"optimizer": {"type": "Adam", "param": {"lr": 0.1}}}, r"optimizer\.param: unknown key.*Did you mean 'params'"),
    ({"fp16": {"enabled": True, "fp16": True}}, r"fp16\.fp16: unknown key, ignored"),
    ({"aio": {"thread_count": 2}}, r"aio\.thread_count: unknown key, ignored"),
])
def test_unknown_key_in_lenient_block_warns(raw, message):
    with pytest.warns(ConfigWarning, match=message):
        config = load_config(raw)
    assert config.ignored_keys == ()


def test_opaque_blocks_are_not_looked_into():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_config({"compression_training": {"anything": {"goes": 1}}, "train_batch_size": 1})
    assert config.raw["compression_training"]["anything"]["goes"] == 1
    assert "compression_training" in config.not_applied


def test_bf16_wins_over_bfloat16_as_in_deepspeed():
    with pytest.warns(ConfigWarning, match="bfloat16: ignored because bf16 is also given"):
        config = load_config({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}})
    assert config.bf16.enabled is False and config.ignored_keys == ("bfloat16", )


# --- "auto" --------------------------------------------------------------------------------------


def test_auto_accepted_where_hf_fills_it():
    config = load_config({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto", "momentum": 0.9}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto",
                              "stage3_gather_16bit_weights_on_model_save": "auto",
                              "offload_optimizer": {"device": "auto", "nvme_path": "auto"}},
    })
    assert config.train_batch_size is AUTO and config.gradient_clipping is AUTO
    assert config.fp16.enabled is AUTO and config.bf16.enabled is AUTO
    assert set(config.optimizer.params.values()) == {AUTO, 0.9}
    assert set(config.scheduler.params.values()) == {AUTO}
    zero = config.zero_optimization
    assert zero.stage is AUTO and zero.prefetch_bucket_size is AUTO and zero.overlap_comm is None
    assert zero.offload_optimizer.device is AUTO and zero.offload_optimizer.nvme_path is AUTO


@pytest.mark.parametrize("raw, path", [
    ({"steps_per_print": "auto"}, "steps_per_print"),
    ({"communication_data_type": "auto"}, "communication_data_type"),
    ({"prescale_gradients": "auto"}, "prescale_gradients"),
    ({"optimizer": {"type": "Adam", "params": {"momentum": "auto"}}}, "optimizer.params.momentum"),
    ({"optimizer": {"type": "auto"}}, "optimizer.type"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "auto"}}}, "scheduler.params.warmup_type"),
    ({"stepfx": {"codegen": "auto"}}, "stepfx.codegen"),
    ({"activation_checkpointing": {"partition_activations": "auto"}}, "activation_checkpointing.partition_activations"),
    ({"dump_state": "auto"}, "dump_state"),
])
def test_auto_rejected_elsewhere(raw, path):
    error = error_of(raw)
    assert error.path == path and "'auto' is accepted only at the keys that HF" in str(error)


def test_auto_in_a_pydantic_field_hf_does_not_fill_means_deepspeed_default():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        config = load_config({"zero_optimization": {"sub_group_size": "auto"}, "fp16": {"hysteresis": "auto"}})
    messages = [str(w.message) for w in record]
    assert len(messages) == 2 and messages[0].startswith("zero_optimization.sub_group_size: 'auto' is not filled")
    assert "default 1000000000" in messages[0] and messages[1].startswith("fp16.hysteresis: 'auto'")
    assert config.zero_optimization.sub_group_size == 1_000_000_000 and config.fp16.hysteresis == 2


# --- coercion (pydantic lax mode, as DeepSpeed) ----------------------------------------------------


def test_integral_floats_and_digit_strings_become_ints():
    config = load_config({"steps_per_print": 1e5, "zero_optimization": {"reduce_bucket_size": 5e8,
                                                                        "allgather_bucket_size": "200", "stage": 3.0}})
    assert config.steps_per_print == 100_000
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert config.zero_optimization.allgather_bucket_size == 200 and config.zero_optimization.stage == 3
    assert all(type(v) is int for v in (config.zero_optimization.reduce_bucket_size, config.zero_optimization.stage))


@pytest.mark.parametrize("raw, path, value", [
    ({"zero_optimization": {"reduce_bucket_size": 5.5}}, "zero_optimization.reduce_bucket_size", 5.5),
    ({"zero_optimization": {"reduce_bucket_size": "5e8"}}, "zero_optimization.reduce_bucket_size", "5e8"),
    ({"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size", -1),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", 4),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage", True),
    ({"zero_optimization": {"contiguous_gradients": 2}}, "zero_optimization.contiguous_gradients", 2),
    ({"zero_optimization": {"offload_optimizer": {"device": "CPU"}}}, "zero_optimization.offload_optimizer.device",
     "CPU"),
    ({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}}, "zero_optimization.offload_optimizer.ratio", 1.5),
    ({"steps_per_print": 0}, "steps_per_print", 0),
    ({"train_batch_size": 0}, "train_batch_size", 0),
    ({"gradient_clipping": -1.0}, "gradient_clipping", -1.0),
    ({"fp16": {"loss_scale": float("inf")}}, "fp16.loss_scale", float("inf")),
    ({"fp16": {"min_loss_scale": 0.5}}, "fp16.min_loss_scale", 0.5),
    ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op", "max"),
    ({"optimizer": {"type": "Adamm"}}, "optimizer.type", "Adamm"),
    ({"scheduler": {"type": "warmuplr"}}, "scheduler.type", "warmuplr"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas", [0.9]),
    ({"stepfx": {"cache_size": 0}}, "stepfx.cache_size", 0),
])
def test_bad_values_raise_naming_path_and_value(raw, path, value):
    error = error_of(raw)
    assert error.path == path and error.value == value
    assert str(error).startswith(f"{path}: got {value!r}; expected ")


def test_bool_strings_and_case_folding_as_deepspeed():
    config = load_config({"prescale_gradients": "yes", "communication_data_type": "BF16",
                          "optimizer": {"type": "ADAMW"}, "gradient_allreduce_op": "SUM"})
    assert config.prescale_gradients is True and config.communication_data_type == "bf16"
    assert config.optimizer.name == "adamw" and config.gradient_allreduce_op == "sum"


def test_optimizer_without_type_is_ignored_like_deepspeed():
    with pytest.warns(ConfigWarning, match="optimizer: no 'type'"):
        config = load_config({"optimizer": {"params": {"lr": 1e-3}}})
    assert config.optimizer is None


def test_accelerate_infinite_steps_per_print_means_never():
    assert load_config({"steps_per_print": float("inf")}).steps_per_print is None


# --- aliases and deprecations ------------------------------------------------------------------------


def test_alias_and_canonical_name_together_is_an_error():
    error = error_of({"zero_optimization": {"stage3_max_live_parameters": 1, "max_live_parameters": 2}})
    assert error.path == "zero_optimization.max_live_parameters" and "two spellings" in str(error)


def test_deprecated_key_with_its_replacement_is_an_error():
    error = error_of({"zero_optimization": {"cpu_offload": False, "offload_optimizer": {"device": "cpu"}}})
    assert error.path == "zero_optimization.cpu_offload"
    error = error_of({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True,
                                            "stage3_gather_16bit_weights_on_model_save": False}})
    assert error.path == "zero_optimization.stage3_gather_fp16_weights_on_model_save"


def test_cpu_offload_param_and_legacy_boolean_zero():
    with pytest.warns(ConfigWarning, match="cpu_offload_param: deprecated"):
        zero = load_config({"zero_optimization": {"stage": 3, "cpu_offload_param": True}}).zero_optimization
    assert zero.offload_param.device == "cpu" and zero.offload_param.buffer_count == 5
    with pytest.warns(ConfigWarning, match="deprecated form"):
        zero = load_config({"zero_optimization": True, "allgather_size": 1e6}).zero_optimization
    assert zero.stage == 1 and zero.allgather_bucket_size == 1_000_000


def test_partial_offload_needs_stage_3():
    error = error_of({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})
    assert error.path == "zero_optimization.offload_optimizer.ratio"
    config = load_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})
    assert config.zero_optimization.offload_optimizer.ratio == 0.5


@pytest.mark.parametrize("stage, overlap", [(0, False), (2, False), (3, True)])
def test_overlap_comm_dynamic_default(stage, overlap):
    assert load_config({"zero_optimization": {"stage": stage}}).zero_optimization.overlap_comm is overlap


# --- cross-block checks (DeepSpeedConfig._do_error_check) --------------------------------------------


@pytest.mark.parametrize("raw, path", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled"),
    ({"fp16": {"fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ({"bf16": {"bf16_optimizer_states": True}, "zero_optimization": {"stage": 1}}, "bf16.bf16_optimizer_states"),
    ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}, "gradient_allreduce_op"),
    ({"gradient_allreduce_op": "sum", "compile": {"deepcompile": True}}, "gradient_allreduce_op"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window"),
])
def test_cross_checks(raw, path):
    assert error_of(raw).path == path


def test_dynamic_loss_scale_checks_only_when_dynamic():
    config = load_config({"fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 0}})
    assert config.fp16.loss_scale == 128.0 and not config.fp16.dynamic_loss_scale


# --- sources --------------------------------------------------------------------------------------


def test_sources(tmp_path):
    assert load_config(None).source == "<defaults>" and load_config(None).not_applied == ()
    config = load_config({"train_batch_size": 4})
    assert config.source == "<dict>" and load_config(config) is config
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 4}')
    assert load_config(path).source == str(path) and load_config(str(path)).train_batch_size == 4
    with pytest.raises(TypeError):
        load_config(42)


def test_duplicate_keys_in_a_file_are_rejected(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"fp16": {"enabled": true, "enabled": false}}')
    error = error_of(path)
    assert error.path == "enabled" and "duplicate" in str(error)
    path.write_text('{"fp16": ')
    assert "not valid JSON" in str(error_of(path))


def test_raw_is_a_read_only_view_of_the_users_dict():
    user = {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.99]}}, "unknown": {"x": [1]}}
    config = load_quietly(user)
    assert config.raw["unknown"]["x"] == (1, )
    with pytest.raises(TypeError):
        config.raw["unknown"] = 1
    user["unknown"]["x"].append(2)
    assert config.raw["unknown"]["x"] == (1, )
    assert config.optimizer.params["betas"] == (0.9, 0.99)


def test_a_monitor_block_switched_off_by_the_string_false_is_off():
    from stepfx.config import load_config

    cfg = load_config({"tensorboard": {"enabled": "false", "output_path": "x"}, "comet": {"enabled": "false"}})
    assert not any(p.startswith(("tensorboard", "comet")) for p in cfg.not_applied)
