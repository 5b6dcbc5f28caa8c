"""The pass pipeline: one explicit ordered list, each entry with the reason
for its place. ``disable=`` in the config turns passes off by name."""
from __future__ import annotations

from .drop_profiler_nodes import drop_profiler_nodes
from .eliminate_dead_code import eliminate_dead_code
from .functionalize_graph import functionalize_graph
from .manager import PipelineEntry
from .prune_unchanged_outputs import prune_unchanged_outputs
from .remove_aliases import remove_aliases

__all__ = ["PIPELINE", "pass_names"]

PIPELINE: tuple[PipelineEntry, ...] = (
    PipelineEntry(
        "functionalize_graph",
        functionalize_graph,
        "first: every later pass assumes no node writes a graph input",
    ),
    PipelineEntry(
        "drop_profiler_nodes",
        drop_profiler_nodes,
        "torch.optim's record_function markers compute nothing and clutter what later passes and readers see",
    ),
    PipelineEntry(
        "remove_aliases",
        remove_aliases,
        "after functionalization detach/alias are bookkeeping; removing them exposes unchanged outputs",
    ),
    PipelineEntry(
        "prune_unchanged_outputs",
        prune_unchanged_outputs,
        "needs aliases gone to see that an output is its own input (frozen params, untouched buffers)",
    ),
    PipelineEntry(
        "eliminate_dead_code",
        eliminate_dead_code,
        "last: the passes above leave unused nodes behind",
    ),
)


def pass_names() -> tuple[str, ...]:
    return tuple(e.name for e in PIPELINE)
