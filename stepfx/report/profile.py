"""``step.profile(steps=N)``: measure the next N runs of the current plan.

The executor already knows how to run a marked copy of its program
(``runtime/phase_timer.py``: a mark before each run of nodes of one kind —
forward, backward, optimizer, communication — read off the host clock on
the CPU, CUDA events on the device). A :class:`Profile` puts such a timer,
one that also keeps every run's segments with their start and end, in the
executor's ``timer`` slot for N runs and then puts back what was there (the
``wall_clock_breakdown`` timer, or none), so profiling costs nothing once
done. The segments are the measured timeline the report draws beside the
predicted one; "communication" segments are communication the program
waited for (exposed), and on CUDA the gaps between segments are idle time.

A run replayed as a CUDA graph has no marks (``stepfx.cuda_graphs``); those
runs are not measured, and the profile says so.

Under data parallelism ``profile`` is a collective (every rank calls it, as
it calls the step): it also measures the link, each kind of collective the
plan runs timed on the step's group at the plan's largest payload of that
kind (1 to 64 MiB), as bus bandwidth (the bytes a rank sends per second,
ring counting, as ``graph.accounting.communication`` counts them), which
the report sets against its assumed bandwidth.
"""
from __future__ import annotations

import torch

from ..runtime.phase_timer import PhaseTimer

__all__ = ["Profile", "profile_step"]


class _SegmentTimer(PhaseTimer):
    """A PhaseTimer that keeps each run's segments and hands the executor
    back its previous timer after ``wanted`` runs."""

    def __init__(self, executor, wanted: int, profile: "Profile"):
        super().__init__(executor.gm, "cuda" if profile.device_type == "cuda" else "cpu")
        self._executor, self._previous, self._wanted, self._profile = executor, executor.timer, wanted, profile

    def seconds(self) -> dict[str, float]:
        out = super().seconds()  # on CUDA this waits for the run's last event
        if self.cuda:
            starts = [self._events[0].elapsed_time(e) / 1e3 for e in self._events]
        else:
            starts = [t - self._times[0] for t in self._times]
        self._profile.runs.append([{"kind": k, "start": starts[i], "end": starts[i + 1]}
                                   for i, k in enumerate(self.kinds[:-1])])
        if len(self._profile.runs) >= self._wanted:
            self._executor.timer = self._previous
            if self.cuda:
                self._profile.peak_bytes = torch.cuda.max_memory_allocated()
        return out


def measure_links(plan, dp, repeats: int = 3) -> dict[str, float]:
    """Bus bandwidth (bytes a rank sends per second) of each kind of collective ``plan`` runs, on
    ``dp``'s group: a collective every rank must call (the kinds are the same on every rank)."""
    import time

    import torch.distributed as dist

    from ..graph.accounting import communication, ring_sent_bytes

    n = dp.world_size
    largest: dict[str, int] = {}
    for item in communication(plan.graph, n):
        largest[item.op] = max(largest.get(item.op, 0), int(item.payload_bytes))
    device = torch.device("cuda", torch.cuda.current_device()) if plan.device_type == "cuda" else torch.device("cpu")
    out = {}
    for op in sorted(largest):
        elements = min(max(largest[op], 1 << 20), 64 << 20) // 4 // n * n
        whole = torch.ones(elements, dtype=torch.float32, device=device)
        shard = torch.ones(elements // n, dtype=torch.float32, device=device)
        if op == "all_reduce":
            run, payload = (lambda: dist.all_reduce(whole, group=dp.group)), whole.nbytes
        elif op == "reduce_scatter":
            run, payload = (lambda: dist.reduce_scatter_tensor(shard, whole, group=dp.group)), whole.nbytes
        else:
            run, payload = (lambda: dist.all_gather_into_tensor(whole, shard, group=dp.group)), shard.nbytes
        sent = ring_sent_bytes(op, payload, n)
        run()  # warm-up: connections, algorithms
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(repeats):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out[op] = sent * repeats / (time.perf_counter() - started)
    return out


class Profile:
    """The measured runs: ``runs`` (one list of segments per run), on
    CUDA the peak bytes allocated over them (``peak_bytes``), and under data
    parallelism the link's measured bus bandwidth per collective (``links``)."""

    def __init__(self, plan, steps: int, dp=None):
        if steps < 1:
            raise ValueError(f"profile(steps={steps}): steps must be at least 1")
        self.plan = plan
        self.steps = steps
        self.device_type = plan.device_type
        self.runs: list[list[dict]] = []
        self.peak_bytes: int | None = None
        self.clock = "CUDA events on the current stream" if self.device_type == "cuda" else "the host clock"
        self.links = measure_links(plan, dp) if dp is not None and dp.active else {}
        if self.device_type == "cuda" and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        plan.executor.timer = _SegmentTimer(plan.executor, steps, self)

    @property
    def done(self) -> bool:
        return len(self.runs) >= self.steps

    def as_data(self) -> dict:
        """Segments averaged over the measured runs (every run of one plan
        has the same segments), for the report."""
        if not self.runs:
            return {"runs": 0, "steps": self.steps, "segments": [], "seconds": 0.0, "clock": self.clock,
                    "peak_bytes": self.peak_bytes, "links": self.links}
        n = len(self.runs)
        segments = [{"kind": seg["kind"],
                     "start": sum(run[i]["start"] for run in self.runs) / n,
                     "end": sum(run[i]["end"] for run in self.runs) / n}
                    for i, seg in enumerate(self.runs[0])]
        return {"runs": n, "steps": self.steps, "segments": segments,
                "seconds": segments[-1]["end"] if segments else 0.0, "clock": self.clock,
                "peak_bytes": self.peak_bytes, "links": self.links}


def profile_step(step, steps: int) -> Profile:
    """Measure the next ``steps`` runs of ``step``'s current plan (call the step once first); under
    data parallelism a collective (the link is measured on the step's group)."""
    return Profile(step.plan, steps, getattr(step, "_dp", None))
