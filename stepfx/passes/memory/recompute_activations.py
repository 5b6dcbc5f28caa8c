"""recompute_activations: activation checkpointing chosen on the graph — the
backward recomputes forward values instead of keeping them, under a budget.

Why: between the forward and the backward a step holds every forward value
the backward reads (saved activations): for a transformer most of its peak
at long sequences. Recomputing cheap ones (pointwise ops, casts, norms,
views: memory-bound, a few percent of the step's time) frees most of that;
recomputing matmuls (whole blocks from their inputs, as
``torch.utils.checkpoint`` per block does) frees nearly all of it for about
a third more forward compute.

What is saved is a minimum cut (networkx), as torch's own partitioner
chooses it: each forward value that the backward needs is either saved
(paying its bytes) or recomputed from saved values and the step's inputs.
Ops are recomputable by level, and the pass takes the least aggressive
level whose saved bytes meet the budget:

- ``cheap``: pointwise ops, casts, row reductions, norms, views, embedding
  lookups (O(bytes) work);
- ``matmuls``: also matmuls (attention's output and statistics stay saved);
- ``all``: also attention (without dropout) — whole blocks recomputed from
  their inputs.

At ``matmuls``, the values between blocks (where all of the batch's
data flows through one value that several ops read: the residual stream,
before the attention and before the MLP) are kept: a cut that saved only
the embedding would rebuild every earlier block for each later block's
backward and keep those copies alive until their own backward — fewer
saved bytes, a higher peak. At ``all`` every other one of those that carry
the residual stream (the next one reached through cheap ops only: not a
norm's output that several projections read) is kept, from the first: a
pre-norm block's input, as ``torch.utils.checkpoint`` per block keeps it.

Never recomputed at any level: random ops (a second draw would differ;
attention with dropout),
collectives and ops with side effects; values the step returns; with
codegen, a cross-entropy loss's head (the log-softmax, the logits' matmul,
the hidden state it reads), which fuse_linear_cross_entropy turns into a
kernel that stores no logits.

Config: ``"stepfx": {"memory_budget_gib": X}``: the memory planner
(planner.py) imposes the level (``options.extra[RECOMPUTE_LEVEL_KEY]``).
``"stepfx": {"activation_memory_budget": b}`` with b in [0, 1]: the
saved bytes may be at most b times what the step saves without
recomputation (1: nothing recomputed; 0: the least the levels reach).
DeepSpeed's ``activation_checkpointing`` block present, or its
``pipeline.activation_checkpoint_interval`` above 0 (and no budget set),
means b = 0 (the interval itself is not honoured: the cut is the graph's). Neither: the pass does nothing.

Requires: a functional graph with phases (capture), before the ZeRO passes
(a recomputed op reads parameters the way the backward does: stage 3
gathers them again there).

Ensures: for the chosen set R of forward nodes, a copy of each node of R
(phase backward, ``meta["recomputed_from"]`` naming the original) sits just
before the first backward or optimizer node that needs it, and every
non-forward reader of a node of R reads the copy; forward readers keep the
original. Values are unchanged (the same ops on the same inputs: bitwise
where kernels are deterministic). The summary names each level's saved
bytes and recomputed ops, and the choice.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import networkx as nx
import torch
import torch.fx as fx

from ...errors import PassError
from ...graph import StepGraph
from ...graph.accounting import Sizes, size_values
from ...graph.build import clone_step_graph_mapped, copy_node_meta
from ...graph.ops import (
    ATTENTION_OPS,
    allocates_nothing,
    batch_dependent,
    has_side_effect,
    is_collective,
    is_random,
)
from ...graph.step_graph import META_PHASE, Phase
from ..manager import PassOptions, PassResult

__all__ = ["LEVELS", "RECOMPUTE_LEVEL_KEY", "activation_memory_budget", "format_bytes", "recompute_activations"]

aten = torch.ops.aten
LEVELS = ("cheap", "matmuls", "all")
# options.extra[RECOMPUTE_LEVEL_KEY]: a level the memory planner (planner.py) imposes, or "none"
RECOMPUTE_LEVEL_KEY = "recompute_level"
META_RECOMPUTED = "recomputed_from"

_MATMULS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.matmul.default,
    aten.linear.default, aten.convolution.default, aten._convolution.default,
})
_INF = float("inf")


def _level_of(node: fx.Node) -> int | None:
    """The first level (index in LEVELS) at which ``node`` may be recomputed; None: never."""
    if node.target in ATTENTION_OPS:
        # tagged random for their dropout: without it (dropout_p 0) the same inputs give the same outputs
        return 2 if _dropout_p(node) == 0 else None
    if is_random(node) or is_collective(node) or has_side_effect(node):
        return None
    if not isinstance(node.target, torch._ops.OpOverload) and node.target is not operator.getitem:
        return None
    if node.target in _MATMULS:
        return 1
    return 0


def _dropout_p(node: fx.Node):
    """An attention op's ``dropout_p`` (by its schema name), None when it has none."""
    if "dropout_p" in node.kwargs:
        return node.kwargs["dropout_p"]
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == "dropout_p":
            return node.args[i] if i < len(node.args) else a.default_value
    return None


def activation_memory_budget(config) -> float | None:
    """The budget the config asks for: ``stepfx.activation_memory_budget``,
    else 0 when DeepSpeed's ``activation_checkpointing`` block is there, else None."""
    if config is None:
        return None
    budget = getattr(getattr(config, "stepfx", None), "activation_memory_budget", None)
    if budget is not None:
        return float(budget)
    raw = getattr(config, "raw", None) or {}
    if "activation_checkpointing" in raw:
        return 0.0
    pipeline = getattr(config, "pipeline", None)  # DeepSpeed's pipeline checkpoints every N layers when N > 0
    if pipeline is not None and getattr(pipeline, "activation_checkpoint_interval", 0):
        return 0.0
    return None


@dataclass
class _Choice:
    level: str
    saved: set  # forward nodes whose values the backward reads as saved
    recompute: set  # forward nodes copied into the backward
    saved_bytes: int


def _is_tensor(val) -> bool:
    return isinstance(val, torch.Tensor) or (isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val))


def _loss_head(nodes: list) -> set:
    """The chains under each cross-entropy loss that fuse_linear_cross_entropy (codegen) turns into a kernel
    that never stores the logits; it matches them only where backward reads the forward's own values:
    recomputed, the logits would be stored after all ([tokens, vocab] in fp32: 6 GiB at 32k tokens)."""
    from ..fusion.fuse_linear_cross_entropy import fusable_head

    head: set = set()
    for n in nodes:
        if n.op == "call_function" and n.target is aten.nll_loss_forward.default:
            head |= fusable_head(n)
    return head


class _Analysis:
    def __init__(self, graph: StepGraph, keep_loss_head: bool = False):
        self.nodes = list(graph.gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.sizes = Sizes(size_values(graph))
        self.forward = [n for n in self.nodes if n.op == "call_function" and n.meta.get(META_PHASE) == Phase.FORWARD]
        fwd = set(self.forward)
        # forward values read after the forward (backward, optimizer) or returned
        self.needed = {n for n in self.forward if any(u not in fwd for u in n.users)}
        self.returned = {n for n in self.forward if any(u.op == "output" for u in n.users)}
        self.fwd = fwd
        points = self._shared_points()
        # kept from ``matmuls`` on: a multi-output op counts (attention, a norm: read by its results)
        self.boundaries = {n for n in points if not allocates_nothing(n)}
        # the residual stream is among the values: one tensor each, not a multi-output op's tuple
        self.shared_values = {n for n in points if self._is_value(n)}
        # at ``all``: every other value of the residual stream, from the first (a pre-norm transformer's block
        # inputs: the value between attention and MLP is recomputed with the block, as torch.utils.checkpoint
        # per block does); a model without such a chain: every other shared value
        stream = self._residual_stream() or sorted(self.shared_values, key=self.index.__getitem__)
        self.block_inputs = set(stream[::2])
        self.loss_head = _loss_head(self.nodes) if keep_loss_head else set()

    def _is_value(self, n: fx.Node) -> bool:
        """One tensor of storage its own: an op's result, or one result of a multi-output op (a norm's
        output, attention's); not a view of another value, not the tuple itself."""
        if not isinstance(n.meta.get("val"), torch.Tensor):
            return False
        if n.target is operator.getitem:
            parent = n.args[0]
            return isinstance(parent, fx.Node) and not allocates_nothing(parent)
        return not allocates_nothing(n)

    def _shared_points(self) -> list:
        """Where the batch's data flows through one node that several forward ops read: the residual
        stream between blocks (an articulation point of the forward's data flow with more than one
        reader). Recomputing across them would rebuild earlier blocks for a later block's backward and
        keep the copies alive until their own backward: from the ``matmuls`` level on they are kept."""
        data = batch_dependent([n for n in self.nodes if n.op == "placeholder"] + list(self.forward))
        flow = nx.Graph()
        for n in self.forward:
            if n in data and _is_tensor(n.meta.get("val")):
                flow.add_node(n)
                flow.add_edges_from((a, n) for a in n.all_input_nodes if a in data and a in self.fwd)
        return [n for n in nx.articulation_points(flow) if sum(1 for u in n.users if u in self.fwd) > 1]

    def _residual_stream(self) -> list:
        """The shared values that carry the residual stream, in program order: those from which the next
        one is reached through ops recomputable at level ``cheap`` (a residual add; a post-norm's add and
        norm). A norm's output that several projections read (Llama's q/k/v, gate/up) is shared too, but
        the next one is reached from it only through matmuls."""
        ordered = sorted(self.shared_values, key=self.index.__getitem__)
        stream = []
        for b, after in zip(ordered, ordered[1:]):
            seen, stack = {b}, [b]
            while stack and after not in seen:
                for u in stack.pop().users:
                    if u in self.fwd and u not in seen and (
                            u is after or (u not in self.shared_values and _level_of(u) == 0)):
                        seen.add(u)
                        stack.append(u)
            if after in seen:
                stream.append(b)
        return stream

    def bytes(self, node: fx.Node) -> float:
        val = node.meta.get("val")
        return float(self.sizes.value(self.sizes.bytes_of(val))) if _is_tensor(val) else 0.0

    def cost(self, node: fx.Node, movable: bool = True) -> float:
        """Bytes kept if ``node``'s value is saved. A view or getitem that could be recomputed keeps its
        base: the cut goes there (infinite here); one that cannot counts its own bytes."""
        if movable and allocates_nothing(node):
            return _INF
        return self.bytes(node)

    def choose(self, level: int) -> _Choice:
        g = nx.DiGraph()
        for n in self.forward:
            # sizes and scalars are read as they are; returned values live all step anyway
            if not _is_tensor(n.meta.get("val")) or n in self.returned:
                g.add_edge("source", (n, "out"), capacity=_INF)
                continue
            lvl = None if n in self.loss_head else _level_of(n)
            kept = self.boundaries if level == 1 else self.block_inputs if level >= 2 else ()
            movable = lvl is not None and lvl <= level and n not in kept
            g.add_edge((n, "in"), (n, "out"), capacity=self.cost(n, movable))
            if not movable:
                g.add_edge("source", (n, "in"), capacity=_INF)  # computed in the forward, only saved or not
            for arg in n.all_input_nodes:
                # sizes and returned values are there in the backward anyway: reading them costs no edge
                if arg in self.fwd and _is_tensor(arg.meta.get("val")) and arg not in self.returned:
                    g.add_edge((arg, "out"), (n, "in"), capacity=_INF)
            if n in self.needed:
                g.add_edge((n, "out"), "sink", capacity=_INF)
        # inputs (placeholders) are held all step: available, nothing to cut
        _, (reachable, _) = nx.minimum_cut(g, "source", "sink") if g.has_node("sink") else (0, (set(g.nodes), None))
        saved = {n for n in self.forward if (n, "in") in reachable and (n, "out") not in reachable}
        recompute: set = set()
        stack = [n for n in self.needed if n not in saved and (n, "out") not in reachable]
        while stack:
            n = stack.pop()
            if n in recompute:
                continue
            recompute.add(n)
            stack += [a for a in n.all_input_nodes if a in self.fwd and a not in saved and (a, "out") not in reachable]
        saved_bytes = int(sum(self.bytes(n) for n in saved))
        return _Choice(LEVELS[level], saved, recompute, saved_bytes)

    def baseline_bytes(self) -> int:
        """Bytes of the forward values the backward reads, without recomputation (a view counts its base)."""
        roots = set()
        for n in self.needed:
            root = n
            while allocates_nothing(root) and root.all_input_nodes and root.args and isinstance(root.args[0], fx.Node) \
                    and root.args[0] in self.fwd:
                root = root.args[0]
            if root in self.fwd and not allocates_nothing(root):
                roots.add(root)
        return int(sum(self.bytes(n) for n in roots))


def _rewrite(graph: StepGraph, recompute: set) -> StepGraph:
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    R = {copy_of[n] for n in recompute}
    # where each copy must exist: before its first non-forward reader, or before the copy that reads it
    first: dict[fx.Node, fx.Node] = {}
    for n in sorted(R, key=order.__getitem__, reverse=True):
        readers = [u for u in n.users if u not in R and u.meta.get(META_PHASE) != Phase.FORWARD and u.op != "output"]
        readers += [first[u] for u in n.users if u in R and u in first]
        if readers:
            first[n] = min(readers, key=order.__getitem__)
    copies: dict[fx.Node, fx.Node] = {}
    for n in sorted(first, key=lambda x: (order[first[x]], order[x])):
        with g.inserting_before(first[n]):
            args = fx.node.map_arg(n.args, lambda a: copies.get(a, a))
            kwargs = fx.node.map_arg(n.kwargs, lambda a: copies.get(a, a))
            new = g.create_node("call_function", n.target, args, kwargs, name=f"recompute_{n.name}")
        copy_node_meta(n, new, phase=Phase.BACKWARD)
        new.meta["val"] = n.meta.get("val")
        new.meta[META_RECOMPUTED] = n.name
        copies[n] = new
    for n, new in copies.items():
        for user in list(n.users):
            if user not in copies.values() and user.meta.get(META_PHASE) != Phase.FORWARD and user.op != "output" \
                    and user not in R:
                user.replace_input_with(n, new)
    g.lint()
    graph.gm.recompile()
    return graph


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} B"


def recompute_activations(graph: StepGraph, options: PassOptions) -> PassResult:
    imposed = (options.extra or {}).get(RECOMPUTE_LEVEL_KEY)
    budget = activation_memory_budget(options.config)
    if imposed == "none" or (budget is None and imposed is None):
        return PassResult(graph, False, "")
    if not graph.functional:
        raise PassError("recompute_activations requires a functional graph (run functionalize_graph first)")
    from ..declared import codegen_enabled  # (declared.py imports this module)

    analysis = _Analysis(graph, keep_loss_head=codegen_enabled(options))
    if imposed is not None:  # the memory planner chose the level
        choice = analysis.choose(LEVELS.index(imposed))
        head = (f"level {choice.level!r} (stepfx.memory_budget_gib's plan): {len(choice.recompute)} ops recomputed, "
                f"saves {format_bytes(choice.saved_bytes)} of {format_bytes(analysis.baseline_bytes())}")
        if not choice.recompute:
            return PassResult(graph, False, head)
        return PassResult(_rewrite(graph, choice.recompute), True, head)
    base = analysis.baseline_bytes()
    if base == 0:
        return PassResult(graph, False, "no forward value is read by the backward")
    limit = budget * base
    if base <= limit:
        return PassResult(graph, False, f"budget {budget:g}: nothing recomputed ({format_bytes(base)} saved for the backward)")
    lines, chosen = [], None
    for level in range(len(LEVELS)):
        choice = analysis.choose(level)
        lines.append(f"{choice.level}: saves {format_bytes(choice.saved_bytes)}, recomputes {len(choice.recompute)} ops")
        if chosen is None and choice.saved_bytes <= limit:
            chosen = choice
    met = chosen is not None
    if chosen is None:  # the budget cannot be met: the least the levels reach
        chosen = min((analysis.choose(level) for level in range(len(LEVELS))), key=lambda c: c.saved_bytes)
    head = (f"budget {budget:g} x {format_bytes(base)} saved without recomputation: level {chosen.level!r}, "
            f"{len(chosen.recompute)} ops recomputed, saves {format_bytes(chosen.saved_bytes)}"
            + ("" if met else f" (over the budget's {format_bytes(int(limit))}: no level saves less)"))
    if not chosen.recompute:
        return PassResult(graph, False, head + " [" + "; ".join(lines) + "]")
    out = _rewrite(graph, chosen.recompute)
    return PassResult(out, True, head + " [" + "; ".join(lines) + "]")
