"""Run a pipeline-parallel step: this rank's stage programs in its schedule's order.

One call of the decorated step takes the whole batch (``gradient_accumulation_steps``
micro-batches of ``train_micro_batch_size_per_gpu`` rows on this data-parallel
rank) and:

1. cuts every batch tensor into micro-batches along dim 0;
2. walks this rank's items of the schedule (runtime/pipeline_schedule.py):
   a compute item runs its stage program (passes/pipeline/stage_programs.py)
   on one micro-batch, a communication batch posts its sends and receives
   together (``torch.distributed.batch_isend_irecv`` on the pipeline group)
   and waits for them;
3. sums the gradients each stage's optimizer reads over the micro-batches
   (the captured backward already divides by their number, as DeepSpeed's
   gradient accumulation does), averages them over the stage's
   data-parallel group, and runs each stage's optimizer program (in two
   parts around a sum over the stages, such as gradient clipping's
   squared norm, which the pipeline group all-reduces);
4. returns the mean over micro-batches of what the step returns (the loss),
   made on the last stage and broadcast to every stage.

Values live per (stage, micro-batch) in a dict by name and are dropped after
the last item of this rank that reads them, so a schedule's activation
memory is what it keeps in flight. Nothing is written to the user's objects
until every program ran; a failure aborts stepfx's groups so every rank
raises instead of waiting (runtime/distributed.py: failed_together).
"""
from __future__ import annotations

import math
from typing import Any

import sympy
import torch
import torch.distributed as dist

from .. import compat
from ..graph import Role, StepGraph
from ..passes.pipeline.stage_programs import StagePrograms
from .binding import ModuleBinding
from .host_optimizer import settle_across_steps
from .distributed import DataParallel, failed_together
from .pipeline_schedule import Action, CommBatch, Schedule

__all__ = ["PipelineExecutor", "pipeline_fingerprint", "zero1_shares"]

_KIND_CODE = {"SEND_F": 0, "RECV_F": 0, "SEND_B": 1, "RECV_B": 1}


class PipelineExecutor:
    def __init__(self, graph: StepGraph, binding: ModuleBinding, dp: DataParallel, programs: StagePrograms,
                 schedule: Schedule, micro_batches: int, update_shares: dict[str, int] | None = None,
                 shard_gradients: bool = False, partitioned: dict[int, int] | None = None,
                 prefetch_elements: int = 50_000_000, pipe_partitioned: bool = True, grad_partitioned: bool = True):
        self.graph = graph
        self.gm = graph.gm
        self.binding = binding
        self.dp = dp
        self.programs = programs
        self.schedule = schedule
        self.micro_batches = micro_batches
        # ZeRO-1/2 over the stage's data-parallel group: parameter name -> the data-parallel rank that updates
        # it; ZeRO-2: gradients reduced to that rank only
        self.update_shares = update_shares
        self.shard_gradients = shard_gradients and update_shares is not None
        self.runs = 0
        self.timer = None
        self.phase_seconds = None
        self.graphs_note = "not used with pipeline parallelism"
        rank = dp.pp_rank
        self.rank = rank
        self.items = schedule.program[rank]
        self.my_stages = schedule.stages_of(rank)
        self._nodes: dict[str, Any] = {}
        self._dev = torch.device("cpu")
        self._batch_positions = [i for i, s in enumerate(graph.signature.inputs) if s.role is Role.BATCH]
        # stepfx.dynamic: each symbolic batch size -> (step input position, dimension) it is read from, so the
        # shape of what a stage receives is evaluated at the micro-batch's sizes
        self._symbols: dict[Any, tuple[int, int]] = {}
        placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
        for pos in self._batch_positions:
            val = placeholders[pos].meta.get("val")
            for d, size in enumerate(getattr(val, "shape", ())):
                expr = compat.size_expr(size)
                if not isinstance(expr, int) and getattr(expr, "is_Symbol", False):
                    self._symbols.setdefault(expr, (pos, d))
        self._sizes: list[dict] = []  # per micro-batch of the running step: symbol -> its size
        # the last item of this rank that touches (stage, micro): its values go after it
        last_use: dict[tuple[int, int], int] = {}
        for i, item in enumerate(self.items):
            for a in (item.actions if isinstance(item, CommBatch) else (item,)):
                last_use[(a.stage, a.micro)] = i
        self._free_after: dict[int, list[tuple[int, int]]] = {}  # item index -> the (stage, micro) values freed
        for key, i in last_use.items():
            self._free_after.setdefault(i, []).append(key)
        # the gradients this rank's updates read (summed over micro-batches), the forward values the step returns
        self._accumulated = {name for s in self.my_stages for name in programs.accumulated.get(s, ())}
        self._user_names = {programs.outputs[i][1] for i in programs.user_outputs}
        # DeepSpeed's pipe_partitioned / grad_partitioned: under tensor parallelism a value every rank of the TP
        # group holds alike crosses to the next (previous) stage as each rank's 1/tp slice, gathered over the
        # receiving stage's TP group: tp times fewer bytes between stages, one all-gather inside the stage
        tp_on = dp.tp_size > 1 and dp.tp_group is not None
        self._sliced = {"F": tp_on and pipe_partitioned, "B": tp_on and grad_partitioned}
        self.p2p_bytes_sent = 0  # this rank's per-micro-batch sends, summed over the steps run
        # ZeRO-3 (runtime/pipeline_params.py): step input position -> the global rank that keeps the parameter;
        # this rank's forward and backward programs fetch the others from it as they read them
        self.partitioned = dict(partitioned or {})
        self._keepers = {graph.signature.inputs[i].name: r for i, r in self.partitioned.items()}
        self.fetched: dict[tuple[str, int], list[int]] = {}  # program -> the step input positions it fetches
        if self.partitioned:
            from .pipeline_params import FETCHED_KINDS, insert_fetches

            for (kind, stage), prog in programs.programs.items():
                if stage in self.my_stages and kind in FETCHED_KINDS:
                    self.fetched[(kind, stage)] = insert_fetches(prog, self.partitioned, dp.dp_group, dp.rank,
                                                                 max(1, prefetch_elements))
                elif stage in self.my_stages:
                    stray = [i for src, i in prog.inputs if src == "graph" and self.partitioned.get(i, dp.rank) != dp.rank]
                    if stray:
                        raise RuntimeError(f"stepfx: program {kind}{stage} reads {graph.signature.inputs[stray[0]].name}, "
                                           "which another data-parallel rank of the stage keeps (ZeRO-3)")

    def unread_inputs(self) -> set[int]:
        """Positions of the step's inputs that no program of this rank reads
        (other stages' parameters and their optimizer state): the rank need
        not keep them."""
        read: set[int] = set()
        for (kind, stage), prog in self.programs.programs.items():
            if stage in self.my_stages or stage < 0:
                read.update(i for src, i in prog.inputs if src == "graph")
        kept_elsewhere = {i for i in read if self.partitioned.get(i, self.dp.rank) != self.dp.rank}
        return (set(range(len(self.graph.signature.inputs))) - read) | kept_elsewhere

    def partitioned_keeper(self, name: str) -> int | None:
        """ZeRO-3: the global rank that keeps parameter ``name`` between steps (None: every rank of its stage)."""
        return self._keepers.get(name)

    # -- helpers ----------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        return self.dp.pp_ranks[self.schedule.stage_rank[stage]]

    def _tag(self, action: Action, index: int) -> int:
        """The same number for a send and its receive: the direction, the sending stage, the micro-batch,
        the value's place in the message (gloo matches by tag; NCCL by order, which validate() checked)."""
        sender = {"SEND_F": action.stage, "SEND_B": action.stage, "RECV_F": action.stage - 1,
                  "RECV_B": action.stage + 1}[action.kind]
        return ((_KIND_CODE[action.kind] * 256 + sender) * 4096 + action.micro) * 64 + index

    def _micro_inputs(self, inputs: list[Any]) -> list[list[Any]]:
        m = self.micro_batches
        per_micro = [list(inputs) for _ in range(m)]
        for pos in self._batch_positions:
            t = inputs[pos]
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                continue
            rows = t.shape[0]
            if rows % m:
                raise ValueError(f"batch tensor {self.graph.signature.inputs[pos].name}: {rows} rows do not split into "
                                 f"{m} micro-batches (gradient_accumulation_steps)")
            for i, piece in enumerate(t.split(rows // m)):
                per_micro[i][pos] = piece
        return per_micro

    def _shape(self, name: str, micro: int) -> tuple[int, ...]:
        """The shape of value ``name`` on micro-batch ``micro`` (its symbolic sizes evaluated)."""
        shape = self.programs.specs[name][0]
        if all(isinstance(x, int) for x in shape):
            return shape
        sizes = self._sizes[micro]
        out = []
        for x in shape:
            if not isinstance(x, int):
                x = x.xreplace(sizes)
                if not x.is_Integer:
                    raise RuntimeError(f"stepfx: the size {shape} of {name}, received from another stage, is not "
                                       f"determined by the batch's sizes ({dict(sizes)})")
            out.append(int(x))
        return tuple(out)

    def _call(self, kind: str, stage: int, graph_inputs: list[Any], values: dict[str, Any]) -> None:
        prog = self.programs.programs.get((kind, stage))
        if prog is None:
            return
        args = [graph_inputs[i] if src == "graph" else values[i] for src, i in prog.inputs]
        outs = prog.gm(*args)
        for name, v in zip(prog.outputs, outs):
            values[name] = v

    # -- a step -------------------------------------------------------------------
    def run(self, batch_tensors: list[torch.Tensor]) -> Any:
        try:
            inputs = self.binding.inputs(batch_tensors, release=True)
            settle_across_steps()  # host updates earlier steps left running (stages wait for none themselves)
            with torch.no_grad():
                outputs = self._run(inputs)
        except Exception as exc:
            self.binding.failed()
            raise failed_together(self.dp, exc, self.runs) from exc
        self.runs += 1
        return self.binding.write(outputs)

    def _run(self, inputs: list[Any]) -> list[Any]:
        progs = self.programs
        self._dev = next((v.device for v in inputs if isinstance(v, torch.Tensor)), torch.device("cpu"))
        micro_inputs = self._micro_inputs(inputs)
        self._sizes = [{sym: sympy.Integer(int(args[pos].shape[d])) for sym, (pos, d) in self._symbols.items()}
                       for args in micro_inputs]
        store: dict[tuple[int, int], dict[str, Any]] = {}
        acc: dict[str, torch.Tensor] = {}
        forward_results: list[dict[str, Any]] = [dict() for _ in range(self.micro_batches)]
        accumulated, user_names = self._accumulated, self._user_names
        for index, item in enumerate(self.items):
            if isinstance(item, CommBatch):
                self._communicate(item, store)
            else:
                values = store.setdefault((item.stage, item.micro), {})
                self._call(item.kind, item.stage, micro_inputs[item.micro], values)
                for name in accumulated.intersection(values):
                    g = values.pop(name)
                    acc[name] = g.clone() if name not in acc else acc[name].add_(g)
                if item.kind == "F":
                    for name in user_names.intersection(values):
                        forward_results[item.micro][name] = values[name]
            for key in self._free_after.get(index, ()):
                store.pop(key, None)
        if self.dp.dp_group is not None and self.dp.dp_size > 1:
            self._average_gradients(acc)
        # shared (tied) parameters: each stage's summed part to the owner's optimizer (under ZeRO-2 between
        # the ranks of the data-parallel place that updates the parameter)
        sends = [(name, src, dst, acc) for name, src, dst in progs.step_sends if self._holds_gradient(name)]
        self._exchange(sends, 2, acc)
        values: dict[str, Any] = dict(acc)
        for stage in self.my_stages:
            self._call("O", stage, inputs, values)
        for name, parts in progs.cross_sums:  # sums over the stages (clipping's squared norm)
            mine = [values[p] for p in parts if p in values]
            spec = self._node(name).meta["val"]
            local = torch.stack(mine).sum() if mine else torch.zeros((), dtype=spec.dtype, device=self._dev)
            if self.dp.pp_size > 1:
                dist.all_reduce(local, group=self.dp.pp_group)
            if self.shard_gradients and self.dp.dp_size > 1:  # ZeRO-2: each data-parallel rank summed its share
                dist.all_reduce(local, group=self.dp.dp_group)
            values[name] = local
        for stage in self.my_stages:
            self._call("O2", stage, inputs, values)
        self._call("R", -1, inputs, values)
        if self.update_shares is not None:  # ZeRO-1: each parameter's new value from the rank that updated it
            self._share_updates(values)
        # ... and the owner's new value to the other stages that read them
        shared: dict[str, Any] = {}
        self._exchange([(name, src, dst, values) for _, name, src, dst in progs.param_sends], 3, shared)
        shared_at = {pos: shared[name] for pos, name, _, _ in progs.param_sends if name in shared}
        outputs: list[Any] = []
        for i, ((src, ref), task) in enumerate(zip(progs.outputs, progs.output_task)):
            if src == "const":
                outputs.append(ref)
            elif src == "graph":
                outputs.append(inputs[ref])
            elif task == "F":
                outputs.append(self._user_output(ref, forward_results))
            elif ref in values:
                outputs.append(values[ref])
            elif i in shared_at:
                outputs.append(shared_at[i])
            else:  # an update of a parameter another stage owns: this rank keeps its (unused) copy
                slot = self.graph.signature.outputs[i]
                at = self._input_position(slot)
                if at is not None:
                    outputs.append(inputs[at])
                else:  # state the step creates (a momentum buffer): zeros where another stage owns it
                    val = self._node(ref).meta["val"]
                    outputs.append(torch.zeros(tuple(val.shape), dtype=val.dtype, device=self._dev))
        return outputs

    def _input_position(self, slot) -> int:
        positions = getattr(self, "_positions", None)
        if positions is None:
            positions = self._positions = {s.ident: i for i, s in enumerate(self.graph.signature.inputs)}
        return positions.get(slot.ident)

    def _user_output(self, name: str, forward_results: list[dict[str, Any]]) -> torch.Tensor:
        """The mean over micro-batches of a forward value the step returns,
        from the last stage, on every rank of the pipeline."""
        node = self._node(name)
        val = node.meta["val"]
        last = self.schedule.stage_rank[node.meta["pp_stage"]]
        if not val.is_floating_point():
            raise ValueError(f"the step returns {name}, a {val.dtype} tensor: with pipeline parallelism a step "
                             "returns floating-point values (averaged over the micro-batches)")
        if self.rank == last:
            parts = [r[name] for r in forward_results]
            out = torch.stack(parts).mean(0) if len(parts) > 1 else parts[0].clone()
        else:
            out = torch.empty(tuple(val.shape), dtype=val.dtype, device=self._device())
        if self.dp.pp_size > 1:
            dist.broadcast(out, src=self.dp.pp_ranks[last], group=self.dp.pp_group)
        return out

    def _node(self, name: str):
        if not self._nodes:
            self._nodes.update((n.name, n) for n in self.gm.graph.nodes)
        return self._nodes[name]

    def _device(self) -> torch.device:
        return self._dev

    def _holds_gradient(self, name: str) -> bool:
        """Under ZeRO-2 whether this rank keeps the summed gradient ``name``
        (its data-parallel place updates the parameter); otherwise always."""
        if not self.shard_gradients:
            return True
        param = self.programs.grad_params.get(name)
        return param is None or self.update_shares.get(param, 0) == self.dp.dp_rank

    def _average_gradients(self, acc: dict[str, torch.Tensor]) -> None:
        """The mean over the stage's data-parallel ranks of each summed
        gradient: all-reduced (ZeRO 0/1), or reduced to the rank that updates
        its parameter, which alone keeps it (ZeRO-2: half the traffic, and
        the others free it)."""
        size, per_stage = self.dp.dp_size, self.dp.world_size // self.dp.pp_size
        base = self.dp.pp_rank * per_stage + self.dp.tp_rank
        for name in sorted(acc):
            param = self.programs.grad_params.get(name)
            if not self.shard_gradients or param is None:
                dist.all_reduce(acc[name], group=self.dp.dp_group)
                acc[name].div_(size)
                continue
            owner = self.update_shares.get(param, 0)
            dist.reduce(acc[name], dst=base + owner * self.dp.tp_size, group=self.dp.dp_group)
            if owner == self.dp.dp_rank:
                acc[name].div_(size)
            else:
                del acc[name]

    def _share_updates(self, values: dict[str, Any]) -> None:
        """ZeRO-1/2: broadcast each of this rank's stages' updated parameters
        from the data-parallel rank that updated it to the others."""
        sig, per_stage = self.graph.signature, self.dp.world_size // self.dp.pp_size
        base = self.dp.pp_rank * per_stage + self.dp.tp_rank
        owner = self.programs.plan.owner
        for slot, (src, name) in zip(sig.outputs, self.programs.outputs):
            if slot.role is not Role.PARAM or owner.get(slot.name) not in self.my_stages or src != "value":
                continue
            if self.partitioned_keeper(slot.name) is not None:
                continue  # ZeRO-3: the rank that updated it keeps it; the others fetch it when they read it
            d = self.update_shares.get(slot.name, 0)
            if d == self.dp.dp_rank:
                value = values[name].contiguous()
            else:
                val = self._node(name).meta["val"]
                value = torch.empty(tuple(val.shape), dtype=val.dtype, device=self._dev)
            dist.broadcast(value, src=base + d * self.dp.tp_size, group=self.dp.dp_group)
            values[name] = value

    def _exchange(self, sends: list[tuple[str, int, int, dict]], code: int, into: dict) -> None:
        """Once-a-step transfers between stages, all posted together and
        waited (every rank walks the same list, so the order agrees):
        (value name, from stage, to stage, where the sender has it)."""
        mine = set(self.my_stages)
        ops, received = [], []
        for index, (name, src, dst, have) in enumerate(sends):
            if src in mine and dst in mine:
                into[name] = have[name]
                continue
            tag = ((code * 256 + src) * 4096 + dst) * 64 + index % 64
            if src in mine:
                ops.append(dist.P2POp(dist.isend, have[name].contiguous(), self._peer(dst), self.dp.pp_group, tag))
            elif dst in mine:
                dtype = self.programs.specs[name][1]
                t = torch.empty(self._shape(name, 0), dtype=dtype, device=self._dev)
                received.append((name, t))
                ops.append(dist.P2POp(dist.irecv, t, self._peer(src), self.dp.pp_group, tag))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for name, t in received:
            into[name] = t

    def _communicate(self, batch: CommBatch, store: dict) -> None:
        progs = self.programs
        ops = []
        received: list[tuple[dict, str, torch.Tensor, bool, int]] = []  # (values, name, buffer, sliced, micro)
        device = None
        for action in batch.actions:
            values = store.setdefault((action.stage, action.micro), {})
            if action.kind == "SEND_F":
                names, peer = progs.send_forward[action.stage], self._peer(action.stage + 1)
            elif action.kind == "SEND_B":
                names, peer = progs.send_backward[action.stage], self._peer(action.stage - 1)
            elif action.kind == "RECV_F":
                names, peer = progs.send_forward[action.stage - 1], self._peer(action.stage - 1)
            else:
                names, peer = progs.send_backward[action.stage + 1], self._peer(action.stage + 1)
            sliced = self._sliced[action.kind[-1]]
            for i, name in enumerate(names):
                tag = self._tag(action, i)
                part = sliced and name in progs.tp_replicated
                if action.kind.startswith("SEND"):
                    t = values[name].contiguous()
                    device = t.device
                    if part:
                        t = self._slice(t)
                    self.p2p_bytes_sent += t.numel() * t.element_size()
                    ops.append(dist.P2POp(dist.isend, t, peer, self.dp.pp_group, tag))
                else:
                    shape, dtype = self._shape(name, action.micro), progs.specs[name][1]
                    if device is None:
                        device = self._device()
                    numel = math.prod(shape)
                    t = torch.empty((-(-numel // self.dp.tp_size),) if part else shape, dtype=dtype, device=device)
                    received.append((values, name, t, part, action.micro))
                    ops.append(dist.P2POp(dist.irecv, t, peer, self.dp.pp_group, tag))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for values, name, t, part, micro in received:
            values[name] = self._gather_slices(t, self._shape(name, micro)) if part else t

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel rank's slice of a value the TP group holds alike (flattened, zero-padded to a
        multiple of the group's size)."""
        tp, flat = self.dp.tp_size, t.reshape(-1)
        size = -(-flat.numel() // tp)
        if flat.numel() % tp:
            flat = torch.cat([flat, flat.new_zeros(size * tp - flat.numel())])
        return flat[self.dp.tp_rank * size:(self.dp.tp_rank + 1) * size]

    def _gather_slices(self, piece: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        whole = torch.empty(piece.numel() * self.dp.tp_size, dtype=piece.dtype, device=piece.device)
        dist.all_gather_into_tensor(whole, piece, group=self.dp.tp_group)
        return whole[:math.prod(shape)].view(shape)


def pipeline_fingerprint(executor: Any) -> list[str]:
    """What every rank of a pipeline must agree on before the first step
    (added to the pre-flight exchange): the schedule, and the name, shape and
    dtype of every value each stage sends and the next one receives, so a
    disagreement is an error that names it rather than a receive that hangs."""
    programs = getattr(executor, "programs", None)
    if programs is None:
        return []
    schedule = executor.schedule
    out = [f"pipeline {schedule.name} ranks={schedule.ranks} stages={schedule.stages} "
           f"micro_batches={executor.micro_batches}"]
    sliced = getattr(executor, "_sliced", {})
    for direction, sends in (("forward", programs.send_forward), ("backward", programs.send_backward)):
        for stage, names in enumerate(sends):
            for i, name in enumerate(names):
                shape, dtype = programs.specs[name]
                part = " (in tensor-parallel slices)" if sliced.get(direction[0].upper()) and name in programs.tp_replicated else ""
                # the place, the dimensions and the dtype, not the name (a capture's) or the sizes: those follow
                # the pipeline's batch (the same on each of its ranks, checked at the first call; another
                # pipeline's batch may differ)
                out.append(f"stage {stage} sends {direction} value #{i}: <{len(shape)} dims> {dtype}{part}")
    for i, (name, src, dst) in enumerate(programs.step_sends):
        out.append(f"stage {src} sends shared gradient #{i} {list(programs.specs[name][0])} to stage {dst} once a step")
    return out


def zero1_shares(graph: StepGraph, dp_size: int, first: frozenset[str] = frozenset()) -> dict[str, int]:
    """ZeRO-1 under pipeline parallelism: which data-parallel rank of its
    stage updates (and keeps the optimizer state of) each parameter. Whole
    parameters, largest first to the least loaded rank of the stage, as
    torch's ZeroRedundancyOptimizer partitions; the same on every rank.
    ``first`` (ZeRO-3: the parameters a rank keeps only its share of) are
    placed before the rest, so that they balance among themselves and the
    rest evens out the optimizer state."""
    from ..passes.pipeline.partition_stages import PIPELINE_KEY

    owner = graph.signature.extra[PIPELINE_KEY].owner
    sizes = {}
    for n in graph.gm.graph.nodes:
        if n.op == "placeholder" and n.meta["slot"].role is Role.PARAM and n.meta["slot"].name in owner:
            sizes[n.meta["slot"].name] = n.meta["val"].numel()
    shares: dict[str, int] = {}
    load = {}
    for name in sorted(sizes, key=lambda k: (k not in first, -sizes[k], k)):
        stage = owner[name]
        loads = load.setdefault(stage, [0] * dp_size)
        d = min(range(dp_size), key=lambda r: (loads[r], r))
        shares[name] = d
        loads[d] += sizes[name]
    return shares
