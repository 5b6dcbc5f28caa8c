"""ZeRO-3 under pipeline parallelism: a stage's parameters partitioned over
its data-parallel ranks, fetched by each program as it needs them.

Under ZeRO-1/2 with a pipeline each data-parallel rank of a stage updates a
share of the stage's parameters (whole parameters, runtime/pipeline.zero1_shares)
and keeps their optimizer state; at ZeRO-3 it also keeps only those
parameters between steps. Every forward and backward program of the stage
(once per micro-batch each) then reads each other parameter from the rank
that keeps it: a broadcast over the stage's data-parallel group, started
ahead of the parameter's first reader and waited just before it, in the
program's own op order; the received copy is freed after its last reader in
that program (fx's generated code drops each value after its last use).
So a rank holds its share of the stage plus what is in flight
(``stage3_prefetch_bucket_size`` elements) and what the running layer reads
— never the stage gathered at once.

What stays whole on every rank of the stage, as at ZeRO-2 (updated by its
share's rank and broadcast after the update): parameters smaller than
``stage3_param_persistence_threshold`` (DeepSpeed's persistent parameters),
parameters another stage reads too (tied embeddings: the owner sends their
new value across stages once a step), and tensor-parallel shards (they live
in the rank's store, not in the module).

What it costs, against ZeRO-2 with the same pipeline: each partitioned
parameter crosses the data-parallel group once per program that reads it,
for every micro-batch: the forward and the backward (under a zero-bubble
schedule the input-gradient part reads a weight, the weight-gradient part
usually not) — about ``2 x micro-batches x (dp - 1) / dp`` of the stage's
partitioned bytes received per rank a step, where ZeRO-2 moves none; in
exchange a rank keeps ``1 / dp`` of them. ``explain()`` gives the bytes.
DeepSpeed refuses ZeRO-3 with its pipeline engine outright.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..graph import Role, StepGraph, Storage

__all__ = ["partitionable", "partitioned_parameters", "insert_fetches", "FETCHED_KINDS"]

FETCHED_KINDS = ("F", "B", "BI", "BW")  # the programs every data-parallel rank of a stage runs alike


class _StartFetch(torch.nn.Module):
    """``start(local, src, shape)``: the broadcast of one parameter from the
    group rank ``src`` keeps, started; returns (buffer, work)."""

    def __init__(self, group: Any, rank: int):
        super().__init__()
        self.group, self.rank = group, rank

    def forward(self, local: torch.Tensor, src: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, Any]:
        if self.rank == src:
            buffer = local if local.is_contiguous() else local.contiguous()
        else:
            buffer = torch.empty(shape, dtype=local.dtype, device=local.device)
        return buffer, dist.broadcast(buffer, src=src, group=self.group, async_op=True)


class _WaitFetch(torch.nn.Module):
    def forward(self, handle: tuple[torch.Tensor, Any]) -> torch.Tensor:
        buffer, work = handle
        work.wait()
        return buffer


def partitionable(graph: StepGraph, persist: int) -> frozenset[str]:
    """The parameters ZeRO-3 partitions under a pipeline (see the module
    docstring for what stays whole): in the module, not 0-d, at least
    ``persist`` elements, read by the forward and backward of one stage only
    (through the casts and views every stage copies)."""
    from ..passes.pipeline.partition_stages import META_STAGE, META_TASK, PIPELINE_KEY

    owner = graph.signature.extra[PIPELINE_KEY].owner
    out = set()
    for slot, ph in zip(graph.signature.inputs, (n for n in graph.gm.graph.nodes if n.op == "placeholder")):
        val = ph.meta.get("val")
        if (slot.role is not Role.PARAM or slot.storage is not Storage.USER or owner.get(slot.name) is None
                or not isinstance(val, torch.Tensor) or val.dim() == 0 or val.numel() < persist):
            continue
        stages, todo, seen = set(), list(ph.users), set()
        while todo:
            u = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            if u.meta.get(META_STAGE) is None:
                todo.extend(u.users)  # (a copy every stage that reads it makes)
            elif u.meta.get(META_TASK) in FETCHED_KINDS:
                stages.add(u.meta[META_STAGE])
        if len(stages) <= 1:
            out.add(slot.name)
    return frozenset(out)


def partitioned_parameters(graph: StepGraph, names: frozenset[str], shares: dict[str, int], dp,
                           stage_rank: list[int]) -> dict[int, int]:
    """Step input position -> the global rank that keeps that parameter, for
    every parameter of ``names`` (:func:`partitionable`), of every stage
    (``stage_rank``: the pipeline rank that runs each stage): the same on
    every rank."""
    from ..passes.pipeline.partition_stages import PIPELINE_KEY

    owner = graph.signature.extra[PIPELINE_KEY].owner
    per_stage = dp.world_size // dp.pp_size
    return {i: stage_rank[owner[slot.name]] * per_stage + dp.tp_rank + shares[slot.name] * dp.tp_size
            for i, slot in enumerate(graph.signature.inputs)
            if slot.role is Role.PARAM and slot.name in names and slot.name in shares}


def insert_fetches(program, owners: dict[int, int], group: Any, rank: int, budget: int) -> list[int]:
    """Rewrite ``program`` (a TaskProgram of a forward or backward) so that
    each partitioned parameter it reads is broadcast from its keeper: the
    wait just before its first reader, the start when fewer than ``budget``
    elements are in flight (at least one: the next to be read). Returns the
    step input positions of the parameters fetched, in the order read."""
    gm: fx.GraphModule = program.gm
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    fetched = [(ph, owners[i]) for ph, (src, i) in zip(placeholders, program.inputs)
               if src == "graph" and i in owners and ph.users]
    if not fetched:
        return []
    order = {n: k for k, n in enumerate(g.nodes)}
    first = {ph: min(ph.users, key=order.__getitem__) for ph, _ in fetched}
    fetched.sort(key=lambda f: order[first[f[0]]])
    gm.add_submodule("stepfx_fetch_start", _StartFetch(group, rank))
    gm.add_submodule("stepfx_fetch_wait", _WaitFetch())
    sizes = [ph.meta["val"].numel() for ph, _ in fetched]
    handles: list[fx.Node] = []
    in_flight = 0

    def top_up(anchor: fx.Node) -> None:
        nonlocal in_flight
        while len(handles) < len(fetched) and (in_flight == 0 or in_flight + sizes[len(handles)] <= budget):
            ph, src = fetched[len(handles)]
            with g.inserting_before(anchor):
                start = g.call_module("stepfx_fetch_start", (ph, src, tuple(int(x) for x in ph.meta["val"].shape)))
            start.meta["zero3_fetch"] = ph.name
            handles.append(start)
            in_flight += sizes[len(handles) - 1]

    for k, (ph, _) in enumerate(fetched):
        anchor = first[ph]
        top_up(anchor)
        with g.inserting_before(anchor):
            wait = g.call_module("stepfx_fetch_wait", (handles[k],))
        wait.meta = {**ph.meta, "zero3_fetch": ph.name}
        in_flight -= sizes[k]
        ph.replace_all_uses_with(wait, delete_user_cb=lambda u: u is not handles[k])
        top_up(anchor)
    g.lint()
    gm.recompile()
    position = {ph: i for ph, (_, i) in zip(placeholders, program.inputs)}
    return [position[ph] for ph, _ in fetched]


def describe(executor) -> list[str]:
    """explain()'s lines for ZeRO-3 under a pipeline: what is partitioned,
    what this rank keeps, what each program fetches and what that costs."""
    graph, partitioned = executor.graph, executor.partitioned
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    owner = executor.programs.plan.owner
    mine = set(executor.my_stages)

    def nbytes(i: int) -> int:
        val = placeholders[i].meta["val"]
        return val.numel() * val.element_size()

    stage_params = [i for i, s in enumerate(graph.signature.inputs) if s.role is Role.PARAM and owner.get(s.name) in mine]
    parts = [i for i in stage_params if i in partitioned]
    kept = [i for i in parts if partitioned[i] == executor.dp.rank]
    whole = [i for i in stage_params if i not in partitioned]
    mib = 2.0 ** 20
    lines = [f"ZeRO-3 over each stage's {executor.dp.dp_size} data-parallel ranks (whole parameters, largest first to "
             f"the least loaded rank): this rank keeps {len(kept)} of its stages' {len(parts)} partitioned parameters "
             f"({sum(map(nbytes, kept)) / mib:.2f} of {sum(map(nbytes, parts)) / mib:.2f} MiB); {len(whole)} stay "
             f"whole on every rank ({sum(map(nbytes, whole)) / mib:.2f} MiB: under "
             "stage3_param_persistence_threshold, read by another stage, or tensor-parallel shards)"]
    received = 0
    for (kind, stage), positions in sorted(executor.fetched.items(), key=lambda kv: (kv[0][1], FETCHED_KINDS.index(kv[0][0]))):
        if positions:
            other = sum(nbytes(i) for i in positions if partitioned[i] != executor.dp.rank)
            received += other * executor.micro_batches
            lines.append(f"  {kind}{stage} fetches {len(positions)} parameter(s) per micro-batch "
                         f"({other / mib:.2f} MiB received by this rank), each broadcast from its keeper ahead of "
                         "its first reader and freed after its last")
    lines.append(f"  cost against ZeRO-2: {received / mib:.2f} MiB received a step by this rank "
                 f"({executor.micro_batches} micro-batch(es)), none at ZeRO-2; "
                 f"{sum(map(nbytes, parts)) - sum(map(nbytes, kept)):,} bytes of parameters not kept")
    return lines
