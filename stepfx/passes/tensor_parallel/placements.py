"""How a tensor-parallel split travels through a step graph (not a pass).

Both tensor-parallel passes share this: ``plan_tensor_parallel`` tries
candidate splits with it, ``shard_tensor_parallel`` rewrites with the result.

Every value of the joint graph gets a state: replicated (``None``: every
rank of the TP group holds all of it), sharded (:class:`Sharded`: each rank
holds a slice along ``dim``, in ``parts`` fused parts), or partial
(``PARTIAL``: each rank holds a summand; the sum over the group is the
value). Seeds are the split parameters (and their optimizer state); the
rules below say what each op makes of its inputs' states, in graph order:

- pointwise ops keep a split when every split operand is split alike and
  the replicated ones broadcast along that dimension;
- views, transposes, expands move the split dimension (a dimension of
  heads x head size keeps the split on heads);
- ``mm(x split on K, w split on K)`` is partial (the row-parallel product);
  a sum over the split dimension is partial;
- attention is split over heads (q, k and v split on dim 1; k/v with one
  head may stay replicated: multi-query attention, their gradients partial);
  its math path too (with dropout on the CPU): a view merging the batch
  into split heads is split in ``batch`` parts, a ``bmm`` keeps a batch
  split both operands share, a softmax one not along its dimension;
- a random draw shaped like a split value keeps the split
  (``Propagation.draws``: the rewrite draws it whole and slices it);
- a partial value stays partial through views and sums of partials; any
  other reader needs the whole value: an all-reduce goes before it
  (Megatron's g in the forward, f's gradient in the backward);
- over a split vocabulary (rows of an embedding, outputs of an LM head): a
  lookup is partial (each rank finds the tokens it holds), its backward is
  split; a log-softmax over the split dimension, its backward and the
  negative log-likelihood keep the split and are rewritten with a max and
  sums all-reduced over the group (``Propagation.vocab``); the loss is
  partial. The logits are never gathered.

What no rule covers refuses the split (:class:`Refused`, with the op), and
the planner keeps those parameters replicated.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace

import sympy
import torch
import torch.fx as fx

from ... import compat
from ...graph import META_PHASE, Phase, Role

__all__ = ["Sharded", "PARTIAL", "Refused", "Propagation", "propagate", "linear_uses", "LinearUse"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Sharded:
    """Split along ``dim`` over the group, in ``parts`` fused parts.
    ``tokens``: the split is of tokens (sequence parallelism: each rank
    holds a contiguous range of the flattened tokens), not of features."""

    dim: int
    parts: int = 1
    tokens: bool = False
    sizes: tuple[int, ...] | None = None  # the fused parts' whole sizes when they differ (else equal parts)

    def part_sizes(self, whole: int) -> list[int]:
        return list(self.sizes) if self.sizes else [whole // self.parts] * self.parts


PARTIAL = "partial"


class Refused(Exception):
    """A split cannot pass ``node``; ``parts`` suggests a fused split to try instead."""

    def __init__(self, node: fx.Node | None, reason: str, parts: int | None = None,
                 sizes: tuple[int, ...] | None = None):
        super().__init__(reason)
        self.node, self.reason, self.parts, self.sizes = node, reason, parts, sizes

    def describe(self) -> str:
        where = f" at {self.node.name} ({_op_name(self.node)})" if self.node is not None else ""
        return f"{self.reason}{where}"


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


POINTWISE = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.silu.default, aten.silu_backward.default,
    aten.gelu.default, aten.gelu_backward.default, aten.sqrt.default, aten.rsqrt.default, aten.lerp.Scalar,
    aten.lerp.Tensor, aten.addcmul.default, aten.addcdiv.default, aten.pow.Tensor_Scalar, aten.clone.default,
    aten._to_copy.default, aten.tanh.default, aten.tanh_backward.default, aten.sigmoid.default,
    aten.sigmoid_backward.default, aten.exp.default, aten.relu.default, aten.threshold_backward.default,
    aten.where.self, aten.maximum.default, aten.minimum.default, aten.abs.default, aten.sign.default,
    aten.reciprocal.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.masked_fill.Scalar, aten.fill.Scalar, aten.sin.default, aten.cos.default, aten.erf.default,
})
SOFTMAX = frozenset({aten._softmax.default, aten._softmax_backward_data.default}
                    | ({aten._safe_softmax.default} if hasattr(aten, "_safe_softmax") else set()))
# random ops whose result is shaped like their first operand (dropout's mask)
DRAWS = frozenset({aten.bernoulli.p, aten.rand_like.default, aten.randn_like.default})
# a partial value stays partial through these when every tensor operand is partial
_LINEAR_IN_ALL = frozenset({aten.add.Tensor, aten.sub.Tensor})
VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
ATTENTION = frozenset(
    op for op in (
        getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None),
        getattr(aten, "_scaled_dot_product_flash_attention", None),
        getattr(aten, "_scaled_dot_product_efficient_attention", None),
        getattr(aten, "_scaled_dot_product_cudnn_attention", None),
    ) if op is not None for op in [op.default])
ATTENTION_BACKWARD = frozenset(
    op for op in (
        getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None),
        getattr(aten, "_scaled_dot_product_flash_attention_backward", None),
        getattr(aten, "_scaled_dot_product_efficient_attention_backward", None),
        getattr(aten, "_scaled_dot_product_cudnn_attention_backward", None),
    ) if op is not None for op in [op.default])

# sequence parallelism: ops that compute each token on its own (or sum over tokens: partial), so they take
# token-split inputs; and the readers for which a partial value is reduce-scattered rather than all-reduced
_PER_TOKEN = POINTWISE | VIEWS | frozenset({
    aten.t.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.mm.default, aten.addmm.default, aten.sum.dim_IntList, aten.mean.dim, aten.native_layer_norm.default,
    aten.native_layer_norm_backward.default, operator.getitem})
_SCATTER_READERS = POINTWISE | frozenset({aten.native_layer_norm.default, aten.native_layer_norm_backward.default})


def _shape(node) -> tuple | None:
    """The value's sizes: ints, or SymInts for sizes that vary between calls
    (stepfx.dynamic: the tokens). A split dimension is always static."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(val.shape)


def _is(size, n: int) -> bool:
    """Whether a size is statically ``n`` (a symbolic size never is: it varies)."""
    return not compat.is_symbolic(size) and int(size) == n


def divides(size, by: int) -> bool:
    """Whether a size divides by ``by`` at every call: a static one, or a
    symbolic one whose expression is a multiple of ``by`` for every value
    of its symbols (``4*s0`` by 2: a batch of 4 sequences of any length)."""
    if compat.is_symbolic(size):
        return sympy.Mod(compat.size_expr(size), by) == 0
    return int(size) % by == 0


def _same(a, b) -> bool:
    """Equal for every call: the same sympy expression (or the same int)."""
    def expr(x):
        return x if isinstance(x, sympy.Basic) else sympy.sympify(compat.size_expr(x))

    return sympy.expand(expr(a) - expr(b)) == 0


@dataclass
class Propagation:
    """The states of every value, and what the rewrite must add: an
    all-reduce after each partial value for the readers that need it whole,
    and row-parallel ``addmm`` nodes to split into mm, all-reduce, bias add."""

    tp: int
    states: dict = field(default_factory=dict)  # node -> state, or a tuple of states (multi-output)
    reduce: dict = field(default_factory=dict)  # partial node -> [readers needing it whole]
    decompose: set = field(default_factory=set)  # addmm nodes whose product is partial
    constants: set = field(default_factory=set)  # empty get_attr constants concatenated to split values
    vocab: dict = field(default_factory=dict)  # node -> what the rewrite makes of it over a split vocabulary
    lookups: dict = field(default_factory=dict)  # (indices, rows) of a lookup in a split embedding -> the lookup
    # sequence parallelism (``tokens``: the step's token count, None when off): partial values reduce-scattered
    # over the tokens for per-token readers, token-split values gathered for the readers that need them whole,
    # replicated operands sliced to the rank's tokens where they meet token-split ones
    tokens: int | sympy.Expr | None = None  # an expression in the batch's symbols under stepfx.dynamic
    scatter: dict = field(default_factory=dict)  # partial node -> [readers taking its token shard]
    gather: dict = field(default_factory=dict)  # token-split node -> [readers needing it whole]
    slices: dict = field(default_factory=dict)  # reader -> [replicated operands it reads sliced to its tokens]
    reading: dict = field(default_factory=dict)  # while a rule runs: inputs it reads in another state (gathered)
    draws: dict = field(default_factory=dict)  # random draw over a split value -> its state (drawn whole, sliced)
    slices_local: dict = field(default_factory=dict)  # slice (or its backward) of one fused part -> local [start, end)
    fused_parts: dict = field(default_factory=dict)  # (dim, whole size, start, end) -> (the whole's state, local bounds)

    def state(self, value):
        if not isinstance(value, fx.Node):
            return None
        return self.reading[value] if value in self.reading else self.states.get(value)

    def token_dim(self, value: fx.Node) -> int | None:
        """The dimension a token split of ``value`` cuts (the first of more
        than one element, the leading dimensions holding the step's tokens),
        or None when it is not a per-token value or does not divide."""
        if self.tokens is None:
            return None
        shape = _shape(value)
        if not shape or len(shape) < 2:
            return None
        tokens = sympy.sympify(self.tokens)
        count, first = sympy.Integer(1), None
        for d, size in enumerate(shape[:-1]):
            count = sympy.expand(count * compat.size_expr(size))
            if first is None and not _is(size, 1):
                first = d
            if count == tokens:  # the same expression: the same count at every call
                return first if first is not None and divides(shape[first], self.tp) else None
        return None


@dataclass(frozen=True)
class LinearUse:
    """A forward matmul by a parameter: ``out`` = x @ W^T (Linear, weight
    ``t``-ed) or x @ W (Conv1D). ``out_dim`` / ``in_dim``: the weight's
    dimension of output / input features; ``bias``: the bias parameter name."""

    weight: str
    node: fx.Node  # the mm / addmm
    x: fx.Node
    out_dim: int
    in_dim: int
    bias: str | None


def linear_uses(g: fx.Graph) -> dict[str, list[LinearUse]]:
    """Parameter name -> its forward matmul uses. Under bf16/fp16 the
    matmul reads the parameter's compute copy (a dtype cast of it): the
    cast is looked through, and splits with the parameter (pointwise)."""
    params = {n: n.meta["slot"].name for n in g.nodes if n.op == "placeholder" and n.meta["slot"].role is Role.PARAM}

    def param_of(value) -> str | None:
        if isinstance(value, fx.Node) and value.op == "call_function" and value.target is aten._to_copy.default \
                and set(value.kwargs) <= {"dtype"}:
            value = value.args[0]
        return params.get(value) if isinstance(value, fx.Node) else None

    uses: dict[str, list[LinearUse]] = {}
    for node in g.nodes:
        if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
            continue
        if node.meta.get(META_PHASE) is not Phase.FORWARD:
            continue
        x, w = (node.args[0], node.args[1]) if node.target is aten.mm.default else (node.args[1], node.args[2])
        bias = param_of(node.args[0]) if node.target is aten.addmm.default else None
        if isinstance(w, fx.Node) and w.target is aten.t.default and param_of(w.args[0]):
            name = param_of(w.args[0])
            uses.setdefault(name, []).append(LinearUse(name, node, x, 0, 1, bias))
        elif param_of(w):
            uses.setdefault(param_of(w), []).append(LinearUse(param_of(w), node, x, 1, 0, bias))
    return uses


def propagate(g: fx.Graph, seeds: dict[str, Sharded], tp: int, outputs, tokens: int | None = None) -> Propagation:
    """States of every node for parameters split as ``seeds`` (name ->
    Sharded of the parameter); ``outputs``: the signature's output slots;
    ``tokens``: the step's token count, for sequence parallelism (None:
    off). Raises :class:`Refused`."""
    prop = Propagation(tp, tokens=tokens)
    for node in g.nodes:
        if node.op == "placeholder":
            prop.states[node] = _placeholder(node, seeds, tp)
        elif node.op == "get_attr":
            prop.states[node] = None
        elif node.op == "call_function":
            ins = [a for a in node.all_input_nodes]
            _gathered_inputs(node, prop)
            if node.target is aten.embedding_dense_backward.default and (node.args[1], node.args[2]) in prop.lookups:
                prop.states[node] = _lookup_backward(node, prop)
            elif all(prop.state(a) is None for a in ins):
                prop.states[node] = None
            else:
                prop.states[node] = _rule(node, prop, tp)
            prop.reading.clear()
        elif node.op == "output":
            _output(node, prop, seeds, outputs)
    return prop


def _placeholder(node: fx.Node, seeds: dict[str, Sharded], tp: int):
    slot = node.meta["slot"]
    seed = seeds.get(slot.name)
    if seed is None or slot.role not in (Role.PARAM, Role.OPTIMIZER_STATE, Role.GRAD):
        return None
    shape = _shape(node)
    # a gradient accumulated over micro-steps is split as its parameter (the rank holds its shard)
    if slot.role is Role.OPTIMIZER_STATE and (shape is None or len(shape) <= seed.dim):
        return None  # a step counter
    if any(size % tp for size in seed.part_sizes(shape[seed.dim])) or shape[seed.dim] % (seed.parts * tp) and not seed.sizes:
        raise Refused(node, f"{slot.name}: dimension {seed.dim} ({shape[seed.dim]}) is not divisible by "
                      f"{seed.parts} part(s) x {tp} ranks")
    return seed


def _output(node: fx.Node, prop: Propagation, seeds: dict[str, Sharded], slots) -> None:
    for i, value in enumerate(node.args[0]):
        state = prop.state(value)
        slot = slots[i] if slots is not None else None
        if state is None:
            if slot is not None and slot.role in (Role.PARAM, Role.GRAD) and slot.name in seeds:
                raise Refused(value if isinstance(value, fx.Node) else None,
                              f"{slot.describe()} of a split parameter comes out whole")
            continue
        if state == PARTIAL:
            prop.reduce.setdefault(value, []).append(node)
            continue
        if slot is None or slot.role not in (Role.PARAM, Role.OPTIMIZER_STATE, Role.GRAD) or seeds.get(slot.name) != state:
            what = slot.describe() if slot is not None else f"output #{i}"
            raise Refused(value, f"a split value is returned as {what}")


def _whole(prop: Propagation, node: fx.Node, value):
    """The state ``node`` reads ``value`` in when it needs it replicated or
    split: a partial value is all-reduced first; under sequence
    parallelism, reduce-scattered over the tokens for a per-token reader."""
    state = prop.state(value)
    if state == PARTIAL:
        dim = prop.token_dim(value) if node.op == "call_function" and node.target in _SCATTER_READERS else None
        if dim is not None:
            prop.scatter.setdefault(value, []).append(node)
            return Sharded(dim, tokens=True)
        prop.reduce.setdefault(value, []).append(node)
        return None
    return state


def _gathered_inputs(node: fx.Node, prop: Propagation) -> None:
    """Under sequence parallelism: the token-split inputs ``node`` cannot
    take are gathered for it (an op that mixes tokens, or one that also
    reads a value split by features)."""
    if prop.tokens is None:
        return
    split = {a: prop.state(a) for a in node.all_input_nodes}
    by_tokens = [a for a, s in split.items() if isinstance(s, Sharded) and s.tokens]
    if not by_tokens:
        return
    by_features = any(isinstance(s, Sharded) and not s.tokens for s in split.values())
    moves = node.target in (aten.t.default, aten.transpose.int, aten.permute.default) \
        and _permute(node, prop).dim != split[node.args[0]].dim  # the tokens would leave the leading dimensions
    if node.target in _PER_TOKEN and not by_features and not moves:
        return
    for a in by_tokens:
        prop.gather.setdefault(a, []).append(node)
        prop.reading[a] = None


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.args if isinstance(a, fx.Node)] + [a for a in node.kwargs.values() if isinstance(a, fx.Node)]


def _rule(node: fx.Node, prop: Propagation, tp: int):
    target = node.target
    if target is operator.getitem:
        src, i = node.args
        state = prop.state(src)
        return state[i] if isinstance(state, tuple) else state
    if target in VIEWS:
        return _view(node, prop, tp)
    if target in (aten.t.default, aten.transpose.int, aten.permute.default):
        return _permute(node, prop)
    if target in (aten.unsqueeze.default, aten.squeeze.dim):
        return _squeeze(node, prop)
    if target is aten.expand.default:
        state = _whole(prop, node, node.args[0])
        if state is None:
            return None
        return replace(state, dim=state.dim + len(node.args[1]) - len(_shape(node.args[0])))
    if target in (aten.mm.default, aten.addmm.default):
        return _mm(node, prop)
    if target is aten.bmm.default:
        return _bmm(node, prop)
    if target in SOFTMAX:
        return _softmax(node, prop)
    if target in DRAWS:
        return _draw(node, prop)
    if target in POINTWISE:
        return _pointwise(node, prop, tp)
    if target in (aten.sum.dim_IntList, aten.mean.dim):
        return _reduction(node, prop)
    if target in (aten.split.Tensor, aten.split_with_sizes.default):
        return _split(node, prop, tp)
    if target is aten.cat.default:
        return _cat(node, prop, tp)
    if target is aten.slice.Tensor:
        return _slice(node, prop, tp)
    if target is aten.slice_backward.default:
        state = _whole(prop, node, node.args[0])
        if state is not None and state.dim == node.args[2] % len(node.args[1]):
            whole = node.args[1][state.dim]
            fused = prop.fused_parts.get((node.args[2] % len(node.args[1]), whole,
                                          *_slice_bounds(node.args[3], node.args[4], whole)))
            if fused is None or state.parts != 1:
                raise Refused(node, "a slice along the split dimension")
            whole_state, local = fused  # the gradient of one fused part, placed in the rank's share of the whole
            prop.slices_local[node] = local
            return whole_state
        return state
    if target is aten.native_layer_norm.default:
        return _layer_norm(node, prop, backward=False)
    if target is aten.native_layer_norm_backward.default:
        return _layer_norm(node, prop, backward=True)
    if target is aten._log_softmax.default:
        return _log_softmax(node, prop)
    if target is aten._log_softmax_backward_data.default:
        return _log_softmax_backward(node, prop)
    if target is aten.nll_loss_forward.default:
        return _nll_loss(node, prop, backward=False)
    if target is aten.nll_loss_backward.default:
        return _nll_loss(node, prop, backward=True)
    if target is aten.embedding.default:
        return _lookup(node, prop)
    if target in ATTENTION:
        return _attention(node, prop, backward=False)
    if target in ATTENTION_BACKWARD:
        return _attention(node, prop, backward=True)
    # no rule: partial inputs are reduced; a split input refuses
    for a in _tensor_args(node):
        if _whole(prop, node, a) is not None:
            raise Refused(node, "no tensor-parallel rule for this op")
    return None


def _view(node: fx.Node, prop: Propagation, tp: int):
    src = node.args[0]
    state = prop.state(src)
    if state is None or state == PARTIAL:
        return state
    a, b = _shape(src), _shape(node)
    groups = _view_groups(a, b)
    if groups is None:
        raise Refused(node, "a view that does not regroup dimensions")
    for ins, outs in groups:
        if state.dim in ins:
            ins = [d for d in ins if not _is(a[d], 1)]  # size-1 dimensions carry nothing
            outs = [d for d in outs if not _is(b[d], 1)]
            if len(ins) > 1 and state.dim != ins[0] or len(outs) > 1 and state.parts > 1 and not state.sizes:
                return _regrouped(node, state, [a[d] for d in ins[:ins.index(state.dim)]], [b[d] for d in outs],
                                  outs, tp)
            if state.sizes and not _same(b[outs[0]], a[state.dim]):
                raise Refused(node, f"a view regrouping the fused parts {list(state.sizes)} of the split dimension")
            if not state.sizes and not divides(b[outs[0]], state.parts * tp):
                raise Refused(node, f"the split dimension becomes {[b[o] for o in outs]}: "
                              f"{b[outs[0]]} not divisible by {state.parts} part(s) x {tp}")
            return replace(state, dim=outs[0])
    raise Refused(node, "lost track of the split dimension")


def _regrouped(node: fx.Node, state: Sharded, outer: list, sizes: list, outs: list, tp: int) -> Sharded:
    """A view that merges the split dimension into outer ones (``outer``:
    their sizes; attention's [batch, heads, ...] -> [batch x heads, ...]),
    or splits a dimension of fused parts: the group's elements are ``P``
    parts (the state's parts times the outer sizes), each cut into ``tp``
    equal ranges. In the output the split is on the first dimension ``k``
    of ``sizes`` where the sizes before it (``c``) count whole parts and
    ``P / c`` parts x ``tp`` ranges divide ``sizes[k]``: each rank then
    holds, for every index before ``k``, its range of each of those parts."""
    shown = f"a view {list(_shape(node.args[0]))} -> {list(_shape(node))}"
    if state.tokens or state.sizes or any(compat.is_symbolic(x) for x in outer):
        raise Refused(node, f"{shown} merging the split dimension {state.dim} into an outer one")
    parts = state.parts
    for x in outer:
        parts *= int(x)
    before = 1
    for k, size in enumerate(sizes):
        if parts % before:
            break
        if divides(size, parts // before * tp):
            return replace(state, dim=outs[k], parts=parts // before)
        if compat.is_symbolic(size):
            break
        before *= int(size)
    raise Refused(node, f"{shown}: its {parts} part(s) of the split dimension do not regroup into {list(sizes)} "
                  f"over {tp} ranks")


def _view_groups(a, b):
    """Pairs (input dims, output dims) of equal products, in order (size-1
    dims attached to a neighbour), or None."""
    # grouped by the sizes of the call traced (a symbolic size's hint), each group's products then checked
    # equal as expressions: a view that regroups dimensions only for some sizes is no regrouping
    ha, hb = [compat.size_hint(x) for x in a], [compat.size_hint(x) for x in b]
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        ins, outs = [], []
        pa = pb = 1
        if i < len(a):
            ins.append(i); pa *= ha[i]; i += 1
        if j < len(b):
            outs.append(j); pb *= hb[j]; j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                ins.append(i); pa *= ha[i]; i += 1
            elif pb < pa and j < len(b):
                outs.append(j); pb *= hb[j]; j += 1
            else:
                return None
        if not _same(sympy.Mul(*[compat.size_expr(a[d]) for d in ins]),
                     sympy.Mul(*[compat.size_expr(b[d]) for d in outs])):
            return None
        groups.append((ins, outs))
    return groups


def _permute(node: fx.Node, prop: Propagation):
    src = node.args[0]
    state = prop.state(src)
    if state is None or state == PARTIAL:
        return state
    n = len(_shape(src))
    if node.target is aten.t.default:
        order = [1, 0] if n == 2 else [0]
    elif node.target is aten.transpose.int:
        order = list(range(n))
        d0, d1 = node.args[1] % n, node.args[2] % n
        order[d0], order[d1] = order[d1], order[d0]
    else:
        order = [d % n for d in node.args[1]]
    return replace(state, dim=order.index(state.dim))


def _squeeze(node: fx.Node, prop: Propagation):
    src = node.args[0]
    state = prop.state(src)
    if state is None or state == PARTIAL:
        return _whole(prop, node, src)
    n = len(_shape(src))
    if node.target is aten.unsqueeze.default:
        d = node.args[1] % (n + 1)
        return replace(state, dim=state.dim + (1 if d <= state.dim else 0))
    d = node.args[1] % n
    if d == state.dim:
        raise Refused(node, "a squeeze of the split dimension")
    return replace(state, dim=state.dim - (1 if d < state.dim else 0))


def _mm(node: fx.Node, prop: Propagation):
    x, w = (node.args[0], node.args[1]) if node.target is aten.mm.default else (node.args[1], node.args[2])
    sx, sw = _whole(prop, node, x), _whole(prop, node, w)
    if sx is None and sw is None:
        result = None
    elif sx is None and sw.dim == 1:
        result = replace(sw, dim=1)
    elif sw is None and sx.dim == 0:
        result = replace(sx, dim=0)
    elif sx is not None and sw is not None and sx.dim == 1 and sw.dim == 0 and sx.parts == sw.parts:
        result = PARTIAL
    elif (sx is None and sw.tokens and sw.dim == 0) or (sw is None and sx.tokens and sx.dim == 1):
        # a sum over tokens with one side whole: that side's columns (rows) of this rank's tokens, partial
        whole, dim = (x, 1) if sx is None else (w, 0)
        prop.slices.setdefault(node, []).append((whole, dim))
        result = PARTIAL
    else:
        raise Refused(node, f"a matmul of operands split as {sx} and {sw}")
    if node.target is aten.addmm.default:
        sb = _whole(prop, node, node.args[0])
        bias_shape = _shape(node.args[0])
        if result == PARTIAL:
            if sb is not None:
                raise Refused(node, "a split bias added to a row-parallel product")
            prop.decompose.add(node)
            dim = prop.token_dim(node)
            if dim is not None:  # sequence parallelism: reduce-scattered, the bias added to the rank's tokens
                return Sharded(dim, tokens=True)
            return None  # the rewrite reduces the product before adding the bias
        if isinstance(result, Sharded) and result.tokens:  # rows of the rank's tokens: the bias broadcasts
            if sb is not None:
                raise Refused(node, "a split bias added to the rank's tokens")
        elif isinstance(result, Sharded):
            out_dim = result.dim - (2 - len(bias_shape))
            if bias_shape and not _is(bias_shape[-1], 1) and (sb is None or sb.dim != out_dim or sb.parts != result.parts):
                raise Refused(node, "a replicated bias added to a split product")
        elif sb is not None:
            raise Refused(node, "a split bias added to a replicated product")
    return result


def _bmm(node: fx.Node, prop: Propagation):
    """A batched matmul whose batch dimension both operands split alike (the
    math path of attention: [batch x heads, ...] split on heads) keeps it."""
    x, y = node.args[:2]
    sx, sy = _whole(prop, node, x), _whole(prop, node, y)
    if sx is None and sy is None:
        return None
    if sx == sy and sx.dim == 0 and not sx.tokens:
        return sx
    raise Refused(node, f"a batched matmul of operands split as {sx} and {sy}")


def _softmax(node: fx.Node, prop: Propagation):
    """A softmax (or its backward) along a dimension that is not split."""
    tensors = [a for a in node.args[:2] if isinstance(a, fx.Node)] if node.target is aten._softmax_backward_data.default \
        else [node.args[0]]
    dim = node.args[2] if node.target is aten._softmax_backward_data.default else node.args[1]
    states = {_whole(prop, node, a) for a in tensors}
    if len(states) != 1:
        raise Refused(node, f"a softmax of operands split as {sorted(map(str, states))}")
    state = states.pop()
    if state is not None and state.dim == dim % len(_shape(node)):
        raise Refused(node, "a softmax along the split dimension")
    return state


def _draw(node: fx.Node, prop: Propagation):
    """Random numbers shaped like a split value (dropout's mask): each rank
    draws them for the whole value, as the single process does, and keeps
    its slice (the rewrite), so the ranks' slices are the reference's draw
    and differ from rank to rank."""
    state = _whole(prop, node, node.args[0])
    if isinstance(state, Sharded):
        if state.tokens:
            raise Refused(node, "random numbers drawn over the rank's tokens")
        prop.draws[node] = state
    return state


def _pointwise(node: fx.Node, prop: Propagation, tp: int):
    out_shape = _shape(node)
    tensors = [a for a in _tensor_args(node) if _shape(a) is not None]  # scalars computed in the graph broadcast
    states = [prop.state(a) for a in tensors]
    if PARTIAL in states:
        if node.target in _LINEAR_IN_ALL and all(s == PARTIAL for s in states) and len(states) == 2:
            return PARTIAL
        states = [_whole(prop, node, a) for a in tensors]
    split = None
    for a, s in zip(tensors, states):
        if s is None:
            continue
        dim = s.dim + len(out_shape) - len(_shape(a))
        here = replace(s, dim=dim)
        if split is not None and here != split:
            raise Refused(node, f"operands split differently ({split} and {here})")
        split = here
    if split is None:
        return None
    for a, s in zip(tensors, states):
        if s is None:
            shape = _shape(a)
            dim = split.dim - (len(out_shape) - len(shape))
            if dim >= 0 and not _is(shape[dim], 1):
                if split.tokens:  # this rank's tokens of it: a slice, no communication
                    prop.slices.setdefault(node, []).append((a, dim))
                    continue
                raise Refused(node, f"a replicated operand ({a.name}) meets a split one along the split dimension")
    return split


def _reduction(node: fx.Node, prop: Propagation):
    src = node.args[0]
    state = _whole(prop, node, src)
    if state is None:
        return None
    n = len(_shape(src))
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(n))
    dims = sorted(d % n for d in dims)
    keep = (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if state.dim in dims:
        if node.target is aten.mean.dim:
            raise Refused(node, "a mean over the split dimension")
        if state.parts != 1:
            raise Refused(node, "a sum over fused parts")
        return PARTIAL
    return replace(state, dim=state.dim - (0 if keep else sum(1 for d in dims if d < state.dim)))


def _split(node: fx.Node, prop: Propagation, tp: int):
    src = node.args[0]
    state = _whole(prop, node, src)
    if state is None:
        return None
    shape = _shape(src)
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(shape)
    outs = [tuple(v.shape) for v in node.meta["val"]]
    if dim != state.dim:
        return tuple(state for _ in outs)
    sizes = [o[dim] for o in outs]
    if any(compat.is_symbolic(x) for x in sizes):
        raise Refused(node, "a split of the split dimension into symbolic sizes")
    sizes = [int(x) for x in sizes]
    if len(set(sizes)) == 1 and len(sizes) == state.parts:
        if sizes[0] % tp:
            raise Refused(node, f"fused parts of {sizes[0]} are not divisible by {tp}")
        return tuple(Sharded(dim, 1) for _ in outs)
    hint = len(sizes) if len(set(sizes)) == 1 and state.parts == 1 else None
    raise Refused(node, f"a split of the split dimension into {sizes}", parts=hint)


def _cat(node: fx.Node, prop: Propagation, tp: int):
    tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    n = len(_shape(node))
    dim %= n
    states = [_whole(prop, node, t) for t in tensors]
    split = next(s for s in states if s is not None)
    for t, s in zip(tensors, states):
        if s is None:
            if len(_shape(t)) == 1 and _is(_shape(t)[0], 0):
                continue  # cat skips a 1-D empty tensor (legacy): nothing to make local
            if t.op == "get_attr" and any(_is(x, 0) for x in _shape(t)) and split.dim != dim:
                prop.constants.add(t)  # an empty cache: made again at the local size
                continue
            raise Refused(node, f"a replicated value ({t.name}) concatenated to a split one")
        if s.dim != split.dim or s.parts != 1 and s.dim == dim:
            raise Refused(node, "values split differently concatenated")
    if split.dim == dim:
        sizes = [_shape(t)[dim] for t in tensors]
        if not all(_same(x, sizes[0]) for x in sizes) or split.parts != 1:
            raise Refused(node, "a concatenation along the split dimension of unequal parts")
        return Sharded(dim, len(tensors))
    return split


def _attention(node: fx.Node, prop: Propagation, *, backward: bool):
    """Heads are dimension 1 of q, k, v ([batch, heads, length, head size]).
    K/V with a single head may stay replicated (multi-query): each rank's
    query heads read it; its gradient is then a partial sum over ranks.
    Replicated K/V with as many heads as the queries (repeated from fewer)
    are sliced to the rank's heads; their gradients are the rank's heads'
    (the sum back over the copies then makes the grouped K/V's partial)."""
    if backward:
        grad_out, q, k, v = node.args[:4]
        rest = [a for a in node.args[4:] if isinstance(a, fx.Node)]
    else:
        q, k, v = node.args[:3]
        grad_out, rest = None, []
    sq, sk, sv = (_whole(prop, node, a) for a in (q, k, v))
    heads = Sharded(1)
    if sq != heads:
        raise Refused(node, f"attention with queries split as {sq}")
    kv_whole = sk is None and sv is None and _is(_shape(k)[1], 1) and _is(_shape(v)[1], 1)
    if not kv_whole:
        for a, s in dict.fromkeys(((k, sk), (v, sv))):
            if s is None and _same(_shape(a)[1], _shape(q)[1]):
                # K/V repeated over every query head (grouped heads fewer than the ranks, repeated by the model
                # or kept repeated for the backward): each rank reads its query heads' copies, a slice
                prop.slices.setdefault(node, []).append((a, 1))
            elif s != heads:
                raise Refused(node, f"attention with keys/values split as {sk}, {sv}")
    for a in rest + ([grad_out] if grad_out is not None else []) + [node.kwargs.get("attn_mask")]:
        if not isinstance(a, fx.Node):
            continue
        s = _whole(prop, node, a)
        shape = _shape(a)
        if s is None and shape is not None and len(shape) >= 2 and not _is(shape[1], 1) and a.op != "placeholder":
            # a mask or saved value over all heads: would need slicing
            if len(shape) >= 3:
                raise Refused(node, f"attention reads {a.name} over all heads")
    dropout = node.args[3] if not backward and len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    if isinstance(dropout, float) and dropout > 0:
        raise Refused(node, "attention dropout draws over all heads")
    vals = node.meta["val"]
    q_heads = _shape(q)[1]
    if backward:
        kv_state = None if kv_whole else heads
        out = []
        for i, v_ in enumerate(vals):
            if i == 0:
                out.append(heads)
            elif i in (1, 2) and v_ is not None:
                out.append(PARTIAL if kv_state is None else heads)
            else:
                out.append(None)
        return tuple(out)
    out = []
    for v_ in vals:
        ok = isinstance(v_, torch.Tensor) and v_.dim() >= 3 and _same(v_.shape[1], q_heads)
        out.append(heads if ok else None)
    return tuple(out)


# -- over a split vocabulary -------------------------------------------------------------------------------


def _log_softmax(node: fx.Node, prop: Propagation):
    """A log-softmax along the split dimension: each rank normalizes its
    slice with the group's max and sum (the rewrite all-reduces both)."""
    src, dim = node.args[0], node.args[1]
    state = _whole(prop, node, src)
    if state is None:
        return None
    if state.dim == dim % len(_shape(src)):
        if state.parts != 1:
            raise Refused(node, "a softmax over fused parts")
        prop.vocab[node] = "log_softmax"
    return state


def _log_softmax_backward(node: fx.Node, prop: Propagation):
    grad, out, dim = node.args[:3]
    sg, so = _whole(prop, node, grad), _whole(prop, node, out)
    if sg != so:
        raise Refused(node, f"a log-softmax backward with operands split as {sg} and {so}")
    if sg is not None and sg.dim == dim % len(_shape(grad)):
        prop.vocab[node] = "log_softmax_backward"
    return sg


def _nll_loss(node: fx.Node, prop: Propagation, *, backward: bool):
    """The negative log-likelihood of log-probabilities split over classes
    (dim 1 of [tokens, classes]): each rank picks the targets it holds; the
    loss is partial, its gradient split like the log-probabilities."""
    logp = node.args[1] if backward else node.args[0]
    target, weight = (node.args[2], node.args[3]) if backward else (node.args[1], node.args[2])
    others = [node.args[0], node.args[6]] if backward else []
    state = _whole(prop, node, logp)
    if any(_whole(prop, node, a) is not None for a in [target, weight, *others] if isinstance(a, fx.Node)):
        raise Refused(node, "a negative log-likelihood with split targets, weights or gradient")
    if state is None:
        return None
    if weight is not None:
        raise Refused(node, "class weights over a split vocabulary")
    if len(_shape(logp)) != 2 or state.dim != 1 or state.parts != 1:
        raise Refused(node, f"a negative log-likelihood of {list(_shape(logp))} log-probabilities split as {state}")
    prop.vocab[node] = "nll_loss_backward" if backward else "nll_loss"
    return state if backward else (PARTIAL, None)


def _lookup(node: fx.Node, prop: Propagation):
    """An embedding lookup in a table split by rows: each rank finds the
    tokens it holds (zeros for the rest), so the result is partial."""
    weight, indices = node.args[:2]
    state = _whole(prop, node, weight)
    if _whole(prop, node, indices) is not None:
        raise Refused(node, "an embedding lookup with split indices")
    if state is None:
        return None
    scale = node.args[3] if len(node.args) > 3 else node.kwargs.get("scale_grad_by_freq", False)
    sparse = node.args[4] if len(node.args) > 4 else node.kwargs.get("sparse", False)
    if state.dim != 0 or state.parts != 1 or scale or sparse:
        raise Refused(node, "an embedding split other than by rows, or with scale_grad_by_freq or sparse gradients")
    prop.vocab[node] = "embedding"
    prop.lookups[(indices, _shape(weight)[0])] = node
    return PARTIAL


def _lookup_backward(node: fx.Node, prop: Propagation):
    """The table's gradient of a lookup in a split table: each rank scatters
    the rows it holds."""
    if _whole(prop, node, node.args[0]) is not None:
        raise Refused(node, "an embedding backward with a split gradient")
    prop.vocab[node] = "embedding_backward"
    return Sharded(0)


# -- sequence parallelism ------------------------------------------------------------------------------------


def _layer_norm(node: fx.Node, prop: Propagation, *, backward: bool):
    """A layer norm of token-split rows (normalized over the last
    dimensions, which the split is not in) is per token; backward, the
    weight's and bias's gradients sum over the tokens: partial. Where some
    operands are token-split and others whole (the first block's norm reads
    the whole embedding, its input gradient arrives reduce-scattered), the
    whole ones are sliced to the rank's tokens."""
    x = node.args[1] if backward else node.args[0]
    normalized = node.args[2] if backward else node.args[1]
    operands = [a for a in ([node.args[0], x, *node.args[3:5]] if backward else [x]) if isinstance(a, fx.Node)]
    weights = [a for a in (node.args[5:7] if backward else node.args[2:4]) if isinstance(a, fx.Node)]
    if any(_whole(prop, node, a) is not None for a in weights):
        raise Refused(node, "a layer norm with a split weight or bias")
    states = {a: _whole(prop, node, a) for a in operands}
    split = [s for s in states.values() if s is not None]
    if not split:
        return None  # every input whole (partial ones all-reduced)
    state = split[0]
    if not state.tokens or state.dim >= len(_shape(x)) - len(normalized) or any(s != state for s in split):
        raise Refused(node, f"a layer norm of operands split as {sorted(set(map(str, split)))}")
    for a, other in states.items():
        if other is None:
            if not divides(_shape(a)[state.dim], prop.tp):
                raise Refused(node, "a layer norm's whole operand that does not divide into the ranks' tokens")
            prop.slices.setdefault(node, []).append((a, state.dim))  # this rank's tokens of it
    if backward:
        return (state, PARTIAL, PARTIAL)
    return (state, state, state)



# -- fused weights of unequal parts ----------------------------------------------------------------------------


def _slice(node: fx.Node, prop: Propagation, tp: int):
    """A slice along the split dimension that takes one whole fused part (a
    fused q/k/v of unequal parts: Phi-3's qkv_proj) is that part, split; the
    rewrite slices the rank's share of it (``Propagation.slices_local``)."""
    src = node.args[0]
    state = _whole(prop, node, src)
    shape = _shape(src)
    dim = node.args[1] % len(shape) if len(node.args) > 1 else 0
    if state is None or state.dim != dim:
        return state
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else shape[dim]
    step = node.args[4] if len(node.args) > 4 else 1
    whole = shape[dim]
    if not all(isinstance(x, int) for x in (start, end, whole)) or step != 1:
        raise Refused(node, "a slice along the split dimension")
    start, end = _slice_bounds(start, end, whole)
    if state.parts > 1:
        sizes = state.part_sizes(whole)
        bounds = [sum(sizes[:p]) for p in range(len(sizes) + 1)]
        if start in bounds and end in bounds and bounds.index(end) == bounds.index(start) + 1:
            part = bounds.index(start)
            local = [size // tp for size in sizes]
            prop.slices_local[node] = (sum(local[:part]), sum(local[:part + 1]))
            prop.fused_parts[(dim, whole, start, end)] = (state, prop.slices_local[node])
            return Sharded(dim)
        raise Refused(node, "a slice across the fused parts of the split dimension")
    # a fused weight seen whole: the slices of the value that tile it are its parts
    cuts = sorted({(u.args[2] if len(u.args) > 2 else 0, u.args[3] if len(u.args) > 3 else whole)
                   for u in src.users if u.target is aten.slice.Tensor and len(u.args) > 1
                   and u.args[1] % len(shape) == dim})
    cuts = [_slice_bounds(a, b, whole) for a, b in cuts if isinstance(a, int) and isinstance(b, int)]
    tiles = len(cuts) > 1 and cuts[0][0] == 0 and cuts[-1][1] == whole and all(
        cuts[i][1] == cuts[i + 1][0] for i in range(len(cuts) - 1))
    sizes = tuple(b - a for a, b in cuts) if tiles else None
    raise Refused(node, "a slice along the split dimension", parts=len(sizes) if sizes else None, sizes=sizes)


def _slice_bounds(start, end, whole):
    """A slice's [start, end) as aten reads it (negative from the end, clamped to the size); symbolic ones as given."""
    if not all(isinstance(x, int) for x in (start, end, whole)):
        return start, end
    return max(0, start + whole if start < 0 else start), min(whole, end + whole if end < 0 else end)
