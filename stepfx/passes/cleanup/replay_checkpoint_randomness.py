"""replay_checkpoint_randomness: a random op that a checkpointed region
recomputes in the backward reuses the forward's draw, as eager's
``torch.utils.checkpoint`` does.

Why: ``torch.utils.checkpoint`` (and Hugging Face's
``gradient_checkpointing_enable``, built on it) recomputes the region in the
backward with the RNG state it had in the forward (``preserve_rng_state``),
restored around the recomputation: the recomputed dropout mask is the
forward's, and the generator advances once. Capture records the ops, not
the state juggling around them: the recomputation draws a second, different
mask (the gradient is then that of another mask: a silently wrong step) and
the generator advances twice.

Requires: a functional graph with phases.

Ensures: each backward-phase random op that computes the same thing as a
forward random op — same op, same constant arguments, and tensor arguments
that are the same nodes or themselves recomputations of them (checked
recursively, the way a recomputation repeats the forward's ops) — is
replaced by that forward op's result; the second draw is gone. Random ops
that are not such a replay are left alone.
"""
from __future__ import annotations

import torch.fx as fx

from ...errors import PassError
from ...graph import StepGraph
from ...graph.build import clone_step_graph_mapped
from ...graph.ops import is_random
from ...graph.step_graph import META_PHASE, Phase
from ..manager import PassOptions, PassResult

__all__ = ["replay_checkpoint_randomness"]


class _Same:
    """Whether a backward node recomputes a forward node (memoized)."""

    def __init__(self):
        self.memo: dict[tuple[fx.Node, fx.Node], bool] = {}

    def nodes(self, a: fx.Node, b: fx.Node) -> bool:
        if a is b:
            return True
        key = (a, b)
        if key not in self.memo:
            self.memo[key] = False  # no cycles in a DAG; a guard against deep recursion on itself
            self.memo[key] = (a.op == b.op == "call_function" and a.target is b.target
                              and self.values(a.args, b.args) and self.values(a.kwargs, b.kwargs))
        return self.memo[key]

    def values(self, a, b) -> bool:
        if isinstance(a, fx.Node) or isinstance(b, fx.Node):
            return isinstance(a, fx.Node) and isinstance(b, fx.Node) and self.nodes(a, b)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(self.values(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(self.values(a[k], b[k]) for k in a)
        return type(a) is type(b) and a == b


def replay_checkpoint_randomness(graph: StepGraph, options: PassOptions) -> PassResult:
    if not graph.functional:
        raise PassError("replay_checkpoint_randomness requires a functional graph (run functionalize_graph first)")
    nodes = list(graph.gm.graph.nodes)
    forward = [n for n in nodes if is_random(n) and n.meta.get(META_PHASE) == Phase.FORWARD]
    backward = [n for n in nodes if is_random(n) and n.meta.get(META_PHASE) == Phase.BACKWARD]
    if not forward or not backward:
        return PassResult(graph, False, "")
    same = _Same()
    pairs: dict[fx.Node, fx.Node] = {}
    used: set = set()
    for b in backward:
        match = next((f for f in forward if f not in used and same.nodes(b, f)), None)
        if match is not None:
            pairs[b] = match
            used.add(match)
    if not pairs:
        return PassResult(graph, False, f"{len(backward)} backward random op(s), none a recomputation of the forward's")
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    for b, f in pairs.items():
        new_b, new_f = copy_of[b], copy_of[f]
        new_b.replace_all_uses_with(new_f)
        g.erase_node(new_b)
    g.lint()
    graph.gm.recompile()
    return PassResult(graph, True, f"{len(pairs)} random op(s) recomputed by a checkpoint reuse the forward's draw "
                                   f"(as torch.utils.checkpoint's preserved RNG state gives)")
