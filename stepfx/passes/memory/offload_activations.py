"""offload_activations: the saved activations partitioned over the tensor-parallel group and/or on the
host between the forward and the backward.

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

DeepSpeed's ``activation_checkpointing.partition_activations``: under
tensor parallelism every rank of a group holds the same saved activations
(those ``shard_tensor_parallel`` marks replicated: the residual stream
without sequence parallelism); each rank keeps only its 1/tp of such a
value (flattened, zero-padded to a multiple of tp, its slice copied so
that the whole is freed) and the backward all-gathers it over the group
before its first reader; with ``cpu_checkpointing`` the slice is what goes
to the host. Bitwise: the ranks' slices of one value are the value. Values
of symbolic size stay whole (noted). Without tensor parallelism there is
nothing to partition (as in DeepSpeed, whose partitioning is over the
model-parallel ranks).

Before / after::

    h = add(x, attn)           # forward                 h = add(x, attn)
    ...                                          ->      h_stored = activation_store(h)
    g = mm(grad, h)            # backward                ...
                                                         h_fetch = activation_fetch_start(h_stored)  (ahead)
                                                         h_back = host_fetch_wait(h_fetch)
                                                         g = mm(grad, h_back)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...graph import Phase, StepGraph
from ...graph.build import clone_step_graph
from ...graph.ops import ALIAS_OPS, RESHAPE_OPS, allocates_nothing, batch_dependent, is_view
from ...graph.step_graph import META_PHASE
from ...runtime.host_params import activation_fetch_start, activation_store, host_fetch_wait
from ..data_parallel.collectives import fake_like, make_node
from ..tensor_parallel.shard_tensor_parallel import META_TP_REPLICATED
from ..manager import PassOptions, PassResult
from .recompute_activations import format_bytes

__all__ = ["offload_activations", "cpu_checkpointing", "partition_activations", "activations_apply"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _block(options: PassOptions) -> dict:
    raw = getattr(options.config, "raw", None) or {}
    return raw.get("activation_checkpointing") or {}


def cpu_checkpointing(options: PassOptions) -> bool:
    return bool(_block(options).get("cpu_checkpointing", False))


def partition_activations(options: PassOptions) -> bool:
    """Asked for and there is a group to partition over."""
    return bool(_block(options).get("partition_activations", False)) and options.tp_size > 1


def activations_apply(options: PassOptions) -> bool:
    return cpu_checkpointing(options) or partition_activations(options)


def offload_activations(graph: StepGraph, options: PassOptions) -> PassResult:
    from ..pipeline.partition_stages import pipeline_settings

    if pipeline_settings(options) > 1:  # said, not dropped: explain() lists it
        return PassResult(graph, False, "not implemented under pipeline parallelism (the stage programs are cut "
                                        "after this pass): activation_checkpointing's cpu_checkpointing and "
                                        "partition_activations not applied, the saved activations stay whole on "
                                        "the device")
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    data = batch_dependent(g.nodes)
    saved = []  # (value, its aliases in graph order, the backward nodes reading it or them)
    last_forward: dict[fx.Node, fx.Node] = {}  # saved value -> its (or an alias's) last forward reader, or itself
    for n in nodes:
        val = n.meta.get("val")
        if (n.op != "call_function" or n.meta.get(META_PHASE) is not Phase.FORWARD or n not in data
                or not isinstance(val, torch.Tensor) or not _owns_storage(n)):
            continue
        aliases = _aliases(n, pos)
        group = {n, *aliases}
        if _held_otherwise(group):
            continue
        readers = {u for m in group for u in m.users if u not in group}
        if any(u.op == "output" for u in readers):
            continue
        later = sorted((u for u in readers if u.meta.get(META_PHASE) is not Phase.FORWARD), key=pos.__getitem__)
        # the views the forward takes count as its readers; those the backward takes (the recomputation's) are
        # made again of the fetched copy below, and the originals dropped
        forward = [u for u in readers if u not in later] + [a for a in aliases if a.meta.get(META_PHASE) is Phase.FORWARD]
        if not later:
            continue
        if forward and max(pos[u] for u in forward) > pos[later[0]]:
            continue  # a backward reader before a forward one (a scheduled graph): nowhere to keep it apart
        saved.append((n, aliases, later))
        last_forward[n] = max(forward, key=pos.__getitem__) if forward else n
    if not saved:
        return PassResult(graph, False, "no saved activation: the backward reads nothing from the forward")
    cpu, part = cpu_checkpointing(options), partition_activations(options)
    tp, rank, group = options.tp_size, options.tp_rank, options.tp_group_name
    kept: dict[fx.Node, fx.Node] = {}  # saved value -> what stays of it (its slice, or itself)
    parted, whole_symbolic = [], 0
    for x, _, _ in saved:
        kept[x] = x
        if part and x.meta.get(META_TP_REPLICATED) and x.meta["val"].dtype.is_floating_point:  # (masks stay whole)
            numel = x.meta["val"].numel()
            if not isinstance(numel, int):
                whole_symbolic += 1
            else:
                with g.inserting_after(last_forward[x]):
                    kept[x] = _slice_of(g, x, numel, tp, rank)
                parted.append(x)
    stores = {}
    if cpu:
        for x, _, _ in saved:
            with g.inserting_after(kept[x] if kept[x] is not x else last_forward[x]):
                stores[x] = make_node(g, activation_store, (kept[x],), val=None, like=x, name=f"{x.name}_stored")
    order = sorted(saved, key=lambda s: pos[s[2][0]])  # by the backward's first reader
    pos = {n: i for i, n in enumerate(g.nodes)}
    moved = symbolic = 0
    for i, (x, aliases, later) in enumerate(order):
        first = later[0]
        val = kept[x].meta["val"]
        back = kept[x]
        if x in stores:
            anchor = order[i - 1][2][0] if i else first
            if pos[anchor] <= pos[stores[x]]:
                anchor = first
            with g.inserting_before(anchor):
                start = make_node(g, activation_fetch_start, (stores[x],), {"device": str(val.device)}, val=val,
                                  like=first, name=f"{x.name}_fetch")
            with g.inserting_before(first):
                back = make_node(g, host_fetch_wait, (start,), val=val, like=first, name=f"{x.name}_back")
            numel = val.numel()
            if isinstance(numel, int):
                moved += numel * val.element_size()
            else:
                symbolic += 1
        if x in parted:
            with g.inserting_before(first):
                back = _gathered(g, back, x, tp, group, first)
        if back is not x:
            again = {x: back}  # the aliases the backward reads, made again of what came back (views: no copy)
            needed = set()
            for a in aliases:
                if any(u in later for u in a.users):
                    while a is not x and a not in needed:
                        needed.add(a)
                        a = a.args[0]
            with g.inserting_before(first):
                for a in aliases:  # (graph order: each after what it views)
                    if a in needed:
                        again[a] = g.node_copy(a, lambda arg: again.get(arg, arg))  # (its meta copied)
                        again[a].meta[META_PHASE] = first.meta.get(META_PHASE)
            for u in later:
                for m, y in again.items():
                    u.replace_input_with(m, y)
            for a in reversed(aliases):  # a view nothing reads now would still keep x to where it is
                if not a.users:
                    g.erase_node(a)
    g.lint()
    graph.gm.recompile()
    said = []
    if part:
        said.append(f"{len(parted)} saved activations replicated over the tensor-parallel group kept as each "
                    f"rank's 1/{tp} (partition_activations), all-gathered before their backward readers"
                    + (f"; {whole_symbolic} of symbolic size kept whole" if whole_symbolic else ""))
    if cpu:
        sizes = format_bytes(moved) + (f" and {symbolic} of symbolic size" if symbolic else "")
        said.append(f"{len(stores)} saved activations ({sizes}) kept on the host between the forward and the "
                    "backward (cpu_checkpointing), each fetched one ahead of its backward readers")
    return PassResult(graph, bool(parted or stores), "; ".join(said))


def _aliases_input(n: fx.Node) -> bool:
    """``n``'s result is (or may be, for reshape) its first argument's storage seen another way, and nothing
    else: read again of the fetched value, it is the same (not an in-place op returning its argument, nor a
    collective's wait, nor a runtime call)."""
    return (n.op == "call_function" and bool(n.args) and isinstance(n.args[0], fx.Node)
            and (is_view(n) or n.target in ALIAS_OPS or n.target in RESHAPE_OPS))


def _held_otherwise(group: set) -> bool:
    """Something other than a view keeps the value's storage (an op writing it in place and returning it):
    storing it would not give its memory back."""
    return any(allocates_nothing(u) and u.target is not operator.getitem and not _aliases_input(u)
               for m in group for u in m.users)


def _owns_storage(n: fx.Node) -> bool:
    """A value whose memory goes back once it and its aliases are no longer read: an op's own result, or one
    result of an op that returns several (``getitem`` of a layer norm's or an attention's outputs)."""
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and not allocates_nothing(src)
    return not _aliases_input(n) and not allocates_nothing(n)


def _aliases(x: fx.Node, pos: dict) -> list:
    """The nodes that view ``x`` (through views of views), in graph order (``pos``: node -> position)."""
    seen, stack = {x}, [x]
    while stack:
        for u in stack.pop().users:
            if u not in seen and _aliases_input(u) and u.args[0] in seen:
                seen.add(u)
                stack.append(u)
    seen.discard(x)
    return sorted(seen, key=pos.__getitem__)


def _slice_of(g: fx.Graph, x: fx.Node, numel: int, tp: int, rank: int) -> fx.Node:
    """This rank's slice of ``x`` flattened and zero-padded to a multiple of ``tp``, copied (so ``x`` is freed)."""
    val = x.meta["val"]
    share = -(-numel // tp)
    meta = dict(like=x)
    flat = make_node(g, aten.reshape.default, (x, [numel]), val=fake_like(val, (numel,)), name=f"{x.name}_flat",
                     **meta)
    if share * tp != numel:
        with g.inserting_after(flat):
            flat = make_node(g, aten.constant_pad_nd.default, (flat, [0, share * tp - numel]),
                             val=fake_like(val, (share * tp,)), name=f"{x.name}_padded", **meta)
    with g.inserting_after(flat):
        part = make_node(g, aten.slice.Tensor, (flat, 0, rank * share, (rank + 1) * share),
                         val=fake_like(val, (share,)), name=f"{x.name}_part", **meta)
    with g.inserting_after(part):
        return make_node(g, aten.clone.default, (part,), val=fake_like(val, (share,)), name=f"{x.name}_kept", **meta)


def _gathered(g: fx.Graph, piece: fx.Node, x: fx.Node, tp: int, group: str, first: fx.Node) -> fx.Node:
    """``x`` again, from the ranks' slices: all-gathered over the group, the padding cut, reshaped."""
    val = x.meta["val"]
    numel = val.numel()
    share = piece.meta["val"].shape[0]
    meta = dict(like=first)
    issued = make_node(g, c10d.all_gather_into_tensor.default, (piece, tp, group),
                       val=fake_like(val, (share * tp,)), name="tp_activation_gather", **meta)
    done = make_node(g, c10d.wait_tensor.default, (issued,), val=fake_like(val, (share * tp,)),
                     name="tp_activation_wait", **meta)
    whole = done
    if share * tp != numel:
        whole = make_node(g, aten.slice.Tensor, (done, 0, 0, numel), val=fake_like(val, (numel,)),
                          name=f"{x.name}_unpadded", **meta)
    return make_node(g, aten.reshape.default, (whole, list(val.shape)), val=fake_like(val, tuple(val.shape)),
                     name=f"{x.name}_whole", **meta)
