"""Graph-to-graph passes over StepGraphs, and the manager that runs them.

Each pass is one module named ``verb_object`` with one public function of
the same name (STYLE.md). Passes are pure rewrites: mesh facts and config
arrive as data in :class:`PassOptions`; they never touch process groups.

Passes live in one subpackage per concern: ``cleanup``, ``data_parallel``,
``precision``, ``fusion``, ``memory``, ``tensor_parallel``, ``pipeline``.
Their order is one list, ``declared.PIPELINE``; ``manager`` runs it.
"""
from .declared import CLEANUP_PASSES, PIPELINE, pass_names
from .manager import PassManager, PassOptions, PassRecord, PassResult, PipelineEntry, dump_records

__all__ = [
    "PassManager",
    "PassOptions",
    "PassRecord",
    "PassResult",
    "PipelineEntry",
    "PIPELINE",
    "CLEANUP_PASSES",
    "pass_names",
    "dump_records",
]
