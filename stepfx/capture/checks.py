"""Checks on a freshly captured step graph: what cannot be replayed.

- writes into a batch tensor, a learning rate, or a tensor the graph holds
  as a constant (a global, an unregistered module attribute) are refused
  with the op and the user's source line;
- ``.item()`` values that only Python saw are warned about (they ran once,
  at capture);
- matrix products and convolutions whose operands differ in dtype (an fp32
  batch tensor meeting bf16 weights) are refused with the user's source
  line: fake kernels let them through, the real kernels would fail.
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from ..errors import CaptureError, CaptureWarning
from ..graph import META_PHASE, META_SLOT, META_SOURCE, Phase, Role, StepGraph, output_values
from ..graph.ops import SAME_DTYPE_OPS, mutated_args
from ..graph.verify import mutation_base

__all__ = ["check_mutations", "check_operand_dtypes", "warn_python_only_reads"]


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


def check_operand_dtypes(graph: StepGraph) -> None:
    """Matrix products and convolutions (``SAME_DTYPE_OPS``) need operands
    of one dtype. Under bf16/fp16 a floating batch tensor fed as given
    (``stepfx.cast_inputs`` false) meets 16-bit weights: refused here, with
    the user's line, rather than when the compiled step first runs."""
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or node.target not in SAME_DTYPE_OPS:
            continue
        vals = [a.meta.get("val") for a in node.args if isinstance(a, fx.Node)]
        dtypes = sorted({str(v.dtype).replace("torch.", "") for v in vals if isinstance(v, torch.Tensor)})
        if len(dtypes) > 1:
            raise CaptureError(
                f"{node.target} multiplies tensors of different dtypes ({', '.join(dtypes)}); "
                "the compiled step would fail when it runs",
                source=node.meta.get(META_SOURCE),
                hint="under bf16/fp16 leave stepfx.cast_inputs on (floating batch tensors are cast to the compute "
                "dtype), or cast the tensor in the step (x.to(weight.dtype))",
            )
