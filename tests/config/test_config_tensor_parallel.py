"""The ``tensor_parallel`` block: DeepSpeed's keys, typed and checked."""
from __future__ import annotations

import pytest

from stepfx.config import Config, ConfigError, TensorParallelConfig, check_tensor_parallel, load_config


def test_keys_parse_and_unapplied_ones_are_listed():
    c = load_config({"tensor_parallel": {
        "autotp_size": 2, "tp_overlap_comm": True, "preset_model": "llama", "vocab_parallel_lm_head": False,
        "partition_config": {"use_default_specs": False, "layer_specs": [
            {"patterns": [".*q_proj"], "partition_type": "column"},
            {"patterns": [".*o_proj"], "partition_type": "ROW", "partition_dim": 1, "shape": [-1, [2, 3]]},
            {"patterns": [".*gate$"], "partition_type": "skip", "model_types": ["mixtral"]},
            {"patterns": [".*lm_head"], "gather_output": True}]}}})
    tp = c.tensor_parallel
    assert tp.degree == 2 and [s.partition_type for s in tp.layer_specs] == ["column", "row", "skip", "column"]
    assert tp.layer_specs[2].model_types == ("mixtral",) and tp.layer_specs[3].gather_output
    assert {"tensor_parallel.autotp_size", "tensor_parallel.partition_config",
            "tensor_parallel.preset_model", "tensor_parallel.tp_overlap_comm"}.isdisjoint(c.not_applied)
    assert tp.tp_overlap_comm is True and TensorParallelConfig().tp_overlap_comm is None  # unset: on
    assert Config(tensor_parallel=TensorParallelConfig(autotp_size=2)).not_applied == ()


@pytest.mark.parametrize("block, path", [
    ({"autotp_sz": 2}, "tensor_parallel.autotp_sz"),
    ({"autotp_size": -1}, "tensor_parallel.autotp_size"),
    ({"partition_config": {"layer_specs": [{"patterns": ["a"], "partition_type": "diag"}]}},
     "tensor_parallel.partition_config.layer_specs[0].partition_type"),
    ({"partition_config": {"layer_specs": [{"partition_type": "row"}]}},
     "tensor_parallel.partition_config.layer_specs[0].patterns"),
    ({"partition_config": {"specs": []}}, "tensor_parallel.partition_config.specs"),
    ({"preset_model": "gpt9"}, "tensor_parallel.preset_model"),
    # DeepSpeed's shape rules: -1 or positive sizes; one list of positive sizes, at the partition dimension
    ({"partition_config": {"layer_specs": [{"patterns": ["a"], "shape": [[2, -1], -1]}]}},
     "tensor_parallel.partition_config.layer_specs[0].shape"),
    ({"partition_config": {"layer_specs": [{"patterns": ["a"], "shape": [-1, [2, 2]]}]}},
     "tensor_parallel.partition_config.layer_specs[0].shape"),
    ({"partition_config": {"layer_specs": [{"patterns": ["a"], "shape": [0, -1]}]}},
     "tensor_parallel.partition_config.layer_specs[0].shape"),
])
def test_bad_values_name_the_key(block, path):
    with pytest.raises(ConfigError) as e:
        load_config({"tensor_parallel": block})
    assert e.value.path == path


def test_degree_must_divide_the_world_and_the_heads():
    tp = TensorParallelConfig(autotp_size=4)
    with pytest.raises(ConfigError, match="4 does not divide the world size 6"):
        check_tensor_parallel(tp, 6)
    with pytest.raises(ConfigError, match=r"4 does not divide the model's num_attention_heads \(6\)"):
        check_tensor_parallel(tp, 8, {"num_attention_heads": 6})
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(2\)"):
        check_tensor_parallel(tp, 8, {"num_attention_heads": 8, "num_key_value_heads": 2})
    # one key/value head (multi-query) is replicated
    assert check_tensor_parallel(tp, 8, {"num_attention_heads": 8, "num_key_value_heads": 1}) == 4
    assert check_tensor_parallel(TensorParallelConfig(), 3) == 1
