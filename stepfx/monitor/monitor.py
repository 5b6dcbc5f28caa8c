"""``Monitor``: training logs and DeepSpeed's monitor blocks, fed once per optimizer update.

The step calls ``after_update`` after every optimizer update (not after
every micro-step under gradient accumulation) and ``close`` at the end.
From the config (``Config``, resolved as the step runs it):

- ``steps_per_print``: every that many updates, rank 0 logs one line
  through the "stepfx" logger at INFO (``log.py``). None: never.
- ``tensorboard`` / ``csv_monitor`` / ``wandb``: rank 0 writes one set of
  scalars per update (``writers.py``; DeepSpeed's tag names, ``TAGS``).
- ``wall_clock_breakdown``: per-phase seconds that the step measured
  (``phase_seconds``) are logged and written too.

Invariant: no host-device synchronization per update. Device tensors
(the loss, the fp16 loss scale and skipped-step counter, a tensor lr) are
copied on the device when given — a step may reuse its output buffers, as
CUDA graphs do — and read to the host in one transfer per device at a
print step, or every ``MAX_PENDING`` updates, or at ``close``. What rank 0
writes is what DeepSpeed writes: its own values, not an average over ranks.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import Config
from .log import Summary, format_line
from .writers import Event, Writer, check_writers_available, writers_from_config

__all__ = ["MAX_PENDING", "Monitor", "PHASES", "TAGS"]

log = logging.getLogger("stepfx")

# Updates whose device values may wait unread: one transfer per this many updates at most.
MAX_PENDING = 100
# wall_clock_breakdown phases -> DeepSpeed's tag suffixes (engine._write_monitor); "communication" is
# DeepSpeed's backward_allreduce, "optimizer" its step.
PHASES: Mapping[str, str] = {"forward": "elapsed_time_ms_forward", "backward": "elapsed_time_ms_backward",
                             "communication": "elapsed_time_ms_backward_allreduce",
                             "optimizer": "elapsed_time_ms_step"}
# Scalar -> tag. train_loss, lr, loss_scale and the elapsed times are DeepSpeed's names; the rest are
# stepfx's, in the same "Train/Samples/" namespace (the x axis is samples, as DeepSpeed's).
TAGS: Mapping[str, str] = {
    "loss": "Train/Samples/train_loss", "lr": "Train/Samples/lr", "loss_scale": "Train/Samples/loss_scale",
    "skipped_steps": "Train/Samples/skipped_steps", "tokens_per_second": "Train/Samples/tokens_per_second",
    "samples_per_second": "Train/Samples/samples_per_second", "mfu": "Train/Samples/mfu",
    "peak_memory_bytes": "Train/Samples/peak_memory_bytes",
    **{f"phase:{name}": f"Train/Samples/{suffix}" for name, suffix in PHASES.items()},
}

Scalar = float | int | torch.Tensor


@dataclass
class _Update:
    """One update as given; ``values`` may hold device tensors until the next flush."""

    step: int  # the writers' x axis
    values: dict[str, Any]
    tokens: int | None
    seconds: float | None
    peak_memory_bytes: int | None
    flops_per_token: float | None


@dataclass
class _Window:
    """Host totals over the updates since the last log line."""

    losses: list[float] = field(default_factory=list)
    last: dict[str, float] = field(default_factory=dict)  # lr, loss scale, skipped steps: latest value
    seconds: float = 0.0  # of updates whose seconds are known
    samples: int = 0
    token_seconds: float = 0.0  # of timed updates that gave tokens
    tokens: int = 0
    flop_seconds: float = 0.0  # of timed updates that gave tokens and FLOPs per token
    flops: float = 0.0
    peak_memory_bytes: int | None = None
    phase_seconds: dict[str, list[float]] = field(default_factory=dict)


class Monitor:
    """Logs and monitor files for one training run (see the module docstring).

    ``rank``/``world_size``: this process's and the data-parallel world's
    (only rank 0 logs and writes). ``peak_flops``: one device's peak
    FLOP/s for the compute dtype, for MFU; None (e.g. on CPU): no MFU.
    ``writers``: replaces the writers the config asks for (rank 0 only).
    ``clock``: seconds, for updates whose ``seconds`` are not given.

    A missing package for an enabled block raises ImportError here, on
    every rank, naming the config key and the package to install.
    """

    def __init__(self, config: Config, *, rank: int = 0, world_size: int = 1, peak_flops: float | None = None,
                 writers: Sequence[Writer] | None = None, clock: Callable[[], float] = time.perf_counter):
        check_writers_available(config)
        self.steps_per_print: int | None = config.steps_per_print
        self.wall_clock_breakdown: bool = config.wall_clock_breakdown
        batch = config.train_batch_size
        self.samples_per_update: int | None = batch if isinstance(batch, int) else None
        self.world_size = world_size
        self.peak_flops = peak_flops
        self.rank = rank
        self.writers: list[Writer] = []
        if rank == 0:
            self.writers = writers_from_config(config) if writers is None else list(writers)
        self._clock = clock
        self._last_time: float | None = None
        self._pending: list[_Update] = []
        self._window = _Window()
        self._closed = False

    @property
    def active(self) -> bool:
        """Whether ``after_update`` does anything here: rank 0, with a print
        interval or a writer. Elsewhere the step may skip gathering values."""
        return self.rank == 0 and not self._closed and (self.steps_per_print is not None or bool(self.writers))

    def after_update(self, update: int, *, loss: Scalar | None = None, lr: Scalar | None = None,
                     tokens: int | None = None, seconds: float | None = None, peak_memory_bytes: int | None = None,
                     loss_scale: Scalar | None = None, skipped_steps: Scalar | None = None,
                     flops_per_token: float | None = None,
                     phase_seconds: Mapping[str, float] | None = None) -> None:
        """Record optimizer update number ``update`` (1 for the first).

        ``loss``: the update's loss (under gradient accumulation, the mean
        over its micro-batches), a device tensor or a number. ``tokens``:
        tokens this update trained on across all data-parallel ranks.
        ``seconds``: its wall time; None: the time since the previous call
        (the first update, which includes capture and compilation, then
        counts toward no throughput). ``peak_memory_bytes``: e.g.
        ``torch.cuda.max_memory_allocated()``. ``loss_scale``,
        ``skipped_steps``: fp16's scale and skipped-update count (tensors
        or numbers). ``flops_per_token``: model FLOPs per trained token
        (forward and backward), for MFU. ``phase_seconds``: with
        ``wall_clock_breakdown``, seconds per phase of this update, keys
        from ``PHASES``.
        """
        if not self.active:
            return
        now = self._clock()
        if seconds is None and self._last_time is not None:
            seconds = now - self._last_time
        self._last_time = now
        values = {k: _keep(v) for k, v in (("loss", loss), ("lr", lr), ("loss_scale", loss_scale),
                                             ("skipped_steps", skipped_steps)) if v is not None}
        if self.wall_clock_breakdown and phase_seconds:
            unknown = sorted(set(phase_seconds) - set(PHASES))
            if unknown:
                raise ValueError(f"phase_seconds: unknown phase(s) {unknown}; the phases are {list(PHASES)}")
            values.update({f"phase:{name}": _keep(s) for name, s in phase_seconds.items()})
        step = update * self.samples_per_update if self.samples_per_update else update
        self._pending.append(_Update(step, values, tokens, seconds, peak_memory_bytes, flops_per_token))
        printing = self.steps_per_print is not None and update % self.steps_per_print == 0
        if printing or len(self._pending) >= MAX_PENDING:
            self.flush()
        if printing:
            log.info("%s", format_line(self._summary(update)))
            self._window = _Window()

    def flush(self) -> None:
        """Read the pending updates' device values (one transfer per device)
        and hand their events to the writers."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        _read_tensors([u.values for u in pending])
        events: list[Event] = []
        for u in pending:
            events += self._events(u)
            self._add_to_window(u)
        for writer in self.writers:
            writer.write_events(events)

    def close(self) -> None:
        """Write what is pending and close the writers. Idempotent."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        for writer in self.writers:
            writer.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- per update and per window ---------------------------------------------------
    def _rates(self, u: _Update) -> dict[str, float]:
        """One update's throughput and MFU, when its time is known."""
        if not u.seconds or u.seconds <= 0:
            return {}
        rates = {}
        if u.tokens is not None:
            rates["tokens_per_second"] = u.tokens / u.seconds
            mfu = self._mfu(u.tokens * u.flops_per_token if u.flops_per_token else None, u.seconds)
            if mfu is not None:
                rates["mfu"] = mfu
        if self.samples_per_update:
            rates["samples_per_second"] = self.samples_per_update / u.seconds
        return rates

    def _mfu(self, flops: float | None, seconds: float) -> float | None:
        if flops is None or not self.peak_flops or seconds <= 0:
            return None
        return flops / seconds / (self.peak_flops * self.world_size)

    def _events(self, u: _Update) -> list[Event]:
        scalars = {**u.values, **self._rates(u)}
        if u.peak_memory_bytes is not None:
            scalars["peak_memory_bytes"] = u.peak_memory_bytes
        events = []
        for key, value in scalars.items():
            if key.startswith("phase:"):
                value = 1000.0 * value  # DeepSpeed writes milliseconds
            events.append((TAGS[key], value, u.step))
        return events

    def _add_to_window(self, u: _Update) -> None:
        w = self._window
        if "loss" in u.values:
            w.losses.append(u.values["loss"])
        w.last.update({k: u.values[k] for k in ("lr", "loss_scale", "skipped_steps") if k in u.values})
        for key, value in u.values.items():
            if key.startswith("phase:"):
                w.phase_seconds.setdefault(key[len("phase:"):], []).append(value)
        if u.peak_memory_bytes is not None:
            w.peak_memory_bytes = max(w.peak_memory_bytes or 0, u.peak_memory_bytes)
        if not u.seconds or u.seconds <= 0:
            return
        w.seconds += u.seconds
        w.samples += self.samples_per_update or 0
        if u.tokens is not None:
            w.token_seconds += u.seconds
            w.tokens += u.tokens
            if u.flops_per_token:
                w.flop_seconds += u.seconds
                w.flops += u.tokens * u.flops_per_token

    def _summary(self, update: int) -> Summary:
        w = self._window
        skipped = w.last.get("skipped_steps")
        return Summary(
            step=update,
            loss=math.fsum(w.losses) / len(w.losses) if w.losses else None,
            lr=w.last.get("lr"),
            tokens_per_second=w.tokens / w.token_seconds if w.token_seconds else None,
            samples_per_second=w.samples / w.seconds if w.seconds and self.samples_per_update else None,
            mfu=self._mfu(w.flops, w.flop_seconds) if w.flop_seconds else None,
            peak_memory_bytes=w.peak_memory_bytes,
            loss_scale=w.last.get("loss_scale"),
            skipped_steps=None if skipped is None else int(skipped),
            phase_ms={name: 1000.0 * math.fsum(s) / len(s) for name, s in w.phase_seconds.items()},
        )


def _keep(value: Any) -> Any:
    """A value to read later: a tensor becomes a private 0-d copy on its
    device (no sync), the mean when it has elements beyond one, as
    DeepSpeed logs ``loss.mean()``; a number becomes a float."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        return t.reshape(()).clone() if t.numel() == 1 else t.float().mean()
    return float(value)


def _read_tensors(records: list[dict[str, Any]]) -> None:
    """Replace every tensor in ``records`` by its value: one stack and one
    device-to-host transfer per device (float64 keeps counters and lr exact)."""
    by_device: dict[torch.device, list[tuple[dict, str, torch.Tensor]]] = {}
    for values in records:
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                by_device.setdefault(value.device, []).append((values, key, value))
    for items in by_device.values():
        host = torch.stack([t.to(torch.float64) for _, _, t in items]).tolist()
        for (values, key, _), number in zip(items, host):
            values[key] = number
