"""What a step really allocates, measured on any device: every tensor an op
returns is tracked by its storage until the last Python reference to it is
gone (the way fx's generated code frees values). Used to hold the memory
predictions (graph/accounting.py, the planner) to measured numbers on CPU,
where torch keeps no allocator statistics.
"""
from __future__ import annotations

import weakref
from typing import Any
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_leaves

from .. import compat

__all__ = ["MeasuredMemory", "measure_memory"]


class MeasuredMemory:
    """Peak bytes of storages made while measuring (``peak``) and alive at once;
    storages that existed before (``held``: parameters, optimizer state, the
    batch) are not counted."""

    def __init__(self, held: list[torch.Tensor]):
        self.external = {t.untyped_storage().data_ptr() for t in held if isinstance(t, torch.Tensor)}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or compat.is_fake(t):
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.external:
            return
        if key not in self.refs:
            self.refs[key] = 0
            self.sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= self.sizes.pop(key)


def measure_memory(fn: Callable[[], Any], held: list[torch.Tensor]) -> MeasuredMemory:
    """Run ``fn()`` and measure what its ops allocate (see the module)."""
    memory = MeasuredMemory(held)

    class _Track(compat.dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    memory.track(leaf)
            return out

    with _Track():
        result = fn()
    del result
    return memory
