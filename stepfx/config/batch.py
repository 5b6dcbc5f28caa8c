"""``resolve_batch_sizes``: DeepSpeed's batch-size arithmetic.

Follows ``deepspeed/runtime/config.py: DeepSpeedConfig._configure_train_batch_size``
= ``_set_batch_related_parameters`` then ``_batch_assertion``, with the same
integer (floor) divisions, so a config that DeepSpeed rejects is rejected
here with the same numbers. ``dp_world_size`` is DeepSpeed's
``world_size``: the number of data-parallel ranks.
"""
from __future__ import annotations

from .config import Config
from .errors import ConfigError
from .values import AUTO

_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def resolve_batch_sizes(config: Config, dp_world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps) for ``dp_world_size`` ranks.

    Given two or three of the numbers, the missing one is derived;
    given only train_batch_size, gas = 1 and micro = train // world;
    given only micro, gas = 1 and train = micro * world. Then DeepSpeed's
    assertions: each number > 0 and train == micro * gas * world.
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ConfigError("dp_world_size", f"got {dp_world_size!r}; expected an integer >= 1",
                          value=dp_world_size, expected="an integer >= 1")
    train, micro, gas = (getattr(config, k) for k in _KEYS)
    for key, value in zip(_KEYS, (train, micro, gas)):
        if value is AUTO:
            raise ConfigError(key, "is still 'auto'; call resolve_auto(config, ...) first", value=AUTO,
                              expected="an integer")
    world = dp_world_size
    # _set_batch_related_parameters: which of the three are given decides what is derived.
    if train is not None and micro is not None and gas is not None:
        pass
    elif train is not None and micro is not None:
        gas = train // micro // world
    elif train is not None and gas is not None:
        micro = train // world // gas
    elif micro is not None and gas is not None:
        train = micro * gas * world
    elif train is not None:
        gas, micro = 1, train // world
    elif micro is not None:
        train, gas = micro * world, 1
    else:
        raise ConfigError("train_batch_size", "neither train_batch_size nor train_micro_batch_size_per_gpu is "
                          "given; DeepSpeed needs at least one of them", value=None,
                          expected="train_batch_size or train_micro_batch_size_per_gpu")
    # _batch_assertion, in DeepSpeed's order.
    for key, value, what in ((_KEYS[0], train, "Train batch size"), (_KEYS[1], micro, "Micro batch size per gpu"),
                             (_KEYS[2], gas, "Gradient accumulation steps")):
        if value <= 0:
            raise ConfigError(key, f"{what}: {value} has to be greater than 0 (train_batch_size={train}, "
                              f"train_micro_batch_size_per_gpu={micro}, gradient_accumulation_steps={gas}, "
                              f"world size {world})", value=value, expected="an integer > 0")
    if train != micro * gas * world:
        raise ConfigError("train_batch_size", f"train_batch_size is not equal to train_micro_batch_size_per_gpu * "
                          f"gradient_accumulation_steps * world_size: {train} != {micro} * {gas} * {world}",
                          value=train, expected=f"{micro * gas * world}")
    return train, micro, gas
