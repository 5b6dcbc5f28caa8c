"""What the multi-tensor kernels share: tables of tensor addresses and
sizes on the device, and the record of a Triton that could not build them.

A multi-tensor kernel reads each tensor's address from an int64 table and
casts it to a pointer (Triton's int-to-pointer bitcast), so one launch
covers hundreds of tensors. The tables go to the device from pinned memory
(no sync) and are cached by what they hold: parameters and optimizer state
are updated in place, and gradients come back at the same addresses once
the allocator is warm, so a steady step sends nothing.
"""
from __future__ import annotations

import logging

import torch
import triton.language as tl

__all__ = ["TRITON_DTYPES", "FALLBACK", "cached", "device_table", "failed"]

log = logging.getLogger("stepfx")

TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_TABLES: dict = {}
_CACHE_SIZE = 32
# Why a multi-tensor kernel could not be built here; its callers then launch
# the one-tensor kernel per tensor (the same results, more launches).
FALLBACK: str | None = None


def device_table(rows, device: torch.device) -> torch.Tensor:
    """``rows`` (ints, or lists of ints) as an int64 tensor on ``device``."""
    host = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def cached(key, build):
    """``build()``'s result for ``key`` (addresses, sizes and the device in
    it), kept for the next calls; the oldest goes when the cache is full."""
    if key not in _TABLES:
        if len(_TABLES) >= _CACHE_SIZE:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = build()
    return _TABLES[key]


def failed(what: str, exc: Exception) -> None:
    """Record (and log once) that the multi-tensor ``what`` kernel could not run."""
    global FALLBACK
    if FALLBACK is None:
        FALLBACK = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        log.warning("stepfx: the multi-tensor %s kernel failed (%s); one tensor per launch from now on", what, FALLBACK)
