"""Data parallelism over torch.distributed: the group, the pre-flight check,
and failing together.

- The process group comes from torchrun's environment (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``), NCCL for CUDA and gloo for CPU;
  stepfx never launches processes. Data parallelism spans all ranks.
- stepfx's collectives run on a group of their own (all ranks), created
  with a bounded timeout, so that a failed step can abort it without
  touching the user's default group.
- Pre-flight: before a rank first runs a compiled step, all ranks exchange
  whether they compiled at all and a fingerprint of what they will run
  (the state they hold and the sequence of collectives; batch shapes may
  differ). A later capture that only a rank's own batch sizes caused runs
  without an exchange when its collectives are ones already agreed on. Any difference makes
  every rank raise an error that says what differs — no rank is left
  waiting in a collective that another rank will never issue.
- A rank whose step fails mid-way aborts stepfx's group: the other ranks'
  pending collectives fail at once and they raise too.
"""
from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..errors import ExecutionError, StepfxError
from ..graph import Role, StepGraph, Storage
from ..graph.ops import is_collective

__all__ = ["DataParallel", "data_parallel", "collective_fingerprint", "preflight", "rank_varying_dims",
           "RankMismatchError"]

DEFAULT_TIMEOUT_S = 600.0


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

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def abort(self) -> None:
        """Abort stepfx's group so every rank blocked in one of its
        collectives fails now instead of at the timeout."""
        if self.group is None:
            return
        group, self.group = self.group, None
        for key, value in list(_GROUPS.items()):
            if value is group:
                del _GROUPS[key]
        abort = getattr(group, "abort", None)
        try:
            if abort is not None:
                abort()
            dist.destroy_process_group(group)
        except Exception:  # already broken: nothing more to release
            pass


def data_parallel(device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> DataParallel:
    """Join (or start, from torchrun's environment) torch.distributed and
    make stepfx's data-parallel group. A single process without torchrun's
    environment is world size 1."""
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
    return DataParallel(world, dist.get_rank(), group, group.group_name, backend)


# stepfx's process groups, one per (backend, world, timeout, default group):
# a process group is a process-wide resource (sockets, threads, a
# communicator), and every decorated step of a job shares it rather than
# making its own. An aborted group is dropped (DataParallel.abort).
_GROUPS: dict[tuple, Any] = {}


def collective_fingerprint(graph: StepGraph) -> list[str]:
    """What every rank must agree on: the step's inputs read from the user's
    objects other than the batch (parameters, buffers, state: roles, names,
    shapes and dtypes) and
    each collective (op, input shape and dtype, arguments other than the
    group) in graph order. Batch shapes may differ between ranks (each rank
    pads its own batch); the collectives they feed may not."""
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


def _shape(val: torch.Tensor) -> tuple:
    """A shape as ranks can compare it: symbolic sizes (named per rank, in
    the order each rank's trace made them) all read ``sym``."""
    return tuple(s if isinstance(s, int) else "sym" for s in val.shape)


def preflight(dp: DataParallel, fingerprint: list[str] | None, error: BaseException | None) -> None:
    """Exchange compile outcome and fingerprint with every rank; raise on
    every rank if any failed or any differs."""
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
