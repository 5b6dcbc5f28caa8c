"""shard_tensor_parallel: run the step on this rank's Megatron shards.

Why: the plan (``plan_tensor_parallel``) says which weights split; this
rewrite makes each rank hold and update only its slice, and adds the two
all-reduces per column/row pair that make the result the unsplit step's.

Requires: ``plan_tensor_parallel`` ran (its plan is in the signature), the
graph is the one it planned on (no pass in between changed the data flow).

Ensures:
- every split parameter, and each of its optimizer states, is a rank-held
  slot (storage "rank") with its ``split``; the step reads and returns the
  shard; its step counter is rank-held whole (the user's optimizer keeps
  nothing of a split parameter after the first run);
- every value derived from a split one has its local shape (view, expand,
  split and slice_backward sizes rewritten; head counts become per-rank);
- a partial value (a row-parallel product in the forward, the input
  gradient of a column-parallel weight in the backward) is all-reduced over
  the tensor-parallel group right after it is made, for the readers that
  need it whole (Megatron's g and f); a row-parallel ``addmm`` becomes mm,
  all-reduce, bias add, so the bias counts once;
- replicated values are computed alike on every rank of the group: the
  gradients of replicated parameters need no reduction there;
- a random draw shaped like a split value (dropout's mask over split heads
  or features) is drawn for the whole value on every rank, from the
  generator state the single process has, and each rank keeps its slice:
  the ranks' masks differ and are the reference's (the whole mask is
  made transiently on each rank: its bytes, not the activation's);
- over a split vocabulary (``vocabulary.py``): lookups find the rank's own
  tokens (all-reduced), the log-softmax and the negative log-likelihood
  run on the rank's slice of the logits with the max, the sums and the
  loss all-reduced; the logits are never gathered.

Before / after (one MLP pair, 2 ranks; shapes per rank)::

    t = aten.t(fc_w)            # [128, 32]       t = aten.t(fc_w)          # [64, 32] shard
    h = aten.addmm(fc_b, x, t)  # [18, 128]       h = aten.addmm(fc_b, x, t)  # [18, 64]
    g = aten.gelu(h)                              g = aten.gelu(h)
    t2 = aten.t(out_w)          # [128, 32]       t2 = aten.t(out_w)        # [64, 32] shard
    y = aten.addmm(out_b, g, t2)          ->      mm = aten.mm(g, t2)        # partial sums
                                                  ar = _c10d_functional.all_reduce(mm, 'sum', tp)
                                                  w = _c10d_functional.wait_tensor(ar)
                                                  y = aten.add(w, out_b)
"""
from __future__ import annotations

import dataclasses
import operator

import sympy
import torch
import torch.fx as fx

from ... import compat
from ...graph import META_GRAD_OF, META_GRAD_PIECE, META_PHASE, Phase, Role, StepGraph, Storage
from ...graph.build import clone_step_graph
from ...graph.tp_layout import TP_PLAN_KEY
from ..cleanup.hoist_symbolic_sizes import SizeBuilder, symbol_sources
from ..data_parallel.collectives import fake_like, fake_result, make_node
from ..manager import PassOptions, PassResult
from .placements import PARTIAL, VIEWS, Sharded, _is, aten, propagate
from .vocabulary import rewrite_vocabulary_op

__all__ = ["shard_tensor_parallel", "META_TP_REPLICATED"]

c10d = torch.ops._c10d_functional
META_TP_REPLICATED = "tp_replicated"


def shard_tensor_parallel(graph: StepGraph, options: PassOptions) -> PassResult:
    plan = graph.signature.extra.get(TP_PLAN_KEY)
    if plan is None or not plan.sharded:
        return PassResult(graph, False, "nothing split: the step runs replicated on each tensor-parallel rank")
    tp, group = options.tp_size, options.tp_group_name
    graph = clone_step_graph(graph)
    gm, g = graph.gm, graph.gm.graph
    seeds = {p.name: Sharded(p.split_dim, p.parts, sizes=p.sizes) for p in plan.sharded}
    prop = propagate(g, seeds, tp, graph.signature.outputs, tokens=plan.tokens)
    # the values every rank of the group holds alike (whole, not partial, not split): a pipeline may send each
    # rank's slice of one to the next stage and gather it there (pipeline.pipe_partitioned); values the rewrite
    # below adds are not marked (conservatively: sent whole)
    for node in g.nodes:
        if node.op == "call_function" and node in prop.states and prop.states[node] is None:
            node.meta[META_TP_REPLICATED] = True
    moved = _sequence_parallel(g, prop, options) if plan.tokens else 0
    _slice_replicated(g, prop, options)
    whole_draws = {node: node.meta["val"] for node in prop.draws}

    # local shapes, in graph order (each node's inputs are already local)
    for node in list(g.nodes):
        state = prop.states.get(node)
        if node.op == "get_attr" and node in prop.constants:
            _local_constant(gm, node, prop, tp)
        if not _is_split(state):
            continue
        if node.op == "placeholder":
            node.meta["val"] = _local_val(node.meta["val"], state, tp)
        elif node.op == "call_function":
            _local_arguments(node, state, tp)
            if node in prop.slices_local:  # one fused part of unequal parts: the rank's share of it
                # slice(x, dim, start, end, step) / slice_backward(grad, sizes, dim, start, end, step)
                at = 2 if node.target is aten.slice.Tensor else 3
                node.args = node.args[:at] + tuple(prop.slices_local[node]) + tuple(node.args[at + 2:])
            node.meta["val"] = _run_fake(node, state, tp)

    if prop.draws:
        sizes = _sizes(g)
        for node, state in prop.draws.items():
            _draw_whole(g, node, state, whole_draws[node], tp, options.tp_rank, sizes)
    reduced = moved
    for node in [n for n in g.nodes if n in prop.decompose]:
        _decompose_addmm(g, node, group, tp)
        reduced += 1
    batched = _gradients_reduced_after_backward(prop.reduce)
    together = {v for values in batched.values() for v in values}
    for value, readers in prop.reduce.items():
        if value not in together:
            _all_reduce(g, value, readers, group)
            reduced += 1
    for values in batched.values():
        if len(values) == 1:
            _all_reduce(g, values[0], prop.reduce[values[0]], group)
        else:
            _all_reduce_together(g, values, prop.reduce, group)
        reduced += 1
    # last: the all-reduces above read (and keep reading) what replaces these
    for node, kind in prop.vocab.items():
        reduced += rewrite_vocabulary_op(g, node, kind, tp, options.tp_rank, group)

    new_sig = _rank_held(graph.signature, plan, g)
    g.lint()
    gm.recompile()
    summary = (f"{len(plan.sharded)} parameters split over {tp} ranks; {reduced} collectives over the "
               f"tensor-parallel group" + (" (sequence parallel)" if plan.tokens else "")
               + (f"; {len(prop.draws)} random draws over split values (dropout masks) drawn whole on each rank "
                  f"and sliced, as the single process draws them" if prop.draws else ""))
    return PassResult(graph.replace(signature=new_sig), True, summary)


def _draw_whole(g: fx.Graph, node: fx.Node, state: Sharded, whole, tp: int, rank: int, sizes: SizeBuilder) -> None:
    """A random draw shaped like a split value (``bernoulli(empty_like(x), p)``,
    dropout's mask): drawn for the whole shape from the same generator state
    as the single process, then this rank's slice taken for its readers. The
    draw costs the whole value's numbers on every rank; what the ranks keep
    is the reference's draw, cut as the value is."""
    meta = dict(like=node, phase=node.meta.get(META_PHASE))
    shape = [sizes.build(compat.size_expr(x), node, node) if compat.is_symbolic(x) else int(x) for x in whole.shape]
    with g.inserting_before(node):
        empty = make_node(g, aten.new_empty.default, (node.args[0], shape), val=fake_like(whole, whole.shape),
                          name="tp_draw_shape", **meta)
    node.args = (empty,) + tuple(node.args[1:])
    local = node.meta["val"]
    node.meta["val"] = fake_like(whole, whole.shape)
    d, parts, n = state.dim, state.parts, int(whole.shape[state.dim])
    chunk = n // (parts * tp)
    users = list(node.users)
    with g.inserting_after(node):
        if parts == 1:
            args = (node, d, rank * chunk, (rank + 1) * chunk)
            mine = make_node(g, aten.slice.Tensor, args, val=fake_result(aten.slice.Tensor, args), name="tp_draw_slice",
                             **meta)
        else:  # [..., parts x tp x chunk, ...] -> the rank's chunk of every part
            cut = shape[:d] + [parts, tp, chunk] + shape[d + 1:]
            view = make_node(g, aten.view.default, (node, cut), val=fake_result(aten.view.default, (node, cut)),
                             name="tp_draw_parts", **meta)
            with g.inserting_after(view):
                sel = make_node(g, aten.select.int, (view, d + 1, rank),
                                val=fake_result(aten.select.int, (view, d + 1, rank)), name="tp_draw_select", **meta)
            local_shape = shape[:d] + [parts * chunk] + shape[d + 1:]
            with g.inserting_after(sel):
                mine = make_node(g, aten.reshape.default, (sel, local_shape),
                                 val=fake_result(aten.reshape.default, (sel, local_shape)), name="tp_draw_slice", **meta)
    assert tuple(mine.meta["val"].shape) == tuple(local.shape), (mine.meta["val"].shape, local.shape)
    for user in users:
        user.replace_input_with(node, mine)


def _is_split(state) -> bool:
    if isinstance(state, tuple):
        return any(isinstance(s, Sharded) for s in state)
    return isinstance(state, Sharded)


def _local_val(val, state: Sharded, tp: int):
    shape = list(val.shape)
    shape[state.dim] //= tp
    return fake_like(val, shape)


def _local_arguments(node: fx.Node, state, tp: int) -> None:
    """Sizes written in the op's arguments, made per-rank."""
    target = node.target
    if target in VIEWS or target is aten.expand.default:
        # the split dimension's size per rank; the others as written (symbolic ones are nodes)
        sizes = list(node.args[1])
        sizes[state.dim] = _per_rank(node, sizes[state.dim], tp)
        node.args = (node.args[0], sizes) + tuple(node.args[2:])
    elif target is aten.embedding_dense_backward.default:  # the table's rows
        node.args = (node.args[0], node.args[1], node.args[2] // tp) + tuple(node.args[3:])
    elif target is aten.slice_backward.default:
        sizes = list(node.args[1])
        sizes[state.dim] = _per_rank(node, sizes[state.dim], tp)
        node.args = (node.args[0], sizes) + tuple(node.args[2:])
    elif target in (aten.split.Tensor, aten.split_with_sizes.default):
        src_state = state[0]
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % node.args[0].meta["val"].dim()
        if dim == src_state.dim:  # a fused dimension split into its parts
            size = node.args[1]
            size = [s // tp for s in size] if isinstance(size, (list, tuple)) else size // tp
            node.args = (node.args[0], size) + tuple(node.args[2:])


def _per_rank(reader: fx.Node, size, tp: int):
    """A size written in ``reader``'s arguments, of a dimension the ranks split: its share per rank. A
    symbolic one (sequence parallelism over a token count that varies: a node computing it) is divided by a
    node made before the reader; the split checked that it divides at every call."""
    if isinstance(size, fx.Node):
        val = size.meta["val"]
        with reader.graph.inserting_before(reader):
            share = reader.graph.call_function(operator.floordiv, (size, tp))
        share.meta.update({k: v for k, v in reader.meta.items() if k != "val"})
        share.meta["val"] = val // tp
        return share
    if not isinstance(size, int):
        raise AssertionError(f"{reader.format_node()}: the split dimension's size {size!r} is neither an int nor a node")
    return size if size == -1 else size // tp


def _run_fake(node: fx.Node, state, tp: int):
    """The node's value at local shapes: the op run on its inputs' fake values
    (keeps strides), or an empty of the local shape when the op cannot run."""
    old = node.meta["val"]
    try:
        return fake_result(node.target, node.args, node.kwargs)
    except Exception:
        if isinstance(state, tuple):
            return type(old)(_local_val(v, s, tp) if isinstance(s, Sharded) else v for v, s in zip(old, state))
        return _local_val(old, state, tp)


def _local_constant(gm: fx.GraphModule, node: fx.Node, prop, tp: int) -> None:
    """An empty constant concatenated to split values (an empty key/value
    cache): made again with the split dimension per-rank."""
    reader = next(u for u in node.users if u.target is aten.cat.default)
    state = prop.states[reader]
    const = getattr(gm, node.target)
    shape = list(const.shape)
    shape[state.dim] //= tp
    name = f"{node.target}_tp"
    setattr(gm, name, torch.empty(shape, dtype=const.dtype, device=const.device))
    node.target = name
    node.meta["val"] = _local_val(node.meta["val"], state, tp)


def _all_reduce(g: fx.Graph, value: fx.Node, readers: list[fx.Node], group: str) -> None:
    val = value.meta["val"]
    meta = dict(like=value, phase=value.meta.get(META_PHASE))
    with g.inserting_after(value):
        issued = make_node(g, c10d.all_reduce.default, (value, "sum", group), val=fake_like(val, val.shape),
                           name="tp_all_reduce", **meta)
    with g.inserting_after(issued):
        done = make_node(g, c10d.wait_tensor.default, (issued,), val=issued.meta["val"], name="tp_wait", **meta)
    for reader in dict.fromkeys(readers):
        reader.replace_input_with(value, done)
    # a parameter's gradient summed over the group's shares of it (a norm's weight over each rank's tokens, a
    # replicated key/value weight over each rank's heads): the sum is the gradient the data-parallel passes reduce
    for key in (META_GRAD_OF, META_GRAD_PIECE):
        if key in value.meta:
            done.meta[key] = value.meta.pop(key)


def _gradients_reduced_after_backward(reduce: dict) -> dict:
    """Partial parameter gradients (a norm's weight summed over each rank's
    tokens under sequence parallelism, a replicated key/value weight over
    each rank's heads) whose readers all come after the backward (the
    update, the step's outputs): by dtype, to be all-reduced together in one
    collective after the last of them, not one small collective each."""
    out: dict = {}
    for value, readers in reduce.items():
        val = value.meta.get("val")
        if (META_GRAD_OF in value.meta and value.meta.get(META_PHASE) is Phase.BACKWARD
                and isinstance(val, torch.Tensor) and not any(compat.is_symbolic(x) for x in val.shape)
                and all(r.op == "output" or r.meta.get(META_PHASE) not in (Phase.FORWARD, Phase.BACKWARD)
                        for r in readers)):
            out.setdefault(val.dtype, []).append(value)
    return out


def _all_reduce_together(g: fx.Graph, values: list[fx.Node], reduce: dict, group: str) -> None:
    """One all-reduce of ``values`` flattened and concatenated, after the
    last of them; each reader reads its value's part, viewed back, and the
    gradient marks move to those parts."""
    order = {n: i for i, n in enumerate(g.nodes)}
    values = sorted(values, key=order.__getitem__)
    last = values[-1]
    vals = [v.meta["val"] for v in values]
    sizes = [int(v.numel()) for v in vals]
    meta = dict(like=last, phase=Phase.BACKWARD)
    cursor = last
    flats = []
    for v, val, size in zip(values, vals, sizes):
        with g.inserting_after(cursor):
            cursor = make_node(g, aten.view.default, (v, [size]), val=fake_like(val, (size,)), name="tp_flat", **meta)
        flats.append(cursor)
    total = sum(sizes)
    with g.inserting_after(cursor):
        packed = make_node(g, aten.cat.default, (flats,), val=fake_like(vals[0], (total,)), name="tp_pack", **meta)
    with g.inserting_after(packed):
        issued = make_node(g, c10d.all_reduce.default, (packed, "sum", group), val=fake_like(vals[0], (total,)),
                           name="tp_all_reduce", **meta)
    with g.inserting_after(issued):
        done = make_node(g, c10d.wait_tensor.default, (issued,), val=issued.meta["val"], name="tp_wait", **meta)
    with g.inserting_after(done):
        parts = make_node(g, aten.split_with_sizes.default, (done, sizes),
                          val=[fake_like(vals[0], (n,)) for n in sizes], name="tp_unpack", **meta)
    cursor = parts
    for i, (v, val, size) in enumerate(zip(values, vals, sizes)):
        with g.inserting_after(cursor):
            piece = make_node(g, operator.getitem, (parts, i), val=fake_like(val, (size,)), name="tp_part", **meta)
        with g.inserting_after(piece):
            cursor = make_node(g, aten.view.default, (piece, list(val.shape)), val=fake_like(val, val.shape),
                               name="tp_reduced", **meta)
        for reader in dict.fromkeys(reduce[v]):
            reader.replace_input_with(v, cursor)
        for key in (META_GRAD_OF, META_GRAD_PIECE):
            if key in v.meta:
                cursor.meta[key] = v.meta.pop(key)


def _split_addmm(g: fx.Graph, node: fx.Node) -> tuple[fx.Node, fx.Node]:
    """addmm(bias, x, w) with a partial product as (mm, mm + bias), so the
    product is reduced (all-reduced, or reduce-scattered over the tokens)
    before the bias is added once."""
    bias, x, w = node.args[:3]
    val = node.meta["val"]
    meta = dict(like=node, phase=node.meta.get(META_PHASE))
    with g.inserting_before(node):
        mm = make_node(g, aten.mm.default, (x, w), val=fake_like(val, val.shape), name="tp_mm", **meta)
        added = make_node(g, aten.add.Tensor, (mm, bias), val=fake_like(val, val.shape), name="tp_bias", **meta)
    node.replace_all_uses_with(added)
    g.erase_node(node)
    return mm, added


def _decompose_addmm(g: fx.Graph, node: fx.Node, group: str, tp: int) -> None:
    """addmm(bias, x, w) with a partial product: mm, all-reduce, then the bias once."""
    mm, added = _split_addmm(g, node)
    _all_reduce(g, mm, [added], group)


def _rank_held(sig, plan, g: fx.Graph):
    """Split parameters, all their optimizer state and their gradients accumulated over
    micro-steps become rank-held slots."""
    split_names = {p.name for p in plan.sharded}

    def held(slot, val):
        if slot.name not in split_names or slot.role not in (Role.PARAM, Role.OPTIMIZER_STATE, Role.GRAD):
            return slot
        split = plan.split_of(slot.name)
        whole_scalar = slot.role is Role.OPTIMIZER_STATE and (val is None or val.dim() <= split.dim)
        return dataclasses.replace(slot, storage=Storage.RANK, split=None if whole_scalar else split)

    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    inputs = []
    for node, slot in zip(placeholders, sig.inputs):
        new = held(slot, node.meta.get("val"))
        node.meta["slot"] = new
        inputs.append(new)
    values = output_node_values(g)
    outputs = tuple(held(slot, v.meta.get("val") if isinstance(v, fx.Node) else None)
                    for slot, v in zip(sig.outputs, values))
    return dataclasses.replace(sig, inputs=tuple(inputs), outputs=outputs)


def output_node_values(g: fx.Graph) -> list:
    for n in reversed(g.nodes):
        if n.op == "output":
            return list(n.args[0])
    return []


# -- sequence parallelism: before the local shapes, so every reader sees the value it reads ---------------------


def _sequence_parallel(g: fx.Graph, prop, options: PassOptions) -> int:
    """Row-parallel addmm become mm, reduce-scatter, bias add on the rank's
    tokens; partial values are reduce-scattered for their per-token readers;
    token-split values gathered for the readers that need them whole
    (replicated operands are sliced to the rank's tokens after). New nodes get their
    states, so the local shapes below cover them. Returns the collectives added."""
    tp, group, count = options.tp_size, options.tp_group_name, 0
    sizes = _sizes(g)
    for node in [n for n in g.nodes if n in prop.decompose and isinstance(prop.states.get(n), Sharded)]:
        state = prop.states[node]
        prop.decompose.discard(node)
        mm, added = _split_addmm(g, node)
        prop.states[mm], prop.states[added] = PARTIAL, state
        prop.scatter[mm] = [added]
    for value, readers in list(prop.scatter.items()):
        _token_collective(g, prop, value, readers, tp, group, sizes, scatter=True)
        count += 1
    for value, readers in list(prop.gather.items()):
        _token_collective(g, prop, value, readers, tp, group, sizes, scatter=False)
        count += 1
    return count


def _slice_replicated(g: fx.Graph, prop, options: PassOptions) -> None:
    """Replicated operands read by a split op, sliced to this rank's share
    (no communication): its tokens under sequence parallelism, its query
    heads of a key/value repeated over all heads."""
    if not prop.slices:
        return
    sizes = _sizes(g)
    for reader, operands in prop.slices.items():
        for operand, dim in operands:
            sliced = _token_slice(g, reader, operand, dim, options.tp_size, options.tp_rank, sizes)
            if reader in prop.reduce.get(operand, ()):  # a partial operand: the slice reads it all-reduced
                prop.reduce[operand] = [sliced if r is reader else r for r in prop.reduce[operand]]


def _token_collective(g, prop, value, readers, tp: int, group: str, sizes: SizeBuilder, *, scatter: bool) -> None:
    """value (whole shape in its meta) as [tokens, rest] rows, reduce-scattered
    (a partial value: each rank keeps the sum of its tokens' rows) or
    all-gathered (a token-split value: every rank gets all rows), and back
    to the value's dimensions, for ``readers``.

    A value the capture laid out in another order than its dimensions (a
    transpose of [batch, length, heads, dim] read as [batch, heads, length,
    dim]) is cut into rows in its memory order and comes back in that
    layout: what reads it (a kernel whose output follows its query's
    strides, then a ``view`` of that output) sees the strides it was
    captured with. Where the split dimension does not lead that order, the
    rows follow the dimensions (values right, layout contiguous)."""
    val = value.meta["val"]
    tokens = sympy.sympify(prop.tokens)
    rest = sympy.cancel(compat.size_expr(val.numel()) / tokens)
    if not rest.is_Integer:
        raise AssertionError(f"{value.format_node()}: {val.numel()} elements are not {tokens} tokens' rows")
    rest = int(rest)
    flat_shape = (val.numel() // rest, rest)  # SymInts where the tokens vary
    token = Sharded(0, tokens=True)
    dim = prop.token_dim(value) if scatter else prop.states[value].dim
    order = _rows_order(val, dim)
    meta = dict(like=value, phase=value.meta.get(META_PHASE))
    after = value.next  # the sizes the reshapes read are made between the value and its first reader
    rows = sizes.build(tokens, after, value) if compat.is_symbolic(flat_shape[0]) else int(flat_shape[0])
    source = value
    if order is not None:  # the memory order: a view of the value, no copy
        with g.inserting_before(after):
            source = make_node(g, aten.permute.default, (value, list(order)),
                               val=fake_result(aten.permute.default, (value, list(order))), name="sp_memory_order",
                               **meta)
        prop.states[source] = PARTIAL if scatter else Sharded(order.index(dim), tokens=True)
    with g.inserting_before(after):
        flat = make_node(g, aten.reshape.default, (source, [rows, rest]), val=fake_like(val, flat_shape),
                         name="sp_rows", **meta)
    with g.inserting_after(flat):
        if scatter:
            issued = make_node(g, c10d.reduce_scatter_tensor.default, (flat, "sum", tp, group),
                               val=fake_like(val, flat_shape), name="tp_reduce_scatter", **meta)
        else:
            issued = make_node(g, c10d.all_gather_into_tensor.default, (flat, tp, group),
                               val=fake_like(val, flat_shape), name="tp_all_gather", **meta)
    with g.inserting_after(issued):
        done = make_node(g, c10d.wait_tensor.default, (issued,), val=fake_like(val, flat_shape), name="tp_wait", **meta)
    anchor = done.next  # the sizes, then the reshape, right before what followed the wait
    whole = [val.shape[d] for d in order] if order is not None else list(val.shape)
    shape = [sizes.build(compat.size_expr(x), anchor, value) if compat.is_symbolic(x) else int(x) for x in whole]
    with g.inserting_before(anchor):
        out = make_node(g, aten.reshape.default, (done, shape), val=fake_like(val, whole),
                        name="sp_tokens" if scatter else "sp_gathered", **meta)
    ordered = out
    if order is not None:  # back to the value's dimensions, with its strides
        inverse = [order.index(d) for d in range(len(order))]
        with g.inserting_before(anchor):
            out = make_node(g, aten.permute.default, (ordered, inverse),
                            val=fake_result(aten.permute.default, (ordered, inverse)),
                            name="sp_tokens" if scatter else "sp_gathered", **meta)
    if scatter:
        prop.states.update({flat: PARTIAL, issued: token, done: token, out: Sharded(dim, tokens=True)})
        if order is not None:
            prop.states[ordered] = Sharded(order.index(dim), tokens=True)
    else:
        prop.states.update({flat: token, issued: None, done: None, out: None, ordered: None})
    for reader in dict.fromkeys(readers):
        reader.replace_input_with(value, out)


def _rows_order(val: torch.Tensor, dim: int | None) -> tuple[int, ...] | None:
    """The order of ``val``'s dimensions in memory when it is a dense
    permutation of them other than their own (strides compared as
    expressions: the same order at every size of a symbolic capture) and
    the split dimension ``dim`` leads it (the dimensions before it in that
    order have size 1: each rank's tokens are one run of rows). None
    otherwise: the rows follow the dimensions."""
    if dim is None or val.dim() < 2:
        return None
    shape, strides = list(val.shape), list(val.stride())
    order = tuple(sorted(range(val.dim()), key=lambda d: (-compat.size_hint(strides[d]), d)))
    if order == tuple(range(val.dim())):
        return None
    expected = sympy.Integer(1)
    for d in reversed(order):
        if not _is(shape[d], 1) and sympy.expand(compat.size_expr(strides[d]) - expected) != 0:
            return None  # not dense in that order (a slice, a broadcast): the dimensions' order
        expected = sympy.expand(expected * compat.size_expr(shape[d]))
    if any(not _is(shape[d], 1) for d in order[:order.index(dim)]):
        return None
    return order


def _sizes(g: fx.Graph) -> SizeBuilder:
    """Arithmetic on the batch's size symbols, each made right before its reader (sequence parallelism over a
    token count that varies: row counts and slice bounds per call)."""
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    return SizeBuilder(g, symbol_sources(g), placeholders[-1], reuse=False)


def _token_slice(g, reader, operand, dim: int, tp: int, rank: int, sizes: SizeBuilder) -> fx.Node:
    """This rank's share of a replicated operand's dimension ``dim`` (its tokens, or its query heads): a slice,
    no communication."""
    val = operand.meta["val"]
    size = val.shape[dim] // tp
    if compat.is_symbolic(size):  # a token count that varies: the bounds are computed per call
        share = sympy.expand(compat.size_expr(val.shape[dim]) / tp)
        bounds = (sizes.build(rank * share, reader), sizes.build((rank + 1) * share, reader))
    else:
        bounds = (rank * int(size), (rank + 1) * int(size))
    args = (operand, dim, *bounds)
    with g.inserting_before(reader):
        sliced = make_node(g, aten.slice.Tensor, args, val=fake_result(aten.slice.Tensor, args), name="sp_slice",
                           like=reader, phase=reader.meta.get(META_PHASE))
    reader.replace_input_with(operand, sliced)
    return sliced
