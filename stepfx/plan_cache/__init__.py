"""Captured-and-passed plans kept on disk across runs.

A step's first call spends most of its time capturing the step and running
the passes (12 s of the 1.3B GPT's 14-20 s on an H200), then compiling
kernels. The final graph of that work depends only on what the key lists
(``key.py``), so it is written to disk (``store.py``) and a later run, in a
fresh process, loads it instead: :func:`look_up` before capturing,
:func:`save` after the passes. Inductor's and Triton's own caches of the
compiled kernels are moved under the same directory, so a warm start also
skips most compilation.

``explain()`` says whether a plan came from the cache (and its key) or why
it was not cached.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..graph import META_SLOT, Role, StepGraph
from .key import NotCacheable, PlanKey, file_digest, plan_key
from .store import CACHE_ENV, FORMAT, CachedPlan, PlanCache, traced_files

__all__ = ["CACHE_ENV", "FORMAT", "CachedPlan", "PlanCache", "PlanKey", "Lookup", "look_up", "mesh_of", "save", "param_numels"]


@dataclass
class Lookup:
    """The outcome of looking a call's plan up: its key (None: not cacheable
    or the cache is off), the entry found (None: capture), and a note."""

    key: PlanKey | None
    entry: CachedPlan | None
    note: str


def mesh_of(dp: Any) -> tuple:
    """The facts of the rank's place in the job (a ``runtime.DataParallel``)
    a plan depends on: every plain field (world size, rank, group names,
    tensor-parallel size and rank, backend); the group objects are left out."""
    return tuple((f.name, getattr(dp, f.name)) for f in dataclasses.fields(dp)
                 if getattr(dp, f.name) is None or isinstance(getattr(dp, f.name), (bool, int, str)))


def look_up(cache: PlanCache, fingerprint: tuple, *, fn: Callable, model: torch.nn.Module, optimizer, config: Any,
            mesh: tuple, device: torch.device, dynamic_dims: Mapping[str, frozenset[int]] | None, batch_shapes: dict,
            batch: list[torch.Tensor]) -> Lookup:
    """The plan on disk for this call, if one may serve it. ``mesh``: :func:`mesh_of`."""
    if not cache.enabled:
        return Lookup(None, None, cache.why_off or "off")
    try:
        key = plan_key(fingerprint, fn=fn, model=model, optimizer=optimizer, config=config, mesh=mesh, device=device,
                       dynamic_dims=dynamic_dims)
    except NotCacheable as exc:
        return Lookup(None, None, f"not cached: {exc}")
    entry, note = cache.load(key)
    if entry is not None:
        # a symbolic variant serves the sizes its guards admit; one whose sizes all specialized, its own
        if entry.guard is not None and not entry.guard.check(batch):
            return Lookup(key, None, "the cached symbolic plan's guards do not admit this call's sizes")
        if entry.guard is None and entry.dynamic and entry.batch_shapes != batch_shapes:
            return Lookup(key, None, "the cached plan specialized its symbolic sizes to other ones")
    return Lookup(key, entry, note)


def save(cache: PlanCache, key: PlanKey, *, captured: StepGraph, final: StepGraph, records, held: dict,
         stepped: frozenset[str], guard: Any, batch_shapes: dict, dynamic: bool, capture_seconds: float,
         passes_seconds: float) -> str:
    """Write a freshly built plan under ``key``; a note for explain()."""
    from ..codegen.regions import regions_of

    sources = dict(key.sources)
    for path in traced_files(captured) - set(sources):
        digest = file_digest(path)
        if digest is not None:
            sources[path] = digest
    entry = CachedPlan(
        graph=final,
        records=tuple((r.index, r.name, r.changed, r.seconds, r.summary, r.skipped) for r in records),
        held=held, stepped=stepped, param_numels=param_numels(captured), regions=regions_of(final.gm), guard=guard,
        batch_shapes=batch_shapes, dynamic=dynamic, sources=sources, capture_seconds=capture_seconds,
        passes_seconds=passes_seconds, key_items=key.items,
    )
    return cache.save(key, entry)


def param_numels(captured: StepGraph) -> dict[str, int]:
    """Parameter name -> elements, as captured (whole: under ZeRO-3 the
    module's own tensors are empty between steps)."""
    return {n.meta[META_SLOT].name: n.meta["val"].numel() for n in captured.gm.graph.nodes
            if n.op == "placeholder" and n.meta[META_SLOT].role is Role.PARAM}
