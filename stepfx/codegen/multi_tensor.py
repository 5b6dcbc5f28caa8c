"""What the multi-tensor kernels share: tables of tensor addresses and
sizes on the device, and the record of a Triton that could not build them.

A multi-tensor kernel reads each tensor's address from an int64 table and
casts it to a pointer (Triton's int-to-pointer bitcast), so one launch
covers hundreds of tensors. The tables go to the device from pinned memory
(no sync) and are cached by what they hold, in two caches, each dropping
its least recently used table: the geometry (which tensor and element each
program starts at: one row per block, ~600k rows for a 1.3B model's
update) depends only on the sizes and is built once, vectorized; the
address tables (a few hundred entries) change whenever the allocator hands
a gradient another address, so they come and go without ever pushing the
geometry out (on the H200 that cost a ~1 s rebuild every ~30 steps).
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch
import triton.language as tl

__all__ = ["TRITON_DTYPES", "FALLBACK", "blocks", "cached", "clear_caches", "device_table", "failed"]

log = logging.getLogger("stepfx")

TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# LRU caches: geometry (keyed by sizes) and addresses (keyed by data_ptrs)
_CACHES: dict[bool, OrderedDict] = {True: OrderedDict(), False: OrderedDict()}
_CACHE_SIZE = {True: 16, False: 64}
# Why a multi-tensor kernel could not be built here; its callers then launch
# the one-tensor kernel per tensor (the same results, more launches).
FALLBACK: str | None = None
# Tables a CUDA graph reads (made or looked up while a stream was capturing):
# kept for the process's life, so that neither the pinned host rows its copy
# node reads nor the device table is ever handed to another tensor.
_KEPT_FOR_GRAPHS: list = []


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def device_table(rows, device: torch.device) -> torch.Tensor:
    """``rows`` (ints, lists of ints, or an int64 host tensor) as an int64
    tensor on ``device``."""
    pin = device.type == "cuda"
    if isinstance(rows, torch.Tensor):
        host = rows.to(torch.int64).contiguous()
        host = host.pin_memory() if pin else host
    else:
        host = torch.tensor(rows, dtype=torch.int64, pin_memory=pin)
    table = host.to(device, non_blocking=True)
    if pin and _capturing():
        _KEPT_FOR_GRAPHS.append((host, table))
    return table


def blocks(numels, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host int64 tensors ``(index, first)``: for each block of ``block``
    elements of the tensors of sizes ``numels`` in turn, its tensor's index
    and its first element, as the loop ``[(j, s) for j, n in
    enumerate(numels) for s in range(0, n, block)]`` lists them (vectorized:
    ~600k blocks for a 1.3B model)."""
    n = torch.tensor(list(numels), dtype=torch.int64)
    counts = (n + block - 1) // block
    index = torch.repeat_interleave(torch.arange(len(n), dtype=torch.int64), counts)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    first = (torch.arange(index.numel(), dtype=torch.int64) - starts) * block
    return index, first


def cached(key, build, *, geometry: bool = False):
    """``build()``'s result for ``key`` (addresses or sizes, and the device),
    kept for the next calls in the geometry cache or the address cache; a
    full cache drops its least recently used entry."""
    cache = _CACHES[geometry]
    if key in cache:
        cache.move_to_end(key)
        value = cache[key]
    else:
        if len(cache) >= _CACHE_SIZE[geometry]:
            cache.popitem(last=False)
        cache[key] = value = build()
    if _capturing():
        _KEPT_FOR_GRAPHS.append(value)
    return value


def clear_caches() -> None:
    """Forget every cached table (a failed capture left tables whose copy
    never ran)."""
    for cache in _CACHES.values():
        cache.clear()


def failed(what: str, exc: Exception) -> None:
    """Record (and log once) that the multi-tensor ``what`` kernel could not run."""
    global FALLBACK
    if FALLBACK is None:
        FALLBACK = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        log.warning("stepfx: the multi-tensor %s kernel failed (%s); one tensor per launch from now on", what, FALLBACK)
