"""functionalize_graph: in-place updates become out-of-place ops.

Requires: a captured step graph (``functional`` False) whose outputs hold
the final value of every input it writes (capture guarantees this for
parameters, buffers, gradients and optimizer state, and rejects writes into
anything else).

Ensures: ``functional`` True — no node writes anything; views stay views
(materializing them would change matmul operand layouts and so the
numbers). Node phases, sources and annotations carry over.

Before / after::

    mul_ = aten.mul_.Tensor(s_w_exp_avg_sq, 0.999)       ->  mul = aten.mul.Tensor(s_w_exp_avg_sq, 0.999)
    addcmul_ = aten.addcmul_(mul_, g, g, value=0.001)    ->  addcmul = aten.addcmul(mul, g, g, value=0.001)
    return (..., addcmul_)                               ->  return (..., addcmul)

Two ways, same result:

- *direct rewrite* (fast, pure graph surgery): each in-place op becomes its
  out-of-place twin and later reads of the written tensor read the new
  value. It applies when every write is provably local: the written tensor
  (or the view written through) is not read through another alias after the
  write — which is what optimizer updates, gradient clipping, dropout masks
  and batch-norm statistics look like. A write through a chain of slices,
  selects, diagonals or reshapes (``shifted[:, 1:] = ids[:, :-1]``, as
  Hugging Face's encoder-decoders shift their labels) also becomes
  out of place: the written view's new value is scattered back into each
  tensor of the chain (``slice_scatter``, ...), whose later reads read it.
- *torch's functionalization* (general, ~100x slower: it re-traces the
  graph) for everything else: an op without an out-of-place twin, or a
  write that another live view must observe.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ... import compat
from ...errors import PassError
from ...graph import Role, StepGraph, output_values
from ...graph.build import adopt_annotations, clone_step_graph, copy_node_meta, flatten_codegen, label_params
from ...graph.ops import ALIAS_OPS, UNDECLARED_MUTATIONS, functional_variant, is_view, mutated_arg_indices
from ..manager import PassOptions, PassResult

__all__ = ["functionalize_graph"]

aten = torch.ops.aten


class _NotLocal(Exception):
    """The direct rewrite cannot prove this graph safe; use torch's."""


def functionalize_graph(graph: StepGraph, options: PassOptions) -> PassResult:
    if graph.functional:
        return PassResult(graph, False)
    try:
        result, count = _rewrite_directly(graph)
        how = f"{count} in-place ops rewritten out of place"
    except _NotLocal as why:
        result, count = _torch_functionalize(graph)
        how = f"torch functionalization ({why}); {count} input writes turned into outputs"
    strided = _strided_writes(graph)
    if strided:
        how += (
            f"; {strided} wrote a strided view (e.g. an RNN cell's gate chunk) and now make a contiguous tensor: "
            "elementwise math read from it (sigmoid, tanh) runs in whole vectors where eager ran each row's tail "
            "scalar, so results can differ from eager in the last bit"
        )
    label_params(result)
    return PassResult(result, True, how)


def _strided_writes(graph: StepGraph) -> int:
    """In-place ops of the captured graph that write a non-contiguous tensor.
    Their out-of-place twins return contiguous tensors, so the ops that read
    the result iterate over it differently: CPU kernels vectorize whole
    contiguous runs and fall back to scalar code for each run's tail, and
    the two paths of transcendental functions round differently. Only
    floating-point writes count: integers round nothing."""
    count = 0
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for _, value in _written(node):
            val = value.meta.get("val") if isinstance(value, fx.Node) else None
            # integer writes (labels shifted into a slice) round nothing
            if isinstance(val, torch.Tensor) and val.is_floating_point() and not val.is_contiguous():
                count += 1
    return count


# -- direct rewrite -------------------------------------------------------------


def _is_inplace_alias(node: fx.Node) -> bool:
    """``foo_(x, ...)`` returns x itself: its result is x."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    rets = target._schema.returns
    return len(rets) == 1 and rets[0].alias_info is not None and rets[0].alias_info.is_write


def _root(node):
    """Follow full aliases (detach, alias, the result of an in-place op) to
    the node that names the same tensor."""
    while isinstance(node, fx.Node) and node.op == "call_function" and (node.target in ALIAS_OPS - {aten.lift_fresh_copy.default} or _is_inplace_alias(node)):
        node = node.args[0]
    return node


def _base(node):
    """Follow full aliases and views to the node that owns the storage."""
    while isinstance(node, fx.Node) and node.op == "call_function" and (
        node.target in ALIAS_OPS - {aten.lift_fresh_copy.default} or _is_inplace_alias(node) or is_view(node)
    ):
        node = node.args[0]
    return node


def _written(node: fx.Node) -> list[tuple[int, fx.Node | list]]:
    """(argument position, value) of every argument the node writes."""
    out = []
    for i in mutated_arg_indices(node):
        schema_arg = node.target._schema.arguments[i]
        value = node.args[i] if i < len(node.args) else node.kwargs.get(schema_arg.name)
        out.append((i, value))
    return out


def _rewrite_directly(graph: StepGraph) -> tuple[StepGraph, int]:
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    nodes = list(g.nodes)
    # alias structure of the graph as captured, before any rewriting
    pos = {n: i for i, n in enumerate(nodes)}
    root = {n: _root(n) for n in nodes}
    base = {n: _base(n) for n in nodes}
    last_use = {n: max((pos[u] for u in n.users), default=-1) for n in nodes}
    members: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        members.setdefault(base[n], []).append(n)
    # (view, its parent) from each node out to its storage's owner, as captured
    chains = {n: _view_chain(n) for n in nodes}

    def check_local(target: fx.Node, at: int) -> None:
        """Writing ``target`` at position ``at`` is local when no other alias
        of its storage, made before the write, is read after it — but the
        tensors of the view chain it was written through, which get their
        new values scattered back (``_view_chain``)."""
        updated = {root[parent] for _, parent in chains[target]} | {root[target]}
        for x in members.get(base[target], ()):
            if root[x] is root[target] or root[x] in updated:
                continue
            if pos[x] < at < last_use[x]:
                raise _NotLocal(f"{x.name} aliases {target.name}, written by {nodes[at].name}, and is read after")

    current: dict[fx.Node, fx.Node] = {}  # tracked tensor (a root) -> its latest value

    def read(value):
        if isinstance(value, fx.Node):
            return current.get(root.get(value, value), value)
        if isinstance(value, (list, tuple)):
            return type(value)(read(v) for v in value)
        if isinstance(value, dict):
            return {k: read(v) for k, v in value.items()}
        return value

    rewritten = 0
    replaced = []
    for node in nodes:
        if node.op == "output":
            node.args = read(node.args)
            continue
        if node.op != "call_function":
            continue
        writes = _written(node)  # judged on the graph as captured
        for _, value in writes:
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, fx.Node):
                    check_local(t, pos[node])
        roots = [[root[t] for t in v] if isinstance(v, (list, tuple)) else root[v] for _, v in writes]
        node.args, node.kwargs = read(node.args), read(dict(node.kwargs))
        if writes:
            _replace_write(g, node, roots, current)
            for _, value in writes:
                if isinstance(value, fx.Node) and root[value] is not root[base[value]]:
                    _scatter_back(g, node, value, chains[value], root, current)
            replaced.append(node)
            rewritten += 1

    for node in reversed(replaced):
        for item in [u for u in node.users if u.target is operator.getitem and not u.users]:
            g.erase_node(item)  # a multi-output write's results, read through their new values now
        if node.users:
            raise PassError(f"functionalize_graph: {node.name} still has users after the rewrite: {list(node.users)}")
        g.erase_node(node)
    _check_state_outputs(graph, current)
    return graph.replace(functional=True), rewritten


def _replace_write(g: fx.Graph, node: fx.Node, roots: list, current: dict) -> None:
    """Insert the out-of-place twin of ``node`` and make it the current
    value of the tensors ``node`` wrote (``roots``, one per written argument:
    a node, or a list of nodes for foreach ops). Later reads of those
    tensors pick the new values up through ``current``."""
    target = node.target
    if target in UNDECLARED_MUTATIONS:
        if target is not aten.native_batch_norm.default:
            raise _NotLocal(f"{target} writes its arguments without declaring it")
        # training batch norm: the functional op also returns the new running stats
        with g.inserting_before(node):
            new = g.create_node(
                "call_function", aten._native_batch_norm_legit_functional.default, node.args, node.kwargs, name="batch_norm"
            )
        copy_node_meta(node, new)
        vals = tuple(node.meta.get("val") or (None, None, None))
        new.meta["val"] = (*vals, node.args[3].meta.get("val"), node.args[4].meta.get("val"))
        outs = _getitems(g, node, new, 5)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                # later reads take the new result through ``current``; the captured graph's nodes keep their
                # arguments until they are rewritten in turn (an in-place op on the output, a residual's
                # ``h += x``, is judged on the graph as captured); the old item goes when nothing reads it
                current[user] = outs[user.args[1]]
        current[roots[0]] = outs[3]
        current[roots[1]] = outs[4]
        return
    twin = functional_variant(target)
    if twin is None:
        raise _NotLocal(f"{target} has no out-of-place twin")
    if len(roots) != 1:
        raise _NotLocal(f"{target} writes several arguments")
    (written,) = roots
    args, kwargs = _with_defaults(target, twin, node.args, node.kwargs)
    with g.inserting_before(node):
        new = g.create_node("call_function", twin, args, kwargs, name=twin.overloadpacket.__name__)
    copy_node_meta(node, new)
    if isinstance(written, list):
        new.meta["val"] = [w.meta.get("val") for w in written]
        for w, item in zip(written, _getitems(g, node, new, len(written))):
            current[w] = item
    else:
        new.meta["val"] = node.meta.get("val")
        current[written] = new


_SCATTERS = {
    # view op -> its scatter: (parent, new view value, the view's own arguments) -> new parent
    aten.slice.Tensor: aten.slice_scatter.default,
    aten.select.int: aten.select_scatter.default,
    aten.diagonal.default: aten.diagonal_scatter.default,
    aten.as_strided.default: aten.as_strided_scatter.default,
}
_RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim,
                       aten.squeeze.dims, aten.squeeze.default})


def _view_chain(node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(view, its parent) for each view and full alias from ``node`` out to
    the tensor that owns the storage, innermost first."""
    chain = []
    while isinstance(node, fx.Node) and node.op == "call_function" and (
        node.target in ALIAS_OPS - {aten.lift_fresh_copy.default} or _is_inplace_alias(node) or is_view(node)
    ):
        chain.append((node, node.args[0]))
        node = node.args[0]
    return chain


def _scatter_back(g: fx.Graph, node: fx.Node, written: fx.Node, chain: list, root: dict, current: dict) -> None:
    """``node`` wrote ``written``, a view (``chain``: its views out to the
    storage's owner, as captured): give each tensor of the chain its new
    value, the written view's new value scattered into its current value
    (``x[:, 1:] = y`` is ``x = slice_scatter(x, y, 1, 1)``)."""
    value = current[root[written]]
    last = value
    for view, parent in chain:
        parent_now = current.get(root[parent], parent)
        if view.target in ALIAS_OPS or _is_inplace_alias(view):
            new_parent = value
        elif view.target in _SCATTERS:
            with g.inserting_after(last):
                new_parent = g.call_function(_SCATTERS[view.target], (parent_now, value, *view.args[1:]), dict(view.kwargs))
        elif view.target in _RESHAPES:
            parent_val, value_val = parent.meta.get("val"), value.meta.get("val")
            if not isinstance(parent_val, torch.Tensor) or not all(isinstance(d, int) for d in parent_val.shape):
                raise _NotLocal(f"{node.name} wrote a reshaped view of a tensor with symbolic sizes")
            if not isinstance(value_val, torch.Tensor) or not value_val.is_contiguous():
                raise _NotLocal(f"{node.name} wrote a reshaped view with a strided result")
            with g.inserting_after(last):
                new_parent = g.call_function(aten.view.default, (value, list(parent_val.shape)))
        else:
            raise _NotLocal(f"{node.name} wrote through {view.target}, which has no scatter")
        if new_parent is not value:
            copy_node_meta(node, new_parent)
            new_parent.meta["val"] = parent.meta.get("val")
            last = new_parent
        current[root[parent]] = new_parent
        value = new_parent


def _with_defaults(op, twin, args, kwargs):
    """Spell out arguments the in-place op defaults but its twin requires
    (``bernoulli_(x)`` has p=0.5; ``bernoulli.p`` needs p)."""
    args, kwargs = list(args), dict(kwargs)
    for i, (a, b) in enumerate(zip(op._schema.arguments, twin._schema.arguments)):
        if not b.has_default_value() and a.has_default_value():
            if b.kwarg_only:
                kwargs.setdefault(b.name, a.default_value)
            elif i >= len(args):
                args.append(a.default_value)
    return tuple(args), kwargs


def _getitems(g: fx.Graph, like: fx.Node, multi: fx.Node, n: int) -> list[fx.Node]:
    items, last = [], multi
    for i in range(n):
        with g.inserting_after(last):
            item = g.call_function(operator.getitem, (multi, i))
        copy_node_meta(like, item)
        item.meta["val"] = multi.meta["val"][i]
        items.append(item)
        last = item
    return items


def _check_state_outputs(graph: StepGraph, current: dict) -> None:
    """Every written graph input must be returned, with its final value, by
    the output slot of the same identity (capture's contract)."""
    out_index = graph.signature.output_index()
    outs = output_values(graph.gm)
    for node in graph.gm.graph.nodes:
        if node.op != "placeholder" or node not in current:
            continue
        slot = node.meta["slot"]
        i = out_index.get(slot.ident)
        if i is None:
            if slot.role is Role.GRAD:
                continue  # an accumulated gradient the update consumed (cleared after it)
            raise PassError(f"functionalize_graph: the step writes {slot.describe()} but returns no new value for it")
        if outs[i] is not current[node]:
            raise PassError(
                f"functionalize_graph: the value returned for {slot.describe()} ({outs[i]}) is not its final value ({current[node]})"
            )


# -- torch's functionalization --------------------------------------------------


def _torch_functionalize(graph: StepGraph) -> tuple[StepGraph, int]:
    gm = graph.gm
    gm.recompile()
    fake_args = tuple(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")
    new_gm = compat.functionalize_graph_module(gm, fake_args)
    flatten_codegen(new_gm)
    adopt_annotations(new_gm, graph.signature.inputs)
    dropped = _drop_copy_epilogue(new_gm, graph)
    new_gm.graph.lint()
    return graph.replace(gm=new_gm, functional=True), dropped


def _unalias(value):
    while isinstance(value, fx.Node) and value.op == "call_function" and (value.target in ALIAS_OPS or is_view(value)):
        value = value.args[0]
    return value


def _drop_copy_epilogue(gm: fx.GraphModule, graph: StepGraph) -> int:
    """Remove ``copy_(placeholder, v)`` nodes, checking that the output slot
    of the same identity returns ``v`` (up to aliases)."""
    slots_in = graph.signature.inputs
    out_index = graph.signature.output_index()
    outs = output_values(gm)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    slot_of = dict(zip(phs, slots_in))
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy_.default:
            continue
        dst, src = node.args[0], node.args[1]
        if dst not in slot_of:
            continue
        slot = slot_of[dst]
        i = out_index.get(slot.ident)
        if i is None and slot.role is Role.GRAD:
            gm.graph.erase_node(node)  # a consumed gradient accumulator: the write is dead
            dropped += 1
            continue
        if i is None:
            raise PassError(f"functionalize_graph: the step writes {slot.describe()} but returns no new value for it")
        if _unalias(outs[i]) is not _unalias(src):
            raise PassError(
                f"functionalize_graph: the value written into {slot.describe()} ({src}) "
                f"is not the value returned for it ({outs[i]})"
            )
        if node.users:
            node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        dropped += 1
    return dropped
