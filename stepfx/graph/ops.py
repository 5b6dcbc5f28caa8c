"""Op kinds, defined once and matched by identity (never by name strings).

Passes ask questions such as "is this node a view?", "which arguments does
this op write?", "is it random?" through these helpers.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

__all__ = [
    "PROFILER_OPS",
    "ALIAS_OPS",
    "is_op",
    "mutated_arg_indices",
    "is_mutating",
    "is_random",
    "is_view",
    "is_collective",
    "SYMBOLIC_SCALAR_FUNCTIONS",
]

# Markers the optimizer's record_function wrappers leave in a traced graph.
# They compute nothing; their enter/exit pairing is a side effect only the
# profiler cares about.
PROFILER_OPS = frozenset(
    {
        torch.ops.profiler._record_function_enter.default,
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    }
)

# Ops that return their input unchanged in a functional graph run under
# no_grad: ``detach`` (autograd bookkeeping), ``alias``, and
# ``lift_fresh_copy`` of a constant nobody mutates.
ALIAS_OPS = frozenset({aten.detach.default, aten.alias.default, aten.lift_fresh_copy.default})

# Python-level scalar arithmetic that make_fx records for symbolic scalars
# (learning rate, bias corrections computed from the step counter).
SYMBOLIC_SCALAR_FUNCTIONS = frozenset(
    {
        operator.add,
        operator.sub,
        operator.mul,
        operator.truediv,
        operator.floordiv,
        operator.pow,
        operator.neg,
        operator.mod,
        operator.eq,
        operator.ne,
        operator.lt,
        operator.le,
        operator.gt,
        operator.ge,
    }
)


def is_op(node: fx.Node, *ops) -> bool:
    return node.op == "call_function" and node.target in ops


def _schema(node: fx.Node):
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    return target._schema


def mutated_arg_indices(node: fx.Node) -> list[int]:
    """Positions of the arguments this op writes in place (schema alias info)."""
    schema = _schema(node)
    if schema is None:
        return []
    return [
        i
        for i, arg in enumerate(schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    ]


def mutated_args(node: fx.Node) -> list:
    """The argument values (Nodes) this op writes in place."""
    schema = _schema(node)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if i < len(node.args):
            out.append(node.args[i])
        elif arg.name in node.kwargs:
            out.append(node.kwargs[arg.name])
    return out


def is_mutating(node: fx.Node) -> bool:
    return bool(mutated_arg_indices(node))


def is_random(node: fx.Node) -> bool:
    """Ops that draw from an RNG: removing or reordering them changes results."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.nondeterministic_seeded in target.tags


def is_view(node: fx.Node) -> bool:
    """Ops whose output aliases an input (schema: non-writing alias on output)."""
    schema = _schema(node)
    if schema is None or not schema.returns:
        return False
    ret = schema.returns[0]
    return ret.alias_info is not None and not ret.alias_info.is_write


def is_collective(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return target.namespace in ("_c10d_functional", "c10d_functional")
