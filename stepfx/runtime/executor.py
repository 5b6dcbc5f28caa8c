"""Run a compiled step on this rank.

The executor owns nothing but the compiled GraphModule; the binding says
where inputs come from and where outputs go. With ``cuda_graphs`` the plan
is replayed as CUDA graphs from its third run on (runtime/graphs.py). The
graph runs under ``torch.no_grad()`` (it already contains the backward). A failure leaves
all state untouched (nothing is written before the graph finished) and,
when ranks run together, aborts stepfx's group so that they all stop.
"""
from __future__ import annotations

from typing import Any

import torch

from ..graph import StepGraph
from .binding import ModuleBinding
from .distributed import DataParallel, failed_together
from .host_optimizer import abort_jobs, host_adam_ready, release_delayed, settle_across_steps
from .graphs import WARMUP_RUNS, GraphedStep, NotGraphable, PoolHolder
from .phase_timer import PhaseTimer

__all__ = ["LocalExecutor"]


class LocalExecutor:
    def __init__(self, graph: StepGraph, binding: ModuleBinding, dp: DataParallel | None = None, *,
                 cuda_graphs: bool = False, device_type: str = "cuda", graph_pool: PoolHolder | None = None,
                 time_phases: bool = False):
        if not graph.functional:
            raise ValueError("the executor runs functional step graphs only (run the pass pipeline first)")
        self.graph = graph
        self.binding = binding
        self.dp = dp if dp is not None else DataParallel()
        self.gm = graph.gm
        self.gm.recompile()
        self.runs = 0
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        # host_update_across_steps: the inputs this graph reads through host_adam_ready (waited for there)
        self._ready_inputs = [i for i, n in enumerate(placeholders) if any(u.target is host_adam_ready for u in n.users)]
        self.graphed: GraphedStep | None = None
        self._no_graphs = "off (stepfx.cuda_graphs)"  # why there is no GraphedStep
        # wall_clock_breakdown: a marked copy of the program; seconds per phase of the last eager run
        self.timer = PhaseTimer(self.gm, device_type) if time_phases else None
        self.phase_seconds: dict[str, float] | None = None
        if cuda_graphs:
            try:
                self.graphed = GraphedStep(self.gm, device_type, graph.signature, graph_pool)
            except NotGraphable as exc:
                self._no_graphs = f"not used: {exc}"

    @property
    def graphs_note(self) -> str:
        """Whether and how the step is replayed as CUDA graphs (for explain())."""
        return self.graphed.describe() if self.graphed is not None else self._no_graphs

    def run(self, batch_tensors: list[torch.Tensor]) -> Any:
        try:
            # host updates earlier steps left running (host_update_across_steps): waited for here unless this graph
            # waits for them itself; a graph that waits for none (a micro-step's) waits before the binding reads
            # the state (a piece's copy made afresh from its master would read it mid-update)
            if not self._ready_inputs:
                settle_across_steps()
            inputs = self.binding.inputs(batch_tensors, release=True)
            if self._ready_inputs:
                settle_across_steps(frozenset(id(inputs[i]) for i in self._ready_inputs))
            graphed = self.graphed
            with torch.no_grad():
                self.phase_seconds = None
                if graphed is not None and graphed.failed is None and self.runs >= WARMUP_RUNS:
                    outputs = graphed.run(inputs)  # a replayed graph has no phase marks
                elif self.timer is not None:
                    outputs = self.timer.program(*inputs)
                    self.phase_seconds = self.timer.seconds()
                else:
                    outputs = self.gm(*inputs)
        except Exception as exc:
            abort_jobs()  # host optimizer updates not begun leave the host state as it was
            self.binding.failed()
            raise failed_together(self.dp, exc, self.runs) from exc
        release_delayed()  # delayed parameter updates left running belong to the next steps now
        self.runs += 1
        return self.binding.write(outputs)
