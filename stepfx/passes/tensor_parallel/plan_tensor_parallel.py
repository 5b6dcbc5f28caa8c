"""plan_tensor_parallel: find Megatron's column/row pairs on the graph (no graph change).

Why: DeepSpeed's AutoTP needs a preset or a hand-written partition per
architecture; the captured step shows the data flow itself. A weight whose
product reaches another weight's matmul only through pointwise ops, views
and attention over heads is a column/row pair (q/k/v -> output projection,
grouped-query heads included; up/gate -> down; a fused q/k/v weight split
per part): split the first by output features and the second by input
features, and the region between runs on each rank's slice of features or
heads with no communication.

Requires: a functional, clean graph (after the cleanups), static sizes,
``options.tp_size`` > 1.

Ensures: ``signature.extra["tensor_parallel"]`` holds a
:class:`TensorParallelPlan`: every parameter's placement (column, row or
replicated) with the reason, and the groups found. A group is kept only
when the split propagates through the whole step (forward, backward and
optimizer: ``placements.propagate``); otherwise its weights stay
replicated, with the op that refused. Columns whose split cannot pass (a
single key/value head: multi-query attention) are dropped from their group
and stay replicated when the rest still propagates.

Before / after: the graph is unchanged; ``explain()`` lists the placements::

    blocks.0.qkv.weight: column (dim 0, 3 parts): product reaches blocks.0.proj.weight through attention
    blocks.0.proj.weight: row (dim 1): reads the split features of blocks.0.qkv.weight
    tok.weight: replicated: used 2 times in the forward (tied)
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import re

import torch.fx as fx

from ... import compat
from ...config.errors import ConfigError
from ...config.tensor_parallel import LayerSpec
from ...graph import META_PHASE, Phase, Role, StepGraph
from ...graph.tp_layout import TP_PLAN_KEY, Placement, TensorParallelPlan
from ..manager import PassOptions, PassResult
from .placements import (ATTENTION, DRAWS, POINTWISE, SOFTMAX, VIEWS, Refused, Sharded, aten, divides, linear_uses,
                         propagate)

__all__ = ["plan_tensor_parallel", "HF_TP_PLAN_KEY", "MODEL_TYPE_KEY"]

# what a column's product may pass through on its way to a row weight (the search; propagation decides)
_CARRIERS = POINTWISE | VIEWS | ATTENTION | SOFTMAX | DRAWS | frozenset({aten.bmm.default}) | frozenset({
    aten.t.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.expand.default, aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default, aten.slice.Tensor,
    operator.getitem})
_MAX_SUBSETS = 16  # column subsets tried per group when the whole group does not propagate


def plan_tensor_parallel(graph: StepGraph, options: PassOptions) -> PassResult:
    tp = options.tp_size
    g = graph.gm.graph
    outputs = graph.signature.outputs
    params = [n.meta["slot"].name for n in g.nodes if n.op == "placeholder" and n.meta["slot"].role is Role.PARAM]
    uses = linear_uses(g)
    forward_users = _forward_users(g)
    why: dict[str, tuple[str, str]] = {}  # name -> (kind, reason) for parameters not split
    single = {}
    for name, found in uses.items():
        if len(found) == 1 and forward_users[name] == 1:
            single[name] = found[0]
        else:
            why[name] = ("replicated", f"used {forward_users[name]} times in the forward (tied or shared)")
    by_x = {u.x: u for u in single.values()}
    groups = _groups(_alternate(single, by_x))

    accepted: dict[str, Sharded] = {}
    found_groups = []
    details: dict[str, tuple[str, str]] = {}
    tp_config = getattr(options.config, "tensor_parallel", None)
    config = getattr(tp_config, "partition_config", None)
    notes: list[str] = []
    preset = getattr(tp_config, "preset_model", None)
    config, labels, with_preset = _with_preset(config, preset, notes)
    model_type = (options.extra or {}).get(MODEL_TYPE_KEY)
    if config is None and (options.extra or {}).get(HF_TP_PLAN_KEY):
        # the Hugging Face model's own plan, where it propagates here; else the search decides
        config, labels, skipped = _hf_specs(options.extra[HF_TP_PLAN_KEY])
        notes += skipped
        try:
            _specified(g, outputs, tp, config, single, params, {}, labels)
        except ConfigError as exc:
            notes.append(f"the model's base_model_tp_plan does not apply here ({str(exc).split(': ', 1)[-1]}); "
                         "the search decides")
            config = labels = None
    if config is not None:  # the user's layer_specs split what they match; the search the rest, if asked
        kept_whole: dict[str, str] = {}
        try:
            specified = _specified(g, outputs, tp, config, single, params, details, labels, model_type, kept_whole)
        except ConfigError as exc:
            if with_preset:
                merged = " (merged after partition_config's specs)" if with_preset == "merged" else ""
                raise ConfigError("tensor_parallel.preset_model", f"the preset {preset!r}{merged} does not fit this "
                                  f"model: {str(exc).split(': ', 1)[-1]}; without preset_model the search finds the "
                                  "splits", value=preset, expected="a preset of this model's family, or none") from None
            raise
        accepted.update(specified)
        for name, reason in kept_whole.items():
            why[name] = ("replicated", reason)
        groups = [(c, r) for c, r in groups if not (set(c) | set(r)) & set(kept_whole)]
        if not config["use_default_specs"]:
            groups = []
            for name in params:
                if name not in specified:
                    why.setdefault(name, ("replicated", "matched by no tensor_parallel.partition_config.layer_specs "
                                                        "entry (use_default_specs is false)"))
        else:
            groups = [(c, r) for c, r in groups if not (set(c) | set(r)) & set(specified)]
    for cols, rows in groups:
        if set(cols) & set(rows):
            for n in cols + rows:
                why[n] = ("replicated", "linears chained without a norm between (not paired yet)")
            continue
        result = _try_group(g, outputs, tp, accepted, cols, rows, single)
        if isinstance(result, Refused):
            for n in cols + rows:
                why[n] = ("replicated", f"the split does not propagate: {result.describe()}")
            continue
        seeds, kept = result
        accepted.update(seeds)
        found_groups.append((tuple(kept), tuple(rows)))
        for c in cols:
            if c not in kept:
                why[c] = ("replicated", "its split does not pass attention (e.g. a single key/value head); "
                          "each rank reads it whole")
        for c in kept:
            u = single[c]
            parts = seeds[c].parts
            details[c] = ("column", f"product reaches {', '.join(rows)}" + (f" ({parts} fused parts)" if parts > 1 else ""))
            if u.bias is not None:
                details[u.bias] = ("column", f"bias of {c}")
        for r in rows:
            details[r] = ("row", f"reads the split features of {', '.join(kept)}; its output is all-reduced")
    for name in params:
        if name in single and name not in details and name not in why:
            why[name] = ("replicated", "its product reaches no other weight through splittable ops")
    _vocabulary(g, outputs, tp, options, uses, accepted, details, why)
    placements = []
    for name in params:
        if name in accepted:
            kind, reason = details[name]
            placements.append(Placement(name, kind, accepted[name].dim, accepted[name].parts, reason,
                                        accepted[name].sizes))
        else:
            kind, reason = why.get(name, ("replicated", "not a matmul weight (embedding, norm or bias)"))
            placements.append(Placement(name, "replicated", None, 1, reason))
    tokens, sp_note = _sequence_parallel(g, outputs, tp, options, accepted, uses)
    notes = tuple(notes) + ((sp_note,) if sp_note else ()) + (
        () if accepted else ("nothing to split: every rank of a tensor-parallel group runs the whole step "
                             "(replicated)",))
    plan = TensorParallelPlan(tp, options.tp_rank, tuple(placements), tuple(found_groups), notes, tokens,
                              options.tp_group_name)
    sig = graph.signature
    new_sig = dataclasses.replace(sig, extra={**sig.extra, TP_PLAN_KEY: plan})
    named = ""
    if config is not None:
        named = f"; {len(specified)} named by " + ("the model's base_model_tp_plan" if labels else "partition_config")
    summary = (f"{len(plan.sharded)} of {len(params)} parameters split over {tp} ranks in {len(found_groups)} "
               f"column/row groups found{named}" if accepted else plan.notes[-1])
    return PassResult(graph.replace(signature=new_sig), True, summary)


_SPECS = "tensor_parallel.partition_config.layer_specs"


def _with_preset(config, preset: str | None, notes: list[str]) -> tuple[dict | None, list[str] | None, str | None]:
    """``partition_config`` with DeepSpeed's ``preset_model`` merged as
    DeepSpeed merges them (the user's specs first, the preset's after, when
    ``use_default_specs``): (config, a label per entry or None, "alone" /
    "merged" / None as the preset is used)."""
    if not preset:
        return config, None, None
    from .presets import preset_specs

    specs = preset_specs(preset)
    preset_labels = [f"tensor_parallel.preset_model {preset!r} entry {i}" for i in range(len(specs))]
    if config is None:
        return {"use_default_specs": True, "layer_specs": specs}, preset_labels, "alone"
    if not config["use_default_specs"]:
        notes.append(f"tensor_parallel.preset_model {preset!r} not used: partition_config.use_default_specs "
                     "is false (DeepSpeed merges a preset only with default specs on)")
        return config, None, None
    own = tuple(config["layer_specs"])
    return ({"use_default_specs": True, "layer_specs": own + tuple(specs)},
            [f"{_SPECS}[{i}]" for i in range(len(own))] + preset_labels, "merged")


def _sequence_parallel(g, outputs, tp, options, accepted, uses) -> tuple[int | None, str]:
    """``stepfx.sequence_parallel``: the token count the ranks share between
    the column/row pairs (the rows of the first split matmul's input), if
    the split propagates with it; else off, with the op that refused."""
    stepfx_options = getattr(options.config, "stepfx", None)
    if not accepted or not getattr(stepfx_options, "sequence_parallel", False):
        return None, ""
    firsts = sorted((found[0].node for name, found in uses.items() if name in accepted), key=_order)
    shape = firsts[0].args[1 if firsts[0].target is aten.addmm.default else 0].meta["val"].shape
    tokens = compat.size_expr(shape[0])
    if compat.is_symbolic(shape[0]) and not divides(shape[0], tp):
        return None, (f"sequence parallelism is off for this capture: its token count {tokens} varies between calls "
                      f"(stepfx.dynamic) and is not a multiple of {tp} at every call (a batch size divisible by "
                      f"the tensor-parallel size makes it one)")
    try:
        propagate(g, dict(accepted), tp, outputs, tokens=tokens)
    except Refused as e:
        return None, f"sequence parallelism is off: {e.describe()}"
    varies = " (a count that varies between calls: each rank takes its share of every call's)" \
        if compat.is_symbolic(shape[0]) else ""
    return tokens, (f"sequence parallelism: the {tokens} tokens of the step are shared by the {tp} ranks between "
                    f"the column/row pairs (reduce-scattered after a row, gathered before a column){varies}")
_VOCAB_KEY = "tensor_parallel.vocab_parallel_lm_head"


def _vocabulary(g, outputs, tp, options, uses, accepted, details, why) -> None:
    """Split token embeddings by rows and LM heads by output features over
    the vocabulary (Megatron's vocabulary-parallel embedding and head, the
    cross-entropy on each rank's slice of the logits). An LM head is a
    weight read by one matmul whose product reaches a log-softmax (the
    cross-entropy) and whose output features number an embedding table's
    rows (tied to it, or not); that table is the token embedding. ``vocab_parallel_lm_head``: unset,
    the search splits what propagates; false, heads stay replicated; true,
    a head must split, else a ConfigError with the reason."""
    wanted = getattr(getattr(options.config, "tensor_parallel", None), "vocab_parallel_lm_head", None)
    shapes = {n.meta["slot"].name: tuple(n.meta["val"].shape) for n in g.nodes
              if n.op == "placeholder" and n.meta["slot"].role is Role.PARAM}
    tables = _embedding_tables(g)
    heads = {name: found[0] for name, found in uses.items() if len(found) == 1 and name not in accepted
             and shapes[name][found[0].out_dim] in tables.values() and _feeds_log_softmax(found[0].node)}
    # token embeddings: tables with as many rows as a head has outputs (not position or type embeddings)
    vocabularies = {shapes[name][use.out_dim] for name, use in heads.items()}
    tables = {name: rows for name, rows in tables.items() if rows in vocabularies}
    split_heads, refused = [], []

    def attempt(name, seeds, kind, reason):
        try:
            propagate(g, {**accepted, **seeds}, tp, outputs)
        except Refused as e:
            why[name] = ("replicated", f"not split over the vocabulary: {e.describe()}")
            refused.append(f"{name}: {e.describe()}")
            return False
        accepted.update(seeds)
        for n in seeds:
            details[n] = (kind, reason if n == name else f"bias of {name}")
        return True

    for table, rows in tables.items():
        if table in accepted:
            continue
        if table in heads:  # tied: one weight is the table and the head
            if wanted is False:
                why[table] = ("replicated", f"tied to the LM head; {_VOCAB_KEY} is false")
                continue
            if attempt(table, {table: Sharded(0)}, "vocabulary", f"tied embedding and LM head split over the "
                       f"vocabulary ({rows} rows): lookups all-reduced, cross-entropy on each rank's logits"):
                split_heads.append(table)
            continue
        attempt(table, {table: Sharded(0)}, "vocabulary", f"embedding split over the vocabulary ({rows} rows): "
                "each rank looks up the tokens it holds, the lookups are all-reduced")
    for head, use in heads.items():
        if head in tables or head in accepted:
            continue
        if wanted is False:
            why[head] = ("replicated", f"an LM head; {_VOCAB_KEY} is false")
            continue
        seeds = {head: Sharded(use.out_dim)}
        if use.bias is not None:
            seeds[use.bias] = Sharded(0)
        if attempt(head, seeds, "vocabulary", f"LM head split over the vocabulary ({shapes[head][use.out_dim]} "
                   "outputs): cross-entropy on each rank's logits, never gathered"):
            split_heads.append(head)
    if wanted and not split_heads:
        found = "; ".join(refused) or ("no LM head found (a matmul weight whose outputs number an embedding "
                                       "table's rows)")
        raise ConfigError(_VOCAB_KEY, f"is true but no LM head splits over the vocabulary: {found}", value=True,
                          expected="false, or a head whose logits only feed a cross-entropy")


def _feeds_log_softmax(start: fx.Node) -> bool:
    """Whether ``start``'s value reaches a log-softmax through carrier ops (forward only)."""
    seen, todo = {start}, [start]
    while todo:
        for user in todo.pop().users:
            if user in seen or user.meta.get(META_PHASE) is not Phase.FORWARD or user.op != "call_function":
                continue
            seen.add(user)
            if user.target is aten._log_softmax.default:
                return True
            if user.target in _CARRIERS:
                todo.append(user)
    return False


def _embedding_tables(g: fx.Graph) -> dict[str, int]:
    """Parameters read by a forward embedding lookup (through a dtype cast) -> their rows."""
    out = {}
    for node in g.nodes:
        if node.op != "call_function" or node.target is not aten.embedding.default \
                or node.meta.get(META_PHASE) is not Phase.FORWARD:
            continue
        weight = node.args[0]
        if weight.op == "call_function" and weight.target is aten._to_copy.default:
            weight = weight.args[0]
        if weight.op == "placeholder" and weight.meta["slot"].role is Role.PARAM:
            out[weight.meta["slot"].name] = tuple(weight.meta["val"].shape)[0]
    return out


HF_TP_PLAN_KEY = "hf_tp_plan"  # PassOptions.extra: the model's own ``_tp_plan`` items (Hugging Face), if any
MODEL_TYPE_KEY = "model_type"  # PassOptions.extra: the model's ``config.model_type`` (layer specs' model_types)
_HF_STYLES = {"colwise": "column", "local_colwise": "column", "rowwise": "row", "local_rowwise": "row"}
_HF_VOCABULARY = ("embedding_rowwise", "colwise_gather_output")  # what _vocabulary splits alike


def _hf_specs(plan) -> tuple[dict, list, list[str]]:
    """A Hugging Face ``base_model_tp_plan`` (module patterns with ``*`` for
    a layer index -> style) as layer specs: "colwise" / "rowwise" (and their
    ``local_`` forms) split the module's weight by output / input features;
    a vocabulary-parallel embedding or head is the vocabulary search's; the
    other styles (sequence parallelism, gathers) are not implemented: those
    modules are left to the search, with a note."""
    specs, labels, skipped = [], [], []
    for pattern, style in plan:
        kind = _HF_STYLES.get(style)
        if style in _HF_VOCABULARY:
            skipped.append(f"base_model_tp_plan: {pattern!r}: {style!r}: left to the vocabulary search (the same "
                           "split; the cross-entropy runs on the shards, the logits are not gathered)")
            continue
        if kind is None:
            skipped.append(f"base_model_tp_plan: {pattern!r}: {style!r} is not implemented; the search decides there")
            continue
        regex = "^" + re.escape(pattern).replace(r"\*", r"\d+") + r"\.weight$"
        specs.append(LayerSpec(patterns=(regex,), partition_type=kind))
        labels.append(f"the model's base_model_tp_plan: {pattern!r}: {style}")
    return {"use_default_specs": True, "layer_specs": tuple(specs)}, labels, skipped


def _specified(g, outputs, tp, config, single, params, details, labels=None, model_type=None,
               kept_whole=None) -> dict[str, Sharded]:
    """The splits ``layer_specs`` asks for (DeepSpeed's AutoTP partition
    config: a parameter whose name matches an entry's regular expression, at
    its start as ``re.match``, is split by output features, "column", or
    input features, "row", or kept whole, "skip"; a fused weight's ``shape``
    names its parts; an entry with ``model_types`` applies to those models
    only), checked to propagate through the whole step together; a split
    that cannot is a ConfigError naming the entry and the op that refused.
    ``kept_whole`` receives the names an entry keeps whole (skip, or a
    gathered output left to the vocabulary search) with why."""
    seeds: dict[str, Sharded] = {}
    entry_of: dict[str, int] = {}
    kept_whole = {} if kept_whole is None else kept_whole

    def label(i):
        return labels[i] if labels is not None else f"{_SPECS}[{i}]"

    for i, spec in enumerate(config["layer_specs"]):
        if spec.model_types and (model_type is None or str(model_type).lower() not in
                                 {str(t).lower() for t in spec.model_types}):
            continue
        patterns = [re.compile(p) for p in spec.patterns]
        matched = [n for n in params if any(p.match(n) for p in patterns)]
        for name in matched:
            if name in entry_of or name in kept_whole:
                continue  # the first entry that matches decides, as DeepSpeed's
            if spec.partition_type == "skip":
                kept_whole[name] = f"{label(i)}: partition_type skip"
                continue
            if spec.gather_output:
                kept_whole[name] = (f"{label(i)}: gather_output (a head whose output every rank reads whole): left "
                                    "to the vocabulary search, which splits an LM head without gathering its logits")
                continue
            u = single.get(name)
            if u is None:
                raise ConfigError(f"{_SPECS}[{i}].patterns", f"matches {name!r}, which is not a matmul weight read "
                                  "once in the forward (an embedding, a norm, a bias or a tied weight)",
                                  value=list(spec.patterns), expected="patterns of linear layers' weights")
            entry_of[name] = i
            parts, sizes = _parts(spec, i)
            if spec.partition_type == "column":
                seeds[name] = Sharded(u.out_dim if spec.partition_dim is None else spec.partition_dim, parts, sizes=sizes)
                if u.bias is not None:
                    seeds[u.bias] = Sharded(0, parts, sizes=sizes)
                    details[u.bias] = ("column", f"bias of {name}")
                details[name] = ("column", label(i) + (f" ({parts} fused parts)" if parts > 1 else ""))
            else:
                seeds[name] = Sharded(u.in_dim if spec.partition_dim is None else spec.partition_dim)
                details[name] = ("row", f"{label(i)}; its output is all-reduced")
    if seeds:
        try:
            propagate(g, dict(seeds), tp, outputs)
        except Refused as e:
            raise ConfigError(_SPECS, f"the splits they ask for ({', '.join(f'{n}: entry {entry_of[n]}' for n in entry_of)}) "
                              f"do not propagate through the step: {e.describe()}; a column must feed a row through "
                              "pointwise ops and attention", value=sorted(entry_of), expected="column/row pairs") from None
    return seeds


def _parts(spec, i: int) -> tuple[int, tuple[int, ...] | None]:
    """Fused parts from a spec's ``shape`` at its partition dimension (0 for
    a column, 1 for a row), as DeepSpeed reads it: an int n > 0, n equal
    parts (``[3, -1]``: q, k, v); a list, the parts' sizes (``[[4096, 1024,
    1024], -1]``: grouped-query q, k, v). (1, None) without one."""
    if not spec.shape:
        return 1, None
    dim = spec.partition_dim if spec.partition_dim is not None else (0 if spec.partition_type == "column" else 1)
    entry = spec.shape[dim] if dim < len(spec.shape) else None
    if isinstance(entry, (list, tuple)):
        if not entry or not all(isinstance(x, int) and x > 0 for x in entry):
            raise ConfigError(f"{_SPECS}[{i}].shape", "the sizes of fused parts must be positive integers",
                              value=list(spec.shape), expected="e.g. [[4096, 1024, 1024], -1]")
        return len(entry), (tuple(entry) if len(set(entry)) > 1 else None)
    if isinstance(entry, int) and entry > 1:
        return entry, None
    return 1, None


def _forward_users(g: fx.Graph) -> dict[str, int]:
    """Parameter name -> how many forward ops read it (a ``t`` counts for the matmul it feeds)."""
    out = {}
    for n in g.nodes:
        if n.op == "placeholder" and n.meta["slot"].role is Role.PARAM:
            out[n.meta["slot"].name] = sum(1 for u in n.users if u.meta.get(META_PHASE) is Phase.FORWARD)
    return out


def _reached_rows(start: fx.Node, by_x: dict) -> list[str]:
    """Weights whose matmul input ``start``'s value reaches through carrier ops (forward only)."""
    rows, seen, todo = [], {start}, [start]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen or user.meta.get(META_PHASE) is not Phase.FORWARD:
                continue
            seen.add(user)
            if node in by_x and by_x[node].node is user:
                if by_x[node].weight not in rows:
                    rows.append(by_x[node].weight)
                continue
            if user.op == "call_function" and user.target in _CARRIERS:
                todo.append(user)
    # a view of the row's input counts: the matmul reads a 2-D view of it
    return rows


def _alternate(single: dict, by_x: dict) -> dict[str, list[str]]:
    """Column -> the rows its product reaches, Megatron's alternation in
    forward order: the first unassigned weight starts a pair as a column,
    the weights its product reaches are its rows (a row never starts a
    pair; a decomposed norm between blocks is pointwise, so a row's output
    reaches the next block's columns too)."""
    role: dict[str, str] = {}
    out: dict[str, list[str]] = {}
    for name, u in sorted(single.items(), key=lambda item: _order(item[1].node)):
        if name in role:
            continue
        rows = [r for r in _reached_rows(u.node, by_x) if role.get(r) != "column"]
        if not rows:
            continue
        role[name] = "column"
        for r in rows:
            role[r] = "row"
        out[name] = rows
    return out


def _order(node: fx.Node) -> int:
    i = 0
    for n in node.graph.nodes:
        if n is node:
            return i
        i += 1
    return i


def _groups(reach: dict[str, list[str]]) -> list[tuple[list[str], list[str]]]:
    """Connected components of the column -> row graph, in column order."""
    parent: dict[str, str] = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            x = parent[x]
        return x

    for c, rows in reach.items():
        for r in rows:
            parent[find(c)] = find(r)
    out: dict[str, tuple[list[str], list[str]]] = {}
    for c, rows in reach.items():
        cols, rs = out.setdefault(find(c), ([], []))
        cols.append(c)
        rs.extend(r for r in rows if r not in rs)
    return list(out.values())


def _try_group(g, outputs, tp, accepted, cols, rows, single):
    """Seeds for the group (columns, their biases, rows) that propagate, and
    the columns kept; or the Refused of the whole group."""
    first = None
    sizes = range(len(cols), 0, -1)
    tried = 0
    for size in sizes:
        for kept in itertools.combinations(cols, size):
            tried += 1
            if tried > _MAX_SUBSETS:
                return first
            parts = {c: (1, None) for c in kept}
            while True:
                seeds = dict(accepted)
                for c in kept:
                    u = single[c]
                    seeds[c] = Sharded(u.out_dim, parts[c][0], sizes=parts[c][1])
                    if u.bias is not None:
                        seeds[u.bias] = Sharded(0, parts[c][0], sizes=parts[c][1])
                for r in rows:
                    seeds[r] = Sharded(single[r].in_dim)
                try:
                    propagate(g, seeds, tp, outputs)
                    return seeds, list(kept)
                except Refused as e:
                    first = e
                    if e.parts and len(kept) == 1 and parts[kept[0]] == (1, None):
                        parts[kept[0]] = (e.parts, e.sizes)  # a fused weight: split per part
                        continue
                    break
    return first
