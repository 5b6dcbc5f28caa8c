"""The ZeRO layout: which parameters share a flat bucket and which piece of
each bucket a rank owns.

Parameters that the optimizer updates are grouped, in the optimizer's own
order, into *buckets*: the concatenation of their flattened values, padded
to a multiple of the world size N. Rank ``r`` owns the contiguous shard
``[r*s, (r+1)*s)`` of each bucket (``s = padded / N``); the part of a
parameter inside it is that parameter's *piece* on rank ``r`` (possibly
empty, possibly all of it). A bucket is the unit of every collective:
gradients are all-reduced or reduce-scattered per bucket, parameters are
all-gathered per bucket.

At stage 3 the parameters that take no gradient (``requires_grad=False``:
a frozen embedding, the base model under adapters) are sharded too, in
*frozen* buckets of their own: gathered for forward and backward like the
others, never reduced or updated (DeepSpeed's ZeRO-3 partitions them as
well).

The layout is plain data (no graph nodes): passes record it in the step
signature, the runtime reads it to slice state into pieces and to gather
the full model back.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["Sharding", "BucketParam", "Bucket", "ZeroLayout", "LAYOUT_KEY", "FROZEN_KEY", "EVALUATED_LAYOUT_KEY", "ALIGN", "align"]

LAYOUT_KEY = "zero_layout"  # StepSignature.extra key
FROZEN_KEY = "frozen_params"  # StepSignature.extra key: names of parameters with requires_grad=False
# PassOptions.extra key: the ZeroLayout of the training step whose held pieces an evaluator reads
EVALUATED_LAYOUT_KEY = "evaluated_layout"

# Every parameter starts, and every rank's shard begins, at a multiple of
# ALIGN elements. A piece then starts where a SIMD loop over the whole
# parameter would be at a vector boundary and ends either at the
# parameter's end or at another boundary, so elementwise kernels compute
# each element of a piece exactly as they compute it in the whole tensor
# (vector bodies and scalar tails round differently: FMA vs multiply-add).
# 64 elements is 256 bytes of fp32, also what vectorized GPU loads like.
ALIGN = 64


class Sharding(str, enum.Enum):
    """What a bucket keeps sharded across data-parallel ranks."""

    NONE = "none"  # stage 0 (and stage-3 persistent params): gradients all-reduced, everything whole
    OPTIMIZER = "optimizer"  # stage 1: optimizer state
    GRADIENTS = "gradients"  # stage 2: + gradients (reduce-scatter)
    PARAMETERS = "parameters"  # stage 3: + parameters at rest

    def __str__(self) -> str:
        return self.value


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class BucketParam:
    name: str
    shape: tuple[int, ...]
    offset: int  # into the bucket's flat buffer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    index: int
    params: tuple[BucketParam, ...]
    sharding: Sharding
    world_size: int
    dtype: str  # "torch.float32"
    device: str
    frozen: bool = False  # parameters without gradients: gathered, never reduced or updated

    @property
    def shards_state(self) -> bool:
        """Ranks hold pieces of these parameters' optimizer state (and, from
        stage 2, gradients): a sharded bucket that is not frozen."""
        return self.sharding is not Sharding.NONE and not self.frozen

    @property
    def numel(self) -> int:
        """Elements up to the end of the last parameter (alignment gaps included)."""
        last = self.params[-1]
        return last.offset + last.numel

    @property
    def padded(self) -> int:
        unit = self.world_size * ALIGN
        return -(-self.numel // unit) * unit

    @property
    def shard(self) -> int:
        return self.padded // self.world_size

    def shard_parts(self, rank: int) -> list[tuple[BucketParam, int, int, int]]:
        """``(param, start, stop, shard_offset)`` for every parameter with a
        non-empty piece on ``rank``, in bucket order."""
        out = []
        for p in self.params:
            a, b, at = self.piece(p, rank)
            if b > a:
                out.append((p, a, b, at))
        return out

    def piece(self, param: BucketParam, rank: int) -> tuple[int, int, int]:
        """``(start, stop, shard_offset)``: the part of ``param`` (in its
        flattened index space) inside rank ``rank``'s shard, and where that
        part begins inside the shard. ``start == stop`` when the rank holds
        none of it."""
        lo, hi = rank * self.shard, (rank + 1) * self.shard
        a, b = max(param.offset, lo), min(param.offset + param.numel, hi)
        if a >= b:
            return 0, 0, 0
        return a - param.offset, b - param.offset, a - lo

    def param(self, name: str) -> BucketParam:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)


@dataclass(frozen=True)
class ZeroLayout:
    stage: int
    world_size: int
    rank: int
    buckets: tuple[Bucket, ...]
    # False for a gradient-accumulation micro-step without update: nothing
    # is reduced or updated, only (ZeRO-3) parameters are gathered
    updates: bool = True

    def bucket_of(self, name: str) -> Bucket | None:
        for b in self.buckets:
            if any(p.name == name for p in b.params):
                return b
        return None

    def params(self) -> list[tuple[Bucket, BucketParam]]:
        return [(b, p) for b in self.buckets for p in b.params]

    def my_piece(self, name: str) -> tuple[int, int, int]:
        bucket = self.bucket_of(name)
        if bucket is None:
            raise KeyError(name)
        return bucket.piece(bucket.param(name), self.rank)
