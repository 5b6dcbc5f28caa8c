"""Pieces of tensors as DCP chunks, and the planners that write and read them.

A ZeRO piece is a flat element range ``[start, stop)`` of a parameter (or of
one of its optimizer states) in row-major order. torch.distributed.checkpoint
(DCP) describes what each rank writes and reads as N-d boxes ("chunks") of a
logical tensor, and reshards any saved chunking into any requested one. A
flat range is a union of at most ``2 * ndim - 1`` boxes, each a contiguous
run of the range (:func:`boxes`), so a checkpoint stores every tensor under
its real shape whatever the layout that wrote it, and a rank of another
world size, stage or precision reads exactly the boxes of the pieces it
holds.

:class:`ChunkSavePlanner` and :class:`ChunkLoadPlanner` implement DCP's
public planner interfaces over explicit chunk lists instead of a state dict
of DTensors: the save side lists each rank's chunks (a tensor several ranks
hold whole is written once, by the rank that has written least so far); the
load side asks DCP's resharding (``create_read_items_for_chunk_list``) for
the reads that fill each destination box.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

__all__ = ["Chunk", "boxes", "chunks_of", "ChunkSavePlanner", "ChunkLoadPlanner"]


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat range ``[start, stop)`` of a row-major tensor of ``shape`` as
    boxes ``(offsets, sizes, flat_start)``, in order; each box is the
    contiguous run ``[flat_start, flat_start + prod(sizes))`` of the range.

    >>> boxes((3, 4), 2, 10)
    [((0, 2), (1, 2), 2), ((1, 0), (1, 4), 4), ((2, 0), (1, 2), 8)]
    """
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    row = math.prod(shape[1:])
    if row == 0:
        return []
    first, last = start // row, (stop - 1) // row
    if first == last or start % row:
        # a partial first row (or the whole range within one row): recurse into it
        end = min(stop, (first + 1) * row)
        inner = boxes(shape[1:], start - first * row, end - first * row)
        out = [((first, *o), (1, *s), first * row + f) for o, s, f in inner]
        return out + boxes(shape, end, stop) if end < stop else out
    full_end = stop // row  # rows [first, full_end) are whole
    out = [((first,) + (0,) * (len(shape) - 1), (full_end - first, *shape[1:]), first * row)]
    if stop % row:
        out += boxes(shape, full_end * row, stop)
    return out


@dataclass
class Chunk:
    """A box of the logical tensor ``fqn`` (of ``shape``) and the tensor
    holding it (saving: its values; loading: where they go)."""

    fqn: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor

    @property
    def index(self) -> MetadataIndex:
        return MetadataIndex(self.fqn, torch.Size(self.offsets))

    @property
    def storage(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))


def chunks_of(fqn: str, shape: tuple[int, ...], flat: torch.Tensor, piece: tuple[int, int] | None) -> list[Chunk]:
    """The chunks of ``fqn`` held in ``flat``: the whole tensor (``piece``
    None; ``flat`` of ``shape``), or the flat range ``piece`` of it
    (``flat`` holding exactly that range)."""
    if piece is None:
        return [Chunk(fqn, tuple(shape), (0,) * len(shape), tuple(shape), flat.reshape(shape))]
    values = flat.reshape(-1)
    return [Chunk(fqn, tuple(shape), o, s, values[f - piece[0] : f - piece[0] + math.prod(s)].view(s))
            for o, s, f in boxes(tuple(shape), *piece)]


def _write_item(chunk: Chunk) -> WriteItem:
    whole = chunk.sizes == chunk.shape
    return WriteItem(
        index=chunk.index,
        type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk.storage, properties=TensorProperties.create_from_tensor(chunk.tensor),
                                    size=torch.Size(chunk.shape)),
    )


def _spread(plans: list[SavePlan]) -> list[SavePlan]:
    """Each chunk written once: a chunk listed by several ranks (a tensor
    they all hold whole) goes to the one that has the fewest bytes to write
    so far, so replicated state is spread over the ranks' files."""
    load = [0] * len(plans)
    holders: dict[MetadataIndex, list[int]] = {}
    sizes: dict[MetadataIndex, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(rank)
            sizes[item.index] = item.tensor_storage_size() or 0
    keep: dict[MetadataIndex, int] = {}
    for index, ranks in holders.items():
        if len(ranks) == 1:
            keep[index] = ranks[0]
            load[ranks[0]] += sizes[index]
    for index in sorted((i for i, r in holders.items() if len(r) > 1), key=lambda i: -sizes[i]):
        rank = min(holders[index], key=lambda r: (load[r], r))
        keep[index] = rank
        load[rank] += sizes[index]
    return [dataclasses.replace(plan, items=[it for it in plan.items if keep[it.index] == rank]) for rank, plan in enumerate(plans)]


class ChunkSavePlanner(SavePlanner):
    """Writes the chunks handed to it (the state dict passed to DCP maps
    ``"<fqn>@<offsets>"`` to each chunk's tensor, so that DCP's async staging
    copies them like any state dict; ``shapes`` gives each fqn's logical
    shape)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes

    @staticmethod
    def key(fqn: str, offsets: tuple[int, ...]) -> str:
        return f"{fqn}@{','.join(map(str, offsets))}"

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.by_index: dict[MetadataIndex, torch.Tensor] = {}
        self.items: list[WriteItem] = []
        for key, tensor in state_dict.items():
            fqn, _, offs = key.rpartition("@")
            offsets = tuple(int(x) for x in offs.split(",")) if offs else ()
            chunk = Chunk(fqn, self.shapes[fqn], offsets, tuple(tensor.shape), tensor)
            self.by_index[chunk.index] = tensor
            self.items.append(_write_item(chunk))
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self.items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return create_default_global_save_plan(_spread(all_plans))

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        index = MetadataIndex(write_item.index.fqn, write_item.index.offset)
        return self.by_index[index].detach()


class ChunkLoadPlanner(LoadPlanner):
    """Fills destination chunks from a checkpoint (any saved chunking);
    refuses byte items (stepfx checkpoints keep no pickled objects)."""

    def __init__(self, chunks: list[Chunk]):
        self.chunks = chunks
        self.by_index = {(c.fqn, c.offsets): c.tensor for c in chunks}

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        by_fqn: dict[str, list[Chunk]] = {}
        for c in self.chunks:
            by_fqn.setdefault(c.fqn, []).append(c)
        items: list[ReadItem] = []
        for fqn, chunks in by_fqn.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise KeyError(f"the checkpoint has no tensor {fqn!r}")
            items += create_read_items_for_chunk_list(fqn, md, [c.storage for c in chunks])
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise ValueError(f"{read_item.dest_index.fqn}: a pickled object in the checkpoint; stepfx checkpoints hold tensors only")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self.by_index[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, offset, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """The read went straight into the destination's view."""
