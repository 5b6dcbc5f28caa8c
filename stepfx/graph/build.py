"""Graph helpers shared by capture and passes (one place, never copied).

- :func:`clone_step_graph`: a copy a pass may edit without touching the
  graph it was given (the pass history keeps every intermediate graph);
- :func:`flatten_codegen`: plain positional inputs and a flat tuple output;
- :func:`adopt_annotations`: restore stepfx's node metadata from the
  annotations fx carries through a re-trace;
- :func:`label_params`: which nodes belong to exactly one parameter;
- :func:`new_node_meta`: metadata for a node a pass inserts.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .. import compat
from .signature import Role
from .step_graph import META_GRAD_OF, META_PARAM, META_PHASE, META_SLOT, META_SOURCE, Phase, StepGraph

__all__ = [
    "clone_step_graph",
    "clone_step_graph_mapped",
    "swap_calls",
    "flatten_codegen",
    "placeholder_name",
    "bind_placeholders",
    "adopt_annotations",
    "label_params",
    "copy_node_meta",
]


def clone_step_graph(graph: StepGraph) -> StepGraph:
    """A structurally independent copy (node metadata dicts are copied
    shallowly; fake values and constants are shared, never mutated)."""
    return clone_step_graph_mapped(graph)[0]


def clone_step_graph_mapped(graph: StepGraph) -> tuple[StepGraph, dict[fx.Node, fx.Node]]:
    """:func:`clone_step_graph` and the map from each node of ``graph`` to
    its copy: a pass finds its matches in the input graph and rewrites
    their copies."""
    new_graph = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out = compat.copy_graph(new_graph, graph.gm.graph, val_map)
    new_graph.output(out)
    new_graph._codegen = graph.gm.graph._codegen
    gm = compat.graph_module(graph.gm, new_graph)
    return graph.replace(gm=gm), val_map


def swap_calls(graph: StepGraph, found: list[fx.Node], target, call, name: str) -> StepGraph:
    """A copy of ``graph`` where each node of ``found`` (nodes of ``graph``)
    is a call of ``target`` with ``call(node) -> (args, kwargs)`` (given the
    copy's node), named ``name``, keeping the node's metadata: the swap by
    identity that many fusion passes make."""
    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    for match in found:
        old = copy_of[match]
        args, kwargs = call(old)
        with g.inserting_before(old):
            new = g.create_node("call_function", target, tuple(args), dict(kwargs), name=name)
        new.meta.update(old.meta)
        old.replace_all_uses_with(new)
        g.erase_node(old)
    graph.gm.recompile()
    return graph


def flatten_codegen(gm: fx.GraphModule) -> None:
    """Plain positional inputs and a flat tuple output: drop make_fx's pytree
    wrapping so ``gm(*values)`` returns ``tuple(outputs)``."""
    graph = gm.graph
    graph._codegen = fx.graph.CodeGen()
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    (ret,) = out.args
    flat, _ = pytree.tree_flatten(ret)
    out.args = (tuple(flat),)
    gm.recompile()


def placeholder_name(slot) -> str:
    """A readable Python name for a slot's placeholder: ``p_fc1_weight``,
    ``s_fc1_weight_exp_avg``, ``h_lr_0``, ``in_args_0_x``."""
    prefix = {
        Role.PARAM: "p_",
        Role.BUFFER: "b_",
        Role.GRAD: "g_",
        Role.OPTIMIZER_STATE: "s_",
        Role.HYPERPARAM: "h_",
        Role.BATCH: "in_",
    }.get(slot.role, "x_")
    text = slot.name + (f"_{slot.key}" if slot.key else "") + (f"_{slot.group}" if slot.group is not None else "")
    if slot.piece is not None:
        text += "_piece"
    cleaned = "".join(c if c.isalnum() else "_" for c in text)
    while "__" in cleaned:
        cleaned = cleaned.replace("__", "_")
    return prefix + cleaned.strip("_")


def bind_placeholders(gm: fx.GraphModule, slots) -> None:
    """Put each slot on its placeholder and name the placeholder after it."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for ph, slot in zip(phs, slots):
        ph.meta[META_SLOT] = slot
        name = placeholder_name(slot)
        if ph.name != name:
            compat.rename_node(ph, name)


def adopt_annotations(gm: fx.GraphModule, slots) -> None:
    """After a re-trace: slots back on placeholders, and the phase/source
    recorded in node annotations back into stepfx's metadata keys."""
    bind_placeholders(gm, slots)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        node.meta.setdefault("val", None)  # see capture: None-valued outputs have no val
        notes = node.meta.get(compat.NODE_ANNOTATIONS) or {}
        node.meta[META_PHASE] = Phase(notes.get("phase", Phase.FORWARD.value))
        node.meta[META_SOURCE] = notes.get("source")
        if "grad_of" in notes:
            node.meta[META_GRAD_OF] = notes["grad_of"]


def copy_node_meta(src: fx.Node, dst: fx.Node, *, phase: Phase | None = None) -> None:
    """Give a node a pass inserts the phase, source and annotations of the
    node it stands for (``val`` is the pass's job: it knows the new value)."""
    for key in (META_PHASE, META_SOURCE, META_PARAM, compat.NODE_ANNOTATIONS):
        if key in src.meta:
            dst.meta[key] = src.meta[key]
    if phase is not None:
        dst.meta[META_PHASE] = phase


def label_params(graph: StepGraph) -> None:
    """Set ``meta["param"]`` on nodes that belong to exactly one parameter.

    - placeholders of a parameter, its gradient or its optimizer state, and
      the nodes marked as its gradient after a backward (``grad_of``);
    - forward/backward nodes all of whose tensor inputs belong to the same
      parameter (its views, casts, transposes);
    - optimizer nodes whose parameter-owned inputs all belong to one
      parameter (the per-parameter update; the shared learning rate and the
      incoming gradient do not count);
    - backward nodes used only by one parameter's optimizer nodes or returned
      as its gradient (the final gradient of that parameter).
    """
    gm = graph.gm
    owned_roles = (Role.PARAM, Role.GRAD, Role.OPTIMIZER_STATE)
    for node in gm.graph.nodes:
        node.meta.pop(META_PARAM, None)
        if META_GRAD_OF in node.meta:
            # a parameter's gradient right after backward belongs to it
            # (SGD's first step builds its momentum from nothing else)
            node.meta[META_PARAM] = node.meta[META_GRAD_OF]
            continue
        if node.op == "placeholder":
            slot = node.meta.get(META_SLOT)
            if slot is not None and slot.role in owned_roles:
                node.meta[META_PARAM] = slot.name
            continue
        if node.op != "call_function":
            continue
        # symbolic scalars (the learning rate, a shared step counter) belong
        # to no parameter even when computed from one parameter's state
        inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        labels = {a.meta.get(META_PARAM) for a in inputs}
        if node.meta.get(META_PHASE) is Phase.OPTIMIZER:
            owned = labels - {None}
            if len(owned) == 1:
                node.meta[META_PARAM] = owned.pop()
        elif inputs and len(labels) == 1 and None not in labels:
            node.meta[META_PARAM] = labels.pop()
    grad_outputs = {}
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    for value, slot in zip(out.args[0], graph.signature.outputs):
        if slot.role is Role.GRAD and isinstance(value, fx.Node):
            grad_outputs[value] = slot.name
    for node in reversed(gm.graph.nodes):
        if node.op != "call_function" or node.meta.get(META_PHASE) is not Phase.BACKWARD:
            continue
        if META_PARAM in node.meta:
            continue
        owners = set()
        for user in node.users:
            if user.op == "output":
                owners.add(grad_outputs.get(node))
            elif user.meta.get(META_PHASE) is Phase.OPTIMIZER:
                owners.add(user.meta.get(META_PARAM))
            else:
                owners.add(None)
        if len(owners) == 1 and None not in owners:
            node.meta[META_PARAM] = owners.pop()
