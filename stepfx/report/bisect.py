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

Data parallelism (every rank calls it, as it called the step): each
rank runs every pass's program in step with the others (their collectives
meet), on its own batch. Up to the first program that holds a collective
the reference is the rank's own captured step; from there on it is the
data-parallel step (``testing.data_parallel_update``: every rank's batch,
gradients averaged, clipped as the config asks, one update), built from
all ranks' batches on every rank, and a ZeRO piece a rank returns is
compared with its range of the whole. The ranks agree on the first pass
that departs on any of them; the node named is the first departing one on
the lowest such rank.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from ..graph import META_SOURCE, Role
from ..graph.ops import is_collective
from ..graph.printer import format_statement, format_target
from ..runtime.binding import ModuleBinding, RankStore

__all__ = ["Divergence", "Reference", "bisect_divergence", "bisect_records", "default_tolerance"]

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
    rank: int | None = None  # data parallelism: the rank the node was found on
    reference_clipped: bool = False  # the reference clipped as the config asks (no note about clipping then)
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
            if self.rank is not None:
                lines.append(f"  on rank {self.rank}")
            if self.new_inputs:
                lines.append(f"  inputs made by this pass: {', '.join(self.new_inputs)}")
        if self.pass_name in _CONFIG_SEMANTICS and not (self.reference_clipped and self.pass_name == "unscale_clip_gradients"):
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
    """Output values by ``(role, name, key, piece)`` (piece None: the whole tensor)."""
    values = values if isinstance(values, (list, tuple)) else (values,)
    return {(s.role, s.name, s.key, s.piece): v for s, v in zip(graph.signature.outputs, values)
            if s.role is not Role.RUNTIME_STATE and isinstance(v, torch.Tensor)}


def _run(graph, model, optimizer, batch, seed: int) -> dict[tuple, Any]:
    inputs = _inputs(graph, model, optimizer, batch, seed)
    torch.manual_seed(seed)
    with torch.no_grad():
        return _outputs(graph, graph.gm(*inputs))


def _expected_value(expected: dict, ident: tuple):
    """The reference for an output: the whole tensor, or the range of it a ZeRO piece holds."""
    role, name, key, piece = ident
    whole = expected.get((role, name, key, None))
    if whole is None or piece is None:
        return whole
    return whole.reshape(-1)[piece[0]:piece[1]]


def _has_collective(graph) -> bool:
    return any(is_collective(n) for n in graph.gm.graph.nodes)


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
    role, name, key, piece = ident
    return f"{role} {name}" + (f"[{key}]" if key is not None else "") + (f"{{{piece[0]}:{piece[1]}}}" if piece else "")


def bisect_records(records, model, optimizer, batch, *, rtol: float, atol: float, seed: int = 0,
                   reference: "Reference | None" = None) -> Divergence:
    """Bisect a pipeline's records (record 0: the capture), reading state from ``model``/``optimizer``
    (never written) and the batch's tensors (positional, in the order of the step's batch inputs).

    Without ``reference`` every program is judged against the captured one. With it (built by
    :func:`bisect_divergence`), from the first program holding a collective on, against the
    data-parallel step (every rank of its group calls this; the programs run collectively), and from
    the pass that clips gradients on, against the step clipped as the config asks."""
    result = Divergence(tolerance=(rtol, atol))
    graphs = [r for r in records if r.graph is not None]
    if not graphs or graphs[0] is not records[0]:
        raise ValueError("bisection needs every pass's graph (a plan loaded from the plan cache keeps only its final one)")
    local = _run(records[0].graph, model, optimizer, batch, seed)
    expected, data_parallel, clipped = local, False, False
    previous = records[0]
    for record in records[1:]:
        if record.graph is None or record.skipped or not record.changed:
            continue
        if reference is not None:
            data_parallel = data_parallel or (reference.group is not None and _has_collective(record.graph))
            clipped = clipped or (record.name == "unscale_clip_gradients" and reference.clip_norm is not None)
            expected = reference.expected(local, data_parallel, clipped)
        actual = _run(record.graph, model, optimizer, batch, seed)
        worst, culprit = 0.0, None
        for ident, value in actual.items():
            expect = _expected_value(expected, ident)
            if expect is None:
                continue
            diff = _diff(value, expect)
            if diff > worst:
                worst = diff
            if culprit is None and not _within(diff, expect, rtol, atol):
                culprit = (ident, diff)
        group = reference.group if reference is not None else None
        if group is not None:  # the ranks agree: the pass departs if it departs on any of them
            worst, culprit, result.rank = reference.agree(worst, culprit)
        result.per_pass.append((record.label, worst))
        if culprit is not None:
            result.pass_name, result.label = record.name, record.label
            result.output, result.output_diff = _slot_text(culprit[0]), culprit[1]
            result.reference_clipped = clipped
            _first_node(result, previous.graph, record.graph, model, optimizer, batch, seed, rtol, atol,
                        reference.rank if group is not None else None)
            if group is not None:  # the node found on the departing rank, for every rank
                import torch.distributed as dist

                fields = ("node", "op", "node_diff", "statement", "source", "new_inputs")
                everyone: list = [None] * dist.get_world_size(group)
                dist.all_gather_object(everyone, {f: getattr(result, f) for f in fields}, group=group)
                for f, v in everyone[result.rank].items():
                    setattr(result, f, v)
            return result
        previous = record
    result.rank = None
    return result


@dataclass
class Reference:
    """What the programs are judged against besides the captured step: ``step_fn`` replayed eagerly
    from the same model and optimizer state on ``batches`` (every rank's, in rank order, under data
    parallelism; ``group`` None on one process), gradients averaged over them and clipped to
    ``clip_norm`` (the config's) where the plan clips."""

    step_fn: Callable
    model: torch.nn.Module
    optimizer: Any
    batches: list
    seed: int
    clip_norm: float | None
    group: Any = None
    rank: int = 0
    _cache: dict = field(default_factory=dict)

    def expected(self, local: dict, data_parallel: bool, clipped: bool) -> dict:
        """The rank's captured outputs, with parameters and optimizer state as the replayed step
        leaves them (gradients dropped: the plan's are averaged, or this rank's pieces)."""
        if not data_parallel and not clipped:
            return local
        key = (data_parallel, clipped)
        if key not in self._cache:
            from ..testing.equivalence import data_parallel_update

            model, optimizer = copy.deepcopy((self.model, self.optimizer))
            batches = self.batches if data_parallel else [self.batches[self.rank]]
            data_parallel_update(self.step_fn, model, optimizer, batches, [self.seed] * len(batches),
                                 clip_norm=self.clip_norm if clipped else None)
            params = dict(model.named_parameters())
            out = {}
            for (role, name, k, piece), value in local.items():
                if role is Role.PARAM and name in params:
                    value = params[name].detach()
                elif role is Role.OPTIMIZER_STATE and name in params:
                    value = optimizer.state.get(params[name], {}).get(k, value)
                elif role is Role.GRAD:
                    continue
                out[(role, name, k, piece)] = value
            self._cache[key] = out
        return self._cache[key]

    def agree(self, worst: float, culprit):
        """(the largest difference on any rank, the lowest departing rank's culprit, that rank)."""
        import torch.distributed as dist

        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, (worst, culprit), group=self.group)
        worst = max(w for w, _ in everyone)
        for rank, (_, found) in enumerate(everyone):
            if found is not None:
                return worst, found, rank
        return worst, None, None


def _first_node(result: Divergence, before, after, model, optimizer, batch, seed: int, rtol: float, atol: float,
                my_rank: int | None = None) -> None:
    old = _record(before, model, optimizer, batch, seed)  # (every rank runs both: their collectives meet)
    new = _record(after, model, optimizer, batch, seed)
    if my_rank is not None and result.rank != my_rank:
        return  # the node is named from the rank the pass departed on (broadcast by the caller)
    for node in after.gm.graph.nodes:
        if node.op != "call_function" or node.name not in new or node.name not in old:
            continue
        if is_collective(node) and node.target is not torch.ops._c10d_functional.wait_tensor.default:
            continue  # an issued collective's buffer is filled by its wait (compared there)
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
      user's objects must hold: not under ZeRO, whose ranks hold it; one
      process).

    Under data parallelism the first form is a collective: every rank
    calls it with its own batch, as it would call the step (the warm-up
    step is the data-parallel one, so the ranks start alike).
    ``rtol``/``atol`` (normwise) default to the config's precision
    (:func:`default_tolerance`). Returns a :class:`Divergence` (printable).
    """
    import torch.distributed as dist

    from ..api import ParallelStep, parallelize
    from ..runtime.distributed import data_parallel
    from ..testing.equivalence import data_parallel_update

    all_batches = None
    if isinstance(step_or_fn, ParallelStep):
        step = step_or_fn
        batch = args[0] if args else batch
        model, optimizer = step._model, step._optimizer
        step_fn = step.fn
    else:
        step_fn = step_or_fn
        make_model = args[0] if len(args) > 0 else make_model
        make_optimizer = args[1] if len(args) > 1 else make_optimizer
        batch = args[2] if len(args) > 2 else batch
        if make_model is None or batch is None:
            raise TypeError("bisect_divergence(step_fn, make_model, make_optimizer, batch, config=...)")
        torch.manual_seed(seed)
        model = make_model()
        optimizer = make_optimizer(model) if make_optimizer is not None else None
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        data_parallel(device.type)  # under torchrun: join the ranks (as the step's first call would)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world > 1:  # every rank's batch, for the data-parallel reference (each rank computes it alike)
            all_batches = [None] * world
            dist.all_gather_object(all_batches, _tuple(batch))
        torch.manual_seed(seed)
        if all_batches is not None:  # the optimizer's state exists from here on, the same on every rank
            data_parallel_update(step_fn, model, optimizer, all_batches, [seed] * world)
        else:
            step_fn(model, optimizer, *_tuple(batch))
        twin = copy.deepcopy((model, optimizer))
        step = parallelize(config)(step_fn)
        torch.manual_seed(seed)
        step(twin[0], twin[1], *_tuple(batch))
    dp = getattr(step, "_dp", None)
    clip = step.config.gradient_clipping
    clip = float(clip) if isinstance(clip, (int, float)) and clip > 0 else None
    group, rank = None, 0
    if dp is not None and dp.active:
        if all_batches is None:
            raise ValueError("bisect a data-parallel plan with the first form, bisect_divergence(step_fn, make_model, "
                             "make_optimizer, batch, config=...), called on every rank: a running step's ranks hold "
                             "its state in pieces")
        if dp.tp_size > 1 or dp.pp_size > 1:
            raise ValueError("bisect_divergence: tensor- and pipeline-parallel plans are not bisected yet (their "
                             "programs hold shards and stages); bisect the data-parallel config")
        if len(all_batches) != dp.world_size:
            raise ValueError(f"bisect_divergence: the step's data-parallel group has {dp.world_size} ranks, the "
                             f"world {len(all_batches)}")
        group, rank = dp.group, dp.rank
    reference = Reference(step_fn, model, optimizer, all_batches or [_tuple(batch)], seed, clip, group, rank)
    default = default_tolerance(step.config)
    rtol = default[0] if rtol is None else rtol
    atol = default[1] if atol is None else atol
    tensors = [t for t in torch.utils._pytree.tree_leaves(_tuple(batch)) if isinstance(t, torch.Tensor)]
    return bisect_records(step.plan.records, model, optimizer, tensors, rtol=rtol, atol=atol, seed=seed,
                          reference=reference)


def _tuple(batch) -> tuple:
    return batch if isinstance(batch, tuple) else (batch,)
