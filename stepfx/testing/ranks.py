"""Run a function on N local ranks, in rank processes kept alive across tests.

Starting rank processes is slow (each imports torch and joins a process
group), so a `RankPool` starts them once and reuses them for every `run`:

    with RankPool(2) as pool:
        results = pool.run(all_reduce_ones, 4)    # [rank 0's result, rank 1's]

Each rank process gets the environment torchrun gives its workers and calls
`torch.distributed.init_process_group(backend)` once. Like torchrun's agent,
the pool hosts the TCPStore itself (TORCHELASTIC_USE_AGENT_STORE=True), so
MASTER_PORT is a port the pool already holds: no free-port race.

Measured on a 2-core CPU machine, torch 2.13, gloo: a run costs ~0.2 ms
beyond fn itself (2 or 4 ranks). Starting the ranks costs ~1.5 s (2 ranks)
or ~2.9 s (4 ranks) with "spawn"; with "forkserver" the process's first pool
costs ~1.2 s and every later start or restart 0.03-0.07 s.

Invariants the pool keeps:
- `run` never hangs: ranks that do not finish within the timeout are killed
  (after their Python stacks are dumped, to say what they were doing).
- After any failed or timed-out run the workers are killed, because a
  collective may be half done; the next `run` starts fresh ones.
- A rank's stdout/stderr (fds 1 and 2, so C++ output too) goes to a file
  per rank; it is shown only when a run fails.
"""
from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import re
import signal
import sys
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from stepfx.testing.errors import RankError, RankFailure, RankTimeout, failure_from, fn_name, ranks_text

log = logging.getLogger(__name__)

_STACK_SIGNAL = signal.SIGUSR1   # a rank dumps its Python stacks on this signal
_STOP_TIMEOUT_S = 5.0            # a clean stop that takes longer is finished with SIGKILL


# --------------------------------------------------------------------------
# Helpers for rank code


def rank() -> int:
    """This rank's index in the default process group."""
    return dist.get_rank()


def world_size() -> int:
    """The number of ranks in the default process group."""
    return dist.get_world_size()


def seed_all(seed: int) -> None:
    """Seed Python's, NumPy's (if installed) and torch's (CPU and CUDA) RNGs.

    Under `run_threaded` all ranks share one process and so one torch RNG:
    seeding there does not give each rank its own reproducible stream.
    """
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------
# Inside a rank process


def torchrun_env(rank: int, world_size: int, master_port: int, *, run_id: str,
                 error_file: str, restart_count: int = 0) -> dict[str, str]:
    """The environment torchrun gives worker `rank` of a one-node job.

    Mirrors torch.distributed.elastic's LocalElasticAgent (torch 2.11-2.13):
    the agent (here the pool) hosts the TCPStore, hence
    TORCHELASTIC_USE_AGENT_STORE; error_file is where torch's `@record`
    writes a rank's exception.
    """
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(world_size),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        # torchrun sets 1 when several workers share a node and the user set nothing.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


@dataclasses.dataclass(frozen=True)
class _WorkerSpec:
    rank: int
    backend: str
    env: dict[str, str]
    output_path: str
    stack_path: str


def _identity(x):
    return x


class _ToCpuPickler(pickle.Pickler):
    """Pickles results so the parent can load them: tensors become detached CPU tensors."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and (
                obj.device.type != "cpu" or (obj.requires_grad and not obj.is_leaf)):
            return _identity, (obj.detach().cpu(),)
        return NotImplemented


def _dumps_to_cpu(obj) -> bytes:
    buf = io.BytesIO()
    _ToCpuPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _send(conn, msg) -> None:
    # Our own pickling, not Connection.send: torch registers reductions with
    # multiprocessing that would pass tensors as shared memory.
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _serve(conn, spec: _WorkerSpec) -> None:
    """Main function of one rank process: set up as torchrun would, then run jobs until stopped."""
    out = os.open(spec.output_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.stdout.reconfigure(line_buffering=True)   # a hung rank's prints still reach the file
    stacks = open(spec.stack_path, "ab", buffering=0)   # stays open: faulthandler writes to its fd
    faulthandler.register(_STACK_SIGNAL, file=stacks, all_threads=True)
    faulthandler.enable(file=sys.stderr)          # a crash leaves its stack in the output
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.environ.update(spec.env)
    try:
        if spec.backend == "nccl":
            torch.cuda.set_device(int(spec.env["LOCAL_RANK"]))
        else:
            torch.set_num_threads(1)
        dist.init_process_group(spec.backend)
    except BaseException as exc:
        _send(conn, ("raised", failure_from(spec.rank, exc, "init_process_group")))
        return
    _send(conn, ("ready", os.getpid()))
    try:
        while True:
            try:
                msg = _recv(conn)
            except EOFError:   # the parent is gone
                break
            if msg[0] == "stop":
                break
            _, sys_path, cwd, payload = msg
            _send(conn, _run_job(spec.rank, sys_path, cwd, payload))
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)   # skips interpreter teardown, ~1 s with torch loaded; nothing is left to clean up


def _run_job(rank: int, sys_path: list[str], cwd: str, payload: bytes):
    # Follow the parent: pytest adds test folders to sys.path as it collects them.
    sys.path[:] = sys_path
    try:
        os.chdir(cwd)
    except OSError:
        pass
    try:
        fn, args, kwargs = pickle.loads(payload)
        result = fn(*args, **kwargs)
    except BaseException as exc:
        return ("raised", failure_from(rank, exc, skip_frames=1))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    try:
        return ("ok", _dumps_to_cpu(result))
    except BaseException as exc:
        return ("raised", failure_from(rank, exc, "pickling the result"))


# --------------------------------------------------------------------------
# The parent's side


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')


def _where(stacks: str) -> tuple[str, str]:
    """(one-line summary, stack) of the rank's job from a faulthandler dump of all threads."""
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks):
        lines = block.strip().splitlines()
        frames = [l for l in lines if _FRAME.search(l)]
        jobs = [i for i, l in enumerate(frames) if l.rstrip().endswith(" in _run_job")]
        if not jobs:
            continue
        frames = frames[:jobs[0]]   # drop the pool's own frames below the job
        if not frames:
            return "in the pool's worker loop", ""
        m = _FRAME.search(frames[0])
        summary = f"in {m['fn']} ({os.path.basename(m['file'])}:{m['line']})"
        return summary, "\n".join(["Stack (most recent call first):"] + frames)
    return "no Python stack could be read", ""


class _Workers:
    """One generation of rank processes, their pipes and the TCPStore they rendezvous on."""

    def __init__(self, world_size: int, backend: str, ctx, folder: str, run_id: str,
                 generation: int):
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        self.output_paths = [os.path.join(folder, f"g{generation}-rank{r}.out") for r in range(world_size)]
        self.stack_paths = [os.path.join(folder, f"g{generation}-rank{r}.stacks") for r in range(world_size)]
        self.procs, self.conns = [], []
        for r in range(world_size):
            error_file = os.path.join(folder, f"g{generation}-rank{r}.error.json")
            env = torchrun_env(r, world_size, self.store.port, run_id=run_id,
                               error_file=error_file, restart_count=generation)
            spec = _WorkerSpec(r, backend, env, self.output_paths[r], self.stack_paths[r])
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_serve, args=(child_end, spec), daemon=True,
                               name=f"stepfx-rank{r}")
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        self.pids = [p.pid for p in self.procs]
        # Stops the ranks on stop(), garbage collection or interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, graceful=True)

    def output_offsets(self) -> list[int]:
        return [_size(p) for p in self.output_paths]

    def outputs_since(self, offsets: list[int]) -> list[str]:
        return [_read_from(p, o) for p, o in zip(self.output_paths, offsets)]

    def collect(self, timeout: float, grace: float):
        """Wait for one message per rank.

        Returns ({rank: message}, {rank: exitcode of a dead rank}, [unfinished ranks]).
        Once a rank has failed the others get at most `grace` more seconds:
        a rank waiting in a collective for a failed peer would wait forever.
        """
        deadline = time.monotonic() + timeout
        messages, dead = {}, {}
        pending = set(range(len(self.procs)))
        grace_end = None
        while pending:
            if grace_end is None and (dead or any(m[0] == "raised" for m in messages.values())):
                grace_end = time.monotonic() + grace
            left = min(deadline, grace_end or deadline) - time.monotonic()
            if left <= 0:
                break
            watch = {self.conns[r]: r for r in pending}
            watch.update({self.procs[r].sentinel: r for r in pending})
            for ready in multiprocessing.connection.wait(list(watch), timeout=left):
                r = watch[ready]
                if r not in pending:
                    continue
                conn = self.conns[r]
                if conn.poll():
                    try:
                        messages[r] = _recv(conn)
                        pending.discard(r)
                        continue
                    except (EOFError, OSError):
                        pass
                if not self.procs[r].is_alive() or ready is conn:
                    self.procs[r].join(1.0)
                    dead[r] = self.procs[r].exitcode
                    pending.discard(r)
        return messages, dead, sorted(pending)

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask `ranks` for their Python stacks (faulthandler, so it works inside a blocked collective)."""
        offsets = {r: _size(self.stack_paths[r]) for r in ranks}
        for r in ranks:
            try:
                os.kill(self.pids[r], _STACK_SIGNAL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(_size(self.stack_paths[r]) == offsets[r] for r in ranks):
            time.sleep(0.02)
        time.sleep(0.05)   # let a dump that has started finish
        return {r: _read_from(self.stack_paths[r], offsets[r]) for r in ranks}

    def stop(self) -> None:
        """Ask every rank to leave its process group and exit; kill those that do not."""
        self._finalizer()

    def kill(self) -> None:
        """Kill every rank now (its collectives may be stuck)."""
        if self._finalizer.detach():
            _shutdown(self.procs, self.conns, graceful=False)


def _shutdown(procs, conns, graceful: bool) -> None:
    if graceful:
        for conn in conns:
            try:
                _send(conn, ("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5.0)
    for conn in conns:
        conn.close()


class RankPool:
    """`world_size` rank processes, started once and reused by every `run`.

    backend: "gloo" (CPU; each rank uses one intra-op thread) or "nccl"
    (rank r uses cuda:r). start_method: "spawn" (every start and restart
    imports torch in each rank) or "forkserver" (ranks fork from a server
    that imported torch once: starts and restarts take tens of ms); "fork"
    deadlocks once the parent has used torch's thread pool. timeout: the
    default limit for starting the ranks and for each `run`, in seconds.
    failure_grace: once a rank has failed, how long the others may still
    take before they are reported as stuck (they are usually waiting in a
    collective for the failed rank).

    Runs share their rank processes: globals, process groups a run creates,
    RNG state and CUDA memory carry over to the next run (seed with
    `seed_all` in fn when it matters). `run` calls are serialized.
    """

    def __init__(self, world_size: int, *, backend: str = "gloo", start_method: str = "spawn",
                 timeout: float = 120.0, failure_grace: float = 5.0):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"start_method must be 'spawn' or 'forkserver', got {start_method!r} "
                "('fork' deadlocks once the parent has used torch's thread pool)")
        self.world_size = world_size
        self.backend = backend
        self.start_method = start_method
        self.timeout = timeout
        self.failure_grace = failure_grace
        self._ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # The fork server imports torch and this module once; a rank forked
            # from it starts in ~20 ms instead of ~1.5 s. The fork is safe: the
            # server never runs a torch op, so torch's thread pool does not exist
            # there. This sets multiprocessing's (process-wide) preload list and
            # has no effect once this process's fork server is running.
            self._ctx.set_forkserver_preload([__name__])
        self._folder = tempfile.TemporaryDirectory(prefix="stepfx-ranks-")
        self._run_id = uuid.uuid4().hex[:12]
        self._workers: _Workers | None = None
        self._generation = 0
        self._restart_reason = ""
        self._closed = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._workers else "not started")
        return f"RankPool(world_size={self.world_size}, backend={self.backend!r}, {state})"

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop the rank processes cleanly. The pool cannot be used afterwards."""
        with self._lock:
            self._closed = True
            if self._workers is not None:
                self._workers.stop()
                self._workers = None
            self._folder.cleanup()

    def run(self, fn: Callable, /, *args, timeout: float | None = None, **kwargs) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order.

        fn, args and kwargs are pickled (fn must be a module-level function);
        so are the results, with tensors moved to the CPU. Raises RankError if
        a rank raised or died, RankTimeout if ranks did not finish within
        `timeout` seconds (default: the pool's). Either leaves fresh workers
        for the next call.
        """
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"RankPool.run needs a picklable fn and arguments (a module-level function); "
                f"pickling {fn_name(fn)} failed: {exc}") from exc
        timeout = self.timeout if timeout is None else timeout
        with self._lock:
            workers = self._started()
            offsets = workers.output_offsets()
            msg = ("run", list(sys.path), os.getcwd(), payload)
            try:
                for conn in workers.conns:
                    _send(conn, msg)
                messages, dead, unfinished = workers.collect(timeout, self.failure_grace)
            except BaseException:   # e.g. Ctrl-C: the ranks are mid-job, start over next time
                self._discard(f"last run ({fn_name(fn)}) was interrupted")
                raise
            if not dead and not unfinished and all(m[0] == "ok" for m in messages.values()):
                return [pickle.loads(messages[r][1]) for r in range(self.world_size)]
            self._fail(workers, offsets, fn_name(fn), timeout, messages, dead, unfinished)

    def _started(self) -> _Workers:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._workers is not None:
            return self._workers
        if self._restart_reason:
            log.warning("RankPool(world_size=%d): restarting the rank processes because the %s",
                        self.world_size, self._restart_reason)
        start = time.perf_counter()
        workers = _Workers(self.world_size, self.backend, self._ctx, self._folder.name,
                           self._run_id, self._generation)
        self._generation += 1
        offsets = [0] * self.world_size
        messages, dead, unfinished = workers.collect(self.timeout, self.failure_grace)
        if dead or unfinished or any(m[0] != "ready" for m in messages.values()):
            self._fail(workers, offsets, "start-up (init_process_group)", self.timeout,
                       messages, dead, unfinished)
        log.info("RankPool(world_size=%d, backend=%s): started pids %s in %.2f s",
                 self.world_size, self.backend, workers.pids, time.perf_counter() - start)
        self._workers = workers
        self._restart_reason = ""
        return workers

    def _discard(self, reason: str) -> None:
        if self._workers is not None:
            self._workers.kill()
            self._workers = None
        self._restart_reason = reason

    def _fail(self, workers: _Workers, offsets: list[int], what: str, timeout: float,
              messages: dict, dead: dict, unfinished: list[int]):
        stacks = workers.dump_stacks(unfinished) if unfinished else {}
        workers.kill()   # a collective may be half done: these ranks cannot be trusted again
        if self._workers is workers:
            self._workers = None
        outputs = workers.outputs_since(offsets)
        failures = []
        for r, msg in sorted(messages.items()):
            if msg[0] == "raised":
                failures.append(dataclasses.replace(msg[1], output=outputs[r]))
        for r, code in sorted(dead.items()):
            reason = f"exit code {code}"
            if code is not None and code < 0:
                reason = f"killed by {signal.Signals(-code).name}"
            failures.append(RankFailure(r, "died", message=f"the rank process exited ({reason})",
                                        output=outputs[r]))
        for r in unfinished:
            summary, stack = _where(stacks.get(r, ""))
            failures.append(RankFailure(r, "unfinished", message=summary, traceback=stack,
                                        output=outputs[r]))
        finished = [r for r in range(self.world_size) if r not in unfinished]
        raised_or_died = [f.rank for f in failures if f.kind != "unfinished"]
        if raised_or_died:
            headline = f"{ranks_text(raised_or_died)} of {self.world_size} failed in {what}"
            if unfinished:
                headline += (f"; {ranks_text(unfinished)} still running {self.failure_grace:g} s "
                             "later (waiting for the failed ranks?)")
            error_type, reason = RankError, f"last run ({what}) failed"
        else:
            headline = (f"{ranks_text(unfinished)} of {self.world_size} did not finish {what} "
                        f"within {timeout:g} s")
            if finished:
                headline += f" ({ranks_text(finished)} finished)"
            error_type, reason = RankTimeout, f"last run ({what}) timed out"
        headline += "; the rank processes were killed and restart on the next run"
        self._restart_reason = reason
        for r, text in enumerate(outputs):
            if text:
                print(f"----- output of rank {r} during {what} -----\n{text.rstrip()}",
                      file=sys.stderr)
        raise error_type(headline, failures, outputs)
