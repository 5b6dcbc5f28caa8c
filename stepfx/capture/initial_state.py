"""Optimizer state created before the first capture, as the first step would.

torch's Adam, AdamW, RMSprop, Adamax and Adadelta, and SGD with momentum,
create their state lazily, at their first step. A step captured before
that creates it inside the graph, and the next call, which finds the
state, needs a graph of its own: a run captured twice. Creating the state
first, exactly as each optimizer's ``_init_group`` does (zeros like each
parameter: Adam's ``exp_avg``/``exp_avg_sq`` and amsgrad's
``max_exp_avg_sq``; RMSprop's ``square_avg``, with ``momentum_buffer`` and
``grad_avg`` where momentum/centered ask; Adamax's ``exp_avg``/``exp_inf``;
Adadelta's ``square_avg``/``acc_delta``; the step counter a 0-dim zero, on
the parameter's device when ``capturable``, else a CPU scalar of the
default float dtype), gives the same values the optimizer's own first step
would start from, so a run captures once. SGD's first step clones the
gradient into its momentum buffer instead; from a zero buffer its later
rule (``buf * momentum + (1 - dampening) * grad``) gives the same bits when
``dampening`` is 0 (the default: ``0 * momentum + grad`` is ``grad``), so
its buffer is created too then, and kept lazy otherwise.

These optimizers create state only for parameters that have a gradient at
the step; which ones will is known only after tracing. So state is created
for every parameter that requires grad, and :func:`untouched_state` tells,
from the captured graph, which of them the step did not update: the caller
drops their state again (:func:`drop_state`) and captures anew, leaving
the optimizer exactly as eager would (today's two captures, for models
with trainable parameters the loss does not reach).

Under ZeRO 1-3 the state of parameters in sharded buckets is not created
in the optimizer (no rank is to hold it whole); the rank holds a
description of it instead, and reads zeros for its pieces at the first run
(``runtime/binding.py``): the same first step, and one capture.

``fused`` groups (torch's default AdamW in the Hugging Face Trainer,
nanoGPT's and torchtitan's on CUDA) are captured through the reference
loop (``fused=False`` while tracing), so their state is created as that loop
creates it: the step counter a CPU scalar unless ``capturable``, where the
fused kernel's own first step would put it on the parameter's device. That
is the state a second capture found before (as the loop had made it at the
first), now without the second capture.

Not created (kept lazy): SGD with dampening, subclasses that override
``_init_group``, other optimizers, and an optimizer that already has any
state (Adagrad makes its own at construction).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ..graph import META_SLOT, Role, StepGraph, TensorSpec
from ..graph.ops import mutated_args
from ..graph.verify import mutation_base

__all__ = ["create_initial_state", "untouched_state", "stepped_params", "drop_state"]


def _own_init_group(optimizer, cls) -> bool:
    # unwrapped: once torch.compile has run, dynamo wraps every optimizer class's _init_group (TorchPatcher)
    return isinstance(optimizer, cls) and (
        inspect.unwrap(type(optimizer)._init_group) is inspect.unwrap(cls._init_group))


def _first_state_keys(optimizer, group: dict) -> tuple[bool, list[str]] | None:
    """(whether it keeps a step counter, the state tensors its first step
    makes as zeros like the parameter) for ``group``, or None where the
    first step's state is not that."""
    if group.get("differentiable"):
        return None
    if _own_init_group(optimizer, torch.optim.Adam):  # AdamW too (a subclass sharing _init_group)
        return True, ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
    if _own_init_group(optimizer, torch.optim.RMSprop):
        return True, (["square_avg"] + (["momentum_buffer"] if group["momentum"] > 0 else [])
                      + (["grad_avg"] if group["centered"] else []))
    if _own_init_group(optimizer, torch.optim.Adamax):
        return True, ["exp_avg", "exp_inf"]
    if _own_init_group(optimizer, torch.optim.Adadelta):
        return True, ["square_avg", "acc_delta"]
    if _own_init_group(optimizer, torch.optim.SGD) and group["momentum"] != 0 and group["dampening"] == 0:
        return False, ["momentum_buffer"]
    return None


def _scalar_dtype() -> torch.dtype:
    # torch.optim.optimizer._get_scalar_dtype() (private), non-fused
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def create_initial_state(optimizer, rank_holds: Callable[[torch.Tensor], bool] | None = None
                         ) -> tuple[list[torch.Tensor], dict[torch.Tensor, dict[str, Any]]]:
    """Create the first step's state (see the module docstring) for every
    parameter that requires grad, when the optimizer has none yet. Returns the parameters given state in the
    optimizer, and for those ``rank_holds(p)`` says a ZeRO rank will hold
    the state of (in pieces), what it starts from instead: per state key a
    :class:`TensorSpec` of the whole zeros (the rank makes only its piece)
    or, for the step counter, the 0-d tensor itself. The optimizer gets
    nothing for those: no rank is to hold the whole state, not even at the
    first call."""
    created: list[torch.Tensor] = []
    for_rank: dict[torch.Tensor, dict[str, Any]] = {}
    if optimizer is None:
        return created, for_rank
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(optimizer.state.get(p) for p in params):
        return created, for_rank
    for group in optimizer.param_groups:
        keys = _first_state_keys(optimizer, group)
        if keys is None:
            continue
        counts, moments = keys
        for p in group["params"]:
            if not p.requires_grad:
                continue
            # torch/optim/adam.py Adam._init_group, "Lazy state initialization" (and its siblings')
            state: dict[str, Any] = {"step": (
                torch.zeros((), dtype=_scalar_dtype(), device=p.device)
                if group["capturable"]
                else torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")
            )} if counts else {}
            if rank_holds is not None and rank_holds(p):
                state.update((key, TensorSpec.of(p)) for key in moments)
                for_rank[p] = state
                continue
            state.update((key, torch.zeros_like(p, memory_format=torch.preserve_format)) for key in moments)
            optimizer.state[p].update(state)
            created.append(p)
    return created, for_rank


def untouched_state(captured: StepGraph, names: set[str]) -> set[str]:
    """Of the parameters ``names``, those whose state the captured (not yet
    functional) graph never writes: the step gave them no update, and the
    eager optimizer would have created no state for them."""
    return set(names) - stepped_params(captured)


def stepped_params(captured: StepGraph) -> frozenset[str]:
    """The parameters whose optimizer state (the step counter, or SGD's
    momentum buffer: it has no counter) the captured (not yet functional)
    graph writes: those the step updates. A plan keeps this, so that one
    loaded from disk (without its captured graph) answers
    :func:`untouched_state`'s question."""
    steps = {
        node: node.meta[META_SLOT].name
        for node in captured.gm.graph.nodes
        if node.op == "placeholder" and (slot := node.meta.get(META_SLOT)) is not None
        and slot.role is Role.OPTIMIZER_STATE
    }
    return frozenset(steps[base] for node in captured.gm.graph.nodes if node.op == "call_function"
                     for arg in mutated_args(node) if (base := mutation_base(arg)) in steps)


def drop_state(optimizer, params) -> None:
    for p in params:
        optimizer.state.pop(p, None)
