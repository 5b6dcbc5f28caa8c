"""carry_parameter_copies: the Adam update writes the next step's 16-bit
compute copies of the parameters; the step no longer packs them at its start.

Mixed precision begins every step by rounding each fp32 parameter to
bf16/fp16 (``batch_parameter_casts``' one ``pack``): on the 1.3B GPT it reads
5.3 GB and writes 2.6 GB, 2.1 ms of an H200's step, at the power cap. But
the update at the end of the previous step had every new parameter in
registers: written there, rounded, the copy costs 2 B per element of
stores and no read. The buffer then lives between steps (the rank keeps it,
as DeepSpeed keeps its bf16 model next to the fp32 master weights), and the
runtime checks before each step that nothing else changed the parameters
since, packing afresh when something did (``stepfx.runtime.carried`` says
what it sees, and what it cannot).

Applies on one rank only: between steps, data-parallel jobs may broadcast
parameters, and c10d's collectives write without bumping version counters.
Applies to a ``pack`` of whole parameters (the user's, not ZeRO pieces)
when each of them is either updated in place by a multi-tensor Adam update
(``adam_step_many``; a lone in-place ``adam_step``, a param group of one
tensor, becomes one with a count of 1: the same bits) or not written by
the step at all (frozen), and every
reader of the copies runs before the updates that overwrite them. Else
nothing changes, and the summary says which condition failed. A step that
writes none of them (a gradient-accumulation micro-step) reads the carried
buffer and returns nothing: with the same layout (the same casts in the
same order, as the micro-steps and the update of one model have) it is
the update step's buffer, so accumulation neither packs nor holds a
second copy.

Requires: ``batch_parameter_casts`` and ``batch_optimizer_updates`` ran.
Ensures: the pack is a RUNTIME_STATE placeholder held by the rank (its
layout in ``signature.extra[CARRIED_COPIES_KEY]``); the updates take the
buffer as their last, donated argument and return it, updated, last; the
graph returns it. The values every op reads are the same bits as before
(the kernel rounds as ``pack`` does; tested bitwise over several steps).

Before / after::

    params16 = graph_ops.pack([p_w, p_b], [0, 4096], 4160, dtype=bf16)   params16 = placeholder  # x_param_copies_...
    ...                                                              ->   ...
    u = adam_step_many(2, p_w, p_b, ..., found_inf)                         u = adam_step_many(2, p_w, p_b, ..., found_inf, params16,
                                                                                               copy_offsets=(0, 4096))
                                                                            return (..., u[6])
"""
from __future__ import annotations

import dataclasses
import hashlib
import operator

import torch.fx as fx

from ...graph import CARRIED_COPIES_KEY, META_DONATED, CarriedCopies, Role, Slot, StepGraph, Storage
from ...graph.build import bind_placeholders, clone_step_graph_mapped
from ...graph.ops import storage_root, written_args
from ...graph.step_graph import output_node
from ..data_parallel.collectives import make_node
from ..manager import PassOptions, PassResult

__all__ = ["carry_parameter_copies"]

SLOT_NAME = "param_copies"


def _writers(g: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Each node written in place, and the nodes that write it."""
    out: dict[fx.Node, list[fx.Node]] = {}
    for n in g.nodes:
        if n.op == "call_function":
            for a in written_args(n):
                if isinstance(a, fx.Node):
                    out.setdefault(a, []).append(n)
    return out


def _plan(pack: fx.Node, graph: StepGraph, writers, order) -> tuple[dict | None, str]:
    """``{update node: {param index: offset}}`` for ``pack``, or None and why not."""
    from ...codegen import graph_ops

    parts, offsets = pack.args[0], pack.args[1]
    returned = {s.name for s in graph.signature.outputs if s.role is Role.PARAM}
    plan: dict[fx.Node, dict[int, int]] = {}
    if len(set(parts)) != len(parts):  # the update would keep only one of a parameter's two copies current
        return None, "a parameter has two places in the buffer"
    for part, offset in zip(parts, offsets):
        slot = part.meta.get("slot") if isinstance(part, fx.Node) and part.op == "placeholder" else None
        if slot is None or slot.role is not Role.PARAM or slot.storage is not Storage.USER or slot.piece is not None:
            return None, f"{getattr(part, 'name', part)} is not a whole parameter of the user's module"
        found = writers.get(part, [])
        if not found:
            if slot.name in returned:
                return None, f"{slot.name} is updated out of place"
            continue  # not written by this step (frozen): its copy stays right
        update = found[0]
        single = (update.target is graph_ops.adam_step and update.kwargs.get("inplace") and len(update.args) == 10
                  and update.args[0] is part)
        if len(found) > 1 or not (update.target is graph_ops.adam_step_many or single):
            return None, f"{slot.name} is written by {update.name}, not by one in-place Adam update"
        if update.kwargs.get("copy_offsets") is not None:
            return None, f"{update.name} already writes copies"
        index = 0 if single else next(i for i in range(update.args[0]) if update.args[1 + i] is part)
        plan.setdefault(update, {})[index] = offset
    if not plan:  # nothing here writes them (a gradient-accumulation micro-step): read-only
        return plan, ""
    readers = [n for n in graph.gm.graph.nodes if any(storage_root(a) is pack for a in n.all_input_nodes)]
    if any(n.op == "output" for n in readers):
        return None, "the step returns a compute copy"
    first_update = min(order[u] for u in plan)
    late = [n.name for n in readers if order[n] > first_update]
    if late:
        return None, f"{', '.join(late[:3])} read the copies after the update that overwrites them"
    return plan, ""


def carry_parameter_copies(graph: StepGraph, options: PassOptions) -> PassResult:
    from ...codegen import graph_ops

    g0 = graph.gm.graph
    packs = [n for n in g0.nodes if n.op == "call_function" and n.target is graph_ops.pack
             and n.kwargs.get("scale") is None]
    if not packs:
        return PassResult(graph, False)
    if options.world_size > 1:
        # c10d's in-place collectives (a broadcast of the parameters between steps, as data-parallel
        # jobs do to resync) write without bumping version counters: the check could not see them
        return PassResult(graph, False, "not carried: several ranks (c10d collectives on the parameters between "
                                        "steps would not be seen)")
    writers = _writers(g0)
    order = {n: i for i, n in enumerate(g0.nodes)}
    plans, refused = [], []
    for pack in packs:
        plan, why = _plan(pack, graph, writers, order)
        if plan is None:
            refused.append(f"{pack.name}: {why}")
        elif any(u in p for _, p in plans for u in plan):
            refused.append(f"{pack.name}: its updates already write another buffer's copies")
        else:
            plans.append((pack, plan))
    if not plans:
        return PassResult(graph, False, "not carried: " + "; ".join(refused))

    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    sig = graph.signature
    inputs, outputs = list(sig.inputs), list(sig.outputs)
    out = output_node(graph.gm)
    returned = list(out.args[0])
    carried = dict(sig.extra.get(CARRIED_COPIES_KEY, {}))
    done = []
    for old_pack, old_plan in plans:
        pack = copy_of[old_pack]
        parts, offsets, total = pack.args
        dtype = pack.kwargs["dtype"]
        layout = CarriedCopies(tuple(p.meta["slot"].name for p in parts), tuple(offsets), total, dtype)
        digest = hashlib.sha1(repr((layout.names, layout.offsets, total)).encode()).hexdigest()[:8]
        slot = Slot(Role.RUNTIME_STATE, SLOT_NAME, key=f"{str(dtype).removeprefix('torch.')}_{digest}",
                    storage=Storage.RANK)
        last_ph = [n for n in g.nodes if n.op == "placeholder"][-1]
        with g.inserting_after(last_ph):
            buffer = g.placeholder(SLOT_NAME)
        buffer.meta.update(slot=slot, val=pack.meta["val"])
        pack.replace_all_uses_with(buffer)
        g.erase_node(pack)
        current = buffer
        for old_update in sorted(old_plan, key=order.__getitem__):
            update = copy_of[old_update]
            if update.target is graph_ops.adam_step:  # a lone update (a param group of one): the same math, count 1
                update.target = graph_ops.adam_step_many
                update.args = (1, *update.args)
                update.kwargs = {k: v for k, v in update.kwargs.items() if k != "inplace"}
                update.meta[META_DONATED] = tuple(i + 1 for i in update.meta.get(META_DONATED, ()))
            count = update.args[0]
            where = old_plan[old_update]
            update.args = (*update.args, current)
            update.kwargs = {**update.kwargs, "copy_offsets": tuple(where.get(i, -1) for i in range(count))}
            update.meta["val"] = (*update.meta["val"], buffer.meta["val"])
            update.meta[META_DONATED] = (*update.meta.get(META_DONATED, ()), len(update.args) - 1)
            with g.inserting_after(update):
                current = make_node(g, operator.getitem, (update, 3 * count), val=buffer.meta["val"], like=update,
                                    name="param_copies_next")
        inputs.append(slot)
        carried[slot.key] = layout
        what = (f"{len(parts)} parameters' {str(dtype).removeprefix('torch.')} copies "
                f"({total * dtype.itemsize / 2**20:.1f} MiB)")
        if not old_plan:
            done.append(what + ": read only (this step updates none of them)")
            continue
        outputs.append(slot)
        returned.append(current)
        written = sum(len(p) for p in old_plan.values())
        done.append(what + f": {written} written by the Adam update, {len(parts) - written} not updated")
    out.args = (tuple(returned),)
    bind_placeholders(graph.gm, inputs)
    graph = graph.replace(signature=dataclasses.replace(sig, inputs=tuple(inputs), outputs=tuple(outputs),
                                                        extra={**sig.extra, CARRIED_COPIES_KEY: carried}))
    graph.gm.recompile()
    summary = ("carried between steps: " + "; ".join(done)
               + " (packed afresh only when a parameter changed between steps)")
    if refused:
        summary += "; not carried: " + "; ".join(refused)
    return PassResult(graph, True, summary)
