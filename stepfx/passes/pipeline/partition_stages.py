"""partition_stages: cut the step into pipeline stages.

Why: pipeline parallelism runs each stage of the model on its own rank and
moves only the values between stages (the residual stream) from one rank
to the next. stepfx has the whole step in one graph, so it cuts an
unchanged model itself: no ``PipelineModule`` rewrite, no split markers.

How:

- **Cut points.** The forward ops, in program order; a cut before op i
  crosses every forward value made before i and read at or after i by the
  forward. Cut candidates are the points where the fewest bytes cross
  (between transformer blocks, and between attention and MLP inside one:
  only the residual stream). Values computed from the batch and buffers
  alone (masks, position ids, rotary tables) never cross: every stage
  that needs them computes them ("replicated"), as every rank has the batch.
- **Balance** by ``pipeline.partition``: ``best``/``auto`` (the default):
  each stage's forward *and* backward time by the cost model
  (:func:`op_cost`: matmul and attention FLOPs, other ops' bytes, and the
  host's time to issue an op, whichever is larger; a backward op counts
  where it will run: with the latest forward op whose values it reads;
  a parameter's cast with its first reader); ``parameters``: equal
  parameter counts; ``uniform``: equal numbers of layers (parameters under
  a numbered module,
  ``h.3.``/``layers.3.``); ``type:<regex>``: equal numbers of the modules
  whose class name matches. A linear partition (dynamic programming over
  the candidates) minimises the largest stage. ``stepfx.pipeline.split_points``
  names modules before which a stage starts, instead.
- **The backward** follows: a backward op goes to the lowest stage among the
  stages of the backward values it reads, and not above the highest stage
  of the forward values and parameters it reads: the gradient flows back
  through the stages in reverse, each stage differentiating its own ops
  with the activations it saved.
- **The optimizer** update of each parameter goes to the stage owning the
  parameter (the stage of its first forward reader). A sum over all
  parameters (gradient clipping's squared norm, ``sum(stack(parts))``) is
  a sum over the stages: each adds its own parts, the pipeline group
  all-reduces (the runtime); what depends on it alone (the norm, the clip
  factor, fp16's overflow flag) every stage computes.

Requires: a functional graph with phases (capture), static batch shapes;
run last (every later pass would have to keep the annotations).

Ensures: ``meta["pp_stage"]`` on every call_function node (None on
replicated ones) and ``meta["pp_task"]`` ("F", "B" or "O"; "X" on a sum
over the stages (a ``stack`` and its ``sum``), "G" on optimizer ops made
from such sums alone, both without a stage); the
signature's ``extra["pipeline"]`` holds the :class:`StagePlan`. Values are
unchanged (annotations only). Stage programs are cut from this graph by
``stage_programs.split_programs``.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from ... import compat
from ...config.errors import ConfigError
from ...graph import StepGraph
from ...graph.ops import ATTENTION_BACKWARD_OPS, ATTENTION_OPS, has_side_effect, is_collective, is_random, is_view
from ...graph.signature import Role
from ...graph.step_graph import META_GRAD_OF, META_PARAM, META_PHASE, Phase
from ..manager import PassOptions, PassResult

__all__ = ["META_STAGE", "META_TASK", "DeviceRates", "StagePlan", "op_cost", "stage_costs", "partition_stages", "PIPELINE_KEY", "MODULE_CLASSES_KEY",
           "module_classes", "pipeline_settings"]

aten = torch.ops.aten
META_STAGE = "pp_stage"
META_TASK = "pp_task"
PIPELINE_KEY = "pipeline"  # StepSignature.extra: the StagePlan
# options.extra: {parameter name: (class names of the modules above it, outermost first)} (api)
MODULE_CLASSES_KEY = "module_classes"
# options.extra: the number of stages (pipeline ranks x virtual stages) and of micro-batches (api)
STAGES_KEY = "pipeline_stages"
# options.extra: parameter name -> stage, from the step's first capture: a later capture (new batch sizes) keeps it
PINNED_OWNER_KEY = "pipeline_pinned_owner"

@dataclass(frozen=True)
class DeviceRates:
    """The cost model's device: only ratios matter for balance. Defaults measured on one H200 by
    benchmarks/pipeline_balance.py (2026-12-04): an 8192^3 bf16 matmul, a 1 GiB copy (read + write),
    and the host's time per op of a stage program run op by op (stage programs are not compiled)."""
    flops: float = 780e12
    bandwidth: float = 4.25e12
    op_overhead: float = 8.5e-6


RATES = DeviceRates()


@dataclass(frozen=True)
class StagePlan:
    stages: int
    method: str
    cuts: tuple[str, ...]  # per cut: the first forward op of the next stage
    crossing: tuple[tuple[str, ...], ...]  # per cut: the forward values that cross it
    crossing_bytes: tuple[int, ...]
    costs: tuple[float, ...]  # per stage: forward + backward seconds of one micro-batch by the cost model
    forward_costs: tuple[float, ...]
    backward_costs: tuple[float, ...]
    params: tuple[int, ...]  # per stage: parameter elements owned
    owner: dict = field(default_factory=dict)  # parameter name -> stage

    def describe(self) -> list[str]:
        total = sum(self.costs) or 1.0
        lines = [f"{self.stages} stages ({self.method}); share of a micro-batch's forward + backward time "
                 "(cost model) / parameters per stage:"]
        for s in range(self.stages):
            lines.append(f"  stage {s}: {100 * self.costs[s] / total:5.1f}% (forward {1e3 * self.forward_costs[s]:.3f} ms, "
                         f"backward {1e3 * self.backward_costs[s]:.3f} ms), {self.params[s]:,} parameters")
        for i, (names, nbytes) in enumerate(zip(self.crossing, self.crossing_bytes)):
            lines.append(f"  cut {i} -> {i + 1} before {self.cuts[i]}: {', '.join(names)} ({nbytes:,} bytes per micro-batch)")
        return lines


def module_classes(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """``{parameter name: class names of the modules above it, outermost
    first}``: what ``type:<regex>`` partitions match (options.extra[MODULE_CLASSES_KEY])."""
    out = {}
    for name, _ in model.named_parameters():
        chain, module = [type(model).__name__], model
        for part in name.split(".")[:-1]:
            module = getattr(module, part)
            chain.append(type(module).__name__)
        out[name] = tuple(chain)
    return out


def pipeline_settings(options: PassOptions) -> int:
    """The number of pipeline stages the step is cut into (1: none)."""
    return int(options.extra.get(STAGES_KEY, 1) or 1)


# a symbolic batch size, as the cost model counts it: one value for every rank (each rank's traced sizes
# differ when data-parallel replicas bring different lengths, and every rank must cut the same stages)
SYMBOLIC_SIZE = 1024


def _size(x) -> int:
    if not compat.is_symbolic(x):
        return int(x)
    expr = compat.size_expr(x)
    return int(expr.xreplace({sym: SYMBOLIC_SIZE for sym in expr.free_symbols}))


def _nbytes(node) -> int:
    """Bytes of a node's value (all its tensors, for an op with several
    results); a symbolic size counts as ``SYMBOLIC_SIZE``."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    total = 0
    for t in (val if isinstance(val, (tuple, list)) else (val,)):
        if isinstance(t, torch.Tensor):
            total += math.prod(_size(x) for x in t.shape) * t.element_size()
    return total


def _is_scalar(node) -> bool:
    """A one-element value (a loss, a scale factor): read by a gradient op it does not say which stage
    the op differentiates, and it costs nothing to send along."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and all(not compat.is_symbolic(x) and int(x) == 1 for x in val.shape)


def _shape(node) -> tuple:
    val = node.meta.get("val")
    return tuple(_size(x) for x in val.shape) if isinstance(val, torch.Tensor) else ()


_MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default}


def _arg(node: fx.Node, name: str, default=None):
    """An op's argument by its schema name (positional or keyword)."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.name == name:
            return node.args[i] if i < len(node.args) else default
    return default


def _fused_head_matmuls(node: fx.Node) -> int:
    """Matmuls of the head's logits a fused linear + cross-entropy node makes (each [rows, d] x [d, V]): the
    logits and both gradients (3), the split-vocabulary halves' logits (1) and gradients (2, or 3 when the
    logits were not kept between the halves); 0 for another node."""
    from ...codegen import graph_ops

    if node.target is graph_ops.linear_cross_entropy:
        return 3
    if node.target is graph_ops.vocab_cross_entropy_stats:
        return 1
    if node.target is graph_ops.vocab_cross_entropy_grads:
        kept = node.args[5].meta.get("val") if len(node.args) > 5 and isinstance(node.args[5], fx.Node) else None
        return 2 if isinstance(kept, torch.Tensor) and kept.shape[0] else 3
    return 0


def op_cost(node: fx.Node, rates: DeviceRates = RATES) -> float:
    """Seconds of one op by the cost model: the larger of its work on the device (matmul, attention
    and fused linear + cross-entropy FLOPs at ``rates.flops``, the bytes it reads and writes at ``rates.bandwidth``;
    nothing for a view) and the host's time to issue it (``rates.op_overhead``: a small op waits
    for the host, not the device)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0
    if is_view(node):
        return rates.op_overhead
    out = _nbytes(node)
    moved = sum(_nbytes(a) for a in node.all_input_nodes) + out
    flops = 0.0
    if node.target in _MATMULS:
        a, b = (node.args[1], node.args[2]) if node.target in (aten.addmm.default, aten.baddbmm.default) else node.args[:2]
        sa, sb = _shape(a), _shape(b)
        if sa and sb:
            flops = 2 * math.prod(sa) * sb[-1]
    elif _fused_head_matmuls(node):
        sh, sw = _shape(node.args[0]), _shape(node.args[1])
        if sh and sw:  # the logits chunk by chunk, and both gradients (computed in the same pass)
            flops = _fused_head_matmuls(node) * 2 * math.prod(sh[:-1]) * sh[-1] * sw[0]
    elif node.target in ATTENTION_OPS:
        sq, sk = _shape(_arg(node, "query")), _shape(_arg(node, "key"))
        if sq and sk:
            # QK^T and PV; a causal mask halves them; the backward recomputes QK^T and PV and makes
            # dQ, dK, dV: 2.5 times the forward (FlashAttention-2's count)
            flops = 4 * math.prod(sq) * sk[-2] * (0.5 if _arg(node, "is_causal", False) else 1.0)
            if node.target in ATTENTION_BACKWARD_OPS:
                flops *= 2.5
    return max(flops / rates.flops, moved / rates.bandwidth, rates.op_overhead)


def _anchors(g: fx.Graph, index: dict, replicated: set) -> dict[fx.Node, int]:
    """For the ops that are not forward ops of a stage, the forward op (its index) with whose stage
    they run, as far as it is known before the cut: a replicated forward op (a parameter's cast)
    with its first forward reader; a backward op with the latest forward op whose values it reads,
    no later than the backward ops it reads (gradients flow from the last stage to the first)."""
    anchor: dict[fx.Node, int] = {}
    for n in reversed(list(g.nodes)):
        if n in replicated and n.meta.get(META_PHASE) is Phase.FORWARD:
            at = [index[u] if u in index else anchor.get(u) for u in n.users]
            at = [a for a in at if a is not None]
            if at:
                anchor[n] = min(at)
    for n in g.nodes:
        if n.op != "call_function" or n.meta.get(META_PHASE) is not Phase.BACKWARD or n in replicated:
            continue
        grads = [anchor[a] for a in n.all_input_nodes if a in anchor and a not in index
                 and a.meta.get(META_PHASE) is Phase.BACKWARD]
        fwd = [index[a] if a in index else anchor[a] for a in n.all_input_nodes
               if a in index or (a in anchor and a.meta.get(META_PHASE) is Phase.FORWARD)]
        if fwd:
            anchor[n] = min(max(fwd), min(grads)) if grads else max(fwd)
        elif grads:
            anchor[n] = min(grads)
    return anchor


def stage_costs(g: fx.Graph, rates: DeviceRates = RATES) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds per stage of one micro-batch by the cost model, from the
    annotations of a partitioned graph (replicated forward ops with the stage of their first
    reader)."""
    stages = 1 + max((n.meta[META_STAGE] for n in g.nodes if n.meta.get(META_STAGE) is not None), default=0)
    fwd, bwd = [0.0] * stages, [0.0] * stages
    first: dict[fx.Node, int] = {}
    for n in reversed(list(g.nodes)):
        if n.op != "call_function":
            continue
        task, stage = n.meta.get(META_TASK), n.meta.get(META_STAGE)
        if task == "F":
            fwd[stage] += op_cost(n, rates)
        elif task == "B":
            bwd[stage] += op_cost(n, rates)
        elif task is None and n.meta.get(META_PHASE) is Phase.FORWARD:
            readers = [u.meta[META_STAGE] if u.meta.get(META_TASK) == "F" else first.get(u) for u in n.users]
            readers = [r for r in readers if r is not None]
            if readers:
                first[n] = min(readers)
                fwd[first[n]] += op_cost(n, rates)
    return fwd, bwd


def _replicated(g: fx.Graph) -> set[fx.Node]:
    """Forward/backward ops computed from the batch, buffers, hyperparameters
    and constants alone, and forward ops that read one parameter and nothing
    else (its compute-dtype cast, its transpose: a capture with bf16/fp16
    makes every cast before the forward starts): every stage that needs one
    computes it (every rank binds every parameter)."""
    free_roles = {Role.BATCH, Role.BUFFER, Role.HYPERPARAM, Role.RUNTIME_STATE}  # RUNTIME_STATE: fp16's loss scale
    out: set[fx.Node] = set()
    free: set[fx.Node] = set()
    of_param: set[fx.Node] = set()
    for node in g.nodes:
        if node.op == "placeholder":
            role = node.meta["slot"].role
            if role in free_roles:
                free.add(node)
            elif role is Role.PARAM:
                of_param.add(node)
        elif node.op == "get_attr":
            free.add(node)
        elif node.op == "call_function":
            phase = node.meta.get(META_PHASE)
            if phase not in (Phase.FORWARD, Phase.BACKWARD):
                continue
            if is_random(node) or has_side_effect(node) or is_collective(node):
                continue
            ins = node.all_input_nodes
            if all(a in free for a in ins):
                free.add(node)
                out.add(node)
            elif phase is Phase.FORWARD and len(ins) == 1 and ins[0] in of_param:
                of_param.add(node)
                out.add(node)
    return out


def _param_nodes(g: fx.Graph) -> dict[fx.Node, str]:
    return {n: n.meta["slot"].name for n in g.nodes if n.op == "placeholder" and n.meta["slot"].role is Role.PARAM}


def _linear_partition(weights: list[float], candidates: list[int], stages: int) -> list[int]:
    """Cut positions (a subset of ``candidates``, ascending, ``stages``-1 of
    them) minimising the largest stage weight; ``weights[i]`` is op i's."""
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    n = len(weights)
    points = [0] + sorted(set(candidates)) + [n]
    k = len(points)
    if k - 1 < stages:
        raise ConfigError("pipeline.stages", f"the forward has {k - 1} segments between cut candidates, fewer than the "
                        f"{stages} stages asked for")
    inf = float("inf")
    # best[j][c]: the least max-stage weight covering ops [0, points[c]) with j stages ending at points[c]
    best = [[inf] * k for _ in range(stages + 1)]
    back = [[-1] * k for _ in range(stages + 1)]
    best[0][0] = 0.0
    for j in range(1, stages + 1):
        for c in range(1, k):
            for b in range(c):
                if best[j - 1][b] == inf:
                    continue
                w = max(best[j - 1][b], prefix[points[c]] - prefix[points[b]])
                if w < best[j][c] - 1e-18:
                    best[j][c], back[j][c] = w, b
    if best[stages][k - 1] == inf:
        raise ConfigError("pipeline.stages", f"no way to cut the forward into {stages} non-empty stages")
    cuts, c = [], k - 1
    for j in range(stages, 0, -1):
        c = back[j][c]
        cuts.append(points[c])
    return sorted(cuts)[1:]  # drop the leading 0


def _layer_of(name: str) -> str | None:
    """The numbered module a parameter belongs to (``transformer.h.3``), or None."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return None


def partition_stages(graph: StepGraph, options: PassOptions) -> PassResult:
    stages = pipeline_settings(options)
    if stages <= 1:
        return PassResult(graph, False)
    g = graph.gm.graph
    cfg = options.config
    pipe_cfg = getattr(cfg, "pipeline", None)
    method = getattr(pipe_cfg, "partition", "best") if pipe_cfg is not None else "best"
    pipe_opts = getattr(getattr(cfg, "stepfx", None), "pipeline", None)
    split_points = tuple(getattr(pipe_opts, "split_points", ()) or ())

    replicated = _replicated(g)
    params = _param_nodes(g)
    forward = [n for n in g.nodes if n.op == "call_function" and n.meta.get(META_PHASE) is Phase.FORWARD
               and n not in replicated]
    if len(forward) < stages:
        raise ConfigError("pipeline.stages", f"the forward has {len(forward)} ops, fewer than {stages} stages")
    index = {n: i for i, n in enumerate(forward)}

    # bytes crossing each point: forward values made before and read by the forward at or after it
    last_fwd_reader = {}
    for n in forward:
        for a in n.all_input_nodes:
            if a in index:
                last_fwd_reader[a] = max(last_fwd_reader.get(a, -1), index[n])
    crossing_bytes = [0] * (len(forward) + 1)
    delta = [0] * (len(forward) + 2)
    for v, last in last_fwd_reader.items():
        i = index[v]
        if last > i:  # alive across points i+1 .. last
            b = _nbytes(v)
            delta[i + 1] += b
            delta[last + 1] -= b
    # points where an op with several results (a tuple) would cross are never cut: only tensors travel
    tuple_delta = [0] * (len(forward) + 2)
    for v, last in last_fwd_reader.items():
        i = index[v]
        if last > i and not isinstance(v.meta.get("val"), torch.Tensor):
            tuple_delta[i + 1] += 1
            tuple_delta[last + 1] -= 1
    running = tuples = 0
    no_cut = set()
    for i in range(len(forward) + 1):
        running += delta[i]
        tuples += tuple_delta[i]
        crossing_bytes[i] = running
        if tuples:
            no_cut.add(i)
    interior = [i for i in range(1, len(forward)) if crossing_bytes[i] > 0 and i not in no_cut]
    if not interior:
        raise ConfigError("pipeline.stages", "no forward value flows between any two forward ops: nothing to cut")
    # the threshold: the fewest bytes crossing a point in the body of the model (away from the ends, where
    # only the loss or only the batch's embedding crosses); every point at or under it is a candidate
    # each forward op's weight: its cost and that of the ops that will run with it (its backward,
    # the casts of the parameters it reads first)
    costs_all = [op_cost(n) for n in forward]
    for n, at in _anchors(g, index, replicated).items():
        costs_all[at] += op_cost(n)
    total_cost = sum(costs_all) or 1.0
    prefix_cost, acc = [], 0.0
    for c in costs_all:
        prefix_cost.append(acc)
        acc += c
    lo, hi = total_cost / (2 * stages), total_cost * (1 - 1 / (2 * stages))
    body = [i for i in interior if lo <= prefix_cost[i] <= hi] or interior
    least = min(crossing_bytes[i] for i in body)
    candidates = [i for i in interior if crossing_bytes[i] <= least]

    # parameter owners: the stage of a parameter's first forward reader (through its casts and views)
    first_reader: dict[str, int] = {}
    for n in forward:
        for a in n.all_input_nodes:
            name = params.get(a) or (a.meta.get(META_PARAM) if a in replicated else None)
            if name is not None and name not in first_reader:
                first_reader[name] = index[n]
        name = n.meta.get(META_PARAM)
        if name is not None and name not in first_reader:
            first_reader[name] = index[n]
    numel = {name: (p.meta["val"].numel() if isinstance(p.meta.get("val"), torch.Tensor) else 0) for p, name in params.items()}

    pinned = options.extra.get(PINNED_OWNER_KEY)
    if pinned:  # a later capture of the same step: the stages its first capture chose (the rank released the rest)
        cuts = _cuts_keeping(pinned, first_reader, interior, stages, len(forward))
    elif split_points:
        cuts = _cuts_at_modules(split_points, first_reader, candidates, forward, stages)
        method = "split_points"
    else:
        weights = [0.0] * len(forward)
        if method in ("best", "auto"):
            weights = costs_all
        elif method == "parameters":
            for name, i in first_reader.items():
                weights[i] += numel.get(name, 0)
        elif method == "uniform" or method.startswith("type:"):
            classes = options.extra.get(MODULE_CLASSES_KEY, {})
            pattern = re.compile(method[len("type:"):], re.IGNORECASE) if method.startswith("type:") else None
            seen = set()
            for name, i in sorted(first_reader.items(), key=lambda kv: kv[1]):
                layer = _layer_of(name) if pattern is None else _matching_module(name, classes.get(name, ()), pattern)
                if layer is not None and layer not in seen:
                    seen.add(layer)
                    weights[i] += 1.0
            if len(seen) < stages:
                raise ConfigError("pipeline.stages", f"partition {method!r} found {len(seen)} layers, fewer than the "
                                f"{stages} stages (pipeline.partition)")
            # counting layers, a stage starts right before one: the last cut point before each layer's first op
            starts = [i for i, w in enumerate(weights) if w]
            candidates = sorted({max(c for c in candidates if c <= i) for i in starts if any(c <= i for c in candidates)})
        cuts = _linear_partition(weights, candidates, stages)

    bounds = [0] + list(cuts) + [len(forward)]
    stage_of: dict[fx.Node, int] = {}
    for s in range(stages):
        for n in forward[bounds[s]:bounds[s + 1]]:
            stage_of[n] = s
    owner = {name: _stage_at(bounds, i) for name, i in first_reader.items()}
    for p, name in params.items():
        if name in owner:
            stage_of[p] = owner[name]
    # for the backward, a parameter (or its replicated cast or transpose) belongs to the highest stage
    # whose forward reads it: a tied embedding's transpose is the head's, on the last stage
    root_stage: dict[fx.Node, int] = {}
    for n in reversed(list(g.nodes)):
        is_param = n in params
        if not is_param and not (n in replicated and n.meta.get(META_PHASE) is Phase.FORWARD):
            continue
        readers = [stage_of[u] for u in n.users if u in index] + [root_stage[u] for u in n.users if u in root_stage]
        if readers:
            root_stage[n] = max(readers)
        elif is_param and params[n] in owner:
            root_stage[n] = owner[params[n]]

    # the backward: an op that reads forward values or parameters differentiates the highest stage among
    # them, but runs no higher than the gradients it reads (they flow from the last stage to the first);
    # an op that reads only gradients (views, sums, transposes of an incoming gradient) runs as low as
    # its readers let it: the stage of its highest reader, so an incoming gradient crosses once
    backward = [n for n in g.nodes if n.op == "call_function" and n.meta.get(META_PHASE) is Phase.BACKWARD
                and n not in replicated]
    is_bwd = set(backward)
    bound: dict[fx.Node, int] = {}
    deferred: list[fx.Node] = []
    for n in backward:
        grads = [bound[a] for a in n.all_input_nodes if a in is_bwd]
        fwd = [root_stage[a] if a in root_stage else stage_of[a] for a in n.all_input_nodes
               if (a in stage_of or a in root_stage) and a not in is_bwd and not (grads and _is_scalar(a))]
        ceiling = min(grads) if grads else stages - 1
        if n.target is operator.getitem and n.args[0] in stage_of:  # a result of a multi-result op: with it
            stage_of[n] = bound[n] = stage_of[n.args[0]]
        elif fwd:
            stage_of[n] = bound[n] = min(ceiling, max(fwd))
        else:
            bound[n] = ceiling
            deferred.append(n)
    optimizer_stage = {}
    for n in g.nodes:
        if n.op == "call_function" and n.meta.get(META_PHASE) is Phase.OPTIMIZER:
            name = n.meta.get(META_PARAM)
            if name is not None and name in owner:
                optimizer_stage[n] = owner[name]
    # a shared (tied) parameter's gradient is the sum of its stages' parts: the sum runs with the owner's
    # optimizer, after each stage summed its own part over the micro-batches (one transfer a step)
    # (with the unary ops between the sum and the update: the cast of a 16-bit gradient to fp32)
    def is_update(u):
        return u.op == "call_function" and u.meta.get(META_PHASE) is Phase.OPTIMIZER

    feeds: set[fx.Node] = set()  # unary gradient ops whose readers are all the update or such ops
    grad_sums: set[fx.Node] = set()
    for n in reversed(deferred):
        backward_ins = [a for a in n.all_input_nodes if a in is_bwd]
        if not n.users or not all(is_update(u) or u in feeds or u in grad_sums for u in n.users):
            continue
        if len(backward_ins) == 1 and len(n.all_input_nodes) == 1:
            # (only what reads the gradient alone, a cast or a view: an embedding's backward also reads the
            # batch's indices, and the sum feeding it is of the hidden state's gradient, not of a tied weight's)
            feeds.add(n)
        elif (n.target is aten.add.Tensor and not n.kwargs and len(n.all_input_nodes) == 2
              and len({bound[a] for a in n.all_input_nodes if a in bound}) > 1):
            grad_sums.add(n)
    moved: set[fx.Node] = set()  # a sum of parts and what follows it up to the update: the owner's optimizer
    for n in g.nodes:
        if n in grad_sums or (n in feeds and any(a in moved for a in n.all_input_nodes)):
            moved.add(n)
    for n in reversed(list(g.nodes)):
        if n in moved:
            name = n.meta.get(META_GRAD_OF)
            later = [stage_of[u] for u in n.users if u in moved and u in stage_of]
            stage_of[n] = owner[name] if name in owner else (later[0] if later else
                                                              max((optimizer_stage.get(u, 0) for u in n.users), default=0))
    grad_sums = moved
    for n in reversed(deferred):
        if n in grad_sums:
            continue
        # readers: backward ops (placed by now: reverse order), the update of a parameter (its owner's
        # stage); the gradient a parameter's update reads goes to the owner
        readers = [stage_of.get(u) if u in is_bwd else optimizer_stage.get(u) for u in n.users
                   if u in is_bwd or u in optimizer_stage]
        if n.meta.get(META_GRAD_OF) in owner:
            readers.append(owner[n.meta[META_GRAD_OF]])
        unary = len([a for a in n.all_input_nodes if a in is_bwd]) == 1
        if unary and readers and all(r is not None for r in readers) and not any(u in grad_sums for u in n.users):
            stage_of[n] = min(bound[n], max(readers))
        else:
            stage_of[n] = bound[n]
    # the optimizer: by the parameter an op updates. A sum over the stages' parts (gradient clipping's
    # squared norm: ``sum(stack(parts))``) is a cross-stage sum ("X": each rank adds its stages' parts,
    # the pipeline group all-reduces them); what is computed from such sums alone (the norm, the clip
    # factor, the overflow flag) is global ("G": every stage computes it)
    cross: set[fx.Node] = set()
    global_ops: set[fx.Node] = set()
    for n in g.nodes:
        if n.op != "call_function" or n.meta.get(META_PHASE) is not Phase.OPTIMIZER or n in cross:
            continue
        name = n.meta.get(META_PARAM)
        if name is not None and name in owner:
            stage_of[n] = owner[name]
            continue
        ins = {stage_of[a] for a in n.all_input_nodes if a in stage_of and a.op == "call_function"}
        ins |= {owner[params[a]] for a in n.all_input_nodes if a in params and params[a] in owner}
        if len(ins) > 1:
            users = list(n.users)
            if n.target is aten.stack.default and len(users) == 1 and users[0].target is aten.sum.default \
                    and len(users[0].args) == 1:
                cross.update((n, users[0]))
                continue
            where = n.meta.get("source") or "the update"
            raise ConfigError("pipeline.stages", f"optimizer op {n.name} ({n.target}, {where}) combines values of "
                              f"stages {sorted(ins)}; only sums over the stages (as gradient clipping's norm) are "
                              "supported with pipeline parallelism")
        if not ins and any(a in cross or a in global_ops for a in n.all_input_nodes):
            global_ops.add(n)
            continue
        stage_of[n] = ins.pop() if ins else 0

    gm = graph.gm
    for n in g.nodes:
        if n.op != "call_function":
            continue
        if n in replicated or n in cross or n in global_ops:
            n.meta[META_STAGE] = None
            n.meta[META_TASK] = "X" if n in cross else "G" if n in global_ops else None
            continue
        n.meta[META_STAGE] = stage_of[n]
        phase = n.meta.get(META_PHASE)
        n.meta[META_TASK] = "O" if n in grad_sums else {Phase.FORWARD: "F", Phase.BACKWARD: "B", Phase.OPTIMIZER: "O"}[phase]

    crossing = []
    crossing_sizes = []
    for c in cuts:
        names = [v.name for v, last in last_fwd_reader.items() if index[v] < c <= last]
        crossing.append(tuple(names))
        crossing_sizes.append(crossing_bytes[c])
    fwd_costs, bwd_costs = stage_costs(g)
    fwd_costs += [0.0] * (stages - len(fwd_costs))
    bwd_costs += [0.0] * (stages - len(bwd_costs))
    costs = [f + b for f, b in zip(fwd_costs, bwd_costs)]
    owned = [0] * stages
    for name, s in owner.items():
        owned[s] += numel.get(name, 0)
    plan = StagePlan(stages, method, tuple(forward[c].name for c in cuts), tuple(crossing), tuple(crossing_sizes),
                     tuple(costs), tuple(fwd_costs), tuple(bwd_costs), tuple(owned), owner)
    signature = replace(graph.signature, extra={**graph.signature.extra, PIPELINE_KEY: plan})
    return PassResult(graph.replace(gm=gm, signature=signature), True, "\n".join(plan.describe()))


def _stage_at(bounds: list[int], i: int) -> int:
    for s in range(len(bounds) - 1):
        if bounds[s] <= i < bounds[s + 1]:
            return s
    return len(bounds) - 2


def _matching_module(name: str, classes: tuple, pattern: re.Pattern) -> str | None:
    """The prefix of ``name`` naming the outermost module above it whose
    class name matches ``pattern`` (``classes``: class names, outermost first)."""
    parts = name.split(".")
    for depth, cls in enumerate(classes):
        if pattern.search(cls):
            return ".".join(parts[:depth]) or "<root>"
    return None


def _cuts_keeping(pinned: dict[str, int], first_reader: dict[str, int], interior: list[int], stages: int,
                  n_forward: int) -> list[int]:
    """Cuts that give every parameter the stage ``pinned`` says (an earlier
    capture's owners): before each stage's first parameter reader, the last
    point where only tensors cross. Raises when the owners cannot be kept."""
    cuts = []
    for s in range(1, stages):
        firsts = [first_reader[n] for n, st in pinned.items() if st == s and n in first_reader]
        before = [i for i in interior if firsts and i <= min(firsts)]
        if not before:
            raise ConfigError("pipeline.stages", f"a new capture of the step cannot give stage {s} the parameters "
                              "its first capture gave it (the rank released the others' after its first step)")
        cuts.append(max(before))
    bounds = [0] + cuts + [n_forward]
    moved = [n for n, i in first_reader.items() if n in pinned and _stage_at(bounds, i) != pinned[n]]
    if cuts != sorted(set(cuts)) or moved:
        raise ConfigError("pipeline.stages", "a new capture of the step cannot keep the stages of its first capture "
                          f"({', '.join(moved[:3]) or 'cuts out of order'} would move); pin them with "
                          "stepfx.pipeline.split_points")
    return cuts


def _cuts_at_modules(points: tuple[str, ...], first_reader: dict[str, int], candidates: list[int],
                     forward: list[fx.Node], stages: int) -> list[int]:
    if len(points) != stages - 1:
        raise ConfigError("stepfx.pipeline.split_points", f"names {len(points)} modules; "
                        f"{stages} stages need {stages - 1}")
    cuts = []
    for point in points:
        readers = [i for name, i in first_reader.items() if name == point or name.startswith(point + ".")]
        if not readers:
            raise ConfigError("stepfx.pipeline.split_points", f"no parameter is under module {point!r}")
        at = min(readers)
        before = [c for c in candidates if c <= at]
        if not before:
            raise ConfigError("stepfx.pipeline.split_points", f"no cut point before module {point!r}")
        cuts.append(max(before))
    if cuts != sorted(set(cuts)):
        raise ConfigError("stepfx.pipeline.split_points", f"{list(points)} are not in forward order "
                        "or fall on the same cut")
    return cuts
