"""Whole tensors back from tensor-parallel shards.

Under tensor parallelism each rank of a TP group holds its Megatron shard
of the split parameters and of their optimizer state (slots with a
``split``, ``graph/tp_layout.py``). These gather them over the TP group:
collectives, so every rank must call them. Step counters of split
parameters are rank-held whole and read as they are.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..graph import Role, StepSignature
from .binding import RankStore
from .distributed import DataParallel

__all__ = ["gather_tensor_parallel"]


def gather_tensor_parallel(signature: StepSignature, store: RankStore, dp: DataParallel,
                           role: Role) -> dict[str, dict]:
    """Parameter name -> {key -> whole tensor} for the rank-held slots of
    split parameters with ``role`` (PARAM: the key is None)."""
    out: dict[str, dict] = {}
    split_params = {s.name for s in signature.inputs if s.role is Role.PARAM and s.split is not None}
    for slot in signature.inputs:
        if slot.role is not role or slot.name not in split_params:
            continue
        value = store.tensors.get(slot.ident)
        if value is None:
            continue
        if slot.split is None:  # a whole scalar (a step counter)
            out.setdefault(slot.name, {})[slot.key] = value.detach().clone()
            continue
        shards = [torch.empty_like(value) for _ in range(dp.tp_size)]
        dist.all_gather(shards, value.contiguous(), group=dp.tp_group)
        out.setdefault(slot.name, {})[slot.key] = slot.split.join(shards)
    return out
