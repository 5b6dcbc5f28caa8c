"""fold_causal_masks: an attention mask that is exactly SDPA's causal mask
becomes ``is_causal=True``, forward and backward.

Why: Hugging Face transformers builds an explicit causal mask whenever it
sees tracing (fake tensors, torch.compile) and cannot rule out padding or
packed sequences by reading tensor values — e.g. every causal LM run with
``use_cache=False`` and no attention mask checks its position ids for
packed sequences. Eager, which reads the values, calls SDPA with
``is_causal=True`` and no mask. The mask costs memory and, above all,
time: cuDNN's attention with a bias reads it in every tile and skips no
masked tile (measured on one H200, Llama-3.2-1B shape, 4 x 2048 tokens:
31.8 ms of attention a step with the mask against 12.5 ms causal). And a
mask on the way to SDPA keeps the library from passing grouped-query K/V
unrepeated.

Requires: a functional graph.

Ensures: every SDPA kernel op (cuDNN, memory-efficient, CPU flash; forward
and backward) whose mask argument is a *constant of the shapes* — computed
from ``arange``/``full``/constants and the batch's sizes only, never from
data, parameters or an RNG — and, evaluated, equals SDPA's causal mask
(top-left lower triangle over the last two dims, broadcast over the
others; a float mask 0 there and <= -65504 elsewhere, the value torch
itself gives a boolean mask on cuDNN), reads no mask and has
``is_causal=True``. With symbolic batch sizes the mask is evaluated at the
traced sizes and at three more (every size symbol at 1, 3 and 7, the sizes
it reads evaluated from their expressions), and past the largest integer
constant of its computation (a sliding window is causal below its width:
evaluated at the width + 2, or kept where that mask would be too large to
evaluate); its last two dims must be the query's and key's lengths by their
size expressions. Anything else is left as it was,
with the reason in the summary. The mask's computation is left for
``eliminate_dead_code``.

Before / after::

    mask = aten.expand(bitwise_and_1, [2, -1, 9, 9])          (gone, once nothing reads it)
    where = aten.where.self(mask, zero, minus_inf)
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=where, scale=0.35)
        ->  sdpa = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=0.35)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ... import compat
from ...errors import PassError
from ...graph import StepGraph
from ...graph.build import clone_step_graph
from ...graph.ops import is_random
from ..manager import PassOptions, PassResult

__all__ = ["fold_causal_masks", "attention_ops"]

aten = torch.ops.aten
MASKED_AT_MOST = -65504.0  # what torch's cuDNN path turns a boolean mask's False into
MAX_MASK_ELEMENTS = 1 << 28  # evaluated on the step's device at capture: larger masks are left alone
_TRIAL_SIZES = (1, 3, 7)  # extra sizes a symbolic mask is evaluated at
_SENTINEL = 1 << 31  # integer constants from here up are "to the end" markers (slice's INT64_MAX), not sizes


def attention_ops() -> dict:
    """SDPA kernel op -> (its mask argument's name, whether it is a backward).
    Ops missing from this torch are left out."""
    names = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable")
    out = {}
    for name in names:
        for suffix, backward in (("", False), ("_backward", True)):
            packet = getattr(aten, name + suffix, None)
            op = getattr(packet, "default", None)
            if op is None:
                continue
            args = [a.name for a in op._schema.arguments]
            mask = "attn_bias" if "attn_bias" in args else "attn_mask" if "attn_mask" in args else None
            if mask is not None and "is_causal" in args:
                out[op] = (mask, backward)
    return out


def _position(op, name: str) -> tuple[int, bool]:
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == name:
            return i, arg.kwarg_only
    raise KeyError(name)


def _get(node: fx.Node, name: str, default=None):
    i, kwarg_only = _position(node.target, name)
    if not kwarg_only and i < len(node.args):
        return node.args[i]
    return node.kwargs.get(name, default)


def _set(node: fx.Node, name: str, value) -> None:
    i, kwarg_only = _position(node.target, name)
    if not kwarg_only and i < len(node.args):
        args = list(node.args)
        args[i] = value
        node.args = tuple(args)
    else:  # torch.ops take any argument by its schema name
        node.kwargs = {**node.kwargs, name: value}


def _mask_subgraph(mask: fx.Node) -> tuple[list[fx.Node], list[fx.Node]] | str:
    """(the nodes computing ``mask`` in program order, its size leaves) or why it is not a constant of the shapes."""
    seen: dict[fx.Node, None] = {}
    leaves: dict[fx.Node, None] = {}
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen or node in leaves:
            continue
        if node.op == "call_function" and node.target is aten.sym_size.int:
            leaves[node] = None  # a size of an input: a trial value stands for it
            continue
        if node.op == "placeholder":
            if isinstance(node.meta.get("val"), torch.SymInt):
                leaves[node] = None
                continue
            return f"computed from input {node.name}"
        if node.op == "get_attr":
            seen[node] = None
            continue
        if node.op != "call_function":
            return f"computed by {node.op} {node.name}"
        if is_random(node):
            return f"computed by random op {node.target}"
        seen[node] = None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__), sorted(leaves, key=order.__getitem__)


def _evaluator(root: torch.nn.Module, nodes: list[fx.Node], leaves: list[fx.Node], mask: fx.Node):
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for leaf in leaves:
        env[leaf] = g.placeholder(leaf.name)
    for node in nodes:
        env[node] = g.node_copy(node, lambda n: env[n])
    g.output(env[mask])
    return fx.GraphModule(root, g)


def _is_causal_mask(value: torch.Tensor) -> bool:
    if value.dim() < 2 or value.numel() == 0:
        return False
    lq, lk = value.shape[-2:]
    causal = torch.ones(lq, lk, dtype=torch.bool, device=value.device).tril()
    if value.dtype == torch.bool:
        return bool(torch.equal(value, causal.expand_as(value)))
    if not value.is_floating_point():
        return False
    return bool(((value == 0) == causal).all() and ((value <= MASKED_AT_MOST) == ~causal).all())


def _structure(nodes: list[fx.Node], leaves: list[fx.Node], mask: fx.Node) -> tuple:
    """What a mask's computation is, without its node names: each op with its arguments (other nodes of
    the subgraph by position, leaves as sizes by expression), the result's shape. Masks with the same
    structure (transformers builds one per layer) evaluate alike: evaluated once."""
    index = {leaf: ("leaf", compat.size_expr(leaf.meta["val"])) for leaf in leaves}
    index.update({n: ("node", i) for i, n in enumerate(nodes)})

    def key(a):
        return fx.node.map_arg(a, lambda n: index[n])

    ops = tuple((n.op, str(n.target), repr(key(n.args)), repr(key(n.kwargs))) for n in nodes)
    shape = tuple(str(compat.size_expr(s)) for s in mask.meta["val"].shape)
    return ops, shape, str(mask.meta["val"].dtype), index[mask]


def _why_not_causal(graph: StepGraph, mask: fx.Node, readers: list[fx.Node], ops: dict, evaluated: dict) -> str | None:
    """Why ``mask`` is not SDPA's causal mask for ``readers``, or None; ``evaluated``: verdicts by
    mask structure (one evaluation per distinct computation)."""
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return "not a tensor of at least 2 dims"
    for reader in readers:
        if _get(reader, "is_causal", False) is not False:
            return f"{reader.name} is already causal"
        if ops[reader.target][1]:  # a backward reads the forward's query and key
            if any(u.target is operator.getitem and u.args[1] == 3 and u.users for u in reader.users):
                return f"{reader.name}'s gradient for the mask is read"
            continue
        q, k = _get(reader, "query"), _get(reader, "key")
        qv, kv = q.meta.get("val"), k.meta.get("val")
        # the mask's last two dims are the lengths, not broadcast ones (by expression, so at every size)
        if (compat.size_expr(val.shape[-2]) != compat.size_expr(qv.shape[-2])
                or compat.size_expr(val.shape[-1]) != compat.size_expr(kv.shape[-2])):
            return "its last two dims are not the query's and key's lengths"
    found = _mask_subgraph(mask)
    if isinstance(found, str):
        return found
    nodes, leaves = found
    if any(n.op == "get_attr" for n in nodes):  # a constant's values are not in the structure
        return _evaluate(graph, nodes, leaves, mask, val)
    key = _structure(nodes, leaves, mask)
    if key not in evaluated:
        evaluated[key] = _evaluate(graph, nodes, leaves, mask, val)
    return evaluated[key]


def _at_size_exprs(sizes, leaves: list[fx.Node], size: int) -> list[int]:
    """``sizes`` (ints or SymInts) with every size symbol of ``leaves`` at ``size``."""
    exprs = [compat.size_expr(x) for x in sizes]
    symbols = set().union(*(getattr(compat.size_expr(leaf.meta["val"]), "free_symbols", set()) for leaf in leaves),
                          *(getattr(e, "free_symbols", set()) for e in exprs))
    return [int(e) if isinstance(e, int) else int(e.subs({s: size for s in symbols})) for e in exprs]


def _at_size(leaves: list[fx.Node], size: int) -> list[int]:
    """The leaves' values with every size symbol at ``size``: a leaf is an
    expression of the symbols (a length and that length + 1 are two leaves of
    one symbol), so each is evaluated, never set to ``size`` itself."""
    return _at_size_exprs([leaf.meta["val"] for leaf in leaves], leaves, size)


def _evaluate(graph: StepGraph, nodes: list[fx.Node], leaves: list[fx.Node], mask: fx.Node, val) -> str | None:
    hints = [compat.size_hint(leaf.meta["val"]) for leaf in leaves]
    sizes = list(_TRIAL_SIZES)
    try:
        if leaves:
            # a constant of the computation beyond the trial sizes (a sliding window of 8) could make the mask
            # causal at every size tried and not above it: the mask is evaluated past it too, or kept
            largest = max((abs(x) for n in nodes for x in pytree.tree_leaves((n.args, n.kwargs))
                           if isinstance(x, int) and not isinstance(x, bool) and abs(x) < _SENTINEL), default=0)
            if largest + 2 > max(sizes):
                beyond = largest + 2
                numel = torch.Size(_at_size_exprs(val.shape, leaves, beyond)).numel()
                if numel > MAX_MASK_ELEMENTS:
                    return f"computed with the constant {largest}, beyond the sizes it can be evaluated at"
                sizes.append(beyond)
        trials = [hints] + [_at_size(leaves, size) for size in sizes if leaves]
        module = _evaluator(graph.gm, nodes, leaves, mask)
        for trial in trials:
            shape = [compat.size_hint(s) for s in val.shape] if trial is hints else None
            if shape is not None and torch.Size(shape).numel() > MAX_MASK_ELEMENTS:
                return f"{torch.Size(shape).numel()} elements, more than evaluated at capture"
            with torch.no_grad():
                value = module(*trial)
            if not isinstance(value, torch.Tensor) or not _is_causal_mask(value):
                return "not the causal mask" + (f" at sizes {trial}" if leaves else "")
    except Exception as exc:  # a mask that cannot be evaluated here is kept, never guessed
        return f"could not be evaluated ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    return None


def fold_causal_masks(graph: StepGraph, options: PassOptions) -> PassResult:
    if not graph.functional:
        raise PassError("fold_causal_masks requires a functional graph (run functionalize_graph first)")
    ops = attention_ops()
    readers: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and node.target in ops:
            mask = _get(node, ops[node.target][0])
            if isinstance(mask, fx.Node):
                readers.setdefault(mask, []).append(node)
    if not readers:
        return PassResult(graph, False)
    evaluated: dict = {}  # a mask's structure -> its verdict (one evaluation per distinct computation)
    verdicts = {mask: _why_not_causal(graph, mask, users, ops, evaluated) for mask, users in readers.items()}
    kept = {why for why in verdicts.values() if why is not None}
    folded = [mask for mask, why in verdicts.items() if why is None]
    if not folded:
        return PassResult(graph, False, "masks kept: " + "; ".join(sorted(kept)))
    names = {mask.name for mask in folded}
    graph = clone_step_graph(graph)
    calls = 0
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or node.target not in ops:
            continue
        name, backward = ops[node.target]
        mask = _get(node, name)
        if not isinstance(mask, fx.Node) or mask.name not in names:
            continue
        _set(node, name, None)
        _set(node, "is_causal", True)
        if backward and "grad_input_mask" in [a.name for a in node.target._schema.arguments]:
            wanted = list(_get(node, "grad_input_mask"))
            wanted[3] = False  # no gradient for a mask that is gone (a constant had none to give)
            _set(node, "grad_input_mask", wanted)
        calls += 1
    graph.gm.recompile()
    summary = f"{len(folded)} causal mask(s) folded into is_causal=True ({calls} attention calls)"
    if kept:
        summary += "; kept: " + "; ".join(sorted(kept))
    return PassResult(graph, True, summary)
