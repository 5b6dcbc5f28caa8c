"""Optimizer state created before the first capture, as the first step would.

Adam and AdamW create their state (``step``, ``exp_avg``, ``exp_avg_sq``,
and ``max_exp_avg_sq`` with amsgrad) lazily, at their first step. A step
captured before that creates it inside the graph, and the next call, which
finds the state, needs a graph of its own: a run captured twice. Creating
the state first, exactly as ``Adam._init_group`` does (zeros like each
parameter; the step counter a 0-dim zero, on the parameter's device when
``capturable``, else a CPU scalar of the default float dtype), gives the
same values the optimizer's own first step would start from, so a run
captures once.

Adam creates state only for parameters that have a gradient at the step;
which ones will is known only after tracing. So state is created for every
parameter that requires grad, and :func:`untouched_state` tells, from the
captured graph, which of them the step did not update: the caller drops
their state again (:func:`drop_state`) and captures anew, leaving the
optimizer exactly as eager would (today's two captures, for models with
trainable parameters the loss does not reach).

Not created (kept lazy): optimizers whose first step is not reproducible
from zeros (SGD's momentum buffer is a clone of the first gradient),
``fused`` groups (captured through the reference loop, whose state
placement differs from the fused kernel's), subclasses that override
``_init_group``, and an optimizer that already has any state.
"""
from __future__ import annotations

import inspect

import torch

from ..graph import META_SLOT, Role, StepGraph
from ..graph.ops import mutated_args
from ..graph.verify import mutation_base

__all__ = ["create_initial_state", "untouched_state", "drop_state"]


def _creates_like_adam(optimizer) -> bool:
    # unwrapped: once torch.compile has run, dynamo wraps every optimizer class's _init_group (TorchPatcher)
    return isinstance(optimizer, torch.optim.Adam) and (
        inspect.unwrap(type(optimizer)._init_group) is inspect.unwrap(torch.optim.Adam._init_group))


def _scalar_dtype() -> torch.dtype:
    # torch.optim.optimizer._get_scalar_dtype() (private), non-fused
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def create_initial_state(optimizer, skip: frozenset[int] = frozenset()) -> list[torch.Tensor]:
    """Create Adam/AdamW state for every parameter that requires grad, when
    the optimizer has none yet; returns the parameters given state. ``skip``:
    ids of parameters whose state someone else holds (ZeRO pieces)."""
    if optimizer is None or not _creates_like_adam(optimizer) or skip:
        return []
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(optimizer.state.get(p) for p in params):
        return []
    created = []
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("differentiable"):
            continue
        for p in group["params"]:
            if not p.requires_grad or id(p) in skip:
                continue
            state = optimizer.state[p]
            # torch/optim/adam.py Adam._init_group, "Lazy state initialization"
            state["step"] = (
                torch.zeros((), dtype=_scalar_dtype(), device=p.device)
                if group["capturable"]
                else torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")
            )
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            created.append(p)
    return created


def untouched_state(captured: StepGraph, names: set[str]) -> set[str]:
    """Of the parameters ``names``, those whose step counter the captured
    (not yet functional) graph never writes: the step gave them no update,
    and eager Adam would have created no state for them."""
    steps = {
        node: node.meta[META_SLOT].name
        for node in captured.gm.graph.nodes
        if node.op == "placeholder" and (slot := node.meta.get(META_SLOT)) is not None
        and slot.role is Role.OPTIMIZER_STATE and slot.key == "step" and slot.name in names
    }
    written = {steps[base] for node in captured.gm.graph.nodes if node.op == "call_function"
               for arg in mutated_args(node) if (base := mutation_base(arg)) in steps}
    return set(names) - written


def drop_state(optimizer, params) -> None:
    for p in params:
        optimizer.state.pop(p, None)
