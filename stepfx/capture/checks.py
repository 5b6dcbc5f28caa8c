"""Checks on a freshly captured step graph: what cannot be replayed.

- writes into a batch tensor, a learning rate, or a tensor the graph holds
  as a constant (a global, an unregistered module attribute) are refused
  with the op and the user's source line;
- ``.item()`` values that only Python saw are warned about (they ran once,
  at capture);
- matrix products and convolutions whose operands differ in dtype (an fp32
  batch tensor meeting bf16 weights) are refused with the user's source
  line: fake kernels let them through, the real kernels would fail. Where
  the wider operand comes from floating buffers (a sinusoidal position
  table), the error names them (``BufferDtypeError``): capture then reads
  them in the compute dtype, as DeepSpeed's ``module.bfloat16()`` holds
  them (``stepfx.cast_buffers``).
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from ..errors import CaptureError, CaptureWarning
from ..graph import META_PHASE, META_SLOT, META_SOURCE, Phase, Role, StepGraph, output_values
from ..graph.ops import SAME_DTYPE_OPS, mutated_args
from ..graph.verify import mutation_base

__all__ = ["BufferDtypeError", "check_mutations", "check_operand_dtypes", "warn_python_only_reads"]

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


class BufferDtypeError(CaptureError):
    """An operand mismatch whose wider operand is computed from these floating buffers (names)."""

    def __init__(self, message: str, buffers: tuple[str, ...], **kwargs):
        super().__init__(message, **kwargs)
        self.buffers = buffers


def _floating_buffers_behind(node: fx.Node) -> list[str]:
    """The floating-point buffers (slot names) ``node`` is computed from."""
    seen, stack, found = set(), [node], []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        slot = n.meta.get(META_SLOT) if n.op == "placeholder" else None
        if slot is not None and slot.role is Role.BUFFER:
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                found.append(slot.name)
        stack.extend(n.all_input_nodes)
    return sorted(found)


def warn_python_only_reads(graph: StepGraph) -> None:
    """``.item()`` whose value only Python saw (printed, logged, appended to
    a list) ran once, at capture; later calls do not repeat it."""
    outputs = {v for v in output_values(graph.gm) if isinstance(v, fx.Node)}
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten._local_scalar_dense.default:
            continue
        if node.users or node in outputs or node.meta.get(META_PHASE) is Phase.OPTIMIZER:
            continue
        warnings.warn(
            f"the step reads a tensor's value with .item() at {node.meta.get(META_SOURCE) or 'an unknown line'} "
            "and uses it only in Python: Python side effects (print, logging, lists) run once, at capture, "
            "not on every call. Return the value from the step instead.",
            CaptureWarning,
            stacklevel=4,
        )


def check_mutations(graph: StepGraph) -> None:
    """In-place writes are allowed into parameters, buffers, gradients and
    optimizer state (their new values become outputs). A write into a batch
    tensor or into a tensor the graph holds as a constant (a global, an
    unregistered module attribute) cannot be replayed faithfully."""
    for node in graph.gm.graph.nodes:
        if node.op != "call_function":
            continue
        for arg in mutated_args(node):
            base = mutation_base(arg)
            if base is None:
                continue
            where = node.meta.get(META_SOURCE)
            if base.op == "get_attr":
                raise CaptureError(
                    f"the step writes in place ({node.target}) into a tensor that is not a parameter, buffer, optimizer state "
                    "or argument of the step (a global, a closure variable or a module attribute that is not registered)",
                    source=where,
                    hint="register the tensor on the module (register_buffer) or return its new value from the step",
                )
            slot = base.meta.get(META_SLOT) if base.op == "placeholder" else None
            if slot is not None and slot.role in (Role.BATCH, Role.HYPERPARAM):
                raise CaptureError(
                    f"the step writes in place ({node.target}) into its input {slot.describe()}",
                    source=where,
                    hint="work on a copy (x = x.clone()) or return the new value",
                )


def check_operand_dtypes(graph: StepGraph, *, buffers_hint: str = "") -> None:
    """Matrix products and convolutions (``SAME_DTYPE_OPS``) need operands
    of one dtype. Under bf16/fp16 a floating batch tensor fed as given
    (``stepfx.cast_inputs`` false) or an fp32 buffer meets 16-bit weights:
    refused here, with the user's line, rather than when the compiled step
    first runs (``BufferDtypeError`` naming the buffers for the latter;
    ``buffers_hint``: what its hint says about them)."""
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and node.target in _BATCH_NORMS:
            _check_batch_norm(node)
        if node.op != "call_function" or node.target not in SAME_DTYPE_OPS:
            continue
        operands = [a for a in node.args if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        dtypes = sorted({str(a.meta["val"].dtype).replace("torch.", "") for a in operands})
        if len(dtypes) <= 1:
            continue
        message = (f"{node.target} multiplies tensors of different dtypes ({', '.join(dtypes)}); "
                   "the compiled step would fail when it runs")
        source = node.meta.get(META_SOURCE)
        narrow = any(a.meta["val"].dtype in _SIXTEEN_BIT for a in operands)
        buffers = sorted({b for a in operands if narrow and a.meta["val"].dtype not in _SIXTEEN_BIT
                          for b in _floating_buffers_behind(a)})
        if buffers:
            raise BufferDtypeError(
                message + f"; the wider operand is computed from the buffer(s) {', '.join(buffers)}", tuple(buffers),
                source=source, hint=buffers_hint or "cast the buffer in the step (buf.to(weight.dtype))")
        raise CaptureError(
            message,
            source=source,
            hint="under bf16/fp16 leave stepfx.cast_inputs on (floating batch tensors are cast to the compute "
            "dtype), or cast the tensor in the step (x.to(weight.dtype))",
        )


_BATCH_NORMS = frozenset({torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default,
                          torch.ops.aten._native_batch_norm_legit_no_training.default})


def _check_batch_norm(node: fx.Node) -> None:
    """A 16-bit input with weight, bias and running statistics that are neither all its dtype nor all fp32
    (what torch's batch norm takes): the kernel would fail when the step first runs."""
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:5]]
    x, params = vals[0], [v for v in vals[1:] if isinstance(v, torch.Tensor)]
    if not isinstance(x, torch.Tensor) or x.dtype not in _SIXTEEN_BIT or not params:
        return
    dtypes = {v.dtype for v in params}
    if dtypes in ({x.dtype}, {torch.float32}):
        return
    names = ("weight", "bias", "running_mean", "running_var")
    found = ", ".join(f"{n} {str(v.dtype).replace('torch.', '')}" for n, v in zip(names, vals[1:]) if isinstance(v, torch.Tensor))
    raise CaptureError(
        f"{node.target} takes a {str(x.dtype).replace('torch.', '')} input with {found}; the kernel needs them all "
        "fp32 or all the input's dtype, and would fail when the step runs",
        source=node.meta.get(META_SOURCE),
        hint="pass the batch norm fp32 weight and bias beside fp32 statistics (stepfx does so for nn.BatchNorm "
             "modules), or cast them together",
    )
