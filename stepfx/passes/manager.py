"""The pass manager: runs the declared pipeline, times and checks each pass.

A pass is ``fn(graph, options) -> PassResult`` (STYLE.md): pure in its
input graph (it edits a clone), returning the new graph, whether anything
changed and a one-line summary. The manager

- runs the pipeline in its declared order, skipping passes that are
  disabled by name (``disable=``) or do not apply to this configuration;
- times each pass;
- after every pass that changed the graph, verifies the step-graph
  invariants (``stepfx.graph.verify``) and, when they break, raises a
  PassError naming the pass, the passes before it and the problems;
- keeps every intermediate graph (``records``) and, when asked, writes
  ``NN_<pass>.py`` dumps with a provenance header.
"""
from __future__ import annotations

import difflib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..config.errors import ConfigError
from ..errors import PassError, StepfxError
from ..graph import StepGraph, format_graph, verify_step_graph

__all__ = ["PassOptions", "PassResult", "PipelineEntry", "PassRecord", "PassManager", "dump_records"]


@dataclass(frozen=True)
class PassOptions:
    """What passes may know: the typed config and mesh facts, as data.

    Passes never look at process groups or devices themselves; the runtime
    describes them here.
    """

    config: Any = None  # stepfx.config.Config
    world_size: int = 1
    rank: int = 0
    device_type: str = "cpu"
    group_name: str | None = None  # stepfx's data-parallel process group
    extra: dict = field(default_factory=dict)
    # tensor parallelism (the 2D mesh's other axis): degree, this rank's place in its TP group, the group;
    # world_size / rank / group_name above are then the data-parallel axis
    tp_size: int = 1
    tp_rank: int = 0
    tp_group_name: str | None = None


@dataclass(frozen=True)
class PassResult:
    graph: StepGraph
    changed: bool
    summary: str = ""


PassFn = Callable[[StepGraph, PassOptions], PassResult]


@dataclass(frozen=True)
class PipelineEntry:
    """One pipeline step: the pass, why it sits where it does, and when it
    applies (``applies(options)``; None means always)."""

    name: str
    fn: PassFn
    reason: str
    applies: Callable[[PassOptions], bool] | None = None


@dataclass
class PassRecord:
    index: int
    name: str
    graph: StepGraph | None  # None: not kept (a plan loaded from the cache keeps only its final graph)
    changed: bool
    seconds: float
    summary: str = ""
    skipped: str | None = None  # why the pass did not run

    @property
    def label(self) -> str:
        return f"{self.index:02d}_{self.name}"

    def provenance(self) -> str:
        if self.skipped:
            return f"{self.label}: skipped ({self.skipped})"
        what = self.summary or ("changed" if self.changed else "no change")
        return f"{self.label}: {what} (took {self.seconds * 1e3:.1f} ms)"


class PassManager:
    def __init__(
        self,
        pipeline: Sequence[PipelineEntry],
        *,
        disable: Sequence[str] = (),
        verify: bool = True,
        dump_dir: str | None = None,
    ):
        names = [e.name for e in pipeline]
        for name in disable:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"cannot disable unknown pass {name!r}{hint} (passes: {', '.join(names)})")
        self.pipeline = tuple(pipeline)
        self.disable = frozenset(disable)
        self.verify = verify
        self.dump_dir = dump_dir

    def leading(self, count: int) -> PassManager:
        """A manager of this pipeline's first ``count`` passes (those of them this one disables disabled)."""
        head = self.pipeline[:count]
        names = {e.name for e in head}
        return PassManager(head, disable=[n for n in self.disable if n in names], verify=self.verify)

    def count_running(self, options: PassOptions) -> int:
        """How many passes :meth:`run` would run (neither disabled nor inapplicable)."""
        return sum(1 for e in self.pipeline if e.name not in self.disable and (e.applies is None or e.applies(options)))

    def run(self, graph: StepGraph, options: PassOptions, *, first: PassRecord | None = None,
            resume: Sequence[PassRecord] = ()) -> list[PassRecord]:
        """Run the pipeline on ``graph``. ``first`` (the capture record) is
        kept as record 00. ``resume``: the records of the pipeline's leading
        passes (after ``first``) from an earlier run on the same graph with
        options those passes read alike (the memory planner's candidates
        differ only in what later passes read), kept as they are; the run
        goes on after them. Returns all records; the last one's graph is the result."""
        records: list[PassRecord] = []
        if first is not None:
            records.append(first)
            if not resume:  # else the run the resumed records come from checked it
                self._check(first, records)
        current = graph
        kept = list(resume)
        for entry in self.pipeline:
            index = len(records)
            if kept:
                record = kept.pop(0)
                if record.name != entry.name:
                    raise ValueError(f"resume: record {record.label} is not of pass {entry.name!r}")
                records.append(record)
                current = record.graph
                continue
            if entry.name in self.disable:
                records.append(PassRecord(index, entry.name, current, False, 0.0, skipped="disabled"))
                continue
            if entry.applies is not None and not entry.applies(options):
                records.append(PassRecord(index, entry.name, current, False, 0.0, skipped="not applicable"))
                continue
            start = time.perf_counter()
            try:
                result = entry.fn(current, options)
            except (StepfxError, ConfigError):  # stepfx's own errors and the user's config: as they are
                raise
            except Exception as exc:
                raise PassError(
                    f"pass {entry.name!r} failed: {type(exc).__name__}: {exc}\n"
                    f"  passes before it: {', '.join(r.name for r in records) or '(none)'}"
                ) from exc
            seconds = time.perf_counter() - start
            record = PassRecord(index, entry.name, result.graph, result.changed, seconds, result.summary)
            records.append(record)
            if result.changed:
                self._check(record, records)
            current = result.graph
        if self.dump_dir:
            dump_records(records, self.dump_dir)
        return records

    def _check(self, record: PassRecord, records: list[PassRecord]) -> None:
        if not self.verify:
            return
        problems = verify_step_graph(record.graph)
        if problems:
            before = ", ".join(r.name for r in records[:-1]) or "(none)"
            raise PassError(
                f"pass {record.name!r} broke the step graph's invariants "
                f"(passes before it: {before}):\n- " + "\n- ".join(problems)
            )


def dump_records(records: Sequence[PassRecord], directory: str) -> list[str]:
    """Write ``NN_<pass>.py`` for every record; returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for record in records:
        if record.graph is None:  # a plan loaded from the cache keeps its final graph only
            continue
        path = os.path.join(directory, f"{record.label}.py")
        with open(path, "w") as f:
            f.write(format_graph(record.graph, header=record.provenance()))
        paths.append(path)
    return paths
