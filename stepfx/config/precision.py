"""``fp16`` and ``bf16`` (legacy spelling ``bfloat16``): FP16Config and BF16Config.

Mirrors ``deepspeed/runtime/precision_config.py`` (DeepSpeed v0.19.5): the
same keys, defaults and validators. Key rule: TIGHTENED (see ``rules.py``).
Since v0.17.1 DeepSpeed builds these blocks with pydantic models
(``extra="forbid"``); before that ``runtime/config.py`` read them with
``get_scalar_param`` lookups and ignored extra keys, which published configs
rely on (gpt-neox 20B's ``"fp16": {"fp16": true, ...}``, Megatron-DeepSpeed's
``"bfloat16": {"loss_scale": 1.0}``). So a misspelt key is an error and any
other unknown key a warning.

``bfloat16`` is DeepSpeed's old name for ``bf16`` (``get_bfloat16_config``
reads ``bf16`` and falls back to ``bfloat16``); when both are present
DeepSpeed ignores ``bfloat16``, and so does stepfx (with a warning).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .rules import Notes, Rule, parse_fields, spec, validate_fields
from .values import Bool, Float, Int


@dataclass(frozen=True)
class FP16Config:
    """fp16 mixed precision with DeepSpeed's dynamic loss scaling (``loss_scale`` 0 = dynamic)."""

    enabled: Any = spec(False, Bool(), auto=True)
    auto_cast: bool = spec(False, Bool())
    loss_scale: float = spec(0.0, Float(ge=0.0))
    initial_scale_power: int = spec(16, Int())
    loss_scale_window: int = spec(1000, Int())
    hysteresis: int = spec(2, Int())
    consecutive_hysteresis: bool = spec(False, Bool())
    min_loss_scale: int = spec(1, Int())
    fp16_master_weights_and_grads: bool = spec(False, Bool())

    def __post_init__(self):
        validate_fields(self, "fp16", pydantic=True)
        # DeepSpeedFP16Config._validate_dynamic_loss_scale_params: only checked when dynamic scaling is on.
        if self.enabled is True and self.loss_scale == 0:
            for name in ("loss_scale_window", "min_loss_scale"):
                value = getattr(self, name)
                if value <= 0:
                    raise ConfigError(f"fp16.{name}", f"got {value!r}; must be > 0 when dynamic loss scaling is "
                                      "enabled (loss_scale=0)", value=value, expected="an integer > 0")

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0


@dataclass(frozen=True)
class BF16Config:
    """bf16 mixed precision (DeepSpeed's ``DeepSpeedBF16Config``)."""

    enabled: Any = spec(False, Bool(), auto=True)
    immediate_grad_update: bool = spec(False, Bool())
    check_grad_overflow: bool = spec(True, Bool())
    bf16_master_weights_and_grads: bool = spec(False, Bool())
    bf16_optimizer_states: bool = spec(False, Bool())

    def __post_init__(self):
        validate_fields(self, "bf16", pydantic=True)


def parse_fp16(mapping: Any, path: str, notes: Notes) -> tuple[FP16Config, list[str]]:
    kwargs, set_paths = parse_fields(FP16Config, mapping, path, "fp16", notes, Rule.TIGHTENED, pydantic=True,
                                     block="fp16")
    return FP16Config(**kwargs), set_paths


def parse_bf16(mapping: Any, path: str, notes: Notes) -> tuple[BF16Config, list[str]]:
    kwargs, set_paths = parse_fields(BF16Config, mapping, path, "bf16", notes, Rule.TIGHTENED, pydantic=True,
                                     block=path)
    return BF16Config(**kwargs), set_paths
