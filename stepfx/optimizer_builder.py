"""``build_optimizer``: the torch optimizer for the ``optimizer`` block, as DeepSpeed's engine would build it.

Reference: DeepSpeed v0.19.5 (commit edaa722), ``engine._configure_basic_optimizer``
and ``deepspeed/ops/adam/fused_adam.py``. stepfx captures torch's SGD, Adam,
AdamW, RMSprop, Adagrad, Adamax and Adadelta, so it supports the types for
which DeepSpeed builds one of those, or an optimizer with the same math:

- "Adam" / "AdamW" (any case): DeepSpeed pops ``torch_adam`` (default false)
  and ``adam_w_mode`` (default true). The update uses decoupled weight decay
  (AdamW) when the type is AdamW or adam_w_mode is true, so plain "Adam" is
  AdamW unless ``adam_w_mode: false``. Without torch_adam, DeepSpeed builds
  its FusedAdam (or CPU Adam under ZeRO-Offload). stepfx builds torch's
  Adam/AdamW with FusedAdam's arguments and defaults. Note that
  weight_decay defaults to 0 there, where torch's AdamW defaults to 0.01.
  ``bias_correction: false`` and ``amsgrad: true`` have no torch equivalent
  (FusedAdam raises on amsgrad), so they raise ConfigError. With
  ``torch_adam: true``, DeepSpeed builds torch's class from the params as
  given, and so does stepfx.
- "SGD": ``torch.optim.SGD(params, **params)``, the same call DeepSpeed makes.
- "Adagrad" (any case): DeepSpeed builds ``torch.optim.Adagrad(params,
  **params)`` (its CPU Adagrad only under ZeRO-Offload, whose host update
  stepfx implements for Adam alone and refuses for others), and so does stepfx.
- "RMSprop", "Adamax", "Adadelta" (torch's spelling): DeepSpeed builds any
  other type as ``getattr(torch.optim, type)(params, **params)``; stepfx does
  for the torch optimizers it captures.
- Every other type (OneBitAdam, ZeroOneAdam, Lamb, Lion, NAdam, ...) raises
  ConfigError at ``optimizer.type``.

Before any of this, DeepSpeed rejects ``max_grad_norm`` in params for every
type and points to ``gradient_clipping``. stepfx raises the same error.
torch's optimizers are built with ``foreach=False`` unless the params say
otherwise.
"""
from __future__ import annotations

import inspect
import math
import numbers
from types import MappingProxyType
from typing import Any, Callable, Iterable

import torch

from stepfx.config import AUTO, ConfigError, OptimizerConfig
from stepfx.config.errors import bad_value, join, unknown_key

__all__ = ["SUPPORTED_TYPES", "build_optimizer"]

SUPPORTED_TYPES = ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "Adadelta")
_TORCH_TYPES = {"SGD": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "RMSprop": torch.optim.RMSprop,
                "Adamax": torch.optim.Adamax, "Adadelta": torch.optim.Adadelta}  # config.name -> the class built
_PATH = "optimizer.params"
# FusedAdam's arguments (besides adam_w_mode, which DeepSpeed sets) and their defaults, which stepfx applies.
_FUSED_ADAM_DEFAULTS = MappingProxyType({"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
                                         "weight_decay": 0.0, "amsgrad": False, "set_grad_none": True})
_AUTO_SOURCES = MappingProxyType({"lr": "learning_rate=", "betas": "betas=", "eps": "eps=",
                                  "weight_decay": "weight_decay="})


def build_optimizer(config: OptimizerConfig, params: Iterable[Any]) -> torch.optim.Optimizer:
    """A torch optimizer over ``params`` (tensors or param-group dicts) that does what DeepSpeed's would.

    Raises ConfigError naming ``optimizer.type`` for a type stepfx does not
    build, and ``optimizer.params.<name>`` for a value still AUTO, a name
    the optimizer does not take, or a bad value.
    """
    given = dict(config.params)
    if "max_grad_norm" in given:
        raise ConfigError(join(_PATH, "max_grad_norm"), "is not an optimizer parameter in DeepSpeed, which raises "
                          "ValueError for it; use the top-level \"gradient_clipping\" instead "
                          "(https://www.deepspeed.ai/docs/config-json/#gradient-clipping)",
                          value=given["max_grad_norm"], expected="no max_grad_norm in optimizer.params",
                          suggestion="gradient_clipping")
    if config.name not in ("adam", "adamw", *_TORCH_TYPES):
        raise ConfigError("optimizer.type", f"got {config.type!r}; stepfx builds only {', '.join(SUPPORTED_TYPES)} "
                          "(DeepSpeed's Adam/AdamW and Adagrad, any case, and torch's SGD, RMSprop, Adamax and "
                          "Adadelta); DeepSpeed's other optimizers and the other torch.optim classes are not "
                          "supported", value=config.type, expected=f"one of {SUPPORTED_TYPES}")
    for name, value in given.items():
        if value is AUTO:
            source = _AUTO_SOURCES.get(name, "the matching argument")
            raise ConfigError(join(_PATH, name), f"is still 'auto'; fill it with stepfx.config.resolve_auto(config, "
                              f"{source}...) first", value=AUTO, expected="a value")
    if config.name in _TORCH_TYPES:
        cls = _TORCH_TYPES[config.name]
        return _torch_optimizer(cls, cls.__name__, params, given)
    return _adam(config.name, params, given)


def _adam(name: str, params: Iterable[Any], given: dict[str, Any]) -> torch.optim.Optimizer:
    torch_adam = _CHECKS["torch_adam"]("torch_adam", given.pop("torch_adam", False))
    adam_w_mode = _CHECKS["adam_w_mode"]("adam_w_mode", given.pop("adam_w_mode", True))
    cls = torch.optim.AdamW if name == "adamw" or adam_w_mode else torch.optim.Adam
    if torch_adam:
        return _torch_optimizer(cls, f"torch.optim.{cls.__name__} (torch_adam: true)", params, given)
    for key, value in given.items():
        if key not in _FUSED_ADAM_DEFAULTS:
            raise unknown_key(join(_PATH, key), value, [*_FUSED_ADAM_DEFAULTS, "torch_adam", "adam_w_mode"],
                              "without torch_adam, DeepSpeed builds its FusedAdam, which takes no such argument "
                              "(torch-only arguments need \"torch_adam\": true)")
        _CHECKS[key](key, value)
    kwargs = {**_FUSED_ADAM_DEFAULTS, **given}
    if not kwargs.pop("bias_correction"):
        raise ConfigError(join(_PATH, "bias_correction"), "false is not supported: stepfx builds torch's "
                          f"{cls.__name__}, which always corrects the moments' bias", value=False,
                          expected="true (the default)")
    if kwargs["amsgrad"]:
        raise ConfigError(join(_PATH, "amsgrad"), "true is not supported: DeepSpeed's FusedAdam raises for it "
                          "(pass \"torch_adam\": true for torch's AMSGrad)", value=True, expected="false")
    del kwargs["set_grad_none"]  # only how FusedAdam.zero_grad clears gradients; the update is the same
    return cls(params, foreach=False, **kwargs)


def _torch_optimizer(cls: type, what: str, params: Iterable[Any], given: dict[str, Any]) -> torch.optim.Optimizer:
    """``cls(params, **given)``, DeepSpeed's call, with the names and values checked first."""
    valid = [p for p in inspect.signature(cls).parameters if p != "params"]
    for key, value in given.items():
        if key not in valid:
            raise unknown_key(join(_PATH, key), value, valid, f"{what} takes no such argument")
        if key in _CHECKS:
            _CHECKS[key](key, value)
    kwargs = {"foreach": False, **given}
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as error:
        raise ConfigError(_PATH, f"{what} rejects {given}: {error}", value=given,
                          expected=f"arguments {what} accepts") from error


def _real(ge: float | None = None) -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> Any:
        if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
                or (ge is not None and value < ge)):
            raise bad_value(join(_PATH, name), value, "a finite number" + (f" >= {ge}" if ge is not None else ""))
        return value
    return check


def _flag(optional: bool = False) -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> Any:
        if not (isinstance(value, bool) or (optional and value is None)):
            raise bad_value(join(_PATH, name), value, "true or false" + (" or null" if optional else ""))
        return value
    return check


def _betas(name: str, value: Any) -> Any:
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(b, numbers.Real) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in value)
    if not ok:
        raise bad_value(join(_PATH, name), value, "two numbers in [0, 1)")
    return value


# Checks for the params that torch's SGD/Adam/AdamW and FusedAdam take, with torch's bounds.
_CHECKS: MappingProxyType[str, Callable[[str, Any], Any]] = MappingProxyType({
    "lr": _real(ge=0.0), "eps": _real(ge=0.0), "weight_decay": _real(ge=0.0), "momentum": _real(ge=0.0),
    "dampening": _real(), "betas": _betas,
    **{key: _flag() for key in ("amsgrad", "nesterov", "maximize", "capturable", "differentiable",
                                "decoupled_weight_decay", "bias_correction", "set_grad_none", "torch_adam",
                                "adam_w_mode")},
    **{key: _flag(optional=True) for key in ("foreach", "fused")},
})
