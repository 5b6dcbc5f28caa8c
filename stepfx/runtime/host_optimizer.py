"""The optimizer update on the host (``zero_optimization.offload_optimizer``).

The compiled step calls two ops per group of parameters the
``offload_optimizer`` pass gave to the host (graph nodes, in program order):

- :func:`host_adam_start` where the group's last input exists (its
  gradients reduced, the unscale/clip factor and overflow flag known):
  records an event on the compute stream and hands the group to a worker
  thread. The worker copies the gradients and the parameters' pieces down
  on a copy stream (into pinned buffers when ``pin_memory``), runs
  Adam/AdamW on the host state in place (torch's fused CPU kernel, or
  :func:`adam_chunked`'s exact ops), parameter by parameter while the next
  one comes down, and copies the updated pieces up on another stream. The
  main thread goes on meanwhile (the worker only waits for the event): with
  no clipping and no fp16 loss scaling a group starts as soon as its
  gradients exist, and its update overlaps the rest of the backward; with
  clipping every group waits for the global norm, after the backward.
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

Failure: the host state is updated in place (a copy of 8 bytes per
parameter each step would cost more than the update). A job that has not
begun its update when the step fails is cancelled (:func:`abort_jobs`, from
the executor's failure path), so a step that fails before its updates leaves
the host state as it was; a failure after an update began (a collective
failing in the parameter all-gather that follows, which leaves the process
group unusable anyway) leaves that group's host state updated.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

__all__ = ["host_adam_start", "host_adam_wait", "HostJob", "abort_jobs", "PinnedPool"]

_LOCK = threading.Lock()
_WORKER: ThreadPoolExecutor | None = None
_STREAMS: dict = {}
_PENDING: set = set()


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


class HostJob:
    """A group's update in flight: the worker's future and what it returns."""

    def __init__(self, future: Future, cancel: threading.Event):
        self.future = future
        self.cancel = cancel


def abort_jobs() -> None:
    """Cancel the jobs that have not begun their update and wait for the
    others (the executor calls this when a step fails)."""
    with _LOCK:
        pending = list(_PENDING)
        _PENDING.clear()
    for job in pending:
        job.cancel.set()
    for job in pending:
        try:
            job.future.result()
        except Exception:  # the step's own failure is what the user sees
            pass


def _host_scalar(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.item())
    return float(value)


def host_adam_start(count: int, *flat, step_is_new: bool, eps: float, weight_decay: float, decoupled: bool,
                    maximize: bool, pin_memory: bool, kernel: str = "fused", params_on_host: bool = False) -> HostJob:
    """Start the update of ``count`` parameter pieces on the host. ``flat``:
    the pieces (on the device), their gradients (device), exp_avgs and
    exp_avg_sqs (host), their step counters (before this step's increment
    unless ``step_is_new``), then lr, beta1, beta2, grad_factor, found_inf as
    ``graph_ops.adam_step`` takes them (factor and flag may be None).
    ``kernel``: "fused" (torch's fused CPU Adam) or "exact"
    (:func:`adam_chunked`). ``params_on_host``: the pieces are host tensors
    (``offload_param``), updated in place and returned as they are."""
    params, grads, exp_avgs, exp_avg_sqs, steps = (list(flat[i * count:(i + 1) * count]) for i in range(5))
    lr, beta1, beta2, grad_factor, found_inf = flat[5 * count:5 * count + 5]
    device = grads[0].device if grads else torch.device("cpu")
    ready = None
    if device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
    cancel = threading.Event()

    def run():
        with torch.no_grad():  # grad mode is per thread: the graph's no_grad does not reach this one
            return _update(device, ready, params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, grad_factor,
                           found_inf, step_is_new=step_is_new, eps=eps, weight_decay=weight_decay,
                           decoupled=decoupled, maximize=maximize, pin=pin_memory, cancel=cancel, kernel=kernel,
                           in_place=params_on_host)

    job = HostJob(_worker().submit(run), cancel)
    with _LOCK:
        _PENDING.add(job)  # until its wait reads it, or a failed step aborts it
    return job


def host_adam_wait(job: HostJob) -> tuple:
    """The updated pieces (device), exp_avgs, exp_avg_sqs (host), flat:
    (param, exp_avg, exp_avg_sq) of each parameter in turn."""
    new_params, exp_avgs, exp_avg_sqs = job.future.result()
    with _LOCK:
        _PENDING.discard(job)
    for t in new_params:
        if t.device.type == "cuda":
            t.record_stream(torch.cuda.current_stream(t.device))  # made on the copy stream, read on this one
    return tuple(x for i in range(len(new_params)) for x in (new_params[i], exp_avgs[i], exp_avg_sqs[i]))


CHUNK = 1 << 18  # elements: the six fp32 slices an update touches (6 MiB) stay in cache between the ops
STATS: dict = {"jobs": 0, "elements": 0, "wait_down_s": 0.0, "update_s": 0.0, "wait_up_s": 0.0}
# seconds the worker spent, summed over jobs: waiting for copies down, updating, waiting for the last copies up
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


def _update(device, ready, params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, grad_factor, found_inf, *,
            step_is_new, eps, weight_decay, decoupled, maximize, pin, cancel, kernel, in_place=False):
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this thread's current device (ranks other than 0 use other GPUs)
        down, up = _streams(device)
        with torch.cuda.stream(down):
            down.wait_event(ready)
            scalars = [s.to("cpu", non_blocking=True) if isinstance(s, torch.Tensor) and s.device.type == "cuda" else s
                       for s in (grad_factor, found_inf, *steps)]
            got = torch.cuda.Event()
            got.record(down)
        got.synchronize()
        grad_factor, found_inf, *steps = scalars
    if cancel.is_set():
        raise RuntimeError("stepfx: host optimizer update cancelled (the step failed)")
    if found_inf is not None and bool(found_inf.reshape(()).item() != 0):
        return list(params), list(exp_avgs), list(exp_avg_sqs)  # an fp16 overflow: the step is skipped
    factor = grad_factor.float() if isinstance(grad_factor, torch.Tensor) else grad_factor
    hyper = dict(lr=_host_scalar(lr), beta1=_host_scalar(beta1), beta2=_host_scalar(beta2), eps=eps,
                 weight_decay=weight_decay, grad_factor=factor, decoupled=decoupled, maximize=maximize)
    steps = [_host_scalar(s) + (0.0 if step_is_new else 1.0) for s in steps]
    update = adam_fused if kernel == "fused" else adam_chunked
    if device.type != "cuda":
        new_params = []
        for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
            p = p.detach() if in_place else p.detach().clone()  # the graph's values are written only if host-held
            update(p.view(-1), g.reshape(-1), m.view(-1), v.view(-1), step=s, **hyper)
            new_params.append(p)
        return new_params, list(exp_avgs), list(exp_avg_sqs)
    return _pipelined(params, grads, exp_avgs, exp_avg_sqs, steps, hyper, update, down, up, pin, in_place)


def _pipelined(params, grads, exp_avgs, exp_avg_sqs, steps, hyper, update, down, up, pin, in_place=False):
    """Parameter by parameter: the next one's pieces come down while this one
    is updated, and each goes up as soon as it is; staging buffers go back to
    the pool once their copy up is done (so the host holds a few parameters'
    staging at a time, not the group's)."""
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

    new_params: list = []
    in_flight: list = []  # (event, staging buffers) of copies up not known to be done
    try:
        nxt = fetch(0) if params else None
        for i, p in enumerate(params):
            hp, hg, ev = nxt
            in_flight.append((None, (hg,) if in_place else (hp, hg)))  # the pool's staging buffers
            nxt = fetch(i + 1) if i + 1 < len(params) else None
            t0 = time.perf_counter()
            ev.synchronize()
            t1 = time.perf_counter()
            update(hp, hg, exp_avgs[i].view(-1), exp_avg_sqs[i].view(-1), step=steps[i], owned_grad=True, **hyper)
            STATS["wait_down_s"] += t1 - t0
            STATS["update_s"] += time.perf_counter() - t1
            STATS["elements"] += hp.numel()
            if in_place:
                in_flight[-1] = (ev, (hg,))
                new_params.append(p)
            else:
                with torch.cuda.stream(up):
                    out = torch.empty_like(p)
                    out.view(-1).copy_(hp, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(up)
                in_flight[-1] = (done, (hp, hg))
                new_params.append(out)
            while in_flight and in_flight[0][0] is not None and in_flight[0][0].query():
                for t in in_flight.pop(0)[1]:
                    POOL.give(t, pin)
        if nxt is not None:
            in_flight.append((nxt[2], nxt[1:2] if in_place else nxt[:2]))
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
    return new_params, list(exp_avgs), list(exp_avg_sqs)
