"""Op kinds, defined once and matched by identity (never by name strings).

Passes ask questions such as "is this node a view?", "which arguments does
this op write?", "is it random?" through these helpers.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

__all__ = [
    "PROFILER_OPS",
    "ASSERT_OPS",
    "ALIAS_OPS",
    "RESHAPE_OPS",
    "ATTENTION_OPS",
    "ATTENTION_BACKWARD_OPS",
    "SAME_DTYPE_OPS",
    "is_op",
    "mutated_arg_indices",
    "is_mutating",
    "written_args",
    "is_random",
    "is_view",
    "is_collective",
    "allocates_nothing",
    "storage_root",
    "result_of_first_arg",
    "dtype_cast",
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

# Run-time checks (a batch check the step's code raises on, captured as an
# assertion): they return nothing, and the step must still fail on a bad batch.
ASSERT_OPS = frozenset({aten._assert_async.msg, aten._assert_async.default, aten._assert_scalar.default})

# Ops that return their input unchanged in a functional graph run under
# no_grad: ``detach`` (autograd bookkeeping), ``alias``, and
# ``lift_fresh_copy`` of a constant nobody mutates.
ALIAS_OPS = frozenset({aten.detach.default, aten.alias.default, aten.lift_fresh_copy.default})

# The ops a tensor is reshaped by, whole: ``view`` and ``_unsafe_view`` alias their input, ``reshape`` may
# copy (a non-contiguous input); the same elements in the same order either way.
RESHAPE_OPS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


def result_of_first_arg(fn):
    """Marks a Python function the runtime puts in graphs whose result is storage its first argument made
    or is (runtime/host_params.py: the fetch's wait, the copy into a host tensor): it allocates nothing."""
    fn.stepfx_result_of_first_arg = True
    return fn

# Matrix products and convolutions: every tensor operand must have one
# dtype. Their fake kernels do not check it (the CPU/CUDA kernels do), so a
# mismatch would first show when the compiled step runs.
SAME_DTYPE_OPS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.linear.default,
        aten.convolution.default,
        aten._convolution.default,
    }
)

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


def _undeclared(node: fx.Node) -> tuple[int, ...]:
    positions = UNDECLARED_MUTATIONS.get(node.target, ())
    # batch norm writes its running statistics only in training mode
    if positions and len(node.args) > 5 and node.args[5] is True:
        return tuple(i for i in positions if i < len(node.args) and node.args[i] is not None)
    return ()


def mutated_arg_indices(node: fx.Node) -> list[int]:
    """Positions of the arguments this op writes in place (schema alias
    info, plus the writes a few ops make without declaring them)."""
    schema = _schema(node)
    if schema is None:
        return []
    hidden = _undeclared(node)
    if hidden:
        return list(hidden)
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
    hidden = _undeclared(node)
    if hidden:
        return [node.args[i] for i in hidden]
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if i < len(node.args):
            out.append(node.args[i])
        elif arg.name in node.kwargs:
            out.append(node.kwargs[arg.name])
    return out


def written_args(node: fx.Node) -> list:
    """What ``node`` writes in place: the inputs a fused kernel was donated
    (``META_DONATED``), and the arguments its schema marks as written (``all_reduce_``)."""
    from .step_graph import META_DONATED

    return [node.args[i] for i in node.meta.get(META_DONATED, ())] + mutated_args(node)


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


def allocates_nothing(node: fx.Node) -> bool:
    """The result is storage something else made: a view, an alias, one
    element of a multi-output op's result, an op that writes its first
    argument in place and returns it (``all_reduce_``), the wait for a
    collective (its result is the collective's buffer), or ``_unsafe_view``
    (a view its schema does not declare: what a matmul's result is reshaped
    by)."""
    if node.op != "call_function":
        return False
    if (node.target in ALIAS_OPS or node.target is operator.getitem
            or getattr(node.target, "stepfx_result_of_first_arg", False)
            or node.target is torch.ops._c10d_functional.wait_tensor.default or is_view(node)
            or node.target is torch.ops.aten._unsafe_view.default):
        return True
    schema = _schema(node)
    returns = schema.returns if schema is not None else ()
    return (len(returns) == 1 and returns[0].alias_info is not None and returns[0].alias_info.is_write
            and bool(schema.arguments) and schema.arguments[0].alias_info is not None
            and schema.arguments[0].alias_info.is_write)


def batch_dependent(nodes) -> set:
    """The nodes among ``nodes`` (in program order) whose values are computed from the batch: its
    placeholders and everything that reads one of them, directly or not."""
    from .signature import Role

    out = set()
    for n in nodes:
        if n.op == "placeholder":
            if getattr(n.meta.get("slot"), "role", None) is Role.BATCH:
                out.add(n)
        elif any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def storage_root(node: fx.Node) -> fx.Node:
    """The node that made the storage ``node``'s value lives in."""
    while allocates_nothing(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


# Ops that write their running-statistics arguments in training mode
# although their schemas do not say so. Functionalization must know them.
UNDECLARED_MUTATIONS = {
    aten.native_batch_norm.default: (3, 4),  # running_mean, running_var (when training)
}
for _name in ("cudnn_batch_norm", "miopen_batch_norm"):
    _packet = getattr(aten, _name, None)
    if _packet is not None:
        UNDECLARED_MUTATIONS[_packet.default] = (3, 4)


def _arg_types(schema) -> tuple:
    return tuple((a.name, str(a.type).replace("(a!)", "").replace("(a)", "")) for a in schema.arguments)


@functools.cache
def functional_variant(op) -> "torch._ops.OpOverload | None":
    """The out-of-place twin of an in-place op (``aten.mul_.Tensor`` ->
    ``aten.mul.Tensor``; ``aten.bernoulli_.float`` -> ``aten.bernoulli.p``):
    the overload of the un-suffixed packet whose arguments have the same
    names and types. None when there is none (the caller falls back)."""
    found = None
    if isinstance(op, torch._ops.OpOverload):
        name = op.overloadpacket.__name__
        if name.endswith("_") and not name.endswith("__"):
            packet = getattr(getattr(torch.ops, op.namespace), name[:-1], None)
            if packet is not None:
                want = _arg_types(op._schema)
                for overload in packet.overloads():
                    candidate = getattr(packet, overload)
                    if _arg_types(candidate._schema) == want:
                        found = candidate
                        break
    return found


def has_side_effect(node: fx.Node) -> bool:
    """Nodes dead-code elimination must keep even when nothing reads them:
    inputs/outputs, in-place writes, random draws (removing an unread
    dropout mask would shift every later draw of the RNG stream),
    collectives (every rank must issue the same sequence) and run-time
    assertions (a bad batch must still fail the step)."""
    if node.op in ("placeholder", "output"):
        return True
    if node.op != "call_function":
        return False
    return (is_mutating(node) or is_random(node) or is_collective(node) or node.target in ASSERT_OPS
            or getattr(node.target, "stepfx_side_effect", False))  # a runtime op that must run unread


def dtype_cast(node: fx.Node) -> "tuple[torch.Tensor, torch.Tensor] | None":
    """(input value, output value) when ``node`` is ``aten._to_copy`` that
    changes only the dtype (same device, strided layout), else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten._to_copy.default or len(node.args) != 1:
        return None
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)):
        return None
    extra = {k: v for k, v in node.kwargs.items() if k != "dtype"}
    if set(extra) - {"layout", "device"} or extra.get("layout", torch.strided) != torch.strided:
        return None
    if extra.get("device", src.device) != src.device or out.shape != src.shape:
        return None
    return src, out



def _attention_kernels(suffixes: tuple[str, ...]) -> frozenset:
    """SDPA's kernel ops with these name suffixes ("": forward, "_backward") that this torch has (by identity)."""
    names = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math",
             "_flash_attention_forward", "_efficient_attention_forward")
    ops = set()
    for name in names:
        for suffix in suffixes:
            op = getattr(getattr(aten, name + suffix, None), "default", None)
            if op is not None:
                ops.add(op)
    return frozenset(ops)


# attention kernels (what recompute_activations keeps saved below its "all" level), and their backward ones
ATTENTION_OPS = _attention_kernels(("", "_backward"))
ATTENTION_BACKWARD_OPS = _attention_kernels(("_backward",))

# what fuse_generic_regions hands to inductor besides pointwise ops and casts: row reductions, and the data
# movement inductor fuses into the pointwise code around it (rotary embeddings' rotate_half and its backward)
GENERIC_REDUCTIONS = frozenset({aten.mean.dim, aten.sum.dim_IntList})
GENERIC_MOVES = frozenset({aten.cat.default, aten.slice_backward.default})


def is_generic_fusible(node: fx.Node) -> bool:
    """A forward or backward op that a generic region (inductor) computes:
    pointwise, a dtype cast, a row reduction or cat / slice_backward, on
    floating-point or boolean tensors, neither random nor with side effects.
    Views are not counted here (they compute nothing)."""
    from .step_graph import META_PHASE, Phase

    if node.op != "call_function" or node.meta.get(META_PHASE) not in (Phase.FORWARD, Phase.BACKWARD):
        return False
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if not (torch.Tag.pointwise in target.tags or target in GENERIC_REDUCTIONS or target in GENERIC_MOVES
            or dtype_cast(node) is not None):
        return False
    if has_side_effect(node) or is_random(node):
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not (val.is_floating_point() or val.dtype == torch.bool):
        return False
    return all(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes)
