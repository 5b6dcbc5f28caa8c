"""Parameters at rest on the host (``zero_optimization.offload_param``).

Under ZeRO-3 each rank holds a piece of every sharded parameter between
steps. With ``offload_param`` those pieces live in host memory (pinned when
``pin_memory``; in files under ``nvme_path`` for device "nvme") and the
compiled step moves them itself (the ``offload_parameters`` pass places
these ops):

- :func:`host_fetch_start` ahead of a reader (``buffer_count`` fetches in
  flight at most): copies the piece up on the device's parameter stream
  (non-blocking from pinned memory: the host thread goes on) and records an
  event there;
- :func:`host_fetch_wait` right before the reader: the compute stream waits
  for that event (the host does not) and the copy is recorded on the
  compute stream for the caching allocator. The device copy is freed after
  its last reader, like any value of the step;
- :func:`host_store` where an updated piece is made: the parameter stream
  waits for the compute stream, then copies the piece down into the host
  tensor in place (so a file-backed piece stays file-backed);
  the step's last store waits (on the host) for all of them, so the user
  and checkpoints read finished values.

DeepSpeed's ``activation_checkpointing.cpu_checkpointing`` (the
``offload_activations`` pass) moves the step's saved activations the same
way: :func:`activation_store` after a value's last forward reader copies it
down into pinned host memory on the parameter stream (the device copy is
freed once that copy is done), :func:`activation_fetch_start` brings it back
up on the same stream ahead of its backward readers, and
:func:`host_fetch_wait` hands it to them.

On a CPU device every op is the identity (or a plain copy): the step's
arithmetic never changes, which is what the CPU tests check bit for bit.
"""
from __future__ import annotations

import threading

import torch

from ..graph.ops import result_of_first_arg

__all__ = ["host_fetch_start", "host_fetch_wait", "host_store", "activation_store", "activation_fetch_start",
           "FetchHandle"]

_LOCK = threading.Lock()
_STREAMS: dict = {}


def _stream(device: torch.device):
    with _LOCK:
        if device not in _STREAMS:
            _STREAMS[device] = torch.cuda.Stream(device)
        return _STREAMS[device]


class FetchHandle:
    """A piece on its way up: the device copy and the event after its copy."""

    __slots__ = ("value", "event")

    def __init__(self, value: torch.Tensor, event):
        self.value = value
        self.event = event


def host_fetch_start(piece: torch.Tensor, *, device: str) -> FetchHandle:
    """Start copying the host-held ``piece`` to ``device``."""
    target = torch.device(device)
    if target.type != "cuda" or piece.device.type == "cuda":
        return FetchHandle(piece if piece.device == target or target.type != "cuda" else piece.to(target), None)
    stream = _stream(target)
    with torch.cuda.stream(stream):
        value = piece.to(target, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return FetchHandle(value, event)


@result_of_first_arg
def host_fetch_wait(handle: FetchHandle) -> torch.Tensor:
    """The device copy, ready for the compute stream."""
    value = handle.value
    if handle.event is not None:
        current = torch.cuda.current_stream(value.device)
        current.wait_event(handle.event)
        value.record_stream(current)  # made on the parameter stream, read and freed on this one
    return value


@result_of_first_arg
def host_store(dest: torch.Tensor, value: torch.Tensor, *, last: bool = False) -> torch.Tensor:
    """Copy the updated piece ``value`` into the host tensor ``dest`` (in
    place); returns ``dest``. On CUDA the copy runs on the parameter stream
    after the compute stream's work so far, without blocking the host;
    ``last`` (the step's last store) waits for every copy down issued, so
    the step returns finished values to the user and to checkpoints."""
    if value.device.type != "cuda":
        if value is not dest:
            dest.copy_(value.reshape(dest.shape))
        return dest
    stream = _stream(value.device)
    stream.wait_stream(torch.cuda.current_stream(value.device))
    with torch.cuda.stream(stream):
        value.record_stream(stream)  # read on the parameter stream: not reused before the copy is done
        dest.copy_(value.reshape(dest.shape), non_blocking=True)
    if last:
        stream.synchronize()
    return dest



class StoredActivation:
    """A forward value on the host between the forward and the backward (or the value itself on a CPU device)."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor):
        self.value = value


def activation_store(value: torch.Tensor) -> StoredActivation:
    """Copy ``value`` down into pinned host memory (torch's caching host
    allocator) on the parameter stream, after the compute stream's work so
    far; the device copy goes back to the allocator once the copy is done."""
    if value.device.type != "cuda":
        return StoredActivation(value)
    stream = _stream(value.device)
    stream.wait_stream(torch.cuda.current_stream(value.device))
    with torch.cuda.stream(stream):
        value.record_stream(stream)  # read on the parameter stream: not reused before the copy is done
        host = torch.empty_like(value, device="cpu", pin_memory=True)
        host.copy_(value, non_blocking=True)
    return StoredActivation(host)


def activation_fetch_start(stored: StoredActivation, *, device: str) -> FetchHandle:
    """Start copying a stored activation back up to ``device`` (on the stream that copied it down: after it)."""
    return host_fetch_start(stored.value, device=device)
