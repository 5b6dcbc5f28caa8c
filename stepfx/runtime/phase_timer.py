"""``wall_clock_breakdown``: how long each part of the step took — forward,
backward, optimizer and the communication waited for — read off the program
the rank runs.

The program's nodes carry their phase (capture sets it; passes keep it);
collectives and their waits are "communication". A copy of the program gets a
mark before each run of nodes of one kind and one before the output; a
segment's time is the difference of its marks, summed per kind. On CUDA a
mark records an event on the current stream (device time, no
synchronization inside the step; the events are read once after the step,
which waits for its last one, as DeepSpeed's timers synchronize); on the CPU
it reads the clock. The plan that ``explain()`` shows is not changed.
"""
from __future__ import annotations

import time

import torch
import torch.fx as fx

from .. import compat
from ..graph.ops import is_collective
from ..graph.step_graph import META_PHASE

__all__ = ["PhaseTimer"]

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _kind(node: fx.Node, previous: str | None) -> str | None:
    if is_collective(node) or node.target is _WAIT:
        return "communication"
    phase = node.meta.get(META_PHASE)
    return str(phase) if phase is not None else previous


class PhaseTimer:
    def __init__(self, gm: fx.GraphModule, device_type: str):
        self.cuda = device_type == "cuda" and torch.cuda.is_available()
        self.kinds: list[str] = []  # the kind of the segment each mark opens (the last mark closes)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        current: str | None = None
        for node in gm.graph.nodes:
            if node.op == "output":
                graph.call_function(self.mark, (len(self.kinds),))
                self.kinds.append("end")
            elif node.op == "call_function":
                kind = _kind(node, current)
                if kind is not None and kind != current:
                    graph.call_function(self.mark, (len(self.kinds),))
                    self.kinds.append(kind)
                    current = kind
            env[node] = graph.node_copy(node, lambda n: env[n])
        self.program = compat.graph_module(gm, graph)
        self._times = [0.0] * len(self.kinds)
        self._events = [torch.cuda.Event(enable_timing=True) for _ in self.kinds] if self.cuda else []

    def mark(self, index: int) -> None:
        if self.cuda:
            self._events[index].record()
        else:
            self._times[index] = time.perf_counter()

    def seconds(self) -> dict[str, float]:
        """Seconds per kind in the last run (waits for its device work on CUDA)."""
        if self.cuda:
            self._events[-1].synchronize()
            spans = [self._events[i].elapsed_time(self._events[i + 1]) / 1e3 for i in range(len(self.kinds) - 1)]
        else:
            spans = [self._times[i + 1] - self._times[i] for i in range(len(self.kinds) - 1)]
        out: dict[str, float] = {}
        for kind, span in zip(self.kinds, spans):
            out[kind] = out.get(kind, 0.0) + span
        return out
