"""Run a compiled step on this rank.

The executor owns nothing but the compiled GraphModule; the binding says
where inputs come from and where outputs go. The graph runs under
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

__all__ = ["LocalExecutor"]


class LocalExecutor:
    def __init__(self, graph: StepGraph, binding: ModuleBinding, dp: DataParallel | None = None):
        if not graph.functional:
            raise ValueError("the executor runs functional step graphs only (run the pass pipeline first)")
        self.graph = graph
        self.binding = binding
        self.dp = dp if dp is not None else DataParallel()
        self.gm = graph.gm
        self.gm.recompile()
        self.runs = 0

    def run(self, batch_tensors: list[torch.Tensor]) -> Any:
        try:
            inputs = self.binding.inputs(batch_tensors)
            with torch.no_grad():
                outputs = self.gm(*inputs)
        except Exception as exc:
            raise failed_together(self.dp, exc, self.runs) from exc
        self.runs += 1
        return self.binding.write(outputs)
