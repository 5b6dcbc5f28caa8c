"""functionalize_graph: in-place updates become out-of-place ops.

Requires: a captured step graph (``functional`` False) whose outputs hold
the final value of every input it writes (capture guarantees this for
parameters, buffers, gradients and optimizer state, and rejects writes into
anything else).

Ensures: ``functional`` True — no node writes a graph input or constant;
views stay views (materializing them would change matmul operand layouts
and so the numbers). Node phases, sources and annotations carry over.

Before / after::

    mul_ = aten.mul_.Tensor(s_w_exp_avg_sq, 0.999)       ->  mul = aten.mul.Tensor(s_w_exp_avg_sq, 0.999)
    addcmul_ = aten.addcmul_(mul_, g, g, value=0.001)    ->  addcmul = aten.addcmul(mul, g, g, value=0.001)
    return (..., addcmul_)                               ->  return (..., addcmul)

torch's functionalization appends ``copy_(input, new_value)`` for each
written input; the output already returns ``new_value``, so those copies are
dropped here (checked one by one).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import compat
from ..errors import PassError
from ..graph import StepGraph, output_values
from ..graph.build import adopt_annotations, flatten_codegen, label_params
from ..graph.ops import ALIAS_OPS, is_view
from .manager import PassOptions, PassResult

__all__ = ["functionalize_graph"]

aten = torch.ops.aten


def functionalize_graph(graph: StepGraph, options: PassOptions) -> PassResult:
    if graph.functional:
        return PassResult(graph, False)
    gm = graph.gm
    fake_args = tuple(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")
    new_gm = compat.functionalize_graph_module(gm, fake_args)
    flatten_codegen(new_gm)
    adopt_annotations(new_gm, graph.signature.inputs)
    dropped = _drop_copy_epilogue(new_gm, graph)
    new_gm.graph.lint()
    new_gm.recompile()
    result = graph.replace(gm=new_gm, functional=True)
    label_params(result)
    before = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    after = sum(1 for n in new_gm.graph.nodes if n.op == "call_function")
    return PassResult(result, True, f"{dropped} input writes turned into outputs; {before} -> {after} ops")


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
