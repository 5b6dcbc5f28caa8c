"""offload_activations: the saved activations on the host between the forward and the backward.

DeepSpeed's ``activation_checkpointing.cpu_checkpointing``: the values a
checkpointed step keeps for its backward (with the block present,
recompute_activations keeps the least it can: each block's input, the
values recomputation cannot rebuild) wait in host memory instead of the
device's. What DeepSpeed moves is the checkpointed functions' inputs; here
it is every value the backward reads from the forward that depends on the
batch (parameters, and their gathered copies, stay).

Requires: the graph final but for the host ops (after the fusions, whose
kernels may be what the backward reads), the recomputation chosen.

Ensures, for each forward value ``x`` (a tensor the op allocates, computed
from the batch) that a backward or optimizer node reads:

- ``s = activation_store(x)`` right after ``x``'s last forward reader: on
  CUDA a copy down on the parameter stream into pinned memory, after which
  the device gives ``x``'s memory back (its last reader is now the store);
- ``f = activation_fetch_start(s)`` before the backward's first reader of
  the value stored before it (one value ahead: its copy up runs while the
  backward of the later block does), and ``y = host_fetch_wait(f)`` right
  before ``x``'s first backward reader; every backward reader reads ``y``.

On a CPU device the ops are identities: the same arithmetic, bitwise. The
estimate counts ``x`` until the store and ``y`` from the fetch's start.

Before / after::

    h = add(x, attn)           # forward                 h = add(x, attn)
    ...                                          ->      h_stored = activation_store(h)
    g = mm(grad, h)            # backward                ...
                                                         h_fetch = activation_fetch_start(h_stored)  (ahead)
                                                         h_back = host_fetch_wait(h_fetch)
                                                         g = mm(grad, h_back)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...graph import Phase, Role, StepGraph
from ...graph.build import clone_step_graph
from ...graph.ops import allocates_nothing
from ...graph.step_graph import META_PHASE
from ...runtime.host_params import activation_fetch_start, activation_store, host_fetch_wait
from ..data_parallel.collectives import make_node
from ..manager import PassOptions, PassResult
from .recompute_activations import format_bytes

__all__ = ["offload_activations", "cpu_checkpointing"]


def cpu_checkpointing(options: PassOptions) -> bool:
    raw = getattr(options.config, "raw", None) or {}
    block = raw.get("activation_checkpointing") or {}
    return bool(block.get("cpu_checkpointing", False))


def _batch_dependent(g: fx.Graph) -> set:
    out = set()
    for n in g.nodes:
        if n.op == "placeholder":
            if n.meta["slot"].role is Role.BATCH:
                out.add(n)
        elif any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def offload_activations(graph: StepGraph, options: PassOptions) -> PassResult:
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    data = _batch_dependent(g)
    saved = []
    for n in nodes:
        val = n.meta.get("val")
        if (n.op != "call_function" or n.meta.get(META_PHASE) is not Phase.FORWARD or n not in data
                or not isinstance(val, torch.Tensor) or allocates_nothing(n)):
            continue
        later = sorted((u for u in n.users if u.op != "output" and u.meta.get(META_PHASE) is not Phase.FORWARD),
                       key=pos.__getitem__)
        forward = [u for u in n.users if u not in later]
        if not later or any(u.op == "output" for u in n.users):
            continue
        if forward and max(pos[u] for u in forward) > pos[later[0]]:
            continue  # a backward reader before a forward one (a scheduled graph): nowhere to keep it apart
        saved.append((n, later))
    if not saved:
        return PassResult(graph, False, "no saved activation: the backward reads nothing from the forward")
    stores = {}
    for x, later in saved:
        forward = [u for u in x.users if u not in later]
        after = max(forward, key=pos.__getitem__) if forward else x
        with g.inserting_after(after):
            stores[x] = make_node(g, activation_store, (x,), val=None, like=x, name=f"{x.name}_stored")
    order = sorted(saved, key=lambda s: pos[s[1][0]])  # by the backward's first reader
    pos = {n: i for i, n in enumerate(g.nodes)}
    moved = 0
    for i, (x, later) in enumerate(order):
        first = later[0]
        anchor = order[i - 1][1][0] if i else first
        if pos[anchor] <= pos[stores[x]]:
            anchor = first
        val = x.meta["val"]
        with g.inserting_before(anchor):
            start = make_node(g, activation_fetch_start, (stores[x],), {"device": str(val.device)}, val=val,
                              like=first, name=f"{x.name}_fetch")
        with g.inserting_before(first):
            back = make_node(g, host_fetch_wait, (start,), val=val, like=first, name=f"{x.name}_back")
        for u in later:
            u.replace_input_with(x, back)
        numel = val.numel()
        moved += int(numel) * val.element_size() if isinstance(numel, int) else 0
    g.lint()
    graph.gm.recompile()
    return PassResult(graph, True, f"{len(saved)} saved activations ({format_bytes(moved)}, static sizes counted) "
                                   "kept on the host between the forward and the backward (cpu_checkpointing), "
                                   "each fetched one ahead of its backward readers")
