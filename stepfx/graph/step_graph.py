"""StepGraph: one training step as one fx graph plus its signature.

Node metadata stepfx maintains (besides fx's own ``val`` fake value and
``stack_trace``):

- ``meta["phase"]``: :class:`Phase` of every call_function node;
- ``meta["param"]``: the parameter name a node belongs to, where it belongs
  to exactly one (its views and casts in forward, its final gradient, its
  optimizer update);
- ``meta["source"]``: ``"file.py:123"`` of the user's code that produced the
  node, where known (used in error messages);
- ``meta["slot"]``: the :class:`~stepfx.graph.signature.Slot` of a placeholder;
- ``meta["grad_of"]``: on the node holding a parameter's accumulated
  gradient right after a ``backward`` (the last such node of a parameter is
  the gradient the optimizer uses); ``meta["grad_piece"]`` when that node
  holds only this rank's piece of it (ZeRO);
- ``meta["overflow_flag"]``: on the node that is True when the step's
  gradients hold an inf or nan (fp16 loss scaling).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch.fx as fx

from .signature import StepSignature

__all__ = [
    "Phase",
    "StepGraph",
    "META_PHASE",
    "META_PARAM",
    "META_SOURCE",
    "META_SLOT",
    "META_GRAD_OF",
    "META_GRAD_PIECE",
    "META_OVERFLOW",
    "META_DONATED",
    "META_HOST_RESULTS",
    "META_UNCLIPPED",
    "placeholders",
    "output_node",
    "output_values",
]

META_PHASE = "phase"
META_PARAM = "param"
META_SOURCE = "source"
META_SLOT = "slot"
META_GRAD_OF = "grad_of"
META_GRAD_PIECE = "grad_piece"
META_OVERFLOW = "overflow_flag"
# On a kernel call that writes its results into some of its inputs (a fused
# optimizer update): the positions of those args. Allowed in a functional
# graph only when the call is the last reader of each donated value.
META_DONATED = "donated"
META_HOST_RESULTS = "host_results"  # indices of a node's results that are host tensors it updated in place
META_UNCLIPPED = "unclipped_factor"  # on the unscale x clip factor: what it is when nothing is clipped ("1/loss_scale", "1")


class Phase(str, enum.Enum):
    """Which part of the training step a node belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"

    def __str__(self) -> str:
        return self.value


@dataclass
class StepGraph:
    """A whole training step: ``gm`` computes ``signature.outputs`` from
    ``signature.inputs``.

    ``functional`` is True once no node mutates a graph input (capture gives
    a graph with the optimizer's in-place updates; ``functionalize_graph``
    makes it functional).
    """

    gm: fx.GraphModule
    signature: StepSignature
    functional: bool = False

    def replace(self, **changes) -> "StepGraph":
        return replace(self, **changes)

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def count_ops(self) -> int:
        return sum(1 for n in self.gm.graph.nodes if n.op == "call_function")

    def to_networkx(self):
        """The step as a ``networkx.MultiDiGraph``: a node per fx node with its op, phase, role,
        shape, dtype and source line as attributes, an edge per use (``graph/export.py``)."""
        from .export import to_networkx

        return to_networkx(self)

    def to_dot(self, name: str = "step") -> str:
        """The step as Graphviz DOT text (nodes coloured by phase), for ``dot -Tsvg``."""
        from .export import to_dot

        return to_dot(self, name)


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def output_node(gm: fx.GraphModule) -> fx.Node:
    for n in reversed(gm.graph.nodes):
        if n.op == "output":
            return n
    raise ValueError("graph has no output node")


def output_values(gm: fx.GraphModule) -> list:
    """The flat list of values the graph returns (Nodes or constants)."""
    (ret,) = output_node(gm).args
    if not isinstance(ret, (tuple, list)):
        raise ValueError("a step graph must return a flat tuple")
    return list(ret)
