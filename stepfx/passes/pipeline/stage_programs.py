"""Cut the stage programs out of a partitioned step graph.

``partition_stages`` marks every op with its stage and task (F: the stage's
forward on one micro-batch; B: its backward on one micro-batch; O: the
optimizer update of the parameters it owns, once per step). This module
makes one GraphModule per (task, stage) and says what each reads and
returns, so that the pipeline runtime (runtime/pipeline.py) can run them
in any schedule's order:

- a program reads graph inputs (the step's placeholders: parameters,
  optimizer state, the micro-batch's slice of each batch tensor) and
  *values* by name (node names of the whole graph): values it received,
  values its stage's forward saved for its backward, and for O the
  gradients accumulated over the micro-batches;
- replicated ops (computed from the batch, buffers, hyperparameters and
  step counters alone: masks, position ids, bias corrections) are copied
  into every program that reads them, and computed by every rank where the
  step returns them (step counters stay equal on every rank);
- ``send_forward[s]``: the values the rank of stage s sends to stage s+1
  after its forward on a micro-batch (its own outputs that later stages
  read, and values it relays from earlier stages); ``send_backward[s]``:
  what it sends to stage s-1 after its backward (input gradients, and
  forward values of later stages that an earlier stage's backward reads);
- with ``split_backward`` (zero-bubble schedules) B is cut in two: BI
  computes what ``send_backward`` needs (the input gradients), BW the rest
  (weight gradients), reading BI's values.

Everything a program returns is named, so the runtime keeps per
(stage, micro-batch) one dict of values and frees it after the last item
that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ... import compat
from ...config.errors import ConfigError
from ...graph import StepGraph
from ...graph.signature import Role
from ...graph.step_graph import META_GRAD_OF, META_PARAM, META_PHASE, Phase
from ..tensor_parallel.shard_tensor_parallel import META_TP_REPLICATED
from .partition_stages import META_STAGE, META_TASK, PIPELINE_KEY, StagePlan

__all__ = ["TaskProgram", "StagePrograms", "split_programs"]


@dataclass
class TaskProgram:
    """One program: ``gm(*args)`` with args from ``inputs`` (("graph", i):
    the step's i-th input; ("value", name): a named value), returning the
    values named ``outputs`` in order."""

    kind: str  # "F", "B", "BI", "BW", "O", "R"
    stage: int
    gm: fx.GraphModule
    inputs: list[tuple[str, object]]
    outputs: list[str]

    def describe(self) -> str:
        ops = sum(1 for n in self.gm.graph.nodes if n.op == "call_function")
        return f"{self.kind}{self.stage}: {ops} ops, {len(self.inputs)} inputs, {len(self.outputs)} outputs"


@dataclass
class StagePrograms:
    stages: int
    plan: StagePlan
    programs: dict[tuple[str, int], TaskProgram]  # (kind, stage) -> program; ("R", -1): replicated outputs
    send_forward: list[list[str]]  # per stage
    send_backward: list[list[str]]
    # value name -> (shape, dtype) of what crosses ranks; a size is an int, or a sympy expression in the batch's
    # symbolic sizes (stepfx.dynamic)
    specs: dict[str, tuple[tuple, torch.dtype]]
    accumulated: dict[int, list[str]]  # stage -> the backward values its optimizer reads (summed over micro-batches)
    outputs: list[tuple[str, object]]  # per graph output: ("graph", i) | ("value", name) | ("const", value)
    output_task: list[str | None]  # per graph output: the task kind producing it ("F", "O", "R", ...) or None
    split_backward: bool = False
    user_outputs: list[int] = field(default_factory=list)  # graph output positions made by the forward
    # after the micro-batches: accumulated gradients of shared (tied) parameters sent to the owner's
    # optimizer, (value name, from stage, to stage); after the update: the owner's new value of a shared
    # parameter sent to the other stages that read it, (graph output position, value name, from stage, to stage)
    step_sends: list[tuple[str, int, int]] = field(default_factory=list)
    param_sends: list[tuple[int, str, int, int]] = field(default_factory=list)
    # sums over the stages (gradient clipping's squared norm): (the sum's name, its parts' names); each rank
    # adds the parts its stages' "O" programs made, the pipeline group all-reduces, "O2" programs read the sum
    cross_sums: list[tuple[str, list[str]]] = field(default_factory=list)
    replicated: frozenset = frozenset()  # names of the ops copied into every program that reads them
    grad_params: dict = field(default_factory=dict)  # accumulated value name -> the parameter it is a gradient of
    # values crossing stages that every rank of a tensor-parallel group holds alike (pipeline.pipe_partitioned)
    tp_replicated: frozenset = frozenset()


def _free_inputs(graph: StepGraph) -> set[fx.Node]:
    free = set()
    for n in graph.gm.graph.nodes:
        if n.op == "placeholder":
            slot = n.meta["slot"]
            if slot.role in (Role.BATCH, Role.BUFFER, Role.HYPERPARAM, Role.RUNTIME_STATE) or (
                    slot.role is Role.OPTIMIZER_STATE and slot.key == "step"):
                free.add(n)
        elif n.op == "get_attr":
            free.add(n)
    return free


def split_programs(graph: StepGraph, *, split_backward: bool = False, keep_update=None,
                   shard_gradients: bool = False) -> StagePrograms:
    """``keep_update(name)``: whether this rank's optimizer programs update
    parameter ``name`` (ZeRO-1/2 over a stage's data-parallel ranks: each
    updates its share, runtime/pipeline.zero1_shares); None: all of them.
    ``shard_gradients`` (ZeRO-2): a rank has only its share's gradients
    after the reduction, so the update's ops that read another share's
    gradients (clipping's squared norm parts) leave its programs too."""
    gm = graph.gm
    g = gm.graph
    plan: StagePlan = graph.signature.extra[PIPELINE_KEY]
    stages = plan.stages
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    position = {n: i for i, n in enumerate(placeholders)}
    (out_args,) = [n for n in g.nodes if n.op == "output"][0].args

    # replicated: no stage (partition_stages), or an optimizer op made from free inputs only (step counters)
    free = _free_inputs(graph)
    replicated: set[fx.Node] = set()
    for n in g.nodes:
        if n.op != "call_function":
            continue
        if n.meta.get(META_TASK) == "X":
            continue
        if n.meta.get(META_STAGE) is None or (n.meta.get(META_PHASE) is Phase.OPTIMIZER and n.target is not None
                                              and all(a in free or a in replicated for a in n.all_input_nodes)
                                              and not _impure(n)):
            replicated.add(n)

    def task_of(n: fx.Node) -> tuple[str, int] | None:
        if n.op != "call_function" or n in replicated or n.meta.get(META_TASK) == "X":
            return None
        return n.meta[META_TASK], n.meta[META_STAGE]

    # ZeRO-1/2: the update's ops another data-parallel rank of the stage runs (no program here runs them;
    # what crosses ranks and what is summed over micro-batches stays the same on every rank)
    elsewhere: set[fx.Node] = set()
    if keep_update is not None:
        for n in g.nodes:
            if n.op != "call_function" or n.meta.get(META_TASK) not in ("O", "O2") or n in replicated:
                continue  # (a replicated op is computed wherever it is read)
            name = n.meta.get(META_PARAM)
            if name is not None:
                if not keep_update(name):
                    elsewhere.add(n)
            elif any(a in elsewhere for a in n.all_input_nodes):  # part of another rank's update
                elsewhere.add(n)
            elif shard_gradients:  # reads only gradients another rank keeps (clipping's squared norm parts)
                owners = {p for p in (_param_of(a) for a in n.all_input_nodes if a.op == "call_function") if p}
                if owners and not any(keep_update(o) for o in owners):
                    elsewhere.add(n)

    def updated_elsewhere(n: fx.Node) -> bool:
        return n in elsewhere

    # a shared (tied) parameter's gradient is the sum of its stages' parts: that sum moves to the owner's
    # optimizer, after each stage has summed its part over the micro-batches (a sum either way)
    for n in reversed(list(g.nodes)):
        if (n.op == "call_function" and n.meta.get(META_TASK) == "B" and n.target is torch.ops.aten.add.Tensor
                and not n.kwargs and len(n.args) == 2 and all(isinstance(a, fx.Node) for a in n.args)
                and len({a.meta.get(META_STAGE) for a in n.args if task_of(a) is not None}) > 1
                and n.users and all(task_of(u) is not None and task_of(u)[0] == "O" for u in n.users)):
            owners = {task_of(u)[1] for u in n.users}
            if len(owners) == 1:
                n.meta[META_TASK], n.meta[META_STAGE] = "O", owners.pop()

    # sums over the stages: what reads one (the clip factor and what it scales) runs after the all-reduce
    cross_sums = []
    cross_parts: list[fx.Node] = []
    after_cross: set[fx.Node] = set()
    for n in g.nodes:
        if n.meta.get(META_TASK) == "X" and n.target is torch.ops.aten.sum.default:
            (stack,) = n.all_input_nodes
            parts = list(stack.args[0])
            cross_sums.append((n.name, [p.name for p in parts]))
            cross_parts += parts
        if n.op == "call_function" and (n.meta.get(META_TASK) == "X" or any(a in after_cross for a in n.all_input_nodes)):
            after_cross.add(n)
            if n.meta.get(META_TASK) == "O":
                n.meta[META_TASK] = "O2"
    for p in cross_parts:
        if task_of(p) is None:
            raise ConfigError("pipeline.stages", f"{p.name}, a part of a sum over the stages, has no stage")

    # -- the zero-bubble split of each stage's backward ---------------------------------
    step_sends: set[tuple[str, int, int]] = set()
    send_forward: list[set[str]] = [set() for _ in range(stages)]
    send_backward: list[set[str]] = [set() for _ in range(stages)]
    accumulated: dict[int, set[str]] = {s: set() for s in range(stages)}
    by_name = {n.name: n for n in g.nodes}

    def route(v: fx.Node, consumer: tuple[str, int]) -> None:
        kp, sp = task_of(v)
        kc, sc = consumer
        if kc in ("O", "O2") and kp in ("O", "O2") and sp == sc:
            return
        if kc == "O2":
            kc = "O"
        if kc == "O" and kp == "B" and sp != sc:  # a shared parameter's gradient part
            accumulated[sp].add(v.name)
            step_sends.add((v.name, sp, sc))
            return
        if kc == "O":
            if kp != "B" or sp != sc:
                raise ConfigError("pipeline.stages", f"the optimizer of stage {sc} reads {v.name} ({_where(v)}) made by "
                                  f"the {dict(F='forward', B='backward', O='optimizer')[kp]} of stage {sp}: parameters shared by "
                                  "stages (tied embeddings) are not supported with pipeline parallelism yet")
            accumulated[sc].add(v.name)
            return
        if sp == sc:
            if kp == "B" and kc == "F":
                raise ConfigError("pipeline.stages", f"the forward reads {v.name}, made by the backward")
            return  # the stage's own value (saved from its forward for its backward, or within one task)
        if kc == "F" or (kc == "B" and kp == "F" and sc > sp):
            if kp != "F" or sc < sp:
                raise ConfigError("pipeline.stages", f"{v.name} ({_where(v)}) flows from stage {sp} back to the "
                                  f"forward of stage {sc}")
            for t in range(sp, sc):
                send_forward[t].add(v.name)
            return
        # a backward reads a later stage's value: it travels down with the gradients
        for t in range(sp, sc, -1):
            send_backward[t].add(v.name)

    for n in g.nodes:
        t = task_of(n)
        if t is None:
            continue
        for a in n.all_input_nodes:
            if task_of(a) is not None:
                route(a, t)

    # what each task returns: values other tasks, sends, accumulations and the step's outputs read
    needed_out: dict[tuple[str, int], list[fx.Node]] = {}
    wanted: set[str] = set()
    for s in range(stages):
        wanted |= send_forward[s] | send_backward[s] | accumulated[s]
    output_nodes = {a for a in out_args if isinstance(a, fx.Node)}
    for n in g.nodes:
        t = task_of(n)
        if t is None:
            continue
        if n.name in wanted or n in output_nodes or n in cross_parts or any(
                task_of(u) not in (None, t) for u in n.users):
            needed_out.setdefault(t, []).append(n)

    tasks: dict[tuple[str, int], list[fx.Node]] = {}
    for n in g.nodes:
        t = task_of(n)
        if t is not None and not updated_elsewhere(n):
            tasks.setdefault(t, []).append(n)
    if split_backward:
        for s in range(stages):
            nodes = tasks.pop(("B", s), [])
            if not nodes:
                continue
            targets = [by_name[name] for name in send_backward[s] if task_of(by_name[name]) == ("B", s)]
            keep = _closure(targets, set(nodes))
            bi = [n for n in nodes if n in keep]
            bw = [n for n in nodes if n not in keep]
            tasks[("BI", s)], tasks[("BW", s)] = bi, bw
            outs = needed_out.pop(("B", s), [])
            needed_out[("BI", s)] = [n for n in bi if n in outs or any(u in bw for u in n.users)]
            needed_out[("BW", s)] = [n for n in bw if n in outs]
            for n in bi:
                n.meta[META_TASK] = "BI"
            for n in bw:
                n.meta[META_TASK] = "BW"

    programs: dict[tuple[str, int], TaskProgram] = {}
    for (kind, s), nodes in tasks.items():
        members = set(nodes)
        for n in nodes:
            stray = [a for a in n.all_input_nodes if updated_elsewhere(a)]
            if stray:
                raise ConfigError("zero_optimization.stage", f"{n.name} of the update reads {stray[0].name}, the "
                                  "update of a parameter another data-parallel rank updates under ZeRO-1")
        outs = [o for o in needed_out.get((kind, s), []) if o in members]
        programs[(kind, s)] = _extract(gm, nodes, outs, replicated, position, kind, s)

    # the step's outputs: who makes each
    outputs: list[tuple[str, object]] = []
    output_task: list[str | None] = []
    user_outputs = []
    rep_out = []
    for i, a in enumerate(out_args):
        if not isinstance(a, fx.Node):
            outputs.append(("const", a))
            output_task.append(None)
        elif a.op == "placeholder":
            outputs.append(("graph", position[a]))
            output_task.append(None)
        elif a in replicated:
            outputs.append(("value", a.name))
            output_task.append("R")
            rep_out.append(a)
        else:
            kind, s = a.meta[META_TASK], a.meta[META_STAGE]
            outputs.append(("value", a.name))
            output_task.append(kind)
            if kind == "F":
                user_outputs.append(i)
            elif kind not in ("O", "O2"):
                raise ConfigError("pipeline.stages", f"the step returns {a.name} ({_where(a)}), made by the backward; "
                                  "with pipeline parallelism a step returns forward values (the loss) and updates state")
    if rep_out:
        programs[("R", -1)] = _extract(gm, [], rep_out, replicated, position, "R", -1)

    # shared parameters: the owner's update goes to every other stage that reads the parameter
    param_sends = []
    out_pos = {}
    for i, slot in enumerate(graph.signature.outputs):
        if slot.role is Role.PARAM:
            out_pos[slot.name] = i
    for p in placeholders:
        slot = p.meta["slot"]
        if slot.role is not Role.PARAM or slot.name not in out_pos:
            continue
        i = out_pos[slot.name]
        new = out_args[i]
        if not isinstance(new, fx.Node) or new.op == "placeholder" or task_of(new) is None:
            continue
        owner = task_of(new)[1]
        readers: set[int] = set()  # the stages whose forward or backward reads it (through its casts too)
        stack, seen = list(p.users), set()
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            if u in replicated:
                stack.extend(u.users)
            elif task_of(u) is not None and task_of(u)[0] not in ("O", "O2"):
                readers.add(task_of(u)[1])
        for r in sorted(readers - {owner}):
            param_sends.append((i, new.name, owner, r))

    specs = {}
    for name in set().union(*send_forward, *send_backward, {n for n, _, _ in step_sends},
                          {n for _, n, _, _ in param_sends}):
        val = by_name[name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ConfigError("pipeline.stages", f"{name} crosses stages and is not a tensor")
        # (a symbolic size as its expression: the runtime evaluates it at each micro-batch's sizes)
        specs[name] = (tuple(compat.size_expr(x) for x in val.shape), val.dtype)
    order = {n.name: i for i, n in enumerate(g.nodes)}
    return StagePrograms(
        stages=stages, plan=plan, programs=programs,
        send_forward=[sorted(x, key=order.get) for x in send_forward],
        send_backward=[sorted(x, key=order.get) for x in send_backward],
        specs=specs, accumulated={s: sorted(v, key=order.get) for s, v in accumulated.items()},
        outputs=outputs, output_task=output_task, split_backward=split_backward, user_outputs=user_outputs,
        step_sends=sorted(step_sends, key=lambda t: (order[t[0]], t[1], t[2])), param_sends=param_sends,
        cross_sums=cross_sums, replicated=frozenset(n.name for n in replicated),
        grad_params=_gradient_params(g, {n for v in accumulated.values() for n in v}, by_name),
        tp_replicated=frozenset(n for n in specs if by_name[n].meta.get(META_TP_REPLICATED)))


def _closure(starts, within: set) -> set[fx.Node]:
    """``starts`` and everything they read, transitively, among ``within``."""
    out: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        x = stack.pop()
        if x in out:
            continue
        out.add(x)
        stack.extend(a for a in x.all_input_nodes if a in within)
    return out


def _param_of(node: fx.Node, depth: int = 4) -> str | None:
    """The parameter a gradient value belongs to: its own ``grad_of`` or
    ``param``, else that of the nearest op reading it (breadth first, not
    through a sum over the stages: clipping's norm reads every gradient)."""
    level, seen = [node], {node}
    for _ in range(depth):
        for x in level:
            param = x.meta.get(META_GRAD_OF) or x.meta.get(META_PARAM)
            if param is not None:
                return param
        level = [u for x in level for u in x.users
                 if u.op == "call_function" and u.meta.get(META_TASK) != "X" and u not in seen]
        seen.update(level)
    return None


def _gradient_params(g: fx.Graph, names: set[str], by_name: dict) -> dict[str, str]:
    """The parameter each summed value is (a part of) the gradient of."""
    return {name: p for name in names if (p := _param_of(by_name[name])) is not None}


def _impure(n: fx.Node) -> bool:
    from ...graph.ops import has_side_effect, is_collective, is_random
    return is_random(n) or has_side_effect(n) or is_collective(n)


def _where(n: fx.Node) -> str:
    return n.meta.get("source") or str(n.target)


def _extract(gm: fx.GraphModule, nodes: list[fx.Node], outs: list[fx.Node], replicated: set[fx.Node],
             position: dict[fx.Node, int], kind: str, stage: int) -> TaskProgram:
    """A GraphModule computing ``outs`` from ``nodes`` (in graph order) and
    the replicated ops they read; every other value becomes an input."""
    members = set(nodes)
    needed_rep = _closure([a for n in list(nodes) + list(outs) for a in (n.all_input_nodes if n in members else [n])
                           if a in replicated], replicated)
    body = [n for n in gm.graph.nodes if n in members or n in needed_rep]
    inside = set(body)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[tuple[str, object]] = []
    for n in body:
        for a in n.all_input_nodes:
            if a in inside or a in env:
                continue
            if a.op == "placeholder":
                p = new.placeholder(a.name)
                inputs.append(("graph", position[a]))
            elif a.op == "get_attr":
                p = new.get_attr(a.target)
            else:
                p = new.placeholder(a.name)
                inputs.append(("value", a.name))
            p.meta = dict(a.meta)
            env[a] = p
    for n in body:
        env[n] = new.node_copy(n, lambda a: env[a])
    new.output(tuple(env[o] for o in outs))
    program = fx.GraphModule(gm, new, class_name=f"{kind}{stage if stage >= 0 else ''}")
    program.recompile()
    return TaskProgram(kind, stage, program, inputs, [o.name for o in outs])
