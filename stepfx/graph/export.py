"""A step graph for other tools: networkx and Graphviz DOT.

``step.graphs[name].to_networkx()`` gives a ``networkx.MultiDiGraph`` with
one node per fx node (keyed by its name) and one edge per use of a value
(from the value to its reader, ``arg``: the position of the use among the
reader's inputs). Node attributes:

- ``op``: fx's kind (``placeholder``, ``call_function``, ``get_attr``, ``output``);
- ``target``: the op as the printed graph names it (``aten.mm``), the
  placeholder's slot (``param fc1.weight``), or ``output``;
- ``phase``: ``forward`` / ``backward`` / ``optimizer`` (call_function nodes);
- ``role``: the placeholder's slot role (``param``, ``batch``, ...);
- ``shape``, ``dtype``: of the node's value (a tuple of them for several results),
  symbolic sizes as their text;
- ``source``: the user's line (``file.py:12``) where known;
- ``param``: the parameter a node belongs to, where it belongs to one;
- any other scalar annotations passes leave (the pipeline stage and task).

``to_dot()`` writes the same graph as Graphviz DOT text (nodes coloured by
phase, placeholders as boxes), for ``dot -Tsvg``.
"""
from __future__ import annotations

import networkx as nx
import torch
import torch.fx as fx

from .printer import format_target
from .step_graph import META_PARAM, META_PHASE, META_SOURCE, StepGraph

__all__ = ["to_networkx", "to_dot"]

# annotations copied as attributes when they hold a plain value (pipeline stage / task, recomputation)
_SCALAR_META = ("pp_stage", "pp_task", "recomputed_from", "grad_of")
_PHASE_COLOURS = {"forward": "#cfe2ff", "backward": "#ffe5cc", "optimizer": "#d7f5d7"}


def _value_attrs(val) -> dict:
    def one(t):
        return tuple(str(s) for s in t.shape), str(t.dtype).removeprefix("torch.")

    if isinstance(val, torch.Tensor):
        shape, dtype = one(val)
        return {"shape": shape, "dtype": dtype}
    if isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val):
        parts = [one(v) if isinstance(v, torch.Tensor) else ((), "") for v in val]
        return {"shape": tuple(p[0] for p in parts), "dtype": tuple(p[1] for p in parts)}
    return {}


def _attrs(node: fx.Node) -> dict:
    out: dict = {"op": node.op}
    if node.op == "placeholder":
        slot = node.meta.get("slot")
        out["target"] = slot.describe() if slot is not None else str(node.target)
        if slot is not None:
            out["role"] = str(slot.role)
    elif node.op == "call_function":
        out["target"] = format_target(node.target)
    else:
        out["target"] = str(node.target)
    phase = node.meta.get(META_PHASE)
    if phase is not None:
        out["phase"] = str(phase)
    for key, meta_key in (("source", META_SOURCE), ("param", META_PARAM)):
        if node.meta.get(meta_key) is not None:
            out[key] = str(node.meta[meta_key])
    for key in _SCALAR_META:
        value = node.meta.get(key)
        if isinstance(value, (str, int, float, bool)):
            out[key] = value
    out.update(_value_attrs(node.meta.get("val")))
    return out


def to_networkx(graph: StepGraph) -> nx.MultiDiGraph:
    """The step as a ``networkx.MultiDiGraph`` (see the module docstring)."""
    g = nx.MultiDiGraph()
    for node in graph.gm.graph.nodes:
        g.add_node(node.name, **_attrs(node))
    for node in graph.gm.graph.nodes:
        uses = []
        fx.node.map_arg((node.args, node.kwargs), lambda a: uses.append(a) or a)
        for position, value in enumerate(uses):
            g.add_edge(value.name, node.name, arg=position)
    return g


def _quote(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(graph: StepGraph, name: str = "step") -> str:
    """The step as Graphviz DOT text: one node per fx node (label: name, op, shape), one edge per use."""
    g = to_networkx(graph)
    lines = [f"digraph {_quote(name)} {{", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    for key, data in g.nodes(data=True):
        label = f"{key}\n{data.get('target', '')}"
        if "shape" in data and data["shape"] and not isinstance(data["shape"][0], tuple):
            label += f"\n{data.get('dtype', '')}[{', '.join(data['shape'])}]"
        style = {"placeholder": "shape=box", "output": "shape=doubleoctagon"}.get(data["op"], "shape=ellipse")
        fill = _PHASE_COLOURS.get(data.get("phase", ""))
        if fill:
            style += f', style=filled, fillcolor="{fill}"'
        source = f", tooltip={_quote(data['source'])}" if "source" in data else ""
        lines.append(f"  {_quote(key)} [label={_quote(label)}, {style}{source}];")
    for a, b, data in g.edges(data=True):
        lines.append(f"  {_quote(a)} -> {_quote(b)};")
    lines.append("}")
    return "\n".join(lines) + "\n"
