"""Hypothesis properties: random valid DeepSpeed dicts round-trip into the typed fields;
any single corrupted value or misspelt strict key raises a ConfigError naming that key path."""
from __future__ import annotations

import warnings
from typing import Any, NamedTuple

from hypothesis import given, settings
from hypothesis import strategies as st

from stepfx.config import ConfigError, load_config


class Leaf(NamedTuple):
    json: tuple[str, ...]  # where the value sits in the user's dict
    attr: str  # where it lands on Config
    valid: Any  # strategy of (json value, expected typed value)
    bad: tuple  # values DeepSpeed rejects there
    strict: bool  # the block rejects unknown keys


def ints(lo=0, hi=10**12):
    """An int in any spelling pydantic accepts: int, integral float (1e5), digit string."""
    return st.integers(lo, hi).flatmap(lambda i: st.sampled_from([(i, i), (float(i), i), (str(i), i)]))


def floats(lo=0.0, hi=1e6):
    return st.floats(lo, hi, allow_nan=False).map(lambda x: (x, x))


BOOLS = st.sampled_from([(True, True), (False, False), ("yes", True), ("off", False), (1, True), (0, False)])
BAD_INT = ("many", 2.5, True, None, [])
BAD_UINT = BAD_INT + (-1, )
BAD_BATCH = ("many", 2.5, True, [], 0, -4)  # null is valid there: "not given"
BAD_BOOL = ("maybe", 2, None, 0.5)
BAD_FLOAT = ("fast", True, None, float("inf"), -1.0)

LEAVES = [
    Leaf(("train_batch_size", ), "train_batch_size", ints(1, 10**6), BAD_BATCH, False),
    Leaf(("train_micro_batch_size_per_gpu", ), "train_micro_batch_size_per_gpu", ints(1, 512), BAD_BATCH,
         False),
    Leaf(("gradient_accumulation_steps", ), "gradient_accumulation_steps", ints(1, 512), BAD_BATCH, False),
    Leaf(("gradient_clipping", ), "gradient_clipping", floats(0.0, 10.0), BAD_FLOAT, False),
    Leaf(("steps_per_print", ), "steps_per_print", ints(1, 10**6), BAD_BATCH, False),
    Leaf(("prescale_gradients", ), "prescale_gradients", BOOLS, BAD_BOOL, False),
    Leaf(("communication_data_type", ), "communication_data_type",
         st.sampled_from([("fp32", "fp32"), ("BF16", "bf16"), ("fp16", "fp16"), (None, None)]), ("bfp16", 16, "auto"),
         False),
    Leaf(("zero_optimization", "stage"), "zero_optimization.stage", ints(0, 3), BAD_UINT + (4, ), True),
    Leaf(("zero_optimization", "contiguous_gradients"), "zero_optimization.contiguous_gradients", BOOLS, BAD_BOOL,
         True),
    Leaf(("zero_optimization", "reduce_bucket_size"), "zero_optimization.reduce_bucket_size", ints(), BAD_UINT, True),
    Leaf(("zero_optimization", "overlap_comm"), "zero_optimization.overlap_comm", BOOLS, ("maybe", 2, 0.5),
         True),  # null is valid: DeepSpeed's dynamic default
    Leaf(("zero_optimization", "sub_group_size"), "zero_optimization.sub_group_size", ints(), BAD_UINT,
         True),
    Leaf(("zero_optimization", "stage3_prefetch_bucket_size"), "zero_optimization.prefetch_bucket_size", ints(),
         BAD_UINT, True),
    Leaf(("zero_optimization", "max_live_parameters"), "zero_optimization.max_live_parameters", ints(), BAD_UINT,
         True),
    Leaf(("zero_optimization", "offload_optimizer", "device"), "zero_optimization.offload_optimizer.device",
         st.sampled_from([(d, d) for d in ("none", "cpu", "nvme")]), ("gpu", "CPU", None), True),
    Leaf(("zero_optimization", "offload_optimizer", "buffer_count"), "zero_optimization.offload_optimizer.buffer_count",
         ints(0, 64), BAD_UINT, True),
    Leaf(("fp16", "loss_scale"), "fp16.loss_scale", floats(0.0, 2.0**20), BAD_FLOAT, False),
    Leaf(("fp16", "initial_scale_power"), "fp16.initial_scale_power", ints(0, 32), BAD_INT, False),
    Leaf(("fp16", "loss_scale_window"), "fp16.loss_scale_window", ints(1, 10**4), BAD_INT, False),
    Leaf(("fp16", "enabled"), "fp16.enabled", BOOLS, BAD_BOOL, False),
    Leaf(("bf16", "immediate_grad_update"), "bf16.immediate_grad_update", BOOLS, BAD_BOOL, False),
    Leaf(("stepfx", "cache_size"), "stepfx.cache_size", ints(1, 64), BAD_INT + (0, ), True),
    Leaf(("stepfx", "verify"), "stepfx.verify", BOOLS, BAD_BOOL, True),
    Leaf(("stepfx", "freeze_gc"), "stepfx.freeze_gc", BOOLS, BAD_BOOL, True),
]


@st.composite
def valid_configs(draw):
    """A valid DeepSpeed dict and the typed value expected at each leaf it sets."""
    chosen = draw(st.lists(st.sampled_from(range(len(LEAVES))), unique=True, min_size=1))
    raw: dict = {}
    expected = {}
    for i in chosen:
        leaf = LEAVES[i]
        value, typed = draw(leaf.valid)
        node = raw
        for key in leaf.json[:-1]:
            node = node.setdefault(key, {})
        node[leaf.json[-1]] = value
        expected[i] = typed
    return raw, expected


def get(obj: Any, attr: str) -> Any:
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def set_at(raw: dict, path: tuple[str, ...], value: Any, rename: str | None = None) -> None:
    node = raw
    for key in path[:-1]:
        node = node[key]
    if rename is None:
        node[path[-1]] = value
    else:
        node[rename] = node.pop(path[-1])


@settings(max_examples=50, deadline=None)
@given(valid_configs())
def test_valid_dicts_round_trip(case):
    raw, expected = case
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a valid dict draws no warning either
        config = load_config(raw)
    for i, typed in expected.items():
        value = get(config, LEAVES[i].attr)
        assert value == typed and type(value) is type(typed), LEAVES[i].attr


@settings(max_examples=50, deadline=None)
@given(valid_configs(), st.data())
def test_single_corruption_names_its_key_path(case, data):
    raw, expected = case
    i = data.draw(st.sampled_from(sorted(expected)), label="leaf")
    leaf = LEAVES[i]
    path = ".".join(leaf.json)
    if leaf.strict and data.draw(st.booleans(), label="misspell the key"):
        typo = leaf.json[-1] + "_x"
        set_at(raw, leaf.json, None, rename=typo)
        path = ".".join(leaf.json[:-1] + (typo, ))
    else:
        set_at(raw, leaf.json, data.draw(st.sampled_from(leaf.bad), label="bad value"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_config(raw)
    except ConfigError as error:
        assert error.path == path, str(error)
        assert str(error).startswith(path + ":")
    else:
        raise AssertionError(f"{path} corrupted in {raw} but load_config accepted it")
