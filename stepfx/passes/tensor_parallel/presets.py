"""``tensor_parallel.preset_model``: DeepSpeed AutoTP's built-in layer specs
for common architectures, by the names DeepSpeed knows them.

DeepSpeed (``module_inject/autotp_config.py``, v0.19) has presets for
"llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2" and "phi3"
(the name case-insensitive). Each is a list of layer specs over the Hugging
Face parameter names of that family: attention and MLP input projections
split by output features (column), their output projections by input
features (row), fused weights in equal parts (``shape`` ``(3, -1)``: q, k,
v), MoE routers left whole ("skip"). With a ``partition_config`` too, the
user's specs come first and the preset's follow when its
``use_default_specs`` is true (DeepSpeed's merge: the first matching entry
decides); with ``use_default_specs`` false the preset is not used.

stepfx needs none of this to split these models (the search finds the
pairs on the graph); a preset is honoured because configs written for
DeepSpeed name one, and what it asks for is checked to propagate through
the step like any layer spec: a preset that does not fit the model (a
fused q/k/v of unequal parts cut in equal thirds) is a ConfigError naming
``tensor_parallel.preset_model``, never a silently wrong split.
"""
from __future__ import annotations

from ...config.errors import ConfigError
from ...config.tensor_parallel import PRESET_NAMES, LayerSpec

__all__ = ["PRESETS", "preset_specs"]


def _attention_mlp(q: str, o: str, up: str, down: str) -> tuple[LayerSpec, ...]:
    return (LayerSpec(patterns=(o,), partition_type="row"), LayerSpec(patterns=(q,), partition_type="column"),
            LayerSpec(patterns=(down,), partition_type="row"), LayerSpec(patterns=(up,), partition_type="column"))


_LLAMA = _attention_mlp(r".*\.self_attn\.[qkv]_proj\.weight$", r".*\.self_attn\.o_proj\.weight$",
                        r".*\.mlp\.(up|gate)_proj\.weight$", r".*\.mlp\.down_proj\.weight$")

PRESETS: dict[str, tuple[LayerSpec, ...]] = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "bloom": _attention_mlp(r".*\.self_attention\.query_key_value\.weight$", r".*\.self_attention\.dense\.weight$",
                            r".*\.mlp\.dense_h_to_4h\.weight$", r".*\.mlp\.dense_4h_to_h\.weight$"),
    "chatglm": (
        LayerSpec(patterns=(r".*\.self_attention\.dense\.weight$",), partition_type="row"),
        LayerSpec(patterns=(r".*\.self_attention\.query_key_value\.weight$",), partition_type="column",
                  shape=(3, -1), partition_dim=0),
        LayerSpec(patterns=(r".*\.mlp\.dense_4h_to_h\.weight$",), partition_type="row"),
        LayerSpec(patterns=(r".*\.mlp\.dense_h_to_4h\.weight$",), partition_type="column", shape=(2, -1),
                  partition_dim=0)),
    "mixtral": _LLAMA[:2] + (
        LayerSpec(patterns=(r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$",), partition_type="row"),
        LayerSpec(patterns=(r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$",), partition_type="column"),
        LayerSpec(patterns=(r".*\.block_sparse_moe\.gate\.weight$",), partition_type="skip")),
    "deepseek_v2": (
        LayerSpec(patterns=(r".*\.self_attn\.o_proj\.weight$",), partition_type="row"),
        LayerSpec(patterns=(r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$",), partition_type="skip"),
        LayerSpec(patterns=(r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$",), partition_type="column"),
        LayerSpec(patterns=(r".*\.mlp\.experts\.\d+\.down_proj\.weight$",), partition_type="row"),
        LayerSpec(patterns=(r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$",), partition_type="column"),
        LayerSpec(patterns=(r".*\.mlp\.gate\.weight$",), partition_type="skip"),
        LayerSpec(patterns=(r".*\.mlp\.shared_experts\.down_proj\.weight$",), partition_type="row"),
        LayerSpec(patterns=(r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$",), partition_type="column")),
    "phi3": (
        LayerSpec(patterns=(r".*\.self_attn\.o_proj\.weight$",), partition_type="row"),
        LayerSpec(patterns=(r".*\.self_attn\.qkv_proj\.weight$",), partition_type="column", shape=(3, -1),
                  partition_dim=0),
        LayerSpec(patterns=(r".*\.mlp\.down_proj\.weight$",), partition_type="row"),
        LayerSpec(patterns=(r".*\.mlp\.gate_up_proj\.weight$",), partition_type="column", shape=(2, -1),
                  partition_dim=0)),
}


assert tuple(sorted(PRESETS)) == PRESET_NAMES


def preset_specs(name: str) -> tuple[LayerSpec, ...]:
    """The layer specs of DeepSpeed's preset ``name``; an unknown name is a ConfigError listing the known ones."""
    specs = PRESETS.get(name.lower())
    if specs is None:
        raise ConfigError("tensor_parallel.preset_model", f"{name!r} is not one of DeepSpeed AutoTP's presets",
                          value=name, expected=" | ".join(sorted(PRESETS)))
    return specs
