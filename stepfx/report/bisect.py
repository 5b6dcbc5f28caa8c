"""Divergence bisection: which pass made the step compute something else.

The pass manager keeps the graph after every pass (``PassRecord.graph``).
Each of them is a whole step: run on the same inputs (the same model and
optimizer state, the same batch, the same RNG seed) it should give what the
captured graph gives, up to the precision's tolerance. So every graph is
run once on one process, its outputs matched to the captured graph's by
slot (role, name, key), and the first pass whose outputs leave the
tolerance is the culprit (passes that changed nothing are not run again).
Then the culprit's graph and the one before it are run node by node, and
the first node of the culprit's program whose value departs from its
same-named counterpart (passes keep the names of the nodes they copy) is
named with its op and the user's source line.

World size 1 only: a data-parallel plan's graphs hold collectives and
per-rank pieces, and its reference is the data-parallel one
(``testing.data_parallel_reference``); bisect the same config on one
process first (a wrong rewrite of ZeRO's passes shows there too, as they
apply at world size 1 when a stage is set).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from ..graph import META_SOURCE, Role
from ..graph.printer import format_statement, format_target
from ..runtime.binding import ModuleBinding, RankStore

__all__ = ["Divergence", "bisect_divergence", "bisect_records", "default_tolerance"]

# Passes that add what the config asks and the user's step does not do: a
# departure there may be the config's intent, not a wrong rewrite.
_CONFIG_SEMANTICS = {
    "unscale_clip_gradients": "it clips gradients as the config's gradient_clipping asks (DeepSpeed's default "
                              "is 1.0), which the user's step does not; set gradient_clipping to 0 to compare",
    "skip_step_on_overflow": "it skips steps whose fp16 gradients overflow, as the config's loss scaling asks",
}


@dataclass
class Divergence:
    """The result: ``pass_name`` None when every pass agrees with the capture."""

    pass_name: str | None = None
    label: str | None = None
    output: str | None = None  # the first output out of tolerance
    output_diff: float = 0.0
    node: str | None = None  # the first node of the pass's program that departs
    op: str | None = None
    statement: str | None = None
    source: str | None = None
    node_diff: float = 0.0
    new_inputs: list[str] = field(default_factory=list)  # the node's inputs this pass made (no counterpart before)
    per_pass: list[tuple[str, float]] = field(default_factory=list)  # label -> max normwise difference of its outputs
    tolerance: tuple[float, float] = (0.0, 0.0)

    @property
    def diverged(self) -> bool:
        return self.pass_name is not None

    def __str__(self) -> str:
        if not self.diverged:
            return (f"no divergence: every pass's program gives the captured step's outputs within "
                    f"rtol={self.tolerance[0]:g}, atol={self.tolerance[1]:g} ({len(self.per_pass)} programs run)")
        lines = [f"first divergent pass: {self.label} ({self.output} differs by {self.output_diff:.3g})"]
        if self.node is not None:
            lines.append(f"first divergent node: {self.statement}  (op {self.op}, differs by {self.node_diff:.3g})")
            lines.append(f"  source: {self.source or '(no user source line)'}")
            if self.new_inputs:
                lines.append(f"  inputs made by this pass: {', '.join(self.new_inputs)}")
        if self.pass_name in _CONFIG_SEMANTICS:
            lines.append(f"note: {self.pass_name} may differ on purpose: {_CONFIG_SEMANTICS[self.pass_name]}")
        return "\n".join(lines)


def default_tolerance(config) -> tuple[float, float]:
    """(rtol, atol), normwise: fp32 allows reassociation noise; 16-bit
    compute the rounding of bf16 (8 bits of mantissa) or fp16 (11)."""
    if getattr(getattr(config, "bf16", None), "enabled", None) is True:
        return 1e-1, 1e-3
    if getattr(getattr(config, "fp16", None), "enabled", None) is True:
        return 2e-2, 1e-4
    return 1e-4, 1e-6


def _diff(a, b) -> float:
    """Normwise difference ``max|a - b| / max|b|`` (inf when they do not compare: shape, dtype, non-finites)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    if a.numel() == 0:
        return 0.0
    x, y = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
    if not torch.equal(torch.isfinite(x), torch.isfinite(y)):
        return math.inf
    finite = torch.isfinite(y)
    x, y = x[finite], y[finite]
    if x.numel() == 0:
        return 0.0
    scale = y.abs().max().item()
    err = (x - y).abs().max().item()
    return err / scale if scale > 0 else (0.0 if err == 0 else math.inf)


def _within(diff: float, b: torch.Tensor, rtol: float, atol: float) -> bool:
    if diff == 0:
        return True
    if math.isinf(diff):
        return False
    scale = b.detach().abs().max().item() if b.numel() else 0.0
    return diff * scale <= atol + rtol * scale


def _inputs(graph, model, optimizer, batch: list, seed: int) -> list:
    binding = ModuleBinding(graph.signature, model, optimizer, RankStore())  # a store of its own: reads only
    return [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in binding.inputs(list(batch))]


def _outputs(graph, values) -> dict[tuple, Any]:
    values = values if isinstance(values, (list, tuple)) else (values,)
    return {(s.role, s.name, s.key): v for s, v in zip(graph.signature.outputs, values)
            if s.piece is None and s.role is not Role.RUNTIME_STATE and isinstance(v, torch.Tensor)}


def _run(graph, model, optimizer, batch, seed: int) -> dict[tuple, Any]:
    inputs = _inputs(graph, model, optimizer, batch, seed)
    torch.manual_seed(seed)
    with torch.no_grad():
        return _outputs(graph, graph.gm(*inputs))


class _Recorder(fx.Interpreter):
    """Runs a graph and keeps a copy of every tensor value by node name (a
    copy: fused kernels may write later into values they were donated)."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.values[n.name] = out.detach().clone()
        return out


def _record(graph, model, optimizer, batch, seed: int) -> dict[str, torch.Tensor]:
    inputs = _inputs(graph, model, optimizer, batch, seed)
    recorder = _Recorder(graph.gm)
    torch.manual_seed(seed)
    with torch.no_grad():
        recorder.run(*inputs)
    return recorder.values


def _slot_text(ident: tuple) -> str:
    role, name, key = ident
    return f"{role} {name}" + (f"[{key}]" if key is not None else "")


def bisect_records(records, model, optimizer, batch, *, rtol: float, atol: float, seed: int = 0) -> Divergence:
    """Bisect a pipeline's records (record 0: the capture) on one process,
    reading state from ``model``/``optimizer`` (never written) and the
    batch's tensors (positional, in the order of the step's batch inputs)."""
    result = Divergence(tolerance=(rtol, atol))
    graphs = [r for r in records if r.graph is not None]
    if not graphs or graphs[0] is not records[0]:
        raise ValueError("bisection needs every pass's graph (a plan loaded from the plan cache keeps only its final one)")
    expected = _run(records[0].graph, model, optimizer, batch, seed)
    previous = records[0]
    for record in records[1:]:
        if record.graph is None or record.skipped or not record.changed:
            continue
        actual = _run(record.graph, model, optimizer, batch, seed)
        worst, culprit = 0.0, None
        for ident, value in actual.items():
            if ident not in expected:
                continue
            diff = _diff(value, expected[ident])
            if diff > worst:
                worst = diff
            if culprit is None and not _within(diff, expected[ident], rtol, atol):
                culprit = (ident, diff)
        result.per_pass.append((record.label, worst))
        if culprit is not None:
            result.pass_name, result.label = record.name, record.label
            result.output, result.output_diff = _slot_text(culprit[0]), culprit[1]
            _first_node(result, previous.graph, record.graph, model, optimizer, batch, seed, rtol, atol)
            return result
        previous = record
    return result


def _first_node(result: Divergence, before, after, model, optimizer, batch, seed: int, rtol: float, atol: float) -> None:
    old = _record(before, model, optimizer, batch, seed)
    new = _record(after, model, optimizer, batch, seed)
    for node in after.gm.graph.nodes:
        if node.op != "call_function" or node.name not in new or node.name not in old:
            continue
        a, b = new[node.name], old[node.name]
        if a.shape != b.shape or a.dtype != b.dtype:  # rewritten to another value (a cast, a piece): no counterpart
            continue
        diff = _diff(a, b)
        if not _within(diff, b, rtol, atol):
            result.node, result.op, result.node_diff = node.name, format_target(node.target), diff
            result.statement, result.source = format_statement(node), node.meta.get(META_SOURCE)
            result.new_inputs = [n.name for n in node.all_input_nodes if n.name not in old and n.op != "placeholder"]
            return


def bisect_divergence(step_or_fn, *args, batch=None, config: Any = None, make_model: Callable | None = None,
                      make_optimizer: Callable | None = None, rtol: float | None = None, atol: float | None = None,
                      seed: int = 0) -> Divergence:
    """Find the first pass after which the step computes something else than the captured step.

    Two forms:

    - ``bisect_divergence(step_fn, make_model, make_optimizer, batch, config=...)``,
      the inputs of ``assert_step_equivalent`` with one batch (a tuple of
      the step's arguments after model and optimizer): the model is built
      (seeded), one eager step warms the optimizer's state, and the stepfx
      step is captured and bisected from that state;
    - ``bisect_divergence(step, batch)``: a ``ParallelStep`` that has run,
      bisected from its model's and optimizer's current state (which the
      user's objects must hold: not under ZeRO, whose ranks hold it).

    ``rtol``/``atol`` (normwise) default to the config's precision
    (:func:`default_tolerance`). Returns a :class:`Divergence` (printable).
    """
    from ..api import ParallelStep, parallelize

    if isinstance(step_or_fn, ParallelStep):
        step = step_or_fn
        batch = args[0] if args else batch
        model, optimizer = step._model, step._optimizer
    else:
        make_model = args[0] if len(args) > 0 else make_model
        make_optimizer = args[1] if len(args) > 1 else make_optimizer
        batch = args[2] if len(args) > 2 else batch
        if make_model is None or batch is None:
            raise TypeError("bisect_divergence(step_fn, make_model, make_optimizer, batch, config=...)")
        torch.manual_seed(seed)
        model = make_model()
        optimizer = make_optimizer(model) if make_optimizer is not None else None
        torch.manual_seed(seed)
        step_or_fn(model, optimizer, *_tuple(batch))  # the optimizer's state exists from here on
        twin = copy.deepcopy((model, optimizer))
        step = parallelize(config)(step_or_fn)
        torch.manual_seed(seed)
        step(twin[0], twin[1], *_tuple(batch))
    dp = getattr(step, "_dp", None)
    if dp is not None and dp.active:
        raise ValueError("bisect_divergence runs at world size 1: bisect the same config on one process")
    default = default_tolerance(step.config)
    rtol = default[0] if rtol is None else rtol
    atol = default[1] if atol is None else atol
    tensors = [t for t in torch.utils._pytree.tree_leaves(_tuple(batch)) if isinstance(t, torch.Tensor)]
    return bisect_records(step.plan.records, model, optimizer, tensors, rtol=rtol, atol=atol, seed=seed)


def _tuple(batch) -> tuple:
    return batch if isinstance(batch, tuple) else (batch,)
