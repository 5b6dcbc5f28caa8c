"""update_across_steps: the host update that waits for the norm finishes in the next step.

``stepfx.host_update_across_steps`` with ``offload_optimizer`` at ZeRO-3.
Under clipping or fp16 loss scaling a host update cannot begin before the
global norm, known once the backward is over; without speculation the
device then idles for the whole update (4.7 s of a 10.6 s step at 13B on
the H200 machine). Here the step ends as soon as the updates are started,
and the next step waits for each bucket's update where it first reads that
bucket: its forward runs behind the host, bucket by bucket. The
arithmetic is the same (nothing is stale, unlike ``delayed_parameter_update``).

Requires: ``offload_optimizer`` made the host jobs without speculation;
the pieces are ZeRO-3's rank-held pieces, donated to their start (device
masters) or host-held with 16-bit copies on the device (``host_master_weights``);
after every pass that moves readers of the pieces or copies (the fusions).

Ensures, for every ``host_adam_wait`` whose job updates such pieces:

- the wait is gone; what it returned is what the step read (the pieces are
  donated and the moments and host masters updated in place; the copies are
  given to the start, ``copy_into``, and written in place: ``META_DONATED``,
  so verify checks nothing reads them after it), and the start runs
  ``across_steps``: it registers the device tensors its job writes;
- each such device tensor ``x`` (the piece, or the copy) is read through
  ``r = host_adam_ready(x)``, placed before its first reader: the previous
  step's job for ``x`` done (the first step: nothing to wait for);
- the starts that wait for the norm begin in the order the forward reads
  their pieces (the worker runs jobs in order: the first layers' first).

Before / after (one piece, device masters)::

    ag = all_gather(w, ...)                      w_ready = host_adam_ready(w)
    ...                                          ag = all_gather(w_ready, ...)
    job = host_adam_start(1, w, g, ...)     ->   ...
    up = host_adam_wait(job)                     job = host_adam_start(1, w_ready, g, ..., across_steps=True)
    return (up[0], up[1], up[2])                 return (w_ready, m, v)
"""
from __future__ import annotations

import dataclasses
import operator

import torch.fx as fx

from ...config.errors import ConfigError
from ...graph import MASTER_COPIES_KEY, StepGraph
from ...graph.build import clone_step_graph
from ...graph.step_graph import META_DONATED
from ...runtime.host_optimizer import host_adam_ready, host_adam_wait
from ..data_parallel.collectives import make_node
from ..manager import PassOptions, PassResult
from .host_master_weights import delayed_update
from .offload_optimizer import offload_block, offload_settings, start_of

__all__ = ["update_across_steps", "across_steps_apply"]

_KEY = "stepfx.host_update_across_steps"


def across_steps_apply(options: PassOptions) -> bool:
    """Asked for, where it applies: a host update at ZeRO-3 (below it the updated pieces are gathered into the
    whole parameters within the step; the memory planner's candidates without offload or at other stages
    simply run without it, and explain() lists the pass as not applicable)."""
    from ..data_parallel.plan_zero_layout import zero_settings

    asked = getattr(getattr(options.config, "stepfx", None), "host_update_across_steps", False) is True
    return asked and offload_settings(options) is not None and zero_settings(options)[0] == 3


def _check(options: PassOptions) -> None:
    stepfx = getattr(options.config, "stepfx", None)
    if delayed_update(options):
        raise ConfigError(_KEY, "and stepfx.delayed_parameter_update both move the host update into the next step; "
                          "choose one (this one is exact, the delayed update one step stale)", value=True,
                          expected="false with delayed_parameter_update")
    if getattr(stepfx, "host_update_speculation", "auto") is True:
        raise ConfigError(_KEY, "and stepfx.host_update_speculation true overlap the host update with different "
                          "work; the speculated updates go into new tensors, which this writes in place",
                          value=True, expected="false, or host_update_speculation 'auto' (turned off) or false")
    if offload_block(options, "offload_param") is not None:
        raise ConfigError(_KEY, "is not implemented with zero_optimization.offload_param (its pieces are fetched "
                          "from the host by their own prefetches)", value=True, expected="false with offload_param")


def update_across_steps(graph: StepGraph, options: PassOptions) -> PassResult:
    _check(options)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    waits = [n for n in g.nodes if n.target is host_adam_wait]
    if not waits:
        return PassResult(graph, False, "no host update here (a micro-step, or every piece updated on the device)")
    copies_of = {}  # host master placeholder -> its copy placeholder (host_master_weights)
    masters = graph.signature.extra.get(MASTER_COPIES_KEY, {})
    by_ident = {n.meta["slot"].ident: n for n in g.nodes if n.op == "placeholder"}
    for copy_ident, (piece_ident, _, _) in masters.items():
        copies_of[by_ident[piece_ident]] = by_ident[copy_ident]
    written: dict[fx.Node, fx.Node] = {}  # device tensor a job writes in place -> its start
    moved = 0
    for wait in waits:  # all or none: a step whose updates only partly finish later would be two rules at once
        start = start_of(wait)
        if start is not wait.args[0] or start.kwargs.get("speculative"):
            raise ConfigError(_KEY, f"{start.name} speculates on the norm; the update across steps needs "
                              "host_update_speculation false", value=True, expected="false")
        if not start.kwargs.get("params_on_host") and META_DONATED not in start.meta:
            return PassResult(graph, False, f"{start.name}'s updated pieces are read later in the step (not donated): "
                                            "the updates stay within the step")
        if start.kwargs.get("params_on_host") and start.kwargs.get("copy_dtype") is None:
            raise ConfigError(_KEY, f"{start.name} updates host-held pieces without 16-bit copies", value=True,
                              expected="false")
        if any(u.target is not operator.getitem for u in wait.users):
            raise ConfigError(_KEY, f"{wait.name}'s results are read as a whole", value=True, expected="false")
    for wait in waits:
        start = start_of(wait)
        count = start.args[0]
        params = list(start.args[1:1 + count])
        on_host = bool(start.kwargs.get("params_on_host"))
        moments = [start.args[1 + count * k + i] for i in range(count) for k in (2, 3)]
        current = [x for i in range(count) for x in (params[i], moments[2 * i], moments[2 * i + 1])]
        copies = [copies_of[p] for p in params] if on_host else []
        for user in list(wait.users):
            i = user.args[1]
            user.replace_all_uses_with(current[i] if i < 3 * count else copies[i - 3 * count])
            g.erase_node(user)
        g.erase_node(wait)
        kwargs = {**start.kwargs, "across_steps": True}
        if on_host:  # the copies follow the scalars, written in place
            first = len(start.args)
            start.args = (*start.args, *copies)
            start.meta[META_DONATED] = tuple(range(first, first + count))
            for c in copies:
                written[c] = start
        else:
            for p in params:
                written[p] = start
        start.kwargs = kwargs
        moved += 1
    # each written tensor read through its ready, before its first reader
    order = {n: i for i, n in enumerate(g.nodes)}
    for x in written:
        readers = list(x.users)
        first = min(readers, key=order.__getitem__)
        with g.inserting_before(first):
            r = make_node(g, host_adam_ready, (x,), val=x.meta["val"], like=first, name=f"{x.name}_ready")
        for u in readers:
            u.replace_input_with(x, r)
    order = {n: i for i, n in enumerate(g.nodes)}
    reordered = _forward_order(set(written.values()), order)
    sig = graph.signature
    extra = dict(sig.extra)
    if masters:  # a host update may run on the masters between steps: the binding keeps the copies the steps left
        extra[MASTER_COPIES_KEY] = {c: (p, dtype, True) for c, (p, dtype, _) in masters.items()}
    graph = graph.replace(signature=dataclasses.replace(sig, extra=extra))
    g.lint()
    graph.gm.recompile()
    return PassResult(graph, True, f"{moved} host updates finish in the next step, which waits for each where it "
                                   f"first reads its {len(written)} pieces or copies"
                                   + (f"; {reordered} started in the order the forward reads them" if reordered else ""))


def _forward_order(starts: set, order: dict) -> int:
    """The starts that follow one node (the norm's factor: none can begin before it) reordered so that the
    worker updates first the pieces the next forward reads first; how many moved."""
    by_anchor: dict[fx.Node, list] = {}
    for start in starts:
        anchor = max(start.all_input_nodes, key=order.__getitem__)
        by_anchor.setdefault(anchor, []).append(start)
    moved = 0
    for anchor, group in by_anchor.items():
        first_read = {s: min(order[a] for a in s.args if isinstance(a, fx.Node) and a.target is host_adam_ready)
                      for s in group}
        wanted = sorted(group, key=first_read.__getitem__)
        if wanted == sorted(group, key=order.__getitem__):
            continue
        at = anchor
        for s in wanted:
            at.append(s)
            at = s
        moved += len(group)
    return moved
