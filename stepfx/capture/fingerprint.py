"""What must stay the same for a captured graph to be reused.

A graph bakes in shapes, dtypes, devices, module train/eval modes, the
optimizer's hyperparameters other than the learning rate, which parameters
have gradients and optimizer state, and the Python constants among the
step's arguments. :func:`fingerprint` lists all of them as labelled items;
two calls with equal fingerprints can share a graph, and :func:`describe_change`
says what differs when they cannot.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.utils._pytree as pytree

from ..graph import Role
from .batch_reads import without_unread
from .number_arguments import INPUT, LABEL, is_number
from .optimizers import group_hyperparam_key, step_counters, steps_agree

__all__ = ["fingerprint", "describe_change"]


def _tensor_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad)


def _const_key(x: Any):
    try:
        hash(x)
        return (type(x), x)
    except TypeError:
        return (type(x), repr(x))


def fingerprint(model: torch.nn.Module, optimizer, args: tuple, kwargs: dict, held: Mapping | None = None,
                *, batch_shapes: bool = True, unread: frozenset[str] = frozenset(),
                numbers: frozenset[str] = frozenset()) -> tuple:
    """``held``: state a rank keeps for the user's objects (see
    ``collect_inputs``): its keys are part of the fingerprint, and its step
    counters count as the optimizer's. ``batch_shapes=False`` leaves the
    argument tensors' sizes out (their number of dimensions stays): what a
    step captured with symbolic batch sizes must match, its guard checking
    the sizes. ``unread``: batch dict entries (``pytree.keystr`` paths)
    holding no tensor that the step was seen not to fetch
    (``capture/batch_reads.py``): their values and structure are left out.
    ``numbers``: paths of number arguments the graph takes as inputs
    (``capture/number_arguments.py``): their type stays, not their value."""
    held = held or {}
    items: list[tuple[str, Any]] = [("model", id(model)), ("optimizer", id(optimizer))]
    for name, p in model.named_parameters():
        grad = None if p.grad is None else (tuple(p.grad.shape), p.grad.dtype)
        # a parameter a rank holds in pieces (ZeRO-3) is what capture sees: the whole one's description
        spec = held.get((Role.PARAM, name, None))
        key = (tuple(spec.shape), spec.dtype, spec.device, p.requires_grad) if spec is not None else _tensor_key(p)
        items.append((f"param {name}", (key, grad)))
    for name, b in model.named_buffers():
        items.append((f"buffer {name}", _tensor_key(b)))
    items.append(("train/eval modes", tuple(m.training for m in model.modules())))
    if optimizer is not None:
        items.append(("optimizer type", type(optimizer)))
        steps = step_counters(optimizer) + [v for (role, _, key), v in held.items() if key == "step"]
        items.append(("optimizer step counters all equal", steps_agree(steps)))
        for g, group in enumerate(optimizer.param_groups):
            items.append((f"optimizer group {g} hyperparameters", group_hyperparam_key(group)))
            items.append((f"optimizer group {g} params", tuple(id(p) for p in group["params"])))
            for i, p in enumerate(group["params"]):
                state = optimizer.state.get(p)
                if state:
                    items.append(
                        (
                            f"optimizer state (group {g}, param #{i})",
                            tuple((k, _tensor_key(v)) for k, v in sorted(state.items()) if isinstance(v, torch.Tensor)),
                        )
                    )
    leaves, spec = pytree.tree_flatten_with_path(without_unread(tuple(args), dict(kwargs), unread))
    items.append(("argument structure", spec))
    for path, leaf in leaves:
        where = pytree.keystr(path)
        label = LABEL + where
        if isinstance(leaf, torch.Tensor):
            items.append((label, _tensor_key(leaf) if batch_shapes else (leaf.dim(),) + _tensor_key(leaf)[1:]))
        elif where in numbers and is_number(leaf):
            items.append((label, (type(leaf), INPUT)))
        else:
            items.append((label, _const_key(leaf)))
    items.append(("state held by stepfx", tuple(sorted((str(r), n, k) for r, n, k in held))))
    items.append(("grad mode", torch.is_grad_enabled()))
    items.append(("autocast", _autocast_state()))
    return tuple(items)


def _autocast_state() -> tuple:
    states = []
    for device in ("cpu", "cuda"):
        try:
            enabled = torch.is_autocast_enabled(device)
        except (TypeError, RuntimeError):
            continue
        if enabled:
            states.append((device, torch.get_autocast_dtype(device)))
    return tuple(states)


def describe_change(old: tuple, new: tuple, limit: int = 3) -> str:
    """What differs between two fingerprints, for the re-capture log."""
    old_map, new_map = dict(old), dict(new)
    diffs = []
    for label in list(dict.fromkeys([k for k, _ in old] + [k for k, _ in new])):
        a, b = old_map.get(label, "<absent>"), new_map.get(label, "<absent>")
        if a == b:
            continue
        if a == "<absent>":
            diffs.append(f"{label}: appeared")
        elif b == "<absent>":
            diffs.append(f"{label}: disappeared")
        else:
            diffs.append(f"{label}: {_show(a)} -> {_show(b)}")
    more = f" (+{len(diffs) - limit} more)" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more if diffs else "nothing"


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
