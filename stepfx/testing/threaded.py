"""Run a function on N ranks that are threads of this process: the cheap way to unit-test collectives.

torch's "threaded" process group gives each thread its own torch.distributed
world, so `dist.all_reduce` and the `torch.ops._c10d_functional` collectives
work across threads. A call costs ~1 ms with 2 ranks and ~1.6-3 ms with 4
(a few collectives included; 2-core CPU, torch 2.13), against ~1.5-3 s to
start rank processes; use it for unit tests and a `RankPool` for anything
that needs real processes (gloo/NCCL numerics, per-rank RNG, memory, crashes).

Limits: ranks share one process, so one torch RNG, one set of globals and
one stdout (output is not captured per rank); collectives run on the CPU.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist

from stepfx import compat
from stepfx.testing.errors import RankError, RankFailure, RankTimeout, failure_from, fn_name, ranks_text

_ABORT_WAIT_S = 1.0   # how long aborted ranks get to leave their collectives
_PLUMBING = {"threading.py", "multi_threaded_pg.py"}   # files of the threaded backend's waiting


def run_threaded(fn: Callable, world_size: int, *args, timeout: float = 60.0, **kwargs) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` thread ranks; return the results in rank order.

    Raises RankError naming every rank that raised (the others are woken out
    of their collectives), RankTimeout if ranks are still running after
    `timeout` seconds; their stacks say where they were. Not reentrant.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if compat.threaded_pg_installed():
        raise RuntimeError("run_threaded cannot be called from inside run_threaded")
    results: list[Any] = [None] * world_size
    failures: dict[int, RankFailure] = {}
    done = [False] * world_size
    stopping = threading.Event()   # set once the run is given up: SystemExit from now on is our abort

    def stop(exc: BaseException) -> None:
        stopping.set()
        compat.abort_threaded_collectives(exc)

    compat.install_threaded_pg()
    store = dist.HashStore()

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            results[rank] = fn(*args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, SystemExit) and stopping.is_set():
                failures[rank] = RankFailure(rank, "aborted", message="woken out of a collective "
                                             "after another rank failed or the run timed out")
            else:
                failures[rank] = failure_from(rank, exc, skip_frames=1)
                stop(exc)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            done[rank] = True

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"stepfx-rank{r}", daemon=True)
               for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        unfinished = [r for r in range(world_size) if not done[r]]
        stacks = _stacks_of([threads[r] for r in unfinished])
        if unfinished:
            stop(TimeoutError("run_threaded timed out"))
            for r in unfinished:
                threads[r].join(_ABORT_WAIT_S)
    finally:
        compat.uninstall_threaded_pg()

    what = fn_name(fn)
    real = [f for f in failures.values() if f.kind == "raised"]
    if real:
        raise RankError(f"{ranks_text([f.rank for f in real])} of {world_size} failed in {what} "
                        "(threaded)", list(failures.values()))
    if unfinished:
        timed_out = [RankFailure(r, "unfinished", message=summary, traceback=stack)
                     for r, (summary, stack) in zip(unfinished, stacks)]
        raise RankTimeout(f"{ranks_text(unfinished)} of {world_size} did not finish {what} within "
                          f"{timeout:g} s (threaded)", timed_out)
    return results


def _stacks_of(threads: list[threading.Thread]) -> list[tuple[str, str]]:
    """(one-line summary, stack) of where each thread is now."""
    frames = sys._current_frames()
    out = []
    for t in threads:
        frame = frames.get(t.ident)
        if frame is None:
            out.append(("no stack (thread ended)", ""))
            continue
        stack = traceback.extract_stack(frame)
        mains = [i for i, f in enumerate(stack) if f.name == "rank_main" and f.filename == __file__]
        stack = (stack[mains[0] + 1:] if mains else []) or stack   # drop the runner's own frames
        # Name the call the rank is blocked in, not the threaded backend's waiting machinery.
        inner = next((f for f in reversed(stack) if os.path.basename(f.filename) not in _PLUMBING),
                     stack[-1])
        out.append((f"in {inner.name} ({os.path.basename(inner.filename)}:{inner.lineno})",
                    "Stack (most recent call last):\n" + "".join(traceback.format_list(stack))))
    return out
