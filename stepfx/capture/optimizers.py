"""The optimizers stepfx captures, and what of them is state.

The real ``torch.optim`` optimizer object runs inside the trace; stepfx only
swaps what it works on (parameters, state, learning rate) for traced values.
This module knows which optimizers and options are supported, which
per-group hyperparameters are graph *inputs* (the learning rate, so that a
scheduler can change it between calls) and which are baked into the graph
(betas, eps, weight decay, momentum: changing them re-captures).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CaptureError
from ..graph import TensorSpec

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "GRAPH_INPUT_HYPERPARAMS",
    "check_optimizer",
    "group_hyperparam_key",
    "state_tensors",
    "TraceOverrides",
]

SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.Adadelta,
)

# Per-group hyperparameters passed to the graph as inputs every call (so
# schedulers may change them without re-capture): the learning rate, and
# Adam's betas (DeepSpeed's OneCycle cycles the first one). SGD's momentum
# stays baked in: SGD branches on ``momentum != 0``.
GRAPH_INPUT_HYPERPARAMS = ("lr", "betas")

# Group keys that are not hyperparameters of the update rule.
_NOT_HYPERPARAMS = frozenset({"params", "param_names", "initial_lr", *GRAPH_INPUT_HYPERPARAMS})


def hyperparam_inputs(group: dict) -> list[tuple[str, object]]:
    """(slot name, value) of the group's hyperparameters that are graph inputs."""
    out = [("lr", group["lr"])]
    betas = group.get("betas")
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        out += [("beta1", betas[0]), ("beta2", betas[1])]
    return out

# Options that select an implementation, not the math. stepfx traces the
# reference single-tensor implementation (its own codegen fuses the update),
# so these do not enter the cache key.
_IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused"})


@dataclass(frozen=True)
class TraceOverrides:
    """Group entries set while tracing, restored afterwards."""

    entries: dict[str, Any]


def unwrapped_optimizer(optimizer):
    """The torch optimizer inside a wrapper that delegates to one through
    ``.optimizer`` (accelerate's ``AcceleratedOptimizer`` after
    ``accelerator.prepare``, itself an ``Optimizer`` subclass): stepfx captures, shards and runs the update
    itself, as it does for a model wrapped in DDP."""
    for _ in range(4):  # (wrappers of wrappers)
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(optimizer, SUPPORTED_OPTIMIZERS) or not isinstance(inner, torch.optim.Optimizer):
            return optimizer
        optimizer = inner
    return optimizer


def check_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    if optimizer is None:
        return
    if not isinstance(optimizer, SUPPORTED_OPTIMIZERS):
        names = ", ".join(f"torch.optim.{c.__name__}" for c in SUPPORTED_OPTIMIZERS)
        raise CaptureError(
            f"unsupported optimizer {type(optimizer).__module__}.{type(optimizer).__qualname__}",
            hint=f"use one of {names} (their subclasses work when they keep the update rule)",
        )
    for g, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            raise CaptureError(
                f"optimizer param group {g} has differentiable=True",
                hint="differentiable optimizers are for meta-learning; construct it with differentiable=False",
            )
        for key, value in group.items():
            if key in _NOT_HYPERPARAMS or key in ("params",):
                continue
            if isinstance(value, torch.Tensor):
                raise CaptureError(
                    f"optimizer param group {g} hyperparameter {key!r} is a tensor",
                    hint=f"pass {key} as a Python number (only lr may be changed between steps without re-capture)",
                )


def group_hyperparam_key(group: dict) -> tuple:
    """The hyperparameters baked into the graph: a change re-captures."""
    items = []
    for key in sorted(group):
        if key in _NOT_HYPERPARAMS or key in _IMPLEMENTATION_FLAGS:
            continue
        value = group[key]
        if isinstance(value, list):
            value = tuple(value)
        items.append((key, value))
    return tuple(items)


def trace_overrides(group: dict) -> dict[str, Any]:
    """Implementation flags forced while tracing: the single-tensor loop
    (``foreach=False``, ``fused=False``) is the reference algorithm; the
    fused kernel is opaque to tracing and functionalization."""
    overrides = {}
    if "foreach" in group:
        overrides["foreach"] = False
    if "fused" in group:
        overrides["fused"] = False
    return overrides


def state_tensors(optimizer: torch.optim.Optimizer, param: torch.Tensor, where: str) -> dict[str, torch.Tensor]:
    """The tensor state of one parameter (empty before its first step)."""
    state = optimizer.state.get(param)
    if not state:
        return {}
    out = {}
    for key, value in state.items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise CaptureError(
                f"optimizer state {where}[{key!r}] is a {type(value).__name__}, not a tensor",
                hint="stepfx carries optimizer state as tensors; numbers in the state cannot be updated by a graph",
            )
        out[key] = value
    return out


def shared_step_count(steps) -> float | None:
    """The common value of the optimizer step counters ``steps`` (tensors)
    when all are equal CPU scalars (the normal case: all parameters step
    together), else None.

    Capture then reads one step counter for all parameters: the optimizer's
    per-parameter scalar arithmetic (bias corrections) is recorded against
    one symbolic value instead of hundreds, which is most of the capture
    time of Adam on large models. The fingerprint includes whether the
    counters agree, so a graph that shares one only runs while they do.

    Under ZeRO a :class:`TensorSpec` stands for the counter of a parameter
    whose pieces all live on other ranks: this rank never reads it, so it
    does not count (else a sharded step would read one counter per
    parameter and its updates could not run as one multi-tensor launch).
    """
    value = None
    for step in steps:
        if isinstance(step, TensorSpec):
            continue
        if not isinstance(step, torch.Tensor) or step.device.type != "cpu" or step.numel() != 1:
            return None
        v = step.item()
        if value is None:
            value = v
        elif v != value:
            return None
    return value


def steps_agree(steps) -> bool:
    """Whether the step counters ``steps`` may be read as one: there is at
    least one, and those this rank holds (not :class:`TensorSpec`) are equal
    CPU scalars. A rank that holds none agrees: under ZeRO a rank whose
    pieces hold no parameter's counter must decide as the others do."""
    held = [s for s in steps if not isinstance(s, TensorSpec)]
    return bool(steps) and (not held or shared_step_count(held) is not None)


def step_counters(optimizer: torch.optim.Optimizer | None) -> list:
    """Every trained parameter's ``state["step"]`` the optimizer itself
    holds (a frozen one's never advances: see ``collect_inputs``)."""
    if optimizer is None:
        return []
    return [st["step"] for group in optimizer.param_groups for p in group["params"]
            if p.requires_grad and (st := optimizer.state.get(p)) and "step" in st]
