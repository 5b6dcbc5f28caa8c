"""The optimizer update on the host (``zero_optimization.offload_optimizer``).

The compiled step calls these ops per group of parameters the
``offload_optimizer`` pass gave to the host (graph nodes, in program order):

- :func:`host_adam_start` where the group's gradients exist: records an
  event on the compute stream and hands the group to a worker thread. The
  worker copies the gradients and the parameters' pieces down on a copy
  stream (into pinned buffers when ``pin_memory``), runs Adam/AdamW on the
  host state in place (torch's fused CPU kernel, or :func:`adam_chunked`'s
  exact ops), parameter by parameter while the next one comes down, and
  copies the updated pieces up on another stream. The main thread goes on
  meanwhile (the worker only waits for the event), so the update overlaps
  the rest of the backward.
- with clipping or fp16 loss scaling the update needs the global norm and
  the overflow flag, known only after the backward. The start then
  *speculates*: while they are unknown, each piece is updated with the
  factor that holds when nothing is clipped (1, or the unscale factor) and
  no overflow, after a copy of the host state the update overwrites (the
  moments; the piece too where it lives on the host); or, with speculation
  off, left for later. :func:`host_adam_validate`, where the real factor
  and flag exist, hands them to the worker, which keeps each speculated
  update whose factor was the real one bit for bit, restores and redoes the
  others with the real factor (all of them restored on an overflow: the step
  is skipped), and does what was left. The result is the step without
  speculation, bit for bit, whatever the verdict.
- :func:`host_adam_wait` where the first updated piece is read: the job's
  result (its copies up are complete; the pieces, made on the copy stream,
  are recorded on the compute stream for the caching allocator).

The arithmetic: the gradient in fp32 times the factor, then the rule the
pass checked each region against (``torch.optim.adam._single_tensor_adam``):
with ``stepfx.host_adam: "exact"`` op for op (on CPU the step equals the one
without offloading bitwise), with "fused" (the default: 2.7x faster on the
H200 machine's host) through torch's fused CPU kernel, whose moments are the
same and whose parameter rounds differently within 1e-6 relative per step
(tests/runtime/test_offload_optimizer.py).

Under ``stepfx.host_update_across_steps`` a start (``across_steps``) is the
step's last word on its job: the job outlives the step, writing the donated
device pieces (or the 16-bit copies it is given, ``copy_into``) in place,
and registers them; the next step's first reader of each goes through
:func:`host_adam_ready`, which waits for that job only, so the update
overlaps the next forward. :func:`settle_across_steps` waits for them all
(state read between steps, a plan without those readers).

Failure: the host state is updated in place. A job that has not begun its
update when the step fails is cancelled (:func:`abort_jobs`, from the
executor's failure path) and speculated updates not yet validated are
restored from their copies, so a step that fails before its validation
leaves the host state as it was; a failure after a group was validated (a
collective failing in the parameter all-gather that follows, which leaves
the process group unusable anyway) leaves that group's host state updated.
Under ``delayed_parameter_update`` (:func:`host_adam_swap`) a step's update
outlives it; a failed step drops its own (cancelled as above) and the copies
it had taken are made afresh from the masters by the binding.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

__all__ = ["host_adam_start", "host_adam_validate", "host_adam_wait", "host_adam_swap", "host_adam_ready",
           "flush_delayed", "release_delayed", "settle_across_steps", "HostJob", "abort_jobs", "PinnedPool"]

_LOCK = threading.Lock()
_WORKER: ThreadPoolExecutor | None = None
_STREAMS: dict = {}
_PENDING: set = set()
_IN_FLIGHT: dict = {}  # host_update_across_steps: id(device tensor) -> (tensor, job writing it in place)
_ACROSS: set = set()  # the jobs of finished steps still running (host_update_across_steps)


def _worker() -> ThreadPoolExecutor:
    global _WORKER
    with _LOCK:
        if _WORKER is None:
            # one thread: jobs run in the order the graph starts them; torch's intra-op threads do the math
            _WORKER = ThreadPoolExecutor(1, thread_name_prefix="stepfx-host-optimizer")
        return _WORKER


def _streams(device: torch.device):
    with _LOCK:
        if device not in _STREAMS:
            _STREAMS[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return _STREAMS[device]


class PinnedPool:
    """Host staging buffers by (numel, dtype), reused across steps; pinned
    when asked (``offload_optimizer.pin_memory``)."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        with self._lock:
            free = self._free.get((numel, dtype, pin))
            if free:
                return free.pop()
        return torch.empty(numel, dtype=dtype, pin_memory=pin)

    def give(self, t: torch.Tensor, pin: bool) -> None:
        with self._lock:
            self._free.setdefault((t.numel(), t.dtype, pin), []).append(t)

    def nbytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)


POOL = PinnedPool()


class _Verdict:
    """What a speculative group is validated against: the unscale/clip factor
    and the overflow flag, posted by :func:`host_adam_validate` on the main
    thread (with an event after the device computed them) and read by the
    worker when it needs them (without stalling the compute stream)."""

    def __init__(self):
        self._posted = threading.Event()
        self._given: tuple = (None, None)
        self._event = None
        self._read: tuple | None = None

    def post(self, grad_factor, found_inf, event) -> None:
        self._given, self._event = (grad_factor, found_inf), event
        self._posted.set()

    def known(self) -> bool:
        """Whether reading would not wait (posted, and computed on the device)."""
        return self._posted.is_set() and (self._event is None or self._event.query())

    def read(self, device, stream) -> tuple:
        """(factor, overflow) on the host: a 0-d fp32 tensor or None, and a bool."""
        if self._read is None:
            self._posted.wait()
            factor, found_inf = self._given
            if self._event is not None:
                factor, found_inf = _to_host(device, stream, self._event, factor, found_inf)
            self._read = (_host_factor(factor), _overflowed(found_inf))
        return self._read


class _Group:
    """One start's parameters and where each stands: updated (``out``), updated
    on a speculated factor with a copy of what it overwrote (``backups``,
    ``speculated``), or not yet (``pending``)."""

    def __init__(self, device, params, grads, exp_avgs, exp_avg_sqs, steps, hyper, kernel, pin, in_place,
                 copy_dtype=None, donate=False, copy_into=None):
        self.device, self.params, self.grads = device, params, grads
        self.exp_avgs, self.exp_avg_sqs, self.steps = exp_avgs, exp_avg_sqs, steps
        self.hyper, self.pin, self.in_place = hyper, pin, in_place
        self.update = adam_fused if kernel == "fused" else adam_chunked
        self.out: list = [None] * len(params)
        self.copy_dtype = copy_dtype  # host_master_weights: each piece's 16-bit copy goes up
        self.copies: list = [None] * len(params)
        self.copy_into = copy_into  # the copies' device tensors, written in place (host_update_across_steps)
        self.backups: dict[int, list] = {}
        self.speculated: dict[int, object] = {}
        self.pending: list[int] = []
        self.guess = None  # the factor a speculative start assumed
        self.donate = donate and not in_place  # updates on the real factor go up into the device pieces
        self.streams = _streams(device) if device.type == "cuda" else (None, None)

    def state_of(self, i: int, host_param) -> list:
        """The host tensors an update of parameter ``i`` overwrites."""
        held = [self.exp_avgs[i].view(-1), self.exp_avg_sqs[i].view(-1)]
        return held + [host_param.view(-1)] if self.in_place else held

    def copy_bytes(self, i: int) -> int:
        return (12 if self.in_place else 8) * self.params[i].numel()

    def back_up(self, i: int, host_param) -> None:
        global _COPIES_LIVE
        t0 = time.perf_counter()
        copies = []
        for t in self.state_of(i, host_param):
            copy = POOL.take(t.numel(), t.dtype, False)
            copy.copy_(t)
            copies.append((t, copy))
        self.backups[i] = copies
        with _LOCK:
            _COPIES_LIVE += self.copy_bytes(i)
            STATS["copies_peak"] = max(STATS["copies_peak"], _COPIES_LIVE)
        STATS["backup_s"] += time.perf_counter() - t0

    def _release(self, i: int, restore: bool) -> None:
        global _COPIES_LIVE
        copies = self.backups.pop(i, None)
        if copies is None:
            return
        for t, copy in copies:
            if restore:
                t.copy_(copy)
            POOL.give(copy, False)
        with _LOCK:
            _COPIES_LIVE -= self.copy_bytes(i)

    def restore(self, i: int) -> None:
        self._release(i, True)
        self.speculated.pop(i, None)
        self.out[i] = self.copies[i] = None

    def commit(self, i: int) -> None:
        self._release(i, False)
        self.speculated.pop(i, None)

    def roll_back(self) -> None:
        """Every speculated update not yet validated undone (a failed step)."""
        for i in list(self.backups):
            self.restore(i)

    def result(self) -> tuple:
        return list(self.out), list(self.exp_avgs), list(self.exp_avg_sqs), list(self.copies)


class HostJob:
    """A group's update in flight: the worker's future (the start; with
    speculation, then the validation) and the group it updates."""

    def __init__(self, group: _Group | None, cancel: threading.Event, verdict: _Verdict | None = None,
                 key: str = ""):
        self.group, self.cancel, self.verdict = group, cancel, verdict
        self.key = key  # speculation "auto"'s memory of this start
        self.future: Future | None = None
        self.settled: Future | None = None

    def result(self):
        self.future.result()
        return (self.settled if self.settled is not None else self.future).result()

    def finish(self) -> None:
        """Wait for the worker; undo what was updated on a speculated factor and not yet validated."""
        for fut in (self.future, self.settled):
            if fut is not None:
                try:
                    fut.result()
                except Exception:  # the step's own failure is what the user sees
                    pass
        if self.group is not None:
            self.group.roll_back()


def abort_jobs() -> None:
    """Cancel the jobs that have not begun their update, wait for the others,
    and undo the speculated updates not yet validated (the executor calls
    this when a step fails)."""
    with _LOCK:
        pending = list(_PENDING)
        _PENDING.clear()
    for job in pending:
        job.cancel.set()
    for job in pending:
        job.finish()
    for key in [k for k, entry in _DELAYED.items() if entry[1] in pending]:  # the failed step's own
        del _DELAYED[key]
    with _LOCK:
        for key in [k for k, entry in _IN_FLIGHT.items() if entry[1] in pending]:
            del _IN_FLIGHT[key]
        _ACROSS.difference_update(pending)
        earlier = list(_ACROSS)
    for job in earlier:  # the steps before the failed one: their updates complete (the state is theirs)
        try:
            _settle(job)
        except Exception:  # the failed step's error is what the user sees
            pass


def _host_scalar(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.item())
    return float(value)


def _overflowed(found_inf) -> bool:
    """The fp16 overflow flag read on the host (None: no loss scaling)."""
    return found_inf is not None and bool(found_inf.reshape(()).item() != 0)


def _host_factor(value):
    """The factor as the update multiplies by it: a 0-d fp32 host tensor (as the device's ``mul(grad, factor)``), or None."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").float().reshape(())
    return None if value is None else torch.tensor(float(value), dtype=torch.float32)


def _to_host(device, stream, event, *values) -> list:
    """``values`` copied to the host after ``event``, on ``stream`` (the compute stream goes on)."""
    with torch.cuda.stream(stream):
        stream.wait_event(event)
        out = [v.to("cpu", non_blocking=True) if isinstance(v, torch.Tensor) and v.device.type == "cuda" else v
               for v in values]
        got = torch.cuda.Event()
        got.record(stream)
    got.synchronize()
    return out


def _same_factor(used, real) -> bool:
    """Whether an update multiplied by ``used`` (None: not multiplied) is the one ``real`` asks for, bit for bit."""
    one = torch.tensor(1.0)
    a = one if used is None else used
    b = one if real is None else real
    return bool(torch.equal(a.float().reshape(()), b.float().reshape(())))


_CLIPPED: dict = {}  # speculation "auto": start key -> whether its last validation undid a speculated update
_COPIES_LIVE = 0  # bytes of host state copied by speculated updates not yet validated (all groups)


def host_adam_start(count: int, *flat, step_is_new: bool, eps: float, weight_decay: float, decoupled: bool,
                    maximize: bool, pin_memory: bool, kernel: str = "fused", params_on_host: bool = False,
                    speculative: bool | str = False, key: str = "", copy_cap: int | None = None,
                    copy_dtype: torch.dtype | None = None, donate: bool = False, across_steps: bool = False) -> HostJob:
    """Start the update of ``count`` parameter pieces on the host. ``flat``:
    the pieces (on the device), their gradients (device), exp_avgs and
    exp_avg_sqs (host), their step counters (before this step's increment
    unless ``step_is_new``), then lr, beta1, beta2, grad_factor, found_inf as
    ``graph_ops.adam_step`` takes them (factor and flag may be None).
    ``kernel``: "fused" (torch's fused CPU Adam) or "exact"
    (:func:`adam_chunked`). ``params_on_host``: the pieces are host tensors
    (``offload_param``), updated in place and returned as they are.

    ``speculative`` (True or "auto"): ``grad_factor`` is the factor assumed
    (the unscale factor without clipping, or None) and ``found_inf`` None;
    :func:`host_adam_validate` brings the real ones. Until it has, each piece
    is updated on the assumption, after a copy of the host state it
    overwrites (True; "auto": unless the last validation of ``key`` undid
    one), or left for the validation; not once the copies alive would pass
    ``copy_cap`` bytes (all groups together).

    ``copy_dtype`` (``host_master_weights``; the pieces are host-held): each
    updated piece's copy in that dtype is made on the host and copied up; the
    wait returns them after the (param, exp_avg, exp_avg_sq) triples.

    ``donate`` (device-held pieces that nothing in the graph reads after
    this start): an update made on the real factor goes up into the piece
    itself, so the device never holds the old and the new masters together
    (a 13B model's fp32 pieces: 48 GiB); one made on a guess still goes into
    a new tensor (the redo reads the piece as it was).

    ``across_steps`` (``host_update_across_steps``; no speculation, the
    pieces donated or host-held): nothing waits for the job in this step.
    With ``copy_dtype`` the copies' device tensors follow the scalars in
    ``flat``, written in place. The device tensors the job writes are
    registered: :func:`host_adam_ready` waits for it where the next step
    first reads them."""
    params, grads, exp_avgs, exp_avg_sqs, steps = (list(flat[i * count:(i + 1) * count]) for i in range(5))
    lr, beta1, beta2, grad_factor, found_inf = flat[5 * count:5 * count + 5]
    # read now, not when the worker gets to it (after the step, under across_steps): a scheduler may change a
    # tensor learning rate in place before then
    lr, beta1, beta2 = (v if isinstance(v, torch.Tensor) and v.device.type != "cpu" else _host_scalar(v)
                        for v in (lr, beta1, beta2))
    copy_into = list(flat[5 * count + 5:6 * count + 5]) if across_steps and copy_dtype is not None else None
    if across_steps and (speculative or not (donate or params_on_host)):
        raise ValueError("host_adam_start: across_steps needs donated or host-held pieces and no speculation")
    device = grads[0].device if grads else torch.device("cpu")
    ready = None
    if device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
    cancel = threading.Event()
    verdict = _Verdict() if speculative else None
    job = HostJob(None, cancel, verdict, key)
    guess = speculative is True or (speculative == "auto" and not _CLIPPED.get(key, False))

    def run():
        with torch.no_grad():  # grad mode is per thread: the graph's no_grad does not reach this one
            if device.type == "cuda":
                torch.cuda.set_device(device)  # this thread's current device (ranks other than 0 use other GPUs)
                factor, flag, *counts = _to_host(device, _streams(device)[0], ready, grad_factor, found_inf, *steps)
            else:
                factor, flag, counts = grad_factor, found_inf, steps
            if cancel.is_set():
                raise RuntimeError("stepfx: host optimizer update cancelled (the step failed)")
            hyper = dict(lr=_host_scalar(lr), beta1=_host_scalar(beta1), beta2=_host_scalar(beta2), eps=eps,
                         weight_decay=weight_decay, decoupled=decoupled, maximize=maximize)
            counts = [_host_scalar(s) + (0.0 if step_is_new else 1.0) for s in counts]
            group = job.group = _Group(device, params, grads, exp_avgs, exp_avg_sqs, counts, hyper, kernel, pin_memory,
                                       params_on_host, copy_dtype, donate, copy_into)
            factor = group.guess = _host_factor(factor)
            if verdict is None:
                overflow = _overflowed(flag)
                _run(group, list(range(count)), lambda i: ("skip", None) if overflow else ("real", factor))
                return group.result()

            def choose(i):
                if verdict.known():
                    real, overflow = verdict.read(device, group.streams[0])
                    return ("skip", None) if overflow else ("real", real)
                if guess and (copy_cap is None or _COPIES_LIVE + group.copy_bytes(i) <= copy_cap):
                    return ("guess", factor)
                return ("defer", None)

            group.pending = _run(group, list(range(count)), choose)
            return None

    job.future = _worker().submit(run)
    with _LOCK:
        _PENDING.add(job)  # until its wait reads it (the step's end under across_steps), or a failed step aborts it
        if across_steps:
            for t in (copy_into if copy_into is not None else [] if params_on_host else params):
                _IN_FLIGHT[id(t)] = (t, job)
            _ACROSS.add(job)
    return job


host_adam_start.stepfx_side_effect = True  # under across_steps nothing reads its job: it must still run


def _settle(job: HostJob) -> None:
    """Wait for an across-steps ``job``; forget what it writes."""
    try:
        job.result()
    finally:
        with _LOCK:
            _ACROSS.discard(job)
            _PENDING.discard(job)
            for key in [k for k, (_, j) in _IN_FLIGHT.items() if j is job]:
                del _IN_FLIGHT[key]


def host_adam_ready(x: torch.Tensor) -> torch.Tensor:
    """``x`` (a piece or 16-bit copy the previous step's host update writes in
    place under ``host_update_across_steps``) once that update is done; ``x``
    as it is when nothing writes it. The update's copies up are complete when
    its job is (the worker waited for them)."""
    entry = _IN_FLIGHT.get(id(x))
    if entry is not None and entry[0] is x:
        try:
            _settle(entry[1])
        except Exception as exc:
            raise RuntimeError(f"stepfx: the previous step's host optimizer update failed: {exc}") from exc
    return x


host_adam_ready.stepfx_result_of_first_arg = True  # an alias of its argument: allocates nothing


def settle_across_steps(keep: frozenset = frozenset()) -> int:
    """Wait for the host updates finished steps left running (their writes in
    place complete), except those writing only tensors whose ids are in
    ``keep`` (a plan whose readers wait for them itself); how many."""
    if not _ACROSS:  # every step of every plan asks: nothing left running is the common case
        return 0
    with _LOCK:
        jobs = {j for j in _ACROSS if any(jj is j and key not in keep for key, (_, jj) in _IN_FLIGHT.items())
                or not any(jj is j for _, jj in _IN_FLIGHT.values())}
    for job in jobs:
        _settle(job)
    return len(jobs)


def host_adam_validate(job: HostJob, grad_factor, found_inf) -> HostJob:
    """A speculative job's real factor and overflow flag (device values, once
    the norm is known): the worker then keeps each update made on the
    assumed factor where it is the same bit for bit, undoes and redoes the
    others (or, on an overflow, undoes them all: the step is skipped), and
    updates what it left for now."""
    event = None
    tensors = [t for t in (grad_factor, found_inf) if isinstance(t, torch.Tensor)]
    if tensors and tensors[0].device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensors[0].device))
    job.verdict.post(grad_factor, found_inf, event)

    def settle():
        with torch.no_grad():
            job.future.result()
            group = job.group
            if group.device.type == "cuda":
                torch.cuda.set_device(group.device)
            if job.cancel.is_set():
                group.roll_back()
                raise RuntimeError("stepfx: host optimizer update cancelled (the step failed)")
            real, overflow = job.verdict.read(group.device, group.streams[0])
            redo = []
            for i, used in sorted(group.speculated.items()):
                if not overflow and _same_factor(used, real):
                    group.commit(i)
                else:
                    group.restore(i)
                    redo.append(i)
            STATS["rolled_back"] += sum(group.params[i].numel() for i in redo)
            _CLIPPED[job.key] = overflow or not _same_factor(group.guess, real)  # whether guessing would have missed
            todo, group.pending = redo + group.pending, []
            _run(group, todo, lambda i: ("skip", None) if overflow else ("real", real))
            return group.result()

    job.settled = _worker().submit(settle)
    return job


_DELAYED: dict = {}  # delayed_parameter_update: id(host master) -> (master, job, index, copy slot ident)


_WARMED: set = set()  # delayed_parameter_update with exact first steps: the copy idents past them (step no longer read)


def _exact_step(key: tuple, step, step_is_new: bool, exact_steps: int) -> bool:
    """Whether this update is one of the first ``exact_steps`` optimizer steps, which the delayed update makes
    exact (waited for). Reads the step counter (a host scalar, unless the optimizer is ``capturable``/fused: a
    device read then, made only until the steps are past). ``key``: the first host master's id and the copies'
    idents (two decorated steps training models with the same names keep apart)."""
    if exact_steps <= 0 or step is None or key in _WARMED:
        return False
    count = (step.item() if isinstance(step, torch.Tensor) else float(step)) + (0 if step_is_new else 1)
    if count > exact_steps:
        _WARMED.add(key)
        return False
    return True


def host_adam_swap(job: HostJob, *current, idents: tuple, step=None, step_is_new: bool = False,
                   exact_steps: int = 0) -> tuple:
    """In place of :func:`host_adam_wait` under ``stepfx.delayed_parameter_update``
    (ZeRO-Offload's one-step delayed parameter update): this step's ``job``
    goes on on the host while the next step computes; what the step returns
    is, for each parameter, what the previous step's job made of it (that
    job is waited for here: it ran during this step), or ``current`` where no
    update of it is pending. ``current``: (piece, exp_avg, exp_avg_sq) of
    each parameter in turn, then each piece's 16-bit copy (the pieces and
    moments are host tensors updated in place: the same objects either way);
    ``idents``: the copies' slot idents. Pending updates are kept by their
    host piece (the tensor, so two decorated steps never mix theirs up);
    :func:`flush_delayed` installs them.

    ``exact_steps`` (``delayed_parameter_update: N``): the first N optimizer
    steps (``step``, the first piece's counter, says which this is) wait
    for their own update and return it, as :func:`host_adam_wait` does:
    the stale gradients of the delayed update do the most harm at the start
    of training, where ZeRO-Offload also runs its first steps undelayed."""
    count = len(idents)
    triples, copies = current[:3 * count], list(current[3 * count:])
    if _exact_step((id(triples[0]), idents), step, step_is_new, exact_steps):
        made = job.result()[3]
        with _LOCK:
            _PENDING.discard(job)
        for i in range(count):
            copy = made[i]
            if copy.device.type == "cuda":
                copy.record_stream(torch.cuda.current_stream(copy.device))
            copies[i] = copy
        return tuple(triples) + tuple(copies)
    for i in range(count):
        master = triples[3 * i]
        pending = _DELAYED.pop(id(master), None)
        if pending is not None and pending[0] is master:
            _, prev, j, _ = pending
            copy = prev.result()[3][j]
            if copy.device.type == "cuda":
                copy.record_stream(torch.cuda.current_stream(copy.device))
            copies[i] = copy
    for i, ident in enumerate(idents):
        master = triples[3 * i]
        _DELAYED[id(master)] = (master, job, i, ident)
    return tuple(triples) + tuple(copies)


def release_delayed() -> None:
    """The step succeeded: its delayed and across-steps jobs belong to the steps after it, not to its failure path."""
    with _LOCK:
        _PENDING.difference_update(entry[1] for entry in _DELAYED.values())
        _PENDING.difference_update(_ACROSS)


def flush_delayed(store) -> int:
    """Wait for the pending delayed updates of the pieces ``store`` holds and
    install their copies there (before anything reads the state between
    steps); how many."""
    held = {id(t) for t in store.tensors.values()}
    done = 0
    for key, (master, job, j, ident) in list(_DELAYED.items()):
        if key not in held:
            continue  # another decorated step's
        store.tensors[ident] = job.result()[3][j]
        del _DELAYED[key]
        done += 1
    return done


def host_adam_wait(job: HostJob) -> tuple:
    """The updated pieces (device, or host where host-held), exp_avgs,
    exp_avg_sqs (host), flat: (param, exp_avg, exp_avg_sq) of each parameter
    in turn; then, with ``copy_dtype``, each piece's 16-bit copy (device)."""
    new_params, exp_avgs, exp_avg_sqs, copies = job.result()
    with _LOCK:
        _PENDING.discard(job)
    made = [c for c in copies if c is not None]
    for t in new_params + made:
        if t.device.type == "cuda":
            t.record_stream(torch.cuda.current_stream(t.device))  # made on the copy stream, read on this one
    triples = tuple(x for i in range(len(new_params)) for x in (new_params[i], exp_avgs[i], exp_avg_sqs[i]))
    return triples + tuple(made)


CHUNK = 1 << 18  # elements: the six fp32 slices an update touches (6 MiB) stay in cache between the ops
STATS: dict = {"jobs": 0, "elements": 0, "wait_down_s": 0.0, "update_s": 0.0, "wait_up_s": 0.0, "backup_s": 0.0,
                "speculated": 0, "rolled_back": 0, "copies_peak": 0}
# seconds the worker spent, summed over jobs: waiting for copies down, updating, waiting for the last copies up,
# copying the host state a speculated update overwrites; elements updated on a speculated factor, and those undone;
# the most bytes of such copies alive at once
_SCRATCH = threading.local()


def adam_chunked(p, g, m, v, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
                 grad_factor, decoupled: bool, maximize: bool, owned_grad: bool = False) -> None:
    """Adam/AdamW on flat host tensors in place, op for op as
    ``torch.optim.adam._single_tensor_adam`` (``adam_update_reference``), so
    bitwise equal to it (``stepfx.host_adam: "exact"``); chunk by chunk, so
    that each op reads what the one before it wrote from the cache and no
    temporary is bigger than a chunk; each op runs on torch's intra-op
    threads. Ten passes over each chunk: on the H200 machine's 16 cores
    0.56e9 elements/s against the fused kernel's 1.5e9 (2026-12-04); a pool
    of single-threaded Python workers over the chunks was slower still
    (0.21e9). ``owned_grad`` is :func:`adam_fused`'s; each chunk of the
    gradient is copied to scratch here anyway."""
    n = p.numel()
    if n == 0:
        return
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    scratch = getattr(_SCRATCH, "buffers", None)
    if scratch is None:
        scratch = _SCRATCH.buffers = (torch.empty(CHUNK), torch.empty(CHUNK))
    with torch.no_grad():
        for a in range(0, n, CHUNK):
            b = min(n, a + CHUNK)
            pc, mc, vc = p[a:b], m[a:b], v[a:b]
            gc, dc = scratch[0][: b - a], scratch[1][: b - a]
            gc.copy_(g[a:b])  # grad.float()
            if grad_factor is not None:
                gc.mul_(grad_factor)
            if maximize:
                gc.neg_()
            if weight_decay != 0:
                if decoupled:
                    pc.mul_(1 - lr * weight_decay)
                else:
                    gc.add_(pc, alpha=weight_decay)
            mc.lerp_(gc, 1 - beta1)
            vc.mul_(beta2).addcmul_(gc, gc, value=1 - beta2)
            torch.sqrt(vc, out=dc)
            dc.div_(bias_correction2_sqrt).add_(eps)
            pc.addcdiv_(mc, dc, value=-step_size)


def adam_fused(p, g, m, v, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
               grad_factor, decoupled: bool, maximize: bool, owned_grad: bool = False) -> None:
    """The same update with torch's fused CPU Adam/AdamW (``stepfx.host_adam: "fused"``).
    The gradient times the factor in fp32 is made in place when the caller
    owns it (``owned_grad``: a staging buffer) and it is fp32, else in a
    scratch buffer the thread keeps: a fresh tensor each step would fault in
    its pages anew (5 GB a step on the 1.3B)."""
    if grad_factor is not None or g.dtype != torch.float32:
        if owned_grad and g.dtype == torch.float32:
            g32 = g
        else:
            scratch = getattr(_SCRATCH, "fused", None)
            if scratch is None or scratch.numel() < g.numel():
                scratch = _SCRATCH.fused = torch.empty(g.numel())
            g32 = scratch[: g.numel()].view(g.shape)
            g32.copy_(g)
        if grad_factor is not None:
            g32.mul_(grad_factor)
    else:
        g32 = g
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fused([p], [g32], [m], [v], [], [torch.tensor(float(step))], lr=lr, beta1=beta1, beta2=beta2,
          weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=maximize)


def _run(group: _Group, indices: list[int], choose) -> list[int]:
    """Update the parameters ``indices`` of ``group`` in turn; ``choose(i)``,
    asked when the parameter's data is at hand, says how: ("real", factor),
    ("guess", factor) (back up first), ("skip", None) (an fp16 overflow: the
    parameter stays as it was) or ("defer", None) (this one and the rest
    later). Returns those deferred."""
    if group.device.type == "cuda":
        return _pipelined(group, indices, choose)
    for k, i in enumerate(indices):
        mode, factor = choose(i)
        if mode == "defer":
            return indices[k:]
        p = group.params[i]
        if mode != "skip":
            # the graph's values are written only if host-held, or donated and updated on the real factor
            p = p.detach() if group.in_place or (group.donate and mode == "real") else p.detach().clone()
            _update_one(group, i, p.view(-1), group.grads[i].reshape(-1), mode, factor)
        group.out[i] = p
        if group.copy_dtype is not None and group.copy_into is not None:
            group.copies[i] = group.copy_into[i]
            group.copies[i].copy_(p.detach())
        elif group.copy_dtype is not None:
            group.copies[i] = p.detach().to(group.copy_dtype)
    STATS["jobs"] += 1
    return []


def _update_one(group: _Group, i: int, hp, hg, mode: str, factor, owned_grad: bool = False) -> None:
    if mode == "guess":
        group.back_up(i, hp)
        group.speculated[i] = factor
        STATS["speculated"] += hp.numel()
    t0 = time.perf_counter()
    group.update(hp, hg, group.exp_avgs[i].view(-1), group.exp_avg_sqs[i].view(-1), step=group.steps[i],
                 grad_factor=factor, owned_grad=owned_grad, **group.hyper)
    STATS["update_s"] += time.perf_counter() - t0
    STATS["elements"] += hp.numel()


def _pipelined(group: _Group, indices: list[int], choose) -> list[int]:
    """Parameter by parameter: the next one's pieces come down while this one
    is updated, and each goes up as soon as it is; staging buffers go back to
    the pool once their copy up is done (so the host holds a few parameters'
    staging at a time, not the group's)."""
    down, up = group.streams
    params, grads, pin, in_place = group.params, group.grads, group.pin, group.in_place

    def fetch(i):
        p, g = params[i], grads[i]
        with torch.cuda.stream(down):
            hp = p.view(-1) if in_place else POOL.take(p.numel(), p.dtype, pin)  # host-held: updated where it is
            hg = POOL.take(g.numel(), g.dtype, pin)
            if not in_place:
                hp.copy_(p.reshape(-1), non_blocking=True)
            hg.copy_(g.reshape(-1), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(down)
        return hp, hg, ev

    def staging(hp, hg):
        return (hg,) if in_place else (hp, hg)

    deferred: list[int] = []
    in_flight: list = []  # (event, staging buffers) of copies not known to be done
    t0 = time.perf_counter()
    try:
        nxt = fetch(indices[0]) if indices else None
        for k, i in enumerate(indices):
            hp, hg, ev = nxt
            in_flight.append((None, staging(hp, hg)))
            nxt = fetch(indices[k + 1]) if k + 1 < len(indices) else None
            t0 = time.perf_counter()
            ev.synchronize()
            STATS["wait_down_s"] += time.perf_counter() - t0
            mode, factor = choose(i)
            if mode == "defer" or mode == "skip" and group.copy_dtype is None:
                in_flight[-1] = (ev, staging(hp, hg))
                if mode == "defer":
                    deferred = indices[k:]
                    break
                group.out[i] = params[i]
                continue
            if mode != "skip":
                _update_one(group, i, hp, hg, mode, factor, owned_grad=True)
            if group.copy_dtype is not None:  # host-held piece (in place): its 16-bit copy goes up
                staged = POOL.take(hp.numel(), group.copy_dtype, pin)
                staged.copy_(hp)
                with torch.cuda.stream(up):
                    copy = (group.copy_into[i] if group.copy_into is not None
                            else torch.empty(params[i].shape, dtype=group.copy_dtype, device=group.device))
                    copy.view(-1).copy_(staged, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(up)
                in_flight[-1] = (done, (hg, staged))
                group.copies[i] = copy
                group.out[i] = params[i]
            elif in_place:
                in_flight[-1] = (ev, (hg,))
                group.out[i] = params[i]
            else:
                p = params[i]
                with torch.cuda.stream(up):  # donated: into the piece (its copy down is done: ``ev`` above)
                    out = p if group.donate and mode == "real" else torch.empty_like(p)
                    out.view(-1).copy_(hp, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(up)
                in_flight[-1] = (done, (hp, hg))
                group.out[i] = out
            while in_flight and in_flight[0][0] is not None and in_flight[0][0].query():
                for t in in_flight.pop(0)[1]:
                    POOL.give(t, pin)
        if nxt is not None:
            in_flight.append((nxt[2], staging(*nxt[:2])))
        STATS["jobs"] += 1
        t0 = time.perf_counter()
    finally:
        for event, buffers in in_flight:
            if event is not None:
                event.synchronize()  # never hand back a buffer a copy still reads
            else:
                torch.cuda.current_stream().synchronize()
                down.synchronize()
            for t in buffers:
                POOL.give(t, pin)
    STATS["wait_up_s"] += time.perf_counter() - t0
    return deferred
