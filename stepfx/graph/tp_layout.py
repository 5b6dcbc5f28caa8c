"""Tensor-parallel placements as data: which slice of a tensor a rank holds,
and the plan the tensor-parallel passes leave in ``signature.extra``.

A :class:`TensorSplit` describes a Megatron shard: dimension ``dim`` of the
whole tensor is ``parts`` equal parts (1, or 3 for a fused q/k/v weight, 2
for a fused gate/up weight), each part cut into ``count`` equal slices; rank
``index`` of the tensor-parallel group holds slice ``index`` of every part,
concatenated in part order. ``take`` cuts a rank's shard from the whole
tensor, ``join`` puts the whole back from every rank's shard.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TensorSplit", "Placement", "TensorParallelPlan", "TP_PLAN_KEY"]

TP_PLAN_KEY = "tensor_parallel"  # signature.extra: the TensorParallelPlan


@dataclass(frozen=True)
class TensorSplit:
    """``sizes``: the fused parts' sizes along ``dim`` in the whole tensor
    when they differ (Phi-3's q, k, v with fewer key/value heads); None:
    ``parts`` equal parts."""

    dim: int
    parts: int
    index: int
    count: int
    sizes: tuple[int, ...] | None = None

    def local_shape(self, shape) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] //= self.count
        return tuple(out)

    def part_sizes(self, whole: int) -> list[int]:
        """The parts' sizes along ``dim`` of a whole of ``whole`` elements."""
        return list(self.sizes) if self.sizes else [whole // self.parts] * self.parts

    def take(self, whole):
        """This rank's shard of ``whole`` (a new contiguous tensor)."""
        import torch

        parts = whole.split(self.part_sizes(whole.shape[self.dim]), self.dim)
        pieces = [part.chunk(self.count, self.dim)[self.index] for part in parts]
        return torch.cat(pieces, self.dim).contiguous() if len(pieces) > 1 else pieces[0].contiguous().clone()

    def join(self, shards):
        """The whole tensor from every rank's shard (in rank order)."""
        import torch

        local = [size // self.count for size in self.part_sizes(shards[0].shape[self.dim] * self.count)]
        per_rank = [s.split(local, self.dim) for s in shards]
        return torch.cat([per_rank[r][p] for p in range(self.parts) for r in range(self.count)], self.dim)

    def describe(self) -> str:
        fused = f", {self.parts} fused parts each split" if self.parts > 1 else ""
        return f"dim {self.dim} / {self.count}{fused}"


@dataclass(frozen=True)
class Placement:
    """Where one parameter lives: ``kind`` is "column", "row" or
    "replicated"; ``split`` the shard (None when replicated); ``why`` one line."""

    name: str
    kind: str
    split_dim: int | None
    parts: int
    why: str
    sizes: tuple[int, ...] | None = None  # unequal fused parts' sizes (TensorSplit.sizes)


@dataclass(frozen=True)
class TensorParallelPlan:
    """What plan_tensor_parallel found: each parameter's placement, the
    Megatron groups (column weights -> row weights), and the notes for
    ``explain()``."""

    degree: int
    rank: int
    placements: tuple[Placement, ...]
    groups: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()
    notes: tuple[str, ...] = field(default=())
    # sequence parallelism: the step's token count the ranks share (None: off); under stepfx.dynamic a sympy
    # expression in the batch's size symbols (a multiple of the group size at every call)
    tokens: Any = None
    group: str | None = None  # the tensor-parallel group's name, as its collectives in the graph read it

    def split_of(self, name: str) -> TensorSplit | None:
        for p in self.placements:
            if p.name == name and p.split_dim is not None:
                return TensorSplit(p.split_dim, p.parts, self.rank, self.degree, p.sizes)
        return None

    @property
    def sharded(self) -> tuple[Placement, ...]:
        return tuple(p for p in self.placements if p.split_dim is not None)

    def describe(self) -> list[str]:
        return [f"{p.name}: {p.kind}" + (f" (dim {p.split_dim}" + (f", {p.parts} parts" + (f" of {list(p.sizes)}" if p.sizes else "") if p.parts > 1 else "") + ")"
                                         if p.split_dim is not None else "") + f": {p.why}" for p in self.placements]
