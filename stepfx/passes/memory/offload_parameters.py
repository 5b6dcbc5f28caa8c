"""offload_parameters: ZeRO-3's parameter pieces at rest on the host (ZeRO-Infinity's parameter offload).

``zero_optimization.offload_param`` (``device: cpu | nvme``, ``nvme_path``,
``pin_memory``, ``buffer_count``) with stage 3: the piece of each sharded
parameter this rank holds between steps lives in host memory (pinned when
``pin_memory``), or with ``nvme`` in a mapped file under ``nvme_path``
(runtime/binding.py). The device holds a piece only from shortly before a
reader needs it until its last reader in that phase.

Requires: ``shard_parameters`` ran (the pieces are rank-held slots); run
after every pass that adds readers of the pieces (the fusions, the carried
16-bit copies), so that every device reader is seen.

Ensures, per host-held piece ``p`` (runtime/host_params.py does the copies):

- each phase (forward, backward, optimizer) whose device ops read ``p``
  reads ``host_fetch_wait(h)`` instead, placed before the phase's first
  reader; ``h = host_fetch_start(p)`` is placed ``buffer_count`` fetches
  earlier in program order (the copy up runs on the parameter stream while
  the device computes; at most ``buffer_count`` are in flight ahead of
  their readers);
- ``host_adam_start`` (``offload_optimizer``) reads ``p`` itself: the host
  update works on the host piece in place, with no copy down or up of the
  parameter;
- an updated piece made on the device is copied into ``p``
  (``host_store``) right after the last read of the old value, and the
  step returns ``p``; the last store of the step waits for the copies.

The arithmetic is unchanged (the copies are exact). Accounting: the pieces
are host memory (``signature.extra[HOST_STATE_KEY]``); a fetched copy is
device memory from its fetch to its last reader.

Before / after (stage 3, one parameter's forward gather)::

                                               h = host_fetch_start(w_piece, device='cuda:0')
    ag = all_gather(w_piece, 2, '0')    ->     w_dev = host_fetch_wait(h)
                                               ag = all_gather(w_dev, 2, '0')
"""
from __future__ import annotations

import dataclasses
import operator

import torch.fx as fx

from ...config.errors import ConfigError, join
from ...config.values import AUTO
from ...errors import PassError
from ...graph import HOST_PINNED_KEY, HOST_STATE_KEY, HOST_STATE_NVME_KEY, Role, StepGraph, Storage
from ...graph.step_graph import META_HOST_RESULTS, META_PHASE
from ...graph.build import clone_step_graph
from ...graph.ops import allocates_nothing, is_collective
from ...runtime.host_optimizer import host_adam_start, host_adam_wait
from ...runtime.host_params import host_fetch_start, host_fetch_wait, host_store
from .offload_optimizer import offload_block, offload_settings, start_of, undonate
from ..data_parallel.collectives import make_node
from ..manager import PassOptions, PassResult
from .recompute_activations import format_bytes

__all__ = ["offload_parameters", "param_offload_settings"]

_PATH = "zero_optimization.offload_param"
DEFAULT_BUFFERS = 5  # DeepSpeed's offload_param.buffer_count default


def param_offload_settings(options: PassOptions):
    """The ``offload_param`` block when it moves parameters off the device, else None."""
    return offload_block(options, "offload_param")


def _tier(block) -> tuple:
    return block.device, str(block.nvme_path) if block.device == "nvme" else None


def _refuse_unsupported(block, options: PassOptions) -> None:
    from ..data_parallel.plan_zero_layout import zero_settings
    from ..pipeline.partition_stages import pipeline_settings

    if zero_settings(options)[0] != 3:
        raise ConfigError(_PATH, "needs ZeRO stage 3 (the parameters at rest are the rank's pieces; DeepSpeed "
                          f"refuses it below stage 3 too); zero_optimization.stage is {zero_settings(options)[0]}",
                          value=block.device, expected="zero_optimization.stage 3")
    if pipeline_settings(options) > 1:
        raise ConfigError(_PATH, ("is not implemented with pipeline parallelism (ZeRO-3 there keeps each data-parallel rank's share "
                          "of a stage on the device, runtime/pipeline_params.py)"),
                          value=block.device, expected="'none' with pipeline.stages > 1")
    if block.device == "nvme" and (not block.nvme_path or block.nvme_path is AUTO):
        raise ConfigError(join(_PATH, "nvme_path"), "device 'nvme' needs the directory the parameters are kept in",
                          value=block.nvme_path, expected="a directory on the NVMe drive")
    opt = offload_settings(options)
    if opt is not None and _tier(opt) != _tier(block):  # the binding backs every host slot by one tier
        raise ConfigError(join(_PATH, "device"), f"{block.device!r} with offload_optimizer on {opt.device!r}"
                          f"{' under ' + str(opt.nvme_path) if opt.device == 'nvme' else ''}: both tiers must be the "
                          "same (one directory for the files) in this version", value=block.device,
                          expected=f"{opt.device!r}" + (f" with nvme_path {opt.nvme_path}" if opt.device == "nvme" else ""))


def offload_parameters(graph: StepGraph, options: PassOptions) -> PassResult:
    block = param_offload_settings(options)
    if block is None:
        return PassResult(graph, False)
    _refuse_unsupported(block, options)
    if not _pieces(graph.gm.graph):
        return PassResult(graph, False, "no parameter is held in pieces by this rank (all under the persistence threshold)")
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    host = _pieces(g)
    depth = block.buffer_count if isinstance(block.buffer_count, int) and block.buffer_count > 0 else DEFAULT_BUFFERS
    nodes = list(g.nodes)
    output = nodes[-1]
    host_set = set(host)

    # the host update reads and updates host pieces in place: its updated pieces are host tensors too
    host_values: dict[fx.Node, fx.Node] = {p: p for p in host}  # value -> the host piece (placeholder) it is
    for node in nodes:
        if node.target is host_adam_start:
            on_host = [p in host_set for p in node.args[1:1 + node.args[0]]]
            if any(on_host) and not all(on_host):
                raise PassError(f"{node.name} updates host-held and device-held parameter pieces together")
            if all(on_host):
                undonate(node)
                node.kwargs = {**node.kwargs, "params_on_host": True}
        if node.target is host_adam_wait:
            start = start_of(node)
            count = start.args[0]
            params = start.args[1:1 + count]
            results = set(node.meta.get(META_HOST_RESULTS, ()))
            for use in node.users:
                i = use.args[1]
                if use.target is operator.getitem and i % 3 == 0 and params[i // 3] in host_set:
                    host_values[use] = params[i // 3]
                    results.add(i)
            node.meta[META_HOST_RESULTS] = tuple(sorted(results))

    # fetch points: (host value, phase) -> its device readers there, in program order
    pos = {n: i for i, n in enumerate(nodes)}
    points: dict[tuple, list[fx.Node]] = {}
    for value in host_values:
        for user in sorted(value.users, key=pos.__getitem__):
            if user is output or user.target is host_adam_start or user in host_values:
                continue
            points.setdefault((value, user.meta.get(META_PHASE)), []).append(user)
    ordered = sorted(points.items(), key=lambda kv: pos[kv[1][0]])
    fetched = 0
    moved = 0
    for i, ((value, _), readers) in enumerate(ordered):
        first = readers[0]
        anchor = ordered[max(0, i - depth)][1][0]  # the first ``depth`` start together, before the first reader
        if pos[anchor] <= pos[value]:  # not before the value exists
            anchor = value.next
        val = value.meta["val"]
        with g.inserting_before(anchor if anchor.op != "placeholder" else _first_op(g)):
            start = make_node(g, host_fetch_start, (value,), {"device": str(val.device)}, val=val, like=first,
                              name="fetch")
        with g.inserting_before(first):
            wait = make_node(g, host_fetch_wait, (start,), val=val, like=first, name="fetched")
        for reader in readers:
            reader.replace_input_with(value, wait)
        fetched += 1
        moved += val.numel() * val.element_size()

    started_late = _starts_after_readers(g)

    # updated pieces made on the device go back into the host tensor, after the old value's last reader
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    out_args = list(output.args[0])
    by_ident = {p.meta["slot"].ident: p for p in host}
    stores = []
    for j, slot in enumerate(graph.signature.outputs):
        value = out_args[j]
        piece = by_ident.get(slot.ident)
        if piece is None or not isinstance(value, fx.Node) or value in host_values:
            continue
        readers = [u for n in _aliases(piece) for u in n.users if u is not output]
        after = max([value, *readers], key=pos.__getitem__)  # nodes there before the stores: positions hold
        with g.inserting_after(after):
            store = make_node(g, host_store, (piece, value), val=piece.meta["val"], like=value, name="stored")
        out_args[j] = store
        stores.append(store)
    if stores:
        pos = {n: i for i, n in enumerate(g.nodes)}
        max(stores, key=pos.__getitem__).kwargs = {"last": True}
        output.args = (tuple(out_args),) + tuple(output.args[1:])
    graph.gm.recompile()
    sig = graph.signature
    idents = frozenset(p.meta["slot"].ident for p in host)
    extra = {**sig.extra, HOST_STATE_KEY: frozenset(sig.extra.get(HOST_STATE_KEY, ())) | idents}
    if block.pin_memory:
        extra[HOST_PINNED_KEY] = frozenset(sig.extra.get(HOST_PINNED_KEY, ())) | idents
    if block.device == "nvme":
        extra[HOST_STATE_NVME_KEY] = str(block.nvme_path)
    graph = graph.replace(signature=dataclasses.replace(sig, extra=extra))
    at_rest = sum(p.meta["val"].numel() * p.meta["val"].element_size() for p in host)
    where = f"in files under {block.nvme_path}" if block.device == "nvme" else \
        ("pinned host memory" if block.pin_memory else "host memory (not pinned: pin_memory false)")
    return PassResult(graph, True, f"{len(host)} parameter pieces ({format_bytes(at_rest)}) at rest in {where}; "
                                   f"{fetched} fetches up a step ({format_bytes(moved)}), at most {depth} ahead of "
                                   f"their readers; {len(stores)} updated pieces copied back down"
                                   + (f"; {started_late} host updates moved after the last reader of the pieces "
                                      "they update in place" if started_late else ""))


def _starts_after_readers(g: fx.Graph) -> int:
    """Move each host update that works on host pieces in place (``params_on_host``) after the last reader of
    those pieces: the fetches (their copies up must be done before the host writes the piece) and, through
    the fetched values, their views and collectives, what reads them (on a CPU device the fetched value is
    the piece itself). A start that speculates comes as soon as its gradients exist, in the backward, where the same
    layer's input gradient may still read the piece: updated under it, that gradient would be wrong (a
    validation restores the piece, not what was computed from it). Its validation follows it. How many moved."""
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    moved = 0
    for start in [n for n in nodes if n.target is host_adam_start and n.kwargs.get("params_on_host")]:
        readers: list[fx.Node] = []
        todo = list(start.args[1:1 + start.args[0]])
        seen = set(todo)
        while todo:
            value = todo.pop()
            for user in value.users:
                if user is start or user.op == "output" or user in seen:
                    continue
                seen.add(user)
                readers.append(user)
                if user.target in (host_fetch_start, host_fetch_wait) or allocates_nothing(user) or is_collective(user):
                    # the same memory (a view, or the fetched piece on a CPU device), or a collective that reads
                    # it until its wait (gloo's runs on its own thread)
                    todo.append(user)
        last = max(readers, key=pos.__getitem__, default=None)
        if last is None or pos[last] < pos[start]:
            continue
        followers = [u for u in start.users if u.target is not host_adam_wait and pos[u] <= pos[last]]
        waits = [u for u in start.users if u.target is host_adam_wait]
        if any(pos[w] <= pos[last] for w in waits):
            raise PassError(f"{start.name}: the host update's results are read before the last reader of the "
                            f"pieces it updates in place ({last.name})")
        anchor = last
        for node in [start, *sorted(followers, key=pos.__getitem__)]:
            anchor.append(node)
            anchor = node
        moved += 1
        pos = {n: i for i, n in enumerate(g.nodes)}
    return moved


def _pieces(g: fx.Graph) -> list[fx.Node]:
    """The placeholders of the parameter pieces this rank holds (ZeRO-3)."""
    return [n for n in g.nodes if n.op == "placeholder" and n.meta["slot"].role is Role.PARAM
            and n.meta["slot"].storage is Storage.RANK]


def _first_op(g: fx.Graph) -> fx.Node:
    return next(n for n in g.nodes if n.op != "placeholder")


def _aliases(piece: fx.Node) -> list[fx.Node]:
    """``piece`` and the fetched copies of it (on a CPU device they are the same tensor)."""
    out = [piece]
    for start in [u for u in piece.users if u.target is host_fetch_start]:
        out.extend(u for u in start.users if u.target is host_fetch_wait)
    return out
