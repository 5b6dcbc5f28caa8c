"""What capture knows of each parameter's optimizer update, for the passes.

The graph holds the update as ops; a pass that replaces them by a fused
kernel must know which rule they compute (and then checks that they do).
Capture records, per trainable parameter, the rule of its param group in
``signature.extra[UPDATE_RULES_KEY]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["UpdateRule", "UPDATE_RULES_KEY", "update_rule_of"]

UPDATE_RULES_KEY = "update_rules"


@dataclass(frozen=True)
class UpdateRule:
    """One param group's update rule, with the constants baked into the
    graph (lr and betas are graph inputs; the values here are the
    capture-time ones, used only where the graph has them as constants)."""

    kind: str  # "adam" (Adam and AdamW) or "sgd"
    lr: float = 0.0
    weight_decay: float = 0.0
    maximize: bool = False
    # Adam / AdamW
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    decoupled: bool = False  # AdamW's decoupled weight decay
    amsgrad: bool = False
    # SGD
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False


def update_rule_of(optimizer, group: dict) -> UpdateRule | None:
    """The rule of ``group`` of a torch SGD / Adam / AdamW, None for others."""
    common = dict(lr=float(group["lr"]), weight_decay=float(group.get("weight_decay", 0.0)),
                  maximize=bool(group.get("maximize", False)))
    if isinstance(optimizer, torch.optim.Adam) or isinstance(optimizer, torch.optim.AdamW):
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
        betas = tuple(float(b) for b in group["betas"])
        return UpdateRule("adam", betas=betas, eps=float(group["eps"]), decoupled=decoupled,
                          amsgrad=bool(group.get("amsgrad", False)), **common)
    if isinstance(optimizer, torch.optim.SGD):
        return UpdateRule("sgd", momentum=float(group.get("momentum", 0.0)), dampening=float(group.get("dampening", 0.0)),
                          nesterov=bool(group.get("nesterov", False)), **common)
    return None
