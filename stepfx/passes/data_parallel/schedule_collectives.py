"""schedule_collectives: issue collectives early, wait for them late.

Requires: the ZeRO passes ran (collectives are ``_c10d_functional`` ops,
each followed by its ``wait_tensor``).

Ensures, without changing any value:

- *prefetch*: ZeRO-3's parameter all-gathers are issued ahead of use. In
  forward (and, separately, in backward) the gather of a bucket is issued
  as soon as the gathers it would overtake hold no more than
  ``stage3_prefetch_bucket_size`` elements in flight — at least one bucket
  ahead: when bucket k's parameters arrive, bucket k+1's are requested.
- *late waits*: every ``wait_tensor``, and the views and the averaging
  division that only unpack what it waited for, move to just before their
  first reader. A gradient reduce-scatter issued at the end of a bucket's
  backward is then waited for only where the optimizer needs the shard, so
  the rest of backward runs while it is in flight.

On CUDA the functional collectives run on NCCL's stream and
``wait_tensor`` only orders streams, so compute placed between the issue
and the wait overlaps the communication. The pass applies to CUDA steps
only: with gloo (CPU), several functional collectives in flight at once
intermittently corrupted the heap of a rank process (SIGABRT "malloc():
unaligned tcache chunk", 3 of 24 4-rank runs; 0 of 24 with every wait
right after its issue), and CPU steps are for correctness, not speed.

Before / after (stage 3 forward, two buckets)::

    all_gather = ...(bucket0)            all_gather = ...(bucket0)
    wait = wait_tensor(all_gather)       wait = wait_tensor(all_gather)
    ... forward of bucket 0 ...    ->    all_gather_1 = ...(bucket1)      # prefetched
    all_gather_1 = ...(bucket1)          ... forward of bucket 0 ...
    wait_1 = wait_tensor(all_gather_1)   wait_1 = wait_tensor(all_gather_1)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...graph import META_PHASE, Phase, StepGraph
from ...graph.build import clone_step_graph
from ...graph.ops import is_view
from ..manager import PassOptions, PassResult

__all__ = ["schedule_collectives"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _prefetch_limit(options: PassOptions) -> int:
    """Elements a prefetch may keep in flight: ``stage3_prefetch_bucket_size``,
    and no more than ``stage3_max_live_parameters`` leaves room for."""
    zero = getattr(options.config, "zero_optimization", None)
    size = getattr(zero, "prefetch_bucket_size", 50_000_000)
    live = getattr(zero, "max_live_parameters", 1_000_000_000)
    return min(size if isinstance(size, int) else 50_000_000, live if isinstance(live, int) else 1_000_000_000)


def data_parallel_overlap(options: PassOptions) -> bool:
    """``zero_optimization.overlap_comm`` (unset: on)."""
    zero = getattr(options.config, "zero_optimization", None)
    return getattr(zero, "overlap_comm", None) is not False


def tensor_parallel_overlap(options: PassOptions) -> bool:
    """Tensor parallelism's collectives waited at their first reader:
    ``tensor_parallel.tp_overlap_comm`` unset or true (false: each waited
    right after it is issued, as before)."""
    tp = getattr(options.config, "tensor_parallel", None)
    return options.tp_size > 1 and getattr(tp, "tp_overlap_comm", None) is not False


def schedule_collectives(graph: StepGraph, options: PassOptions) -> PassResult:
    g = graph.gm.graph
    if not any(n.op == "call_function" and n.target is c10d.wait_tensor.default for n in g.nodes):
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    moved = 0
    dp_overlap, tp_overlap = data_parallel_overlap(options), tensor_parallel_overlap(options)
    tp_group = options.tp_group_name if options.tp_size > 1 else None
    if dp_overlap:
        for phase in (Phase.FORWARD, Phase.BACKWARD):
            moved += _prefetch_gathers(g, phase, _prefetch_limit(options), tp_group)
    # a tensor-parallel collective of the backward issued as soon as its operand can be made, and its wait sunk
    # to its reader, lets what does not read it run meanwhile: the weight gradient's matmul while the input
    # gradient is all-reduced, as Megatron overlaps them
    early = _issue_early(g, tp_group) if tp_overlap and tp_group is not None else 0
    sunk, sunk_tp = _sink_waits(g, lambda wait: tp_overlap if _group_of(wait) == tp_group else dp_overlap, tp_group)
    graph.gm.recompile()
    return PassResult(graph, bool(moved or sunk or early), f"{moved} all-gathers prefetched, {early} tensor-parallel "
                      f"collectives of the backward issued early, {sunk} waits and unpacks moved to first use "
                      f"({sunk_tp} of the tensor-parallel group)")


def _issue_early(g: fx.Graph, tp_group: str) -> int:
    """Each backward collective on ``tp_group`` and the pure ops only it
    reads (the input gradient's matmul and views) move up to just after the
    last value they need, ahead of the independent ops between (the weight
    gradient's matmul), which then run while it is in flight."""
    from ...graph.ops import has_side_effect, is_collective, is_random

    moved = 0
    for node in [n for n in g.nodes if n.op == "call_function" and is_collective(n)
                 and n.target is not c10d.wait_tensor.default and n.meta.get(META_PHASE) is Phase.BACKWARD
                 and tp_group in n.args[1:]]:
        order = {n: i for i, n in enumerate(g.nodes)}
        chain = {node}
        todo = list(node.all_input_nodes)
        while todo:
            a = todo.pop()
            if (a in chain or a.op != "call_function" or is_collective(a) or is_random(a) or has_side_effect(a)
                    or a.meta.get(META_PHASE) is not Phase.BACKWARD or not set(a.users) <= chain):
                continue
            chain.add(a)
            todo.extend(a.all_input_nodes)
        needed = [a for c in chain for a in c.all_input_nodes if a not in chain]
        if not needed:
            continue
        anchor = max(needed, key=order.__getitem__)
        members = sorted(chain, key=order.__getitem__)
        if [order[m] for m in members] == list(range(order[anchor] + 1, order[anchor] + 1 + len(members))):
            continue  # already right after what it needs
        cursor = anchor
        for m in members:  # (each member's inputs: the anchor or before, or members placed before it)
            cursor.append(m)
            cursor = m
        moved += 1
    return moved


def _group_of(wait: fx.Node) -> str | None:
    """The group name a waited collective runs on (its last string argument)."""
    collective = wait.args[0] if wait.args and isinstance(wait.args[0], fx.Node) else None
    if collective is None:
        return None
    names = [a for a in collective.args[1:] if isinstance(a, str) and a not in ("sum", "avg", "max", "min")]
    return names[-1] if names else None


def _wait_of(collective: fx.Node) -> fx.Node | None:
    for user in collective.users:
        if user.target is c10d.wait_tensor.default:
            return user
    return None


def _prefetch_gathers(g: fx.Graph, phase: Phase, limit: int, tp_group: str | None = None) -> int:
    gathers = [
        n for n in g.nodes
        if n.op == "call_function" and n.target is c10d.all_gather_into_tensor.default and n.meta.get(META_PHASE) is phase
        and (tp_group is None or tp_group not in n.args[1:])  # (sequence parallelism's gathers read activations)
    ]
    if len(gathers) < 2:
        return 0
    moved = 0
    sizes = [n.args[0].meta["val"].numel() * n.args[1] for n in gathers]
    for k in range(1, len(gathers)):
        # the earliest bucket whose arrival may trigger this one: keep what is
        # in flight ahead of the current bucket under the prefetch limit
        j = k - 1
        in_flight = sizes[k]
        while j > 0 and in_flight + sizes[j] <= limit:
            in_flight += sizes[j]
            j -= 1
        anchor = _wait_of(gathers[j])
        if anchor is None:
            continue
        moved += _move_after(g, gathers[k], anchor)
    return moved


def _move_after(g: fx.Graph, node: fx.Node, anchor: fx.Node) -> int:
    """Move ``node`` and the ancestors only it uses (its packing) right
    after ``anchor``, when that is earlier than where they are."""
    order = {n: i for i, n in enumerate(g.nodes)}
    if order[node] <= order[anchor]:
        return 0
    group: list[fx.Node] = []

    def collect(n: fx.Node) -> None:
        for arg in n.all_input_nodes:
            if arg.op == "call_function" and order[arg] > order[anchor] and arg not in group:
                collect(arg)
        group.append(n)

    collect(node)
    cursor = anchor
    for n in sorted(group, key=order.__getitem__):
        cursor.append(n)
        cursor = n
    return 1


def _sinkable(node: fx.Node, sinking: set[fx.Node]) -> bool:
    if node.op != "call_function":
        return False
    if node.target is c10d.wait_tensor.default:
        return True
    inputs = node.all_input_nodes
    if not inputs or not all(a in sinking for a in inputs if a.op == "call_function"):
        return False
    # unpacking what a wait returned: views, and the division by N that
    # turns a summed gradient into the mean
    return is_view(node) or node.target is aten.div.Tensor


def _sink_waits(g: fx.Graph, allowed, tp_group: str | None = None) -> tuple[int, int]:
    """Move each wait ``allowed(wait)`` admits, and what only unpacks it, to
    just before its first reader. Returns (nodes moved, of them waits on the
    ``tp_group``)."""
    sinking: set[fx.Node] = set()
    for node in g.nodes:
        if node.op == "call_function" and node.target is c10d.wait_tensor.default and not allowed(node):
            continue
        if _sinkable(node, sinking):
            sinking.add(node)
    moved = moved_tp = 0
    for node in reversed(list(g.nodes)):
        if node not in sinking or not node.users:
            continue
        first = node.next
        while first.op != "root" and first not in node.users:
            first = first.next
        if first is not node.next and first.op != "root":
            first.prepend(node)
            moved += 1
            if tp_group is not None and node.target is c10d.wait_tensor.default and _group_of(node) == tp_group:
                moved_tp += 1
    return moved, moved_tp
