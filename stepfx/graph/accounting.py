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
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .ops import allocates_nothing, storage_root
from .signature import Role
from .step_graph import META_DONATED, StepGraph

__all__ = ["MemoryEstimate", "CommItem", "estimate_memory", "communication"]

c10d = torch.ops._c10d_functional


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v) for v in val)
    return 0


@dataclass
class MemoryEstimate:
    at_rest: dict[Role, int] = field(default_factory=dict)  # bytes by role of the inputs
    peak: int = 0
    peak_node: str = ""

    @property
    def resident(self) -> int:
        return sum(self.at_rest.values())


def estimate_memory(graph: StepGraph) -> MemoryEstimate:
    gm = graph.gm
    est = MemoryEstimate()
    at_rest: dict[Role, int] = collections.defaultdict(int)
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    # last position at which each storage is read (through any view of it)
    last_read: dict[fx.Node, int] = {}
    for n in nodes:
        for arg in n.all_input_nodes:
            root = storage_root(arg)
            last_read[root] = max(last_read.get(root, -1), pos[n])
    outputs = {storage_root(v) for v in (nodes[-1].args[0] if nodes and nodes[-1].op == "output" else ()) if isinstance(v, fx.Node)}
    frees: dict[int, list[int]] = collections.defaultdict(list)
    live = 0
    for n in nodes:
        if n.op == "placeholder":
            size = _nbytes(n.meta.get("val"))
            at_rest[n.meta["slot"].role] += size
            live += size  # inputs live for the whole step
            continue
        if n.op != "call_function":
            continue
        if not allocates_nothing(n):
            size = _nbytes(n.meta.get("val"))
            if META_DONATED in n.meta:  # results written into the donated inputs
                size -= sum(_nbytes(n.args[i].meta.get("val")) for i in n.meta[META_DONATED])
            live += size
            if n not in outputs:
                frees[last_read.get(n, pos[n])].append(size)
        if live > est.peak:
            est.peak, est.peak_node = live, n.name
        for size in frees.pop(pos[n], ()):
            live -= size
    est.at_rest = dict(at_rest)
    return est


@dataclass(frozen=True)
class CommItem:
    op: str  # all_reduce | reduce_scatter | all_gather
    node: str
    payload_bytes: int  # the buffer a rank hands to the collective
    sent_bytes: float  # what a rank sends with the ring algorithm


def communication(graph: StepGraph, world_size: int) -> list[CommItem]:
    items = []
    n = max(world_size, 1)
    for node in graph.gm.graph.nodes:
        if node.op != "call_function":
            continue
        inp = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
        size = _nbytes(inp)
        if node.target in (c10d.all_reduce.default, c10d.all_reduce_.default):
            items.append(CommItem("all_reduce", node.name, size, 2 * (n - 1) / n * size))
        elif node.target is c10d.reduce_scatter_tensor.default:
            items.append(CommItem("reduce_scatter", node.name, size, (n - 1) / n * size))
        elif node.target is c10d.all_gather_into_tensor.default:
            items.append(CommItem("all_gather", node.name, size, (n - 1) * size))
    return items
