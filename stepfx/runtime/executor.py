"""Run a compiled step in this process.

The executor owns nothing but the compiled GraphModule; the binding says
where inputs come from and where outputs go. The graph runs under
``torch.no_grad()`` (it already contains the backward).
"""
from __future__ import annotations

from typing import Any

import torch

from ..errors import ExecutionError
from ..graph import StepGraph
from .binding import ModuleBinding

__all__ = ["LocalExecutor"]


class LocalExecutor:
    def __init__(self, graph: StepGraph, binding: ModuleBinding):
        if not graph.functional:
            raise ValueError("the executor runs functional step graphs only (run the pass pipeline first)")
        self.graph = graph
        self.binding = binding
        self.gm = graph.gm
        self.runs = 0

    def run(self, batch_tensors: list[torch.Tensor]) -> Any:
        inputs = self.binding.inputs(batch_tensors)
        try:
            with torch.no_grad():
                outputs = self.gm(*inputs)
        except Exception as exc:
            raise ExecutionError(
                f"the compiled step failed on run #{self.runs + 1}: {type(exc).__name__}: {exc}\n"
                "  the model and optimizer were left as they were before this call"
            ) from exc
        self.runs += 1
        return self.binding.write(outputs)
