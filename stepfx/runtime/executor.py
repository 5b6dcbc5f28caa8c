"""Run a compiled step on this rank.

The executor owns nothing but the compiled GraphModule; the binding says
where inputs come from and where outputs go. With ``cuda_graphs`` the plan
is replayed as CUDA graphs from its third run on (runtime/graphs.py). The graph runs under
``torch.no_grad()`` (it already contains the backward). A failure leaves
all state untouched (nothing is written before the graph finished) and,
when ranks run together, aborts stepfx's group so that they all stop.
"""
from __future__ import annotations

from typing import Any

import torch

from ..graph import StepGraph
from .binding import ModuleBinding
from .distributed import DataParallel, failed_together
from .graphs import WARMUP_RUNS, GraphedStep, NotGraphable, PoolHolder

__all__ = ["LocalExecutor"]


class LocalExecutor:
    def __init__(self, graph: StepGraph, binding: ModuleBinding, dp: DataParallel | None = None, *,
                 cuda_graphs: bool = False, device_type: str = "cuda", graph_pool: PoolHolder | None = None):
        if not graph.functional:
            raise ValueError("the executor runs functional step graphs only (run the pass pipeline first)")
        self.graph = graph
        self.binding = binding
        self.dp = dp if dp is not None else DataParallel()
        self.gm = graph.gm
        self.gm.recompile()
        self.runs = 0
        self.graphed: GraphedStep | None = None
        self.graphs_note = "off (stepfx.cuda_graphs)"  # why the step is (not) replayed as CUDA graphs, for explain()
        if cuda_graphs:
            try:
                self.graphed = GraphedStep(self.gm, device_type, graph.signature, graph_pool)
                self.graphs_note = self.graphed.describe()
            except NotGraphable as exc:
                self.graphs_note = f"not used: {exc}"

    def run(self, batch_tensors: list[torch.Tensor]) -> Any:
        try:
            inputs = self.binding.inputs(batch_tensors)
            graphed = self.graphed
            with torch.no_grad():
                if graphed is not None and graphed.failed is None and self.runs >= WARMUP_RUNS:
                    outputs = graphed.run(inputs)
                    self.graphs_note = graphed.describe()
                else:
                    outputs = self.gm(*inputs)
        except Exception as exc:
            raise failed_together(self.dp, exc, self.runs) from exc
        self.runs += 1
        return self.binding.write(outputs)
