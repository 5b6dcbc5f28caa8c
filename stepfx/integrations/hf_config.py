"""``trainer_config``: a DeepSpeed config's ``"auto"`` values filled from Hugging Face ``TrainingArguments``.

What transformers' own DeepSpeed integration does (``integrations/deepspeed.py``:
``HfTrainerDeepSpeedConfig.trainer_config_process`` when the arguments are
made, ``trainer_config_finalize`` once the model and the number of training
steps are known), for a config stepfx runs instead of DeepSpeed:

=====================================  ==============================================
config key                             filled from
=====================================  ==============================================
train_micro_batch_size_per_gpu         per_device_train_batch_size
gradient_accumulation_steps            gradient_accumulation_steps
train_batch_size                       world_size * per_device_train_batch_size * gas
gradient_clipping                      max_grad_norm
optimizer.params lr / betas / eps      learning_rate / (adam_beta1, adam_beta2) /
/ weight_decay                         adam_epsilon / weight_decay
scheduler.params warmup_min_lr         0
scheduler.params warmup_max_lr         learning_rate
scheduler.params total_num_steps       the Trainer's max_steps
scheduler.params warmup_num_steps      max(1, args.get_warmup_steps(max_steps))
fp16.enabled / bf16.enabled            fp16 or fp16_full_eval / bf16 or bf16_full_eval
zero_optimization.reduce_bucket_size   hidden_size ** 2
(stage 3) stage3_prefetch_bucket_size  int(0.9 * hidden_size ** 2)
(stage 3) stage3_param_persistence_    10 * hidden_size
threshold
=====================================  ==============================================

The model's hidden size is read as transformers reads it (``config.hidden_size``,
the largest of ``config.hidden_sizes``, or the same of ``config.text_config``).
The filling itself is ``stepfx.config.resolve_auto``; this module maps the
arguments onto it and adds transformers' *mismatch* check: a key the config
sets to a value (not ``"auto"``) that differs from its training argument is
an error, all of them listed in one message, as transformers raises (the
Trainer's loop and the compiled step must count batches and updates alike).
A key the config leaves out is neither filled nor checked, again as in
transformers: it takes DeepSpeed's default (``gradient_clipping`` 1.0,
whatever ``max_grad_norm`` says; stepfx warns about that one at the first
step) — except the batch sizes: the triple DeepSpeed derives must give the
Trainer's accumulation steps and micro-batch size, and without
``train_batch_size`` a size left out is the Trainer's (``_batch_sizes``).
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from ..config import (
    AUTO,
    Config,
    ConfigError,
    load_config,
    resolve_auto,
    resolve_batch_sizes,
)

__all__ = ["hidden_size_of", "mismatches", "raw_config", "trainer_config"]


def raw_config(source: Any) -> dict:
    """The config as a plain dict: ``source`` is a path to a JSON file or a
    mapping. (A typed ``stepfx.Config`` no longer says which keys were left
    out, which the mismatch check needs.)"""
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            return json.load(f)
    if isinstance(source, Mapping):
        return json.loads(json.dumps(source))  # a deep copy that also turns tuples into lists, as JSON has them
    raise TypeError(f"stepfx_config must be a path to a DeepSpeed JSON file or a dict, got {type(source).__name__}")


def hidden_size_of(model: torch.nn.Module) -> int | None:
    """The hidden size transformers' DeepSpeed integration sizes buckets by."""
    for cfg in (getattr(model, "config", None), getattr(getattr(model, "config", None), "text_config", None)):
        if getattr(cfg, "hidden_size", None):
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return int(max(cfg.hidden_sizes))
    return None


def _precision(args: Any) -> str:
    fp16 = bool(args.fp16 or args.fp16_full_eval)
    bf16 = bool(args.bf16 or args.bf16_full_eval)
    if fp16 and bf16:
        raise ConfigError("fp16.enabled", "TrainingArguments ask for both fp16 and bf16", value=True,
                          expected="one of them")
    return "fp16" if fp16 else "bf16" if bf16 else "no"


def _expected(args: Any, num_training_steps: int) -> dict[str, Any]:
    """Config key path -> the value the training arguments give it."""
    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    expected = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": args.world_size * micro * gas,
        "gradient_clipping": args.max_grad_norm,
        "optimizer.params.lr": args.learning_rate,
        "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
        "optimizer.params.eps": args.adam_epsilon,
        "optimizer.params.weight_decay": args.weight_decay,
        "scheduler.params.warmup_max_lr": args.learning_rate,
        "scheduler.params.total_num_steps": num_training_steps,
        "scheduler.params.warmup_num_steps": max(1, args.get_warmup_steps(num_training_steps)),
        "fp16.enabled": bool(args.fp16 or args.fp16_full_eval),
        "bf16.enabled": bool(args.bf16 or args.bf16_full_eval),
    }
    if args.auto_find_batch_size:  # the batch size changes as the Trainer searches: transformers does not check it
        del expected["train_micro_batch_size_per_gpu"], expected["train_batch_size"]
    return expected


def _lookup(raw: dict, path: str) -> Any:
    node: Any = raw
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def mismatches(raw: dict, args: Any, num_training_steps: int) -> list[str]:
    """Keys the config sets (not to "auto") to a value other than the training argument's."""
    out = []
    for path, want in _expected(args, num_training_steps).items():
        given = _lookup(raw, path)
        if given is None or given == "auto":
            continue
        if given != want:
            out.append(f"{path}={given!r} but the training arguments give {want!r}")
    return out


def trainer_config(source: Any, args: Any, model: torch.nn.Module, num_training_steps: int) -> Config:
    """The config ``source`` (path or dict) with every ``"auto"`` filled from
    ``args`` (``TrainingArguments``), ``model`` and the Trainer's number of
    update steps; raises ConfigError on a mismatch or an ``"auto"`` without a
    source."""
    raw = raw_config(source)
    bad = mismatches(raw, args, num_training_steps)
    if bad:
        raise ConfigError(
            "", "the config disagrees with the TrainingArguments (transformers' DeepSpeed integration refuses this "
            "too; set these keys to \"auto\" to take the arguments' values):\n  - " + "\n  - ".join(bad),
            value=bad, expected="'auto' or the training argument's value")
    config = load_config(raw)
    if config.zero_optimization.stage is AUTO:
        raise ConfigError("zero_optimization.stage", "is 'auto', which no training argument fills (transformers "
                          "leaves it to DeepSpeed, which refuses it)", value="auto", expected="0, 1, 2 or 3")
    zero = config.zero_optimization
    by_hidden = [k for k in ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold")
                 if getattr(zero, k) is AUTO]
    hidden = hidden_size_of(model)
    if by_hidden and hidden is None:
        raise ConfigError(f"zero_optimization.{by_hidden[0]}",
                          f"'auto' sizes come from the model's hidden size, and {type(model).__name__}'s config has "
                          "neither hidden_size nor hidden_sizes; set them to numbers", value="auto",
                          expected="an integer")
    config = resolve_auto(
        config, hidden_size=hidden, world_size=args.world_size, micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, max_grad_norm=args.max_grad_norm,
        mixed_precision=_precision(args), learning_rate=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon, weight_decay=args.weight_decay,
        warmup_steps=max(1, args.get_warmup_steps(num_training_steps)), total_num_steps=num_training_steps)
    return _batch_sizes(config, args)


def _batch_sizes(config: Config, args: Any) -> Config:
    """The batch-size triple as DeepSpeed derives it, which must give the
    Trainer's numbers: the Trainer's loop decides where an accumulation
    window ends and stepfx updates every ``gradient_accumulation_steps``
    calls. Without ``train_batch_size``, a number the config leaves out is
    the Trainer's (DeepSpeed would take 1 for the accumulation steps, which
    the Trainer's loop cannot follow unless it is 1)."""
    train, micro, gas = config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps
    if train is None:
        micro = args.per_device_train_batch_size if micro is None else micro
        gas = args.gradient_accumulation_steps if gas is None else gas
    train, micro, gas = resolve_batch_sizes(
        dataclasses.replace(config, train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                            gradient_accumulation_steps=gas), args.world_size)
    wrong = [f"{key}={value} where the Trainer's is {want}" for key, value, want in (
        ("gradient_accumulation_steps", gas, args.gradient_accumulation_steps),
        ("train_micro_batch_size_per_gpu", micro, None if args.auto_find_batch_size else args.per_device_train_batch_size),
    ) if want is not None and value != want]
    if wrong:
        raise ConfigError("train_batch_size", f"the config's batch sizes (train_batch_size={train} over "
                          f"{args.world_size} ranks) give " + " and ".join(wrong), value=train,
                          expected="batch sizes that agree with the TrainingArguments (or \"auto\")")
    return dataclasses.replace(config, train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                               gradient_accumulation_steps=gas)
