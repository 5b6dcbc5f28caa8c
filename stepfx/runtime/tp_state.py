"""Whole tensors back from tensor-parallel shards.

Under tensor parallelism each rank of a TP group holds its Megatron shard
of the split parameters and of their optimizer state (slots with a
``split``, ``graph/tp_layout.py``). These gather them over the TP group:
collectives, so every rank must call them. Step counters of split
parameters are rank-held whole and read as they are.

Under ZeRO stages 1-2 as well, a rank holds only a piece of its shard's
optimizer state: the caller first gathers the pieces over the data-parallel
group (``zero_state.gather_sharded_state``, which yields the rank's whole
shards) and passes them in as ``local``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..graph import Role, StepSignature
from ..graph.tp_layout import TP_PLAN_KEY
from .binding import RankStore
from .distributed import DataParallel

__all__ = ["gather_tensor_parallel"]


def gather_tensor_parallel(signature: StepSignature, store: RankStore, dp: DataParallel,
                           role: Role, local: dict[str, dict] | None = None) -> dict[str, dict]:
    """Parameter name -> {key -> whole tensor} for split parameters' tensors
    with ``role`` (PARAM: the key is None): the rank's shards are the
    rank-held slots without a ZeRO piece, and ``local`` (name -> {key ->
    this rank's whole shard}) where the rank holds pieces of them."""
    plan = signature.extra.get(TP_PLAN_KEY)
    if plan is None:
        return {}
    shards: dict[str, dict] = {}
    for slot in signature.inputs:
        if slot.role is role and slot.piece is None and plan.split_of(slot.name) is not None:
            value = store.tensors.get(slot.ident)
            if value is not None:
                shards.setdefault(slot.name, {})[slot.key] = value
    for name, keys in (local or {}).items():
        if plan.split_of(name) is not None:
            shards.setdefault(name, {}).update(keys)
    out: dict[str, dict] = {}
    # every rank of the TP group holds the same names and keys (equal shapes, the same DP rank's
    # pieces): gathered in the plan's order
    for placement in plan.sharded:
        split = plan.split_of(placement.name)
        for key in sorted(shards.get(placement.name, {}), key=str):
            value = shards[placement.name][key]
            if value.dim() <= split.dim:  # a whole scalar (a step counter)
                out.setdefault(placement.name, {})[key] = value.detach().clone()
                continue
            gathered = [torch.empty_like(value) for _ in range(dp.tp_size)]
            dist.all_gather(gathered, value.contiguous(), group=dp.tp_group)
            out.setdefault(placement.name, {})[key] = split.join(gathered)
    return out
