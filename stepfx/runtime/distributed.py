"""Data parallelism over torch.distributed: the group, the pre-flight check,
and failing together.

- The process group comes from torchrun's environment (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``), NCCL for CUDA and gloo for CPU;
  stepfx never launches processes. Without tensor parallelism data
  parallelism spans all ranks; with a TP degree t the mesh is 2D: TP groups
  of t consecutive ranks (inside a node, where the fast links are), data
  parallelism across them (ranks with the same place in their TP group).
  With pipeline parallelism (p stages) the stage is the outermost axis:
  rank = stage x (world / p) + place in the stage; the ranks of one stage
  form its data-parallel group, and the ranks with the same place in every
  stage form a pipeline group (P2P between neighbouring stages).
- stepfx's collectives run on a group of their own (all ranks), created
  with a bounded timeout, so that a failed step can abort it without
  touching the user's default group.
- Pre-flight: before a rank first runs a compiled step, all ranks exchange
  whether they compiled at all and a fingerprint of what they will run
  (the state they hold and the sequence of collectives; batch shapes may
  differ). Every call starts with a small exchange on a gloo group (no
  device sync) of whether each rank captures at it (``captures_at_call``):
  a rank may capture alone (its own batch sizes, a Python value of its own
  such as a token count), and runs without a pre-flight when its new
  collectives are ones already agreed on; otherwise every rank joins one,
  the ranks that did not capture with the program they hold. Any
  difference makes every rank raise an error that says what differs — no
  rank is left waiting in a collective that another rank will never issue.
- A rank whose step fails mid-way aborts stepfx's group: the other ranks'
  pending collectives fail at once and they raise too.
"""
from __future__ import annotations

import datetime
import gc
import hashlib
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..errors import ExecutionError, StepfxError
from ..graph import Role, StepGraph, Storage
from ..graph.ops import is_collective

__all__ = ["DataParallel", "data_parallel", "collective_fingerprint", "preflight", "captures_at_call", "any_rank",
           "rank_varying_dims",
           "check_tensor_parallel_batches", "check_pipeline_batches",
           "RankMismatchError"]

DEFAULT_TIMEOUT_S = 600.0


# every DataParallel that holds groups (abort() makes them all let go) and the fields that hold them
_LIVE: "weakref.WeakValueDictionary[int, DataParallel]" = weakref.WeakValueDictionary()
_GROUP_FIELDS = ("group", "tp_group", "dp_group", "pp_group", "control_group")


class RankMismatchError(StepfxError):
    """Ranks compiled different programs, or some failed to compile."""


@dataclass
class DataParallel:
    """The data-parallel world this process belongs to (world_size 1: none)."""

    world_size: int = 1
    rank: int = 0
    group: Any = None  # stepfx's own ProcessGroup over all ranks
    group_name: str | None = None
    backend: str | None = None
    # the 2D mesh: this rank's tensor-parallel group (consecutive ranks) and data-parallel group
    # (one rank of each TP group); without TP the DP group is ``group``
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    tp_group_name: str | None = None
    dp_group: Any = None
    dp_group_name: str | None = None
    # pipeline parallelism: the number of stages, this rank's stage, its pipeline group (one rank per
    # stage) and that group's global ranks by stage (the P2P peers)
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: Any = None
    pp_group_name: str | None = None
    pp_ranks: tuple[int, ...] = ()
    # gloo over all ranks (``group`` itself under gloo): the host-side exchanges of every call
    control_group: Any = None

    def __post_init__(self) -> None:
        if self.group is not None:
            _LIVE[id(self)] = self

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size)

    @property
    def dp_rank(self) -> int:
        return (self.rank % (self.world_size // self.pp_size)) // self.tp_size

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def abort(self) -> None:
        """Abort stepfx's group so every rank blocked in one of its
        collectives fails now instead of at the timeout."""
        if self.group is None:
            return
        groups = [self.group]
        for g in (self.tp_group, self.dp_group, self.pp_group, self.control_group):
            if g is not None and all(g is not h for h in groups):
                groups.append(g)
        # gloo's abort() leaves its connections open: the other ranks' collectives fail only when
        # the group object is freed and closes them. So every holder lets go: this world's entries
        # in the group cache and every other step's view of the same groups (a second decorated
        # step in the process, say), which then reports the abort instead of running.
        for dp in list(_LIVE.values()) + [self]:
            if any(getattr(dp, f) is g for f in _GROUP_FIELDS for g in groups):
                for f in _GROUP_FIELDS:
                    setattr(dp, f, None)
        for key, value in list(_GROUPS.items()):
            if any(value is g or (isinstance(value, tuple) and g in value) for g in groups):
                del _GROUPS[key]
        for group in groups:
            abort = getattr(group, "abort", None)
            try:
                if abort is not None:
                    abort()
            except Exception:  # already broken: nothing more to release
                pass
            try:
                dist.destroy_process_group(group)
            except Exception:
                pass
        del groups, group
        gc.collect()  # a group held only by a reference cycle is freed (and closes its connections) now


def data_parallel(device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, tp_size: int = 1,
                  pp_size: int = 1) -> DataParallel:
    """Join (or start, from torchrun's environment) torch.distributed and
    make stepfx's groups: one over all ranks and, with ``tp_size`` > 1, the
    tensor- and data-parallel groups of the 2D mesh. A single process
    without torchrun's environment is world size 1. ``tp_size`` must divide
    the world size (``config.check_tensor_parallel`` says so first)."""
    if not dist.is_available():
        return DataParallel()
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in os.environ:
            return DataParallel()
        backend = "nccl" if device_type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    world = dist.get_world_size()
    if world <= 1:
        return DataParallel()
    backend = "nccl" if device_type == "cuda" else "gloo"
    key = (backend, world, timeout_s, id(dist.group.WORLD))
    group = _GROUPS.get(key)
    if group is None:
        group = dist.new_group(ranks=list(range(world)), backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        _GROUPS[key] = group
    rank = dist.get_rank()
    control = group
    if backend != "gloo":
        control = _GROUPS.get(key + ("control",))
        if control is None:
            control = dist.new_group(ranks=list(range(world)), backend="gloo",
                                     timeout=datetime.timedelta(seconds=timeout_s))
            _GROUPS[key + ("control",)] = control
    if pp_size > 1:
        tp_group, dp_group, pp_group, pp_ranks = _pipeline_groups(backend, world, pp_size, tp_size, timeout_s, rank)
        per_stage = world // pp_size
        return DataParallel(world, rank, group, group.group_name, backend, dp_group=dp_group,
                            dp_group_name=dp_group.group_name if dp_group is not None else None,
                            tp_size=tp_size, tp_rank=rank % tp_size, tp_group=tp_group,
                            tp_group_name=tp_group.group_name if tp_group is not None else None,
                            pp_size=pp_size, pp_rank=rank // per_stage, pp_group=pp_group,
                            pp_group_name=pp_group.group_name, pp_ranks=pp_ranks, control_group=control)
    if tp_size <= 1:
        return DataParallel(world, rank, group, group.group_name, backend, dp_group=group, dp_group_name=group.group_name,
                            control_group=control)
    tp_group, dp_group = _mesh_groups(backend, world, tp_size, timeout_s, rank)
    return DataParallel(world, rank, group, group.group_name, backend, tp_size=tp_size, tp_rank=rank % tp_size,
                        tp_group=tp_group, tp_group_name=tp_group.group_name, dp_group=dp_group,
                        dp_group_name=dp_group.group_name, control_group=control)


def _mesh_groups(backend: str, world: int, tp: int, timeout_s: float, rank: int) -> tuple[Any, Any]:
    """This rank's TP and DP groups. Every rank creates every group, in the
    same order (``new_group`` is a collective over the default group)."""
    key = ("mesh", backend, world, tp, timeout_s, id(dist.group.WORLD))
    if key not in _GROUPS:
        timeout = datetime.timedelta(seconds=timeout_s)
        mine_tp = mine_dp = None
        for start in range(0, world, tp):  # TP groups: consecutive ranks
            g = dist.new_group(ranks=list(range(start, start + tp)), backend=backend, timeout=timeout)
            if start <= rank < start + tp:
                mine_tp = g
        for offset in range(tp):  # DP groups: the same place in every TP group
            g = dist.new_group(ranks=list(range(offset, world, tp)), backend=backend, timeout=timeout)
            if rank % tp == offset:
                mine_dp = g
        _GROUPS[key] = (mine_tp, mine_dp)
    return _GROUPS[key]


def _pipeline_groups(backend: str, world: int, pp: int, tp: int, timeout_s: float,
                     rank: int) -> tuple[Any, Any, Any, tuple[int, ...]]:
    """This rank's groups in the (pipeline, data, tensor) mesh, rank =
    stage x (dp x tp) + place in the stage's data-parallel group x tp +
    place in the tensor-parallel group: its tensor-parallel group (None
    without TP), data-parallel group (None when one rank per stage and TP
    place), pipeline group, and the pipeline group's ranks by stage. Every
    rank creates every group, in the same order."""
    key = ("pipeline", backend, world, pp, tp, timeout_s, id(dist.group.WORLD))
    if key not in _GROUPS:
        timeout = datetime.timedelta(seconds=timeout_s)
        per_stage = world // pp
        dp = per_stage // tp
        mine_tp = mine_dp = mine_pp = None
        mine_ranks: tuple[int, ...] = ()
        if tp > 1:
            for start in range(0, world, tp):
                g = dist.new_group(ranks=list(range(start, start + tp)), backend=backend, timeout=timeout)
                if start <= rank < start + tp:
                    mine_tp = g
        if dp > 1:
            for stage in range(pp):
                for t in range(tp):
                    ranks = [stage * per_stage + d * tp + t for d in range(dp)]
                    g = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
                    if rank in ranks:
                        mine_dp = g
        for place in range(per_stage):
            ranks = tuple(place + stage * per_stage for stage in range(pp))
            g = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
            if rank % per_stage == place:
                mine_pp, mine_ranks = g, ranks
        _GROUPS[key] = (mine_tp, mine_dp, mine_pp, mine_ranks)
    return _GROUPS[key]


# stepfx's process groups, one per (backend, world, timeout, default group):
# a process group is a process-wide resource (sockets, threads, a
# communicator), and every decorated step of a job shares it rather than
# making its own. An aborted group is dropped (DataParallel.abort).
_GROUPS: dict[tuple, Any] = {}


def collective_fingerprint(graph: StepGraph, tp_group: str | None = None) -> list[str]:
    """What every rank must agree on: the step's inputs read from the user's
    objects other than the batch (parameters, buffers, state: roles, names,
    shapes and dtypes) and
    each collective (op, input shape and dtype, arguments other than the
    group) in graph order. Batch shapes may differ between ranks (each rank
    pads its own batch); the collectives they feed may not. Collectives over
    the tensor-parallel group ``tp_group`` carry activations, sized by the
    batch the group shares (another group's may differ): their op, rank
    and dtype count, not their sizes."""
    items = []
    for node in graph.gm.graph.nodes:
        if node.op == "placeholder":
            slot, val = node.meta["slot"], node.meta.get("val")
            # what a rank holds itself (ZeRO pieces, state of parameters it updates) is its own;
            # what it reads from the user's objects is everyone's
            if slot.role is not Role.BATCH and slot.storage is Storage.USER and isinstance(val, torch.Tensor):
                items.append(f"{slot.describe()}: {_shape(val)} {val.dtype}")
        elif node.op == "call_function" and is_collective(node) and node.target is not torch.ops._c10d_functional.wait_tensor.default:
            val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
            shape = _shape(val) if val is not None else "?"
            if tp_group is not None and tp_group in node.args[1:] and val is not None:
                shape = f"<{val.dim()} dims, the tensor-parallel group's batch>"
            others = [a for a in node.args[1:] if not isinstance(a, str) or a in ("sum", "avg", "max", "min")]
            items.append(f"{node.target}{shape} {getattr(val, 'dtype', '')} {others}")
    return items


def rank_varying_dims(dp: DataParallel, shapes: dict[str, tuple[int, ...]]) -> dict[str, frozenset[int]]:
    """Batch slot name -> the dimensions whose size differs between ranks at
    this call (a collective: every rank calls it at its first step). Ranks
    that pad their own batches differ in the sequence length from the
    start; those dimensions vary, and the first capture can make them
    symbolic instead of learning it one capture later."""
    everyone: list[Any] = [None] * dp.world_size
    dist.all_gather_object(everyone, shapes, group=dp.group)
    dims: dict[str, frozenset[int]] = {}
    for name, shape in shapes.items():
        others = [e.get(name) for e in everyone]
        if any(o is None or len(o) != len(shape) for o in others):
            continue
        varying = frozenset(d for d in range(len(shape)) if len({o[d] for o in others}) > 1)
        if varying:
            dims[name] = varying
    return dims


def _batch_digests(dp: DataParallel, batch: dict[str, torch.Tensor]) -> list[Any]:
    """Every rank's batch shapes and a digest of its values (float64 sums,
    exact for equal data): one collective over every rank."""
    mine = {name: (tuple(t.shape), float(t.double().sum()), float(t.double().square().sum())) for name, t in batch.items()}
    everyone: list[Any] = [None] * dp.world_size
    dist.all_gather_object(everyone, mine, group=dp.group)
    return everyone


def _first_difference(everyone: list[Any], ranks: list[int]) -> tuple[int, str, str] | None:
    """(rank, batch tensor, "shapes" | "values") where a rank of ``ranks`` was given another batch than the first."""
    seen = everyone[ranks[0]]
    for r in ranks[1:]:
        other = everyone[r]
        for name, mine in seen.items():
            if other.get(name) != mine:
                return r, name, "shapes" if other.get(name, (None,))[0] != mine[0] else "values"
    return None


def check_tensor_parallel_batches(dp: DataParallel, batch: dict[str, torch.Tensor]) -> None:
    """Every rank of a tensor-parallel group must run on the same batch (its
    data-parallel rank's): its ranks compute one step together, so another
    batch on one of them is a wrong step, or a hang. A collective over every
    rank at the first call, so every rank learns of a mismatch in any group
    and all raise together."""
    everyone = _batch_digests(dp, batch)
    tp = dp.tp_size
    for start in range(0, dp.world_size, tp):
        found = _first_difference(everyone, list(range(start, start + tp)))
        if found is not None:
            r, name, what = found
            raise RankMismatchError(
                f"tensor-parallel ranks {start} and {r} (a group of {tp}: ranks {start}-"
                f"{start + tp - 1}) were given different batches ({name}: {what} differ); every rank of a "
                "tensor-parallel group must get the same batch, its data-parallel rank's (a sampler with "
                f"num_replicas = world size / {tp} and rank = rank // {tp})")


def check_pipeline_batches(dp: DataParallel, batch: dict[str, torch.Tensor]) -> None:
    """Every rank of a pipeline (one per stage, the same place in each) runs
    the stages of one step on the same batch: the first stage reads the
    inputs, the last the labels, and each receives what its predecessor made
    of that batch, sized by it. Another batch on one of them is a wrong step,
    or a receive of the wrong size. Checked like the tensor-parallel groups,
    at the first call, over every rank."""
    everyone = _batch_digests(dp, batch)
    per_stage = dp.world_size // dp.pp_size
    for place in range(per_stage):
        ranks = list(range(place, dp.world_size, per_stage))
        found = _first_difference(everyone, ranks)
        if found is not None:
            r, name, what = found
            raise RankMismatchError(
                f"pipeline ranks {ranks[0]} and {r} (one pipeline: ranks {ranks}) were given different batches "
                f"({name}: {what} differ); every stage of a pipeline must get the same batch, its data-parallel "
                f"rank's (a sampler with num_replicas = world size / {dp.pp_size * dp.tp_size} and rank = "
                f"(rank % {per_stage}) // {dp.tp_size})")


def _shape(val: torch.Tensor) -> tuple:
    """A shape as ranks can compare it: symbolic sizes (named per rank, in
    the order each rank's trace made them) all read ``sym``."""
    return tuple(s if isinstance(s, int) else "sym" for s in val.shape)


def captures_at_call(dp: DataParallel, captures: bool) -> tuple[bool, bool]:
    """(whether any rank captures at this call, whether every rank does):
    one all-reduce of two flags on the gloo control group, at every call of
    a step on more than one rank. Ranks run different programs only through
    a capture; a rank that captures alone (its own batch sizes, a Python
    value of its own) must not start an exchange the others, running the
    step, will never join: what this says decides who joins one."""
    if not dp.active:
        return captures, captures
    flags = torch.tensor([int(captures), int(not captures)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=dp.control_group)
    return bool(flags[0]), not bool(flags[1])


def any_rank(dp: DataParallel, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (the gloo control group)."""
    return captures_at_call(dp, flag)[0]


def preflight(dp: DataParallel, fingerprint: list[str] | None, error: BaseException | None,
              note: str | None = None) -> None:
    """Exchange compile outcome and fingerprint with every rank; raise on
    every rank if any failed or any differs. ``note``: how this rank came to
    this program (named in the error)."""
    if not dp.active:
        if error is not None:
            raise error
        return
    digest = hashlib.sha256("\n".join(fingerprint or []).encode()).hexdigest()
    mine = {
        "rank": dp.rank,
        "error": None if error is None else f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
        "digest": digest,
        "fingerprint": fingerprint or [],
        "note": note,
    }
    everyone: list[Any] = [None] * dp.world_size
    dist.all_gather_object(everyone, mine, group=dp.group)
    if error is not None:
        raise error
    failed = [e for e in everyone if e["error"]]
    if failed:
        raise RankMismatchError(
            "other ranks failed to compile this step, so this rank stops too: "
            + "; ".join(f"rank {e['rank']}: {e['error']}" for e in failed)
        )
    digests = {e["digest"] for e in everyone}
    if len(digests) > 1:
        raise RankMismatchError(_describe_mismatch(everyone, dp.rank))


def _describe_mismatch(everyone: list[dict], me: int) -> str:
    ref = everyone[0]["fingerprint"]
    lines = ["ranks compiled different steps; every rank must run the same program (same model, optimizer and collectives):"]
    for e in everyone[1:]:
        other = e["fingerprint"]
        for i in range(max(len(ref), len(other))):
            a = ref[i] if i < len(ref) else "<nothing>"
            b = other[i] if i < len(other) else "<nothing>"
            if a != b:
                lines.append(f"  item {i}: rank 0 has {a!r}, rank {e['rank']} has {b!r}")
                break
    lines += [f"  rank {e['rank']}: {e['note']}" for e in everyone if e.get("note")]
    return "\n".join(lines)


def failed_together(dp: DataParallel, exc: BaseException, runs: int) -> ExecutionError:
    """The error a rank raises when its step fails; aborts stepfx's group
    first so the other ranks do not wait for this one."""
    dp.abort()
    where = f" on rank {dp.rank}" if dp.active else ""
    text = (
        f"the compiled step failed{where} on run #{runs + 1}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}\n"
        "  the model and optimizer were left as they were before this call"
    )
    if dp.active:
        text += "\n  stepfx's data-parallel group was aborted so that every rank stops (a collective error here usually means another rank failed first)"
    return ExecutionError(text)
