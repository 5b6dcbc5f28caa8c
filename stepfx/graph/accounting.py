"""Per-rank memory and communication of a step graph, from its fake values.

- *At rest*: bytes of the state slots this rank reads (parameters, buffers,
  gradients kept across steps, optimizer state), by role — what the rank
  holds between steps.
- *Peak*: a liveness walk over the graph in program order. A value is
  allocated when its node runs and freed after its last reader (fx's
  generated code drops each name after its last use); views allocate
  nothing and keep their base alive as long as they are read; inputs stay
  alive for the whole step (the executor holds them), outputs from when
  they are made; a kernel that writes into donated inputs allocates nothing
  for those results. Peak = the largest sum of live bytes.
- *Communication*: every collective with its payload and the bytes a rank
  sends under the ring algorithm (all-reduce 2(N-1)/N x payload,
  all-gather and reduce-scatter (N-1)/N x the full buffer).
- *Symbolic sizes* (``stepfx.dynamic``, data-dependent sizes): counts are
  expressions in the size symbols (:class:`Sizes`), evaluated at given
  sizes; the peak is the largest live sum at those sizes.
"""
from __future__ import annotations

import collections
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping

import sympy
import torch
import torch.fx as fx

from .. import compat
from .ops import allocates_nothing
from .signature import HOST_STATE_KEY, Role
from .tp_layout import TP_PLAN_KEY
from .step_graph import META_DONATED, META_HOST_RESULTS, StepGraph

__all__ = ["MemoryEstimate", "CommItem", "Sizes", "estimate_memory", "communication", "size_values", "liveness"]

c10d = torch.ops._c10d_functional


class Sizes:
    """Byte counts of values whose sizes may be symbolic (``stepfx.dynamic``).

    A count is kept as its terms (monomial in the size symbols -> integer
    coefficient: ``2*s0*s1*128 + 64``), so sums over thousands of nodes stay
    cheap, and evaluated at ``values`` (symbol -> int: the sizes of the last
    call, or those seen at capture). ``bytes_of`` gives the terms of a fake
    value; ``value`` and ``expr`` read them."""

    def __init__(self, values: Mapping | None = None):
        self.values = dict(values or {})
        self._monomials: dict = {}

    def bytes_of(self, val) -> collections.Counter:
        terms: collections.Counter = collections.Counter()
        if isinstance(val, torch.Tensor):
            n = val.numel() * val.element_size()
            if isinstance(n, int):
                terms[sympy.Integer(1)] += n
            else:
                for mono, coeff in sympy.expand(compat.size_expr(n)).as_coefficients_dict().items():
                    terms[mono] += int(coeff)
        elif isinstance(val, (list, tuple)):
            for v in val:
                terms.update(self.bytes_of(v))
        return terms

    def value(self, terms: Mapping) -> int:
        return sum(coeff * self._monomial(mono) for mono, coeff in terms.items() if coeff)

    def _monomial(self, mono) -> int:
        if mono not in self._monomials:
            free = {s: self.values.get(s) for s in mono.free_symbols}
            self._monomials[mono] = int(mono.subs({s: v for s, v in free.items() if v is not None})) \
                if all(v is not None for v in free.values()) else 0
        return self._monomials[mono]

    @staticmethod
    def expr(terms: Mapping):
        return sympy.Add(*(coeff * mono for mono, coeff in terms.items() if coeff))

    @staticmethod
    def symbolic(terms: Mapping) -> bool:
        return any(coeff and mono.free_symbols for mono, coeff in terms.items())


def size_values(graph: StepGraph, batch_shapes: list | None = None) -> dict:
    """Symbol -> value for the graph's symbolic sizes: ``batch_shapes`` (the
    shapes of a call's batch tensors, in the order of the batch inputs) where
    given, else the sizes seen at capture; a data-dependent size at the
    upper bound torch knows for it."""
    symbols: set = set()
    shape_env = None
    for n in graph.gm.graph.nodes:
        val = n.meta.get("val")
        for v in (val if isinstance(val, (list, tuple)) else (val,)):
            if isinstance(v, torch.Tensor) and compat.is_fake(v) and v.fake_mode.shape_env is not None:
                for size in v.shape:
                    if isinstance(size, torch.SymInt):
                        symbols |= compat.size_expr(size).free_symbols
                        shape_env = v.fake_mode.shape_env
    if shape_env is None:
        return {}
    values = compat.symbol_values(shape_env, symbols)
    batch = [n.meta.get("val") for n in graph.gm.graph.nodes
             if n.op == "placeholder" and n.meta["slot"].role is Role.BATCH]
    for val, shape in zip(batch, batch_shapes or ()):
        if isinstance(val, torch.Tensor) and len(shape) == val.dim():
            for size, actual in zip(val.shape, shape):
                expr = compat.size_expr(size)
                if isinstance(expr, sympy.Symbol):
                    values[expr] = int(actual)
    return values


@dataclass
class MemoryEstimate:
    """Bytes at the sizes the estimate was evaluated at; with symbolic sizes
    ``*_expr`` hold the same counts as expressions in the size symbols."""

    at_rest: dict[Role, int] = field(default_factory=dict)  # bytes by role of the inputs
    peak: int = 0
    peak_node: str = ""
    at_rest_expr: dict[Role, Any] = field(default_factory=dict)
    peak_expr: Any = None
    host: int = 0  # bytes of state held in host memory (offload_optimizer), in none of the above
    host_transient: int = 0  # host bytes a step may add while speculated updates wait for the norm (copies)

    @property
    def resident(self) -> int:
        return sum(self.at_rest.values())


def liveness(graph: StepGraph, sizes: Sizes):
    """The liveness walk both :func:`estimate_memory` and the HTML report read:
    per placeholder and call_function node in program order,
    ``(node, allocated, freed)``: ``allocated`` the byte terms the node adds
    (None for views and other nodes that allocate nothing), ``freed`` the
    ``(holder, terms)`` whose last reader the node is, released after it ran
    (a multi-output op's results one by one: the holder gives them back in
    parts).
    The live set right after ``allocated`` is added is what a peak counts.
    Under ``delayed_parameter_update`` the 16-bit copies the host jobs upload
    outside the graph are counted where they arrive: the previous step's
    from the first node, this step's from their job's start, never freed.
    Under ``host_update_across_steps`` a job reads its gradients after the
    step: they stay to its end, and the previous step's are on the device
    from the first node until the first reader that waits for their job."""
    from ..runtime.host_optimizer import (host_adam_ready, host_adam_start, host_adam_swap,  # (the runtime imports
                                          host_adam_wait)  # this module)

    nodes = list(graph.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    split = {n for n in nodes if _separate_outputs(n, host_adam_wait, host_adam_swap)}

    def root_of(node: fx.Node) -> fx.Node:
        """The storage's maker; an element of a multi-output op is its own (cat_column_sum's [tokens, 3d]
        gradient and its [3d] bias sum are two tensors: the small one read late keeps only itself alive)."""
        while allocates_nothing(node) and isinstance(node.args[0], fx.Node):
            if node.target is operator.getitem and node.args[0] in split:
                return node
            node = node.args[0]
        return node

    # last position at which each storage is read (through any view of it)
    last_read: dict[fx.Node, int] = {}
    for n in nodes:
        for arg in n.all_input_nodes:
            root = root_of(arg)
            last_read[root] = max(last_read.get(root, -1), pos[n])
    outputs = {root_of(v) for v in (nodes[-1].args[0] if nodes and nodes[-1].op == "output" else ()) if isinstance(v, fx.Node)}
    frees: dict[int, list[tuple[fx.Node, collections.Counter]]] = collections.defaultdict(list)
    carried = collections.Counter()  # host_update_across_steps: the previous step's gradients, held by its jobs
    for start in (n for n in nodes if n.target is host_adam_start and n.kwargs.get("across_steps")):
        count = start.args[0]
        grads = {root_of(g) for g in start.args[1 + count:1 + 2 * count] if isinstance(g, fx.Node)}
        outputs |= grads  # alive past the step's end: the job reads them after it
        held = collections.Counter()
        for g in grads:
            held.update(sizes.bytes_of(g.meta.get("val")))
        readies = [a for a in start.args if isinstance(a, fx.Node) and a.target is host_adam_ready]
        carried.update(held)
        at = min((pos[r] for r in readies), default=pos[start])
        frees[at].append((start, held))  # the job is done there: the worker let go of them
    delayed = _delayed_copies(nodes, sizes, host_adam_swap)  # swap -> bytes of the 16-bit copies its job uploads
    started = {_job_start(swap, host_adam_start): swap for swap in delayed}
    first = True
    for n in nodes:
        if n.op == "placeholder":
            yield n, sizes.bytes_of(n.meta.get("val")), []  # inputs live for the whole step
            continue
        if n.op != "call_function":
            continue
        kept = collections.Counter()  # allocated here, alive past the step's end (in ``frees`` only if carried)
        if first:  # delayed_parameter_update: the previous step's job's copies, on the device all step
            for copies in delayed.values():
                kept.update(copies)
            first = False
            kept.update(carried)  # (given back at their job's first ready: ``frees``)
        if n in started:  # this step's delayed job uploads its copies from here on
            kept.update(delayed[started[n]])
        size = None
        if not allocates_nothing(n):
            size = sizes.bytes_of(n.meta.get("val"))
            if META_DONATED in n.meta and n.target is not host_adam_start:  # results written into the donated inputs
                for i in n.meta[META_DONATED]:
                    size.subtract(sizes.bytes_of(n.args[i].meta.get("val")))
            for i in n.meta.get(META_HOST_RESULTS, ()):  # host tensors updated in place (offload_optimizer)
                size.subtract(sizes.bytes_of(n.meta["val"][i]))
            start = _job_start(n, host_adam_start) if n.target in (host_adam_wait, host_adam_swap) else None
            if start is not None and META_DONATED in start.meta:
                for i in range(start.args[0]):  # the updated pieces went up into the donated pieces
                    size.subtract(sizes.bytes_of(n.meta["val"][3 * i]))
            if n in delayed:  # returns the copies counted from the step's start
                size.subtract(delayed[n])
            if n in split:  # each element freed after its own last reader (unread ones right away)
                taken: dict[int, list] = collections.defaultdict(list)
                for u in n.users:
                    if u.target is operator.getitem:
                        taken[u.args[1]].append(u)
                for i, v in enumerate(n.meta["val"]):
                    us = taken.get(i, [])
                    if not any(u in outputs for u in us):
                        at = max((last_read.get(u, pos[u]) for u in us), default=pos[n])
                        frees[at].append((n, sizes.bytes_of(v)))
            elif n not in outputs:
                frees[last_read.get(n, pos[n])].append((n, size))
        if +kept:
            if size is not None:
                kept.update(size)  # (not ``+``: a Counter sum drops the negative terms)
            size = kept
        yield n, size, frees.pop(pos[n], [])


def _separate_outputs(node: fx.Node, *host_waits) -> bool:
    """A multi-output op whose results are separate tensors the liveness frees one by one: it allocates them
    all, and neither writes into donated inputs nor returns host tensors (those keep the whole-node rule)."""
    val = node.meta.get("val")
    return (node.op == "call_function" and isinstance(val, (tuple, list)) and len(val) > 1
            and all(isinstance(v, torch.Tensor) for v in val) and not allocates_nothing(node)
            and META_DONATED not in node.meta and not node.meta.get(META_HOST_RESULTS)
            and node.target not in host_waits)


def _delayed_copies(nodes, sizes: Sizes, host_adam_swap) -> dict:
    """``host_adam_swap`` (delayed_parameter_update) -> the bytes of the 16-bit copies its job makes on the
    device: the job started in one step uploads them while the next step runs, and that step returns them, so
    three sets are on the device at the end of a step (the step's inputs, the previous job's, its own job's)."""
    out = {}
    for n in nodes:
        if n.op == "call_function" and n.target is host_adam_swap:
            count = len(n.kwargs["idents"])
            out[n] = sizes.bytes_of(tuple(n.meta["val"][3 * count:]))
    return out


def _job_start(node: fx.Node, host_adam_start) -> fx.Node:
    """The ``host_adam_start`` a wait or swap reads its job from (through ``host_adam_validate``)."""
    while node.target is not host_adam_start:
        node = node.args[0]
    return node


def speculation_copies(graph: StepGraph) -> int:
    """Bytes of host state the speculative ``host_adam_start`` nodes
    (offload_optimizer) may copy before they overwrite it: both moments of
    each piece (8 bytes an element), and the piece where it lives on the host
    (4 more), within their ``copy_cap`` (all starts together). The copies
    live until the norm is known."""
    from ..runtime.host_optimizer import host_adam_start  # at call time: the runtime imports this module

    total, cap = 0, None
    for node in graph.gm.graph.nodes:
        if node.target is not host_adam_start:
            continue
        if not node.kwargs.get("speculative"):
            continue
        count = node.args[0]
        per = 12 if node.kwargs.get("params_on_host") else 8
        total += sum(per * int(p.meta["val"].numel()) for p in node.args[1:1 + count])  # pieces: static sizes
        if node.kwargs.get("copy_cap") is not None:
            cap = max(cap or 0, node.kwargs["copy_cap"])
    return total if cap is None else min(total, cap)


def estimate_memory(graph: StepGraph, values: Mapping | None = None) -> MemoryEstimate:
    """``values``: symbol -> size to evaluate symbolic sizes at
    (:func:`size_values`; by default the sizes seen at capture)."""
    sizes = Sizes(size_values(graph) if values is None else values)
    est = MemoryEstimate()
    at_rest: dict[Role, collections.Counter] = collections.defaultdict(collections.Counter)
    live: collections.Counter = collections.Counter()
    live_value = 0
    peak_terms: collections.Counter = collections.Counter()
    host = graph.signature.extra.get(HOST_STATE_KEY, ())
    est.host_transient = speculation_copies(graph)
    for n, size, freed in liveness(graph, sizes):
        if n.op == "placeholder" and n.meta["slot"].ident in host:
            est.host += sizes.value(size)
            continue
        if n.op == "placeholder":
            at_rest[n.meta["slot"].role].update(size)
            live.update(size)
            live_value += sizes.value(size)
            continue
        if size is not None:
            live.update(size)
            live_value += sizes.value(size)
        if live_value > est.peak:
            est.peak, est.peak_node, peak_terms = live_value, n.name, +live
        for _, size in freed:
            live.subtract(size)
            live_value -= sizes.value(size)
    est.at_rest = {role: sizes.value(terms) for role, terms in at_rest.items()}
    if any(Sizes.symbolic(t) for t in at_rest.values()) or Sizes.symbolic(peak_terms):
        est.at_rest_expr = {role: Sizes.expr(terms) for role, terms in at_rest.items()}
        est.peak_expr = Sizes.expr(peak_terms)
    return est


@dataclass(frozen=True)
class CommItem:
    op: str  # all_reduce | reduce_scatter | all_gather
    node: str
    payload_bytes: int  # the buffer a rank hands to the collective
    sent_bytes: float  # what a rank sends with the ring algorithm
    payload_expr: Any = None  # the payload as an expression in the size symbols, where it is symbolic
    group: str = "data"  # "data" (data-parallel / ZeRO) or "tensor" (the tensor-parallel group's activations)


def ring_sent_bytes(op: str, payload: float, world_size: int) -> float:
    """What a rank sends for one collective with the ring algorithm: ``payload`` is the all-reduced or
    reduce-scattered buffer, or the all-gathered shard."""
    n = max(world_size, 1)
    if op == "all_reduce":
        return 2 * (n - 1) / n * payload
    if op == "reduce_scatter":
        return (n - 1) / n * payload
    return (n - 1) * payload  # all_gather


def communication(graph: StepGraph, world_size: int, values: Mapping | None = None) -> list[CommItem]:
    """Every collective's payload and ring traffic; symbolic payloads are
    evaluated at ``values`` (as :func:`estimate_memory`)."""
    items = []
    n = max(world_size, 1)
    plan = graph.signature.extra.get(TP_PLAN_KEY)
    tp = plan.degree if plan is not None else 1
    sizes = Sizes(size_values(graph) if values is None else values)
    for node in graph.gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (c10d.all_reduce.default, c10d.all_reduce_.default):
            op = "all_reduce"
        elif node.target is c10d.reduce_scatter_tensor.default:
            op = "reduce_scatter"
        elif node.target is c10d.all_gather_into_tensor.default:
            op = "all_gather"
        else:
            continue
        inp = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
        terms = sizes.bytes_of(inp)
        size = sizes.value(terms)
        expr = Sizes.expr(terms) if Sizes.symbolic(terms) else None
        # the group's size: explicit for reduce-scatter and all-gather; an all-reduce is the TP group's
        # (the group the plan names) or the data-parallel group's (the world over the TP degree)
        tensor = plan is not None and plan.group is not None and plan.group in node.args[1:]
        if op == "all_reduce":
            ranks = tp if tensor else max(1, n // tp)
        else:
            explicit = node.args[2] if op == "reduce_scatter" else node.args[1]
            ranks = explicit if isinstance(explicit, int) else n
        items.append(CommItem(op, node.name, size, ring_sent_bytes(op, size, ranks), expr,
                              "tensor" if tensor else "data"))
    return items


_MATMULS = {torch.ops.aten.mm.default: 0, torch.ops.aten.addmm.default: 1, torch.ops.aten.bmm.default: 0,
            torch.ops.aten.baddbmm.default: 1}


def _hinted(sizes) -> list[int] | None:
    """Sizes as ints without specializing them: a symbolic size's hint (the
    traced call's), None where one has none (a data-dependent size)."""
    out = []
    for x in sizes:
        if isinstance(x, torch.SymInt):
            try:
                x = compat.size_hint(x)
            except Exception:  # an unbacked (data-dependent) size: torch raises its own guard errors
                return None
        out.append(int(x))
    return out


def node_flops(node: fx.Node) -> float:
    """2 x multiply-adds of matmuls and attention; 0 for the rest (memory-bound). Symbolic sizes count at
    their hints (never guarded on); data-dependent ones as 0."""
    first = _MATMULS.get(node.target, getattr(node.target, "stepfx_matmul_args", None))
    if first is not None:
        a, b = (x.meta.get("val") for x in node.args[first:][:2])
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            sa, sb = _hinted(a.shape), _hinted(b.shape[-1:])
            return 0.0 if sa is None or sb is None else 2.0 * math.prod(sa) * sb[0]
    name = getattr(node.target, "__name__", "")
    if "scaled_dot_product" in name or "attention" in name:
        q = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
        if isinstance(q, torch.Tensor) and q.dim() == 4:
            shape = _hinted(q.shape)
            if shape is None:
                return 0.0
            b, h, s, d = shape
            return (8.0 if "backward" in name else 4.0) * b * h * s * s * d
    return 0.0


# the host's Adam/AdamW, elements a second: torch's fused CPU kernel ("fused") and the unfused ops ("exact"),
# measured on the H200 machine's 16 host cores (benchmarks/README.md, optimizer offload, 2026-12-04)
HOST_ADAM_RATE = {"fused": 1.37e9, "exact": 0.56e9}


@dataclass
class HostTraffic:
    """What a step moves between host and device and updates on the host
    (offload_optimizer, host_master_weights, offload_param, cpu_checkpointing)."""

    to_host: int = 0  # bytes: gradients and fp32 pieces going down, updated pieces stored back
    to_device: int = 0  # bytes: updated pieces or their 16-bit copies going up, fetched pieces
    host_elements: dict = field(default_factory=dict)  # host Adam kernel -> elements it updates a step
    flops: float = 0.0  # the device's matmul and attention FLOPs in the step (node_flops)


def host_traffic(graph: StepGraph) -> HostTraffic:
    """The step's host traffic and host update work, from its host ops."""
    from ..runtime.host_optimizer import host_adam_start  # at call time: the runtime imports this module
    from ..runtime.host_params import activation_fetch_start, activation_store, host_fetch_start, host_store

    out = HostTraffic()
    nodes = [n for n in graph.gm.graph.nodes if n.op == "call_function"]
    if not any(n.target in (host_adam_start, host_fetch_start, host_store, activation_store) for n in nodes):
        return out  # no offload: nothing to count
    for node in nodes:
        out.flops += node_flops(node)
        if node.target is host_adam_start:
            count = node.args[0]
            params, grads = node.args[1:1 + count], node.args[1 + count:1 + 2 * count]
            numel = sum(int(p.meta["val"].numel()) for p in params)
            out.to_host += sum(int(g.meta["val"].numel()) * g.meta["val"].element_size() for g in grads)
            if not node.kwargs.get("params_on_host"):  # the fp32 piece goes down and comes back updated
                size = sum(int(p.meta["val"].numel()) * p.meta["val"].element_size() for p in params)
                out.to_host += size
                out.to_device += size
            copy = node.kwargs.get("copy_dtype")
            if copy is not None:
                out.to_device += numel * copy.itemsize
            kernel = node.kwargs.get("kernel", "fused")
            out.host_elements[kernel] = out.host_elements.get(kernel, 0) + numel
        elif node.target is host_fetch_start:
            val = node.args[0].meta["val"]
            out.to_device += int(val.numel()) * val.element_size()
        elif node.target is host_store:
            val = node.args[1].meta["val"]
            out.to_host += int(val.numel()) * val.element_size()
        elif node.target in (activation_store, activation_fetch_start):  # cpu_checkpointing: down, then up
            val = (node.args[0] if node.target is activation_store else node).meta["val"]
            numel = val.numel()
            moved = int(numel) * val.element_size() if isinstance(numel, int) else 0  # (symbolic: uncounted)
            if node.target is activation_store:
                out.to_host += moved
            else:
                out.to_device += moved
    return out
