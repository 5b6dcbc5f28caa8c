"""host_master_weights: the fp32 master pieces on the host, their bf16 copies on the device.

DeepSpeed's ZeRO-Offload layout: with ``offload_optimizer`` the GPU keeps the
16-bit parameters and the host the fp32 masters with the optimizer state.
Before this pass stepfx kept the fp32 pieces on the device, copied each down
and back up every step for the host update (4 + 4 bytes an element over
PCIe, 4 bytes of device memory at rest) and cast them to bf16 on the device
for the gathers. Here, under bf16 at ZeRO-3 with every piece's update on the
host (``offload_optimizer`` with ``ratio`` 1, no ``offload_param``, which
keeps the pieces on the host its own way, and ``stepfx.host_master_weights``
"auto", the default, or true; "auto" leaves the masters on the device when,
with the moments, 12 bytes an element would not fit the host:
``stepfx.host_memory_budget_gib``, else 85% of the physical memory over the
local ranks):

Requires: ``offload_optimizer`` ran (the updates are host jobs) and
``shard_parameters`` (the pieces are rank-held slots); before the fusions,
which would take the casts into kernels.

Ensures, for every rank-held parameter piece ``p`` (trained or frozen):

- ``p`` is host-held (``signature.extra[HOST_STATE_KEY]``; pinned with
  ``offload_optimizer.pin_memory``); the host update works on it in place
  (``params_on_host``) and makes its bf16 copy there (``copy_dtype``), which
  goes up with the update and is the step's next value of
  ``c`` = a rank-held RUNTIME_STATE slot (key ``master_copy``) that the device
  keeps between steps (``signature.extra[MASTER_COPIES_KEY]``: copy ident ->
  (piece ident, dtype, delayed); the binding makes it afresh from ``p`` when ``p`` changed
  outside the step: runtime/carried.py's :class:`PieceCopy`);
- every cast of ``p`` to bf16 reads ``c`` instead; a bucket's
  concatenation that a cast reads is made of the copies (its other parts,
  the zero pads, cast on their own).

Where a piece has a device reader other than those casts, nothing changes
and the pass fails naming it (another plan of the same step, a
gradient-accumulation micro-step, would hold the piece elsewhere).
Bitwise: rounding to bf16 is the same on the host and the device (round to
nearest even), and a cast of a concatenation is the concatenation of the
casts. Per element: host 12 bytes at rest (master and moments; DeepSpeed
16), device 2 (the copy; 4 before), over PCIe 2 down (the gradient) and 2 up
(the copy) a step, against 6 down and 4 up before.

With ``stepfx.delayed_parameter_update`` (ZeRO-Offload's one-step delayed
update, opt-in: it changes the training) each ``host_adam_wait`` becomes
``host_adam_swap``: the step returns what the previous step's host update
made and leaves its own running while the next step computes, which reads
only the copies (runtime/host_optimizer.py). Refused by key where the
masters cannot be on the host.

Before / after (one piece)::

    w16 = _to_copy(w_piece, dtype=bf16)            w16 = placeholder  # c: x_w_master_copy
    ag = all_gather(w16, 2, '0')             ->    ag = all_gather(w16, 2, '0')
    job = host_adam_start(1, w_piece, ...)         job = host_adam_start(1, w_piece, ..., params_on_host=True,
    up = host_adam_wait(job)                                             copy_dtype=bf16)
                                                   up = host_adam_wait(job); w16_next = up[3]
"""
from __future__ import annotations

import dataclasses
import operator
import os

import torch
import torch.fx as fx

from ...errors import PassError
from ...graph import HOST_PINNED_KEY, HOST_STATE_KEY, MASTER_COPIES_KEY, Role, Slot, StepGraph, Storage
from ...graph.build import bind_placeholders, clone_step_graph
from ...graph.step_graph import META_HOST_RESULTS, output_node
from ...config.errors import ConfigError
from ...runtime.host_optimizer import host_adam_start, host_adam_swap, host_adam_wait
from ..data_parallel.collectives import fake_like, make_node
from ..manager import PassOptions, PassResult
from .offload_optimizer import offload_block, offload_settings, start_of, undonate
from .recompute_activations import format_bytes

__all__ = ["host_master_weights", "master_weights_apply", "delayed_update"]

aten = torch.ops.aten
KEY = "master_copy"


def master_weights_apply(options: PassOptions) -> str | None:
    """Why the masters stay on the device, or None when they move to the host."""
    from ..data_parallel.plan_zero_layout import zero_settings

    cfg = options.config
    block = offload_settings(options)
    if block is None:
        return "no offload_optimizer"
    if getattr(getattr(cfg, "stepfx", None), "host_master_weights", "auto") is False:
        return "stepfx.host_master_weights is false"
    bf16 = getattr(cfg, "bf16", None)
    if bf16 is None or bf16.enabled is not True:
        return "the compute copies are not bf16 (fp16's overflow skip reads the fp32 pieces on the device)"
    if zero_settings(options)[0] != 3:
        return "below ZeRO-3 the user's module holds the fp32 parameters"
    if offload_block(options, "offload_param") is not None:
        return "offload_param keeps the pieces on the host itself"
    if block.ratio < 1.0:
        return "offload_optimizer.ratio < 1: some pieces are updated on the device"
    return None


def host_memory_bytes(options: PassOptions) -> tuple[int, str]:
    """What this rank's host memory is taken to be: ``stepfx.host_memory_budget_gib``, else 85% of the machine's
    physical memory shared by the ranks torchrun started on it (``LOCAL_WORLD_SIZE``)."""
    budget = getattr(getattr(options.config, "stepfx", None), "host_memory_budget_gib", None)
    if budget is not None:
        return int(budget * 2**30), "stepfx.host_memory_budget_gib"
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return int(0.85 * physical / local), f"85% of the host's {format_bytes(physical)} over {local} local rank(s)"


def _over_host_memory(pieces: list[fx.Node], options: PassOptions) -> str | None:
    """Why the masters stay on the device when, with the moments, they would not fit the host: counted from
    the pieces alone (12 bytes an element), so every plan of a step (update or micro-step) decides alike."""
    if getattr(getattr(options.config, "stepfx", None), "host_master_weights", "auto") is True:
        return None
    elements = sum(p.meta["val"].numel() for p in pieces)
    room, what = host_memory_bytes(options)
    if 12 * elements <= room:
        return None
    return (f"the fp32 masters would not fit the host with the moments ({format_bytes(12 * elements)} on this rank "
            f"against {format_bytes(room)}: {what}); they stay on the device (8 host bytes an element); "
            "stepfx.host_master_weights true moves them anyway")


def _cast_to(node: fx.Node, dtype) -> bool:
    return (node.op == "call_function" and node.target is aten._to_copy.default and node.kwargs.get("dtype") == dtype
            and set(node.kwargs) <= {"dtype", "layout", "device"} and len(node.args) == 1)


def delayed_update(options: PassOptions) -> bool:
    value = getattr(getattr(options.config, "stepfx", None), "delayed_parameter_update", False)
    return value is not False and value is not None


def exact_first_steps(options: PassOptions) -> int:
    """``delayed_parameter_update: N``: the optimizer steps before the delay begins (true: none)."""
    value = getattr(getattr(options.config, "stepfx", None), "delayed_parameter_update", False)
    return 0 if isinstance(value, bool) else int(value)


def host_master_weights(graph: StepGraph, options: PassOptions) -> PassResult:
    why = master_weights_apply(options)
    delayed = delayed_update(options)
    if why is not None and delayed:
        raise ConfigError("stepfx.delayed_parameter_update", "needs the fp32 masters on the host, updated there while "
                          f"the next step computes (host_master_weights), and they are not here: {why}", value=True,
                          expected="false, or bf16 with zero_optimization.stage 3 and offload_optimizer (ratio 1)")
    if why is not None:
        return PassResult(graph, False, why)
    dtype = torch.bfloat16
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    pieces = [n for n in g.nodes if n.op == "placeholder" and n.meta["slot"].role is Role.PARAM
              and n.meta["slot"].storage is Storage.RANK and n.meta["slot"].piece is not None]
    if not pieces:
        if delayed:
            raise ConfigError("stepfx.delayed_parameter_update", "has nothing to delay: no parameter is held in pieces "
                              "by this rank (all under zero_optimization.stage3_param_persistence_threshold, updated "
                              "on the device)", value=True, expected="false, or a lower persistence threshold")
        return PassResult(graph, False, "no parameter is held in pieces by this rank")
    over = _over_host_memory(pieces, options)
    if over is not None and delayed:
        raise ConfigError("stepfx.delayed_parameter_update", f"needs the fp32 masters on the host: {over}", value=True,
                          expected="false, or stepfx.host_master_weights true")
    if over is not None:
        return PassResult(graph, False, over)
    chosen = set(pieces)
    casts, cats, starts = [], {}, {}
    for p in pieces:
        for u in p.users:
            if u.target is host_adam_start:
                starts[u] = None
            elif _cast_to(u, dtype):
                casts.append((p, u))
            elif u.target is aten.cat.default and u.users and all(_cast_to(c, dtype) for c in u.users):
                cats[u] = None
            else:
                raise PassError(f"host_master_weights: {u.name} ({u.target}) reads the fp32 piece {p.name} on the "
                                "device, where only its bf16 copy will be; set stepfx.host_master_weights false")
    for start in starts:
        count = start.args[0]
        off = [a for a in start.args[1:1 + count] if a not in chosen]
        if off:
            raise PassError(f"host_master_weights: {start.name} updates {off[0].name}, not a rank-held piece")

    sig = graph.signature
    inputs, outputs = list(sig.inputs), list(sig.outputs)
    out = output_node(graph.gm)
    returned = list(out.args[0])
    copy_of: dict[fx.Node, fx.Node] = {}
    masters: dict = {}
    last_ph = [n for n in g.nodes if n.op == "placeholder"][-1]
    for p in pieces:
        pslot = p.meta["slot"]
        slot = Slot(Role.RUNTIME_STATE, pslot.name, key=KEY, storage=Storage.RANK)
        with g.inserting_after(last_ph):
            c = last_ph = g.placeholder(f"{pslot.name}_{KEY}")
        c.meta.update(slot=slot, val=fake_like(p.meta["val"], p.meta["val"].shape, dtype))
        inputs.append(slot)
        copy_of[p] = c
        masters[slot.ident] = (pslot.ident, dtype, delayed)
    for p, cast in casts:
        cast.replace_all_uses_with(copy_of[p])
        g.erase_node(cast)
    for cat in cats:
        parts = []
        with g.inserting_before(cat):
            for x in cat.args[0]:
                if x in copy_of:
                    parts.append(copy_of[x])
                else:  # a zero pad (or another part): cast on its own
                    val = x.meta["val"]
                    parts.append(make_node(g, aten._to_copy.default, (x,), {"dtype": dtype},
                                           val=fake_like(val, val.shape, dtype), like=cat, name="pad_16bit"))
            made = make_node(g, aten.cat.default, (parts, *cat.args[1:]), cat.kwargs,
                             val=fake_like(cat.meta["val"], cat.meta["val"].shape, dtype), like=cat, name="bucket_16bit")
        for cast in list(cat.users):
            cast.replace_all_uses_with(made)
            g.erase_node(cast)
        g.erase_node(cat)
    waits = [n for n in g.nodes if n.target is host_adam_wait and start_of(n) in starts]
    written = 0
    for wait in waits:
        start = start_of(wait)
        count = start.args[0]
        params = start.args[1:1 + count]
        undonate(start)
        start.kwargs = {**start.kwargs, "params_on_host": True, "copy_dtype": dtype}
        vals = tuple(wait.meta["val"]) + tuple(copy_of[p].meta["val"] for p in params)
        if delayed:  # the previous step's results, this step's update left running (runtime/host_optimizer.py)
            moments = [start.args[1 + count * k + i] for i in range(count) for k in (2, 3)]
            current = [x for i in range(count) for x in (params[i], moments[2 * i], moments[2 * i + 1])]
            wait.target = host_adam_swap
            wait.args = (wait.args[0], *current, *(copy_of[p] for p in params))
            kwargs = {"idents": tuple(copy_of[p].meta["slot"].ident for p in params)}
            if exact_first_steps(options):  # the first piece's step counter says which optimizer step this is
                kwargs.update(step=start.args[1 + count * 4], step_is_new=start.kwargs.get("step_is_new", False),
                              exact_steps=exact_first_steps(options))
            wait.kwargs = kwargs
        wait.meta["val"] = vals
        wait.meta[META_HOST_RESULTS] = tuple(sorted({*wait.meta.get(META_HOST_RESULTS, ()),
                                                     *(3 * i for i in range(count))}))
        with g.inserting_after(wait):
            for i, p in enumerate(params):
                nxt = make_node(g, operator.getitem, (wait, 3 * count + i), val=vals[3 * count + i], like=wait,
                                name="master_copy_next")
                outputs.append(copy_of[p].meta["slot"])
                returned.append(nxt)
                written += 1
    out.args = (tuple(returned),)
    bind_placeholders(graph.gm, inputs)
    block = offload_settings(options)
    idents = frozenset(p.meta["slot"].ident for p in pieces)
    extra = {**sig.extra, HOST_STATE_KEY: frozenset(sig.extra.get(HOST_STATE_KEY, ())) | idents,
             MASTER_COPIES_KEY: {**sig.extra.get(MASTER_COPIES_KEY, {}), **masters}}
    if block.pin_memory:
        extra[HOST_PINNED_KEY] = frozenset(sig.extra.get(HOST_PINNED_KEY, ())) | idents
    graph = graph.replace(signature=dataclasses.replace(sig, inputs=tuple(inputs), outputs=tuple(outputs), extra=extra))
    g.lint()
    graph.gm.recompile()
    elements = sum(p.meta["val"].numel() for p in pieces)
    return PassResult(graph, True, f"{len(pieces)} fp32 parameter pieces ({format_bytes(4 * elements)}) held on the "
                                   f"host as masters, their bf16 copies ({format_bytes(2 * elements)}) on the device; "
                                   f"{written} copies made by the host update each step"
                                   + ("; delayed parameter update: each step's host update runs while the next "
                                      "step computes (it computes at the parameters of two updates before)"
                                      + (f", after {exact_first_steps(options)} exact first steps"
                                         if exact_first_steps(options) else "")
                                      if delayed else ""))
