"""Whole tensors back from the pieces ranks hold (ZeRO).

Collectives over stepfx's data-parallel group (the data-parallel axis of
the mesh: under tensor parallelism the pieces are of this rank's Megatron
shards, gathered over its DP group): every rank must call them.
Each bucket's shard of a tensor family (the parameters, or one optimizer
state key) is packed exactly as the compiled step packs it, then
all-gathered; whole tensors are views into the gathered buffer, cloned out.
Scalars that only some ranks hold (a step counter of a parameter whose
piece is empty on a rank) are exchanged as objects.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..graph import Role, Storage, TensorSpec
from ..graph.layout import Bucket, Sharding, ZeroLayout
from .binding import RankStore
from .distributed import DataParallel

__all__ = ["gather_sharded_params", "gather_sharded_state"]


def _gather_family(bucket: Bucket, store: RankStore, dp: DataParallel, role: Role, key: str | None, spec: TensorSpec) -> dict[str, torch.Tensor]:
    shard = torch.zeros(bucket.shard, dtype=spec.dtype, device=spec.device)
    for p, a, b, at in bucket.shard_parts(dp.dp_rank):
        shard[at : at + b - a] = store.tensors[(role, p.name, key, None, Storage.RANK, (a, b))].reshape(-1)
    if dp.dp_size > 1:
        full = torch.empty(bucket.padded, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(full, shard.contiguous(), group=dp.dp_group)
    else:
        full = shard
    return {p.name: full[p.offset : p.offset + p.numel].view(p.shape).clone() for p in bucket.params}


def gather_sharded_params(layout: ZeroLayout, store: RankStore, dp: DataParallel) -> dict[str, torch.Tensor]:
    """Parameter name -> whole value, for parameters of buckets that shard
    parameters (ZeRO-3)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in layout.buckets:
        if bucket.sharding is Sharding.PARAMETERS:
            spec = store.held[(Role.PARAM, bucket.params[0].name, None)]
            out.update(_gather_family(bucket, store, dp, Role.PARAM, None, spec))
    return out


def gather_sharded_state(layout: ZeroLayout, store: RankStore, dp: DataParallel) -> dict[str, dict[str, torch.Tensor]]:
    """Parameter name -> {state key -> whole tensor}, for every parameter
    whose optimizer state a rank holds (stages 1-3)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[tuple[str, str], Any] = {}
    for bucket in layout.buckets:
        if not bucket.shards_state:
            continue  # whole, or frozen: any optimizer state stays in the user's optimizer
        names = {p.name for p in bucket.params}
        keys = sorted({key for (role, name, key) in store.held if role is Role.OPTIMIZER_STATE and name in names})
        for key in keys:
            spec = next(v for (r, n, k), v in store.held.items() if r is Role.OPTIMIZER_STATE and k == key and n in names)
            if isinstance(spec, torch.Tensor) or (isinstance(spec, TensorSpec) and spec.shape == ()):
                for name in names:
                    t = store.tensors.get((Role.OPTIMIZER_STATE, name, key, None, Storage.RANK, None))
                    if t is not None:
                        scalars[(name, key)] = t.detach().cpu()
                continue
            for name, value in _gather_family(bucket, store, dp, Role.OPTIMIZER_STATE, key, spec).items():
                out.setdefault(name, {})[key] = value
    if dp.dp_size > 1:
        everyone: list[Any] = [None] * dp.dp_size
        dist.all_gather_object(everyone, scalars, group=dp.dp_group)
        for theirs in everyone:
            for k, v in theirs.items():
                scalars.setdefault(k, v)
    for (name, key), value in scalars.items():
        out.setdefault(name, {})[key] = value
    return out
