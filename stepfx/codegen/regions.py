"""Generic regions handed to torch's inductor.

stepfx writes kernels only for what is specific to a training step (see
this package's docstring). Chains of pointwise ops and the row reductions
between them (an RMSNorm written out by hand, rotary embeddings, SwiGLU,
their backward) are what inductor already fuses well, so the pass
``fuse_generic_regions`` cuts them out of the step graph as small fx
graphs and this module compiles each with inductor (``torch.compile``) on
first use. Regions are keyed by their code and their inputs' shapes and
dtypes: the 24 identical blocks of a model share one compiled region.

``REGIONS`` maps a key to its :class:`Region`; the graph calls
``graph_ops.run_region(key, *inputs)``, which looks it up. Both explain()
and the dumps show each region's fx code (what inductor was given).
"""
from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

import torch
import torch.fx as fx

from .. import compat

__all__ = ["REGIONS", "Region", "register_region"]

log = logging.getLogger("stepfx")


class Region:
    """One region: its fx graph (positional tensor inputs, a tuple of
    outputs) and, once first run, inductor's compiled form."""

    def __init__(self, key: str, gm: fx.GraphModule, ops: tuple[str, ...], dynamic: bool = False):
        self.key = key
        self.gm = gm
        self.ops = ops
        self.dynamic = dynamic  # cut from a step with symbolic batch sizes: compiled for all sizes
        self._compiled = None
        self._lock = threading.Lock()
        self.failed: str | None = None  # why inductor could not compile it
        # per output: the dim order (outermost first) to lay it out densely in, where inductor's layout
        # differs from the ops' own (set at the first call; None: inductor's is the ops')
        self._orders: list[tuple[int, ...] | None] | None = None

    def source(self) -> str:
        return self.gm.code

    @property
    def compiled(self):
        """Inductor's compiled form (None until the first call)."""
        return self._compiled

    def __call__(self, *args: torch.Tensor) -> tuple:
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    return self._first_call(args)
        out = self._compiled(*args)
        return _laid_out(out, self._orders) if self._orders else out

    def _first_call(self, args) -> tuple:
        """Compile and run; if inductor cannot, the region runs as the ops it
        was made of (the same results, eager speed), logged once.

        The step after the region was traced on the layouts its ops give
        (a later ``view`` may need them); inductor may lay an output out
        otherwise (found on Bloom, 2026-12-06: a ``cat`` of transposed
        values came back transposed, and the next view failed at run #1).
        So the ops run once beside the compiled region, and an output whose
        layout differs is copied into the ops' layout on every call."""
        compiled = compat.compile_region(self.gm, dynamic=self.dynamic)
        try:
            out = compiled(*args)
        except Exception as exc:  # inductor's failure is not the user's: keep the step running
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            log.warning("stepfx: inductor could not compile %s (%s); it runs as aten ops", self.key, self.failed)
            self._compiled = self.gm
            return self.gm(*args)
        with torch.no_grad():
            reference = self.gm(*args)
        orders = [_dense_order(r) if isinstance(o, torch.Tensor) and _layout(o) != _layout(r) else None
                  for o, r in zip(out, reference)]
        del reference
        if any(order is not None for order in orders):
            self._orders = orders
            log.info("stepfx: %s: inductor laid out %d output(s) otherwise than the ops; copied back", self.key,
                     sum(order is not None for order in orders))
            out = _laid_out(out, orders)
        self._compiled = compiled
        return out


def _layout(t: torch.Tensor) -> tuple:
    """The strides that matter (dims of size 1 have none)."""
    return tuple((d, s) for d, (n, s) in enumerate(zip(t.shape, t.stride())) if n != 1)


def _dense_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """``t``'s dims outermost first, where ``t`` is laid out densely in that order; else None (left as
    inductor made it: such an output, a broadcast say, has no dense layout to restore)."""
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))
    return order if _dense_strides(t.shape, order) == _strides_of(t, order) else None


def _strides_of(t: torch.Tensor, order) -> tuple:
    return tuple(t.stride(d) if t.shape[d] != 1 else None for d in order)


def _dense_strides(shape, order) -> tuple:
    out, step = {}, 1
    for d in reversed(order):
        out[d] = step
        step *= shape[d]
    return tuple(out[d] if shape[d] != 1 else None for d in order)


def _laid_out(outputs: tuple, orders) -> tuple:
    """``outputs``, each with an order copied into the dense layout of that dim order."""
    fixed = []
    for out, order in zip(outputs, orders):
        if order is not None and _strides_of(out, order) != _dense_strides(out.shape, order):
            dense = torch.empty_permuted(out.shape, order, dtype=out.dtype, device=out.device)
            dense.copy_(out)
            out = dense
        fixed.append(out)
    return tuple(fixed)


REGIONS: dict[str, Region] = {}


def register_region(gm: fx.GraphModule, inputs: list[Any]) -> str:
    """The key of ``gm`` (with inputs like the fake tensors ``inputs``),
    registering it on first sight."""
    described = "\n".join(f"{tuple(v.shape)} {tuple(v.stride())} {v.dtype} {v.device.type}" for v in inputs)
    digest = hashlib.sha1((gm.code + described).encode()).hexdigest()[:12]
    key = f"region_{digest}"
    if key not in REGIONS:
        ops = tuple(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        dynamic = any(isinstance(s, torch.SymInt) for v in inputs for s in v.shape)
        REGIONS[key] = Region(key, gm, ops, dynamic)
    return key


def regions_of(gm: fx.GraphModule) -> dict[str, tuple[fx.GraphModule, tuple[str, ...], bool]]:
    """The regions ``gm`` runs (``run_region`` calls), as what
    :func:`restore_regions` needs to register them again in another process:
    key -> (region graph, ops, dynamic)."""
    from .graph_ops import run_region

    out = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is run_region and node.args[0] not in out:
            region = REGIONS[node.args[0]]
            out[region.key] = (region.gm, region.ops, region.dynamic)
    return out


def restore_regions(saved: dict[str, tuple[fx.GraphModule, tuple[str, ...], bool]]) -> None:
    """Register regions :func:`regions_of` listed (a plan loaded from disk);
    a key already registered is the same region (keys hash the code and the
    inputs), so it is kept, with its compiled form."""
    for key, (gm, ops, dynamic) in saved.items():
        if key not in REGIONS:
            gm.recompile()  # a loaded GraphModule has its code but no forward yet
            REGIONS[key] = Region(key, gm, ops, dynamic)
