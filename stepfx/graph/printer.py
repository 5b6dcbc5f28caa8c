"""Print a step graph as readable, valid Python.

What ``explain()`` shows and what pass dumps contain. Tuned for reading:
one statement per node, ``aten.addmm`` instead of
``torch.ops.aten.addmm.default``, schema-default arguments elided, the phase
and owning parameter as a trailing comment, outputs listed with their roles.

The text is valid Python given ``import torch; aten = torch.ops.aten`` and
``self`` bound to the GraphModule (for constants), so a person can paste it
into a REPL to check a detail.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from .step_graph import META_PARAM, META_PHASE, META_SLOT, StepGraph

__all__ = ["format_graph", "format_target", "format_statement"]

_INFIX = {
    operator.add: "+",
    operator.sub: "-",
    operator.mul: "*",
    operator.truediv: "/",
    operator.floordiv: "//",
    operator.pow: "**",
    operator.mod: "%",
    operator.eq: "==",
    operator.ne: "!=",
    operator.lt: "<",
    operator.le: "<=",
    operator.gt: ">",
    operator.ge: ">=",
}

_COMMENT_COLUMN = 64


def format_target(target) -> str:
    """``aten.mm`` for aten default overloads, ``aten.add.Tensor`` otherwise."""
    if isinstance(target, torch._ops.OpOverload):
        packet = target.overloadpacket.__name__
        ns = "aten" if target.namespace == "aten" else f"torch.ops.{target.namespace}"
        overload = target._overloadname
        return f"{ns}.{packet}" if overload == "default" else f"{ns}.{packet}.{overload}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"torch.ops.higher_order.{target.name()}"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    return f"{module}.{name}" if module else name


def _fmt(value) -> str:
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_fmt(v) for v in value)
        if isinstance(value, tuple):
            return f"({inner},)" if len(value) == 1 else f"({inner})"
        return f"[{inner}]"
    if isinstance(value, float):
        if math.isinf(value):
            return "float('inf')" if value > 0 else "float('-inf')"
        if math.isnan(value):
            return "float('nan')"
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value)  # "torch.float32"
    if isinstance(value, torch.device):
        return repr(str(value))
    if isinstance(value, (torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_fmt(k)}: {_fmt(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _non_default_kwargs(node: fx.Node) -> dict:
    """kwargs whose value differs from the schema default (the rest is noise)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return dict(node.kwargs)
    defaults = {a.name: a.default_value for a in target._schema.arguments if a.has_default_value()}
    out = {}
    for k, v in node.kwargs.items():
        if k in defaults and _same_default(v, defaults[k]):
            continue
        out[k] = v
    return out


def _same_default(value, default) -> bool:
    try:
        return type(value) is type(default) and value == default or (value is None and default is None)
    except Exception:  # tensors or exotic values compare ambiguously: keep them
        return False


def _expression(node: fx.Node) -> str:
    if node.op == "get_attr":
        return f"self.{node.target}"
    target = node.target
    if target is operator.getitem and len(node.args) == 2:
        return f"{_fmt(node.args[0])}[{_fmt(node.args[1])}]"
    if target in _INFIX and len(node.args) == 2 and not node.kwargs:
        return f"{_fmt(node.args[0])} {_INFIX[target]} {_fmt(node.args[1])}"
    if target is operator.neg and len(node.args) == 1:
        return f"-{_fmt(node.args[0])}"
    args = [_fmt(a) for a in node.args]
    args += [f"{k}={_fmt(v)}" for k, v in _non_default_kwargs(node).items()]
    return f"{format_target(target)}({', '.join(args)})"


def _comment(node: fx.Node) -> str:
    parts = []
    phase = node.meta.get(META_PHASE)
    if phase is not None:
        parts.append(str(phase))
    param = node.meta.get(META_PARAM)
    if param is not None:
        parts.append(param)
    return "  ".join(parts)


def format_statement(node: fx.Node) -> str:
    """One node as the printed graph shows it (``mm_3 = aten.mm(t_1, view_2)``), without its comment."""
    return f"{node.name} = {_expression(node)}"


def format_graph(graph: StepGraph, *, header: str = "", name: str = "step") -> str:
    """The whole step as Python source text."""
    gm = graph.gm
    lines: list[str] = []
    if header:
        lines.extend(f"# {line}" if line else "#" for line in header.splitlines())
    lines.append("import operator")
    lines.append("import torch")
    lines.append("aten = torch.ops.aten")
    lines.append("")
    params = [n for n in gm.graph.nodes if n.op == "placeholder"]
    lines.append(f"def {name}(")
    lines.append("    self,")
    for p in params:
        slot = p.meta.get(META_SLOT)
        stmt = f"    {p.name},"
        if slot is not None:
            stmt = stmt.ljust(_COMMENT_COLUMN) + f"  # {slot.describe()}"
        lines.append(stmt)
    lines.append("):")
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        stmt = f"    {node.name} = {_expression(node)}"
        comment = _comment(node)
        if comment:
            stmt = stmt.ljust(_COMMENT_COLUMN) + f"  # {comment}"
        lines.append(stmt)
    out = [n for n in gm.graph.nodes if n.op == "output"]
    if out:
        (ret,) = out[0].args
        values = list(ret) if isinstance(ret, (tuple, list)) else [ret]
        slots = graph.signature.outputs
        lines.append("    return (")
        for i, v in enumerate(values):
            stmt = f"        {_fmt(v)},"
            if i < len(slots):
                stmt = stmt.ljust(_COMMENT_COLUMN) + f"  # {slots[i].describe()}"
            lines.append(stmt)
        lines.append("    )")
    return "\n".join(lines) + "\n"
