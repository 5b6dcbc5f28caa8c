"""Replay a plan's step as CUDA graphs.

Why: a step launches thousands of kernels from Python. On one H200 the 1.3B
GPT's device work is ~128 ms and the host needs about as long to launch it,
so the GPU waits between kernels. A captured graph is launched with one call.

How (:class:`GraphedStep`):

- *Partition.* The graph's nodes, in program order, become captured
  *segments* and *eager* nodes. A node runs eagerly on every call when it
  reads a host value (or syncs with the host): the learning rate, betas
  and step counters live on the CPU, and a kernel takes them as arguments
  that a graph would freeze (the step counter changes every step). Eager nodes move later,
  never earlier: up to the first captured node that reads them or writes
  what they read. So the optimizer's host arithmetic and its update (one
  multi-tensor launch) gather after the backward, and the GPT step at ZeRO
  0-3 is one segment and a few eager nodes. A collective and its wait must
  fall in one segment (NCCL's stream has to rejoin the capture).
- *Capture.* On the plan's third run (the first two compile and autotune
  kernels and fill their caches) each segment is captured and replayed at
  once, so the capturing call is an ordinary step. All captures of a step
  share one memory pool.
- *Replay.* The graphs read fixed addresses. Batch tensors are copied into
  buffers of the step's own; every other input is read where the user's
  objects (or the rank's store) keep it, and when one of them moved (a
  tensor replaced, ``p.data = ...``) the step is captured again. Eager
  results a segment reads are copied into the captured buffers unless they
  are already there; state the step updates out of place is copied into its
  input's tensor (in place, as torch's optimizers update); the user's
  outputs are cloned (the next replay overwrites them).
- *Failure.* A capture that fails (an op that syncs with the host, say)
  logs why, the rest of that step runs eagerly, and the plan stays eager.
- *Random ops* (dropout) in a segment draw from the CUDA generator's
  graph-safe state, which torch advances on every replay; nothing checks
  that a replayed step draws the numbers an eager step would.

Off by default: on the 1.3B GPT (2xH200) replay measured no faster than
launching (benchmarks/README.md); the step is not launch-bound.

``EMULATE`` lets the CPU test suite drive all of this: "capture" runs the
segment and records it; "replay" re-runs its nodes on the recorded input
tensors and writes every result into the tensor recorded for it, as a
kernel of a graph writes its captured address.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..graph import Role
from ..graph.ops import storage_root, written_args

__all__ = ["GraphedStep", "PoolHolder", "Segment", "partition", "WARMUP_RUNS", "EMULATE", "NotGraphable"]

log = logging.getLogger("stepfx")

WARMUP_RUNS = 2  # eager runs of a plan before its capture: compile, autotune, fill caches
MIN_SEGMENT_OPS = 8  # shorter runs of capturable ops between eager ones run eagerly
EMULATE = False  # CPU tests: emulate capture and replay (see the module docstring)

c10d = torch.ops._c10d_functional
_HOST_SYNC = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                        torch.ops.aten.masked_select.default, torch.ops.aten._assert_async.msg})


class NotGraphable(Exception):
    """Why a step cannot be replayed as graphs."""


class PoolHolder:
    """The first graph a step captured: later captures (its other segments,
    its other plans) allocate from that graph's memory pool, which lives
    as long as this holder keeps the graph."""

    def __init__(self):
        self.graph = None


@dataclass
class Segment:
    nodes: list[fx.Node]
    inputs: list[fx.Node] = field(default_factory=list)  # made outside, read inside
    exports: list[fx.Node] = field(default_factory=list)  # made inside, read after
    graph: Any = None


def _is_host(val, device_type: str) -> bool:
    """A value that lives on the host: a CPU tensor of a CUDA step, or a
    scalar (SymFloat, int) an op made. Under ``EMULATE`` (everything is on
    the CPU) 0-d tensors stand for them."""
    if isinstance(val, torch.Tensor):
        return val.dim() == 0 if device_type == "cpu" else val.device.type == "cpu"
    if isinstance(val, (list, tuple)):
        return any(_is_host(v, device_type) for v in val)
    return isinstance(val, (torch.SymFloat, torch.SymInt, float, int)) and not isinstance(val, bool)


def partition(gm: fx.GraphModule, device_type: str) -> list:
    """The program: :class:`Segment` s and eager nodes, in the order they run.
    Raises :class:`NotGraphable` when a collective and its wait would land
    in different segments, or nothing is worth capturing."""
    host: dict[fx.Node, bool] = {}
    eager: set[fx.Node] = set()
    program: list = []
    pending: list[fx.Node] = []  # eager nodes not yet placed
    current: list[fx.Node] = []
    pending_reads: set[fx.Node] = set()  # storage roots the pending eager nodes read

    def flush():
        nonlocal current
        if current:
            program.append(Segment(current))
            current = []
        program.extend(pending)
        pending.clear()
        pending_reads.clear()

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            host[node] = _is_host(node.meta.get("val"), device_type) if node.op == "placeholder" else False
            continue
        if node.op == "output":
            break
        inputs = node.all_input_nodes
        if node.target is operator.getitem:
            is_eager = inputs[0] in eager
        else:
            # host values come from the host: CPU inputs and what eager ops
            # make of them. A CPU result of a device op (the RNG seed and
            # offset attention returns) is made at capture and kept, so it
            # does not make its readers eager; an op that syncs does.
            is_eager = (any(host[a] for a in inputs) or node.target in _HOST_SYNC
                        or (not inputs and _is_host(node.meta.get("val"), device_type)))
        host[node] = is_eager and _is_host(node.meta.get("val"), device_type)
        if is_eager:
            eager.add(node)
            pending.append(node)
            pending_reads.update(storage_root(a) for a in inputs)
            continue
        if any(a in eager for a in inputs) or {storage_root(w) for w in written_args(node) if isinstance(w, fx.Node)} & pending_reads:
            flush()
        current.append(node)
    flush()
    # a segment of a few ops between eager ones saves a launch or two and
    # costs copies of the eager results it reads: those ops run eagerly
    program = [n for item in program
               for n in ((item,) if not isinstance(item, Segment) or len(item.nodes) >= MIN_SEGMENT_OPS else item.nodes)]
    merged: list = []
    for item in program:
        if isinstance(item, Segment) and merged and isinstance(merged[-1], Segment):
            merged[-1].nodes.extend(item.nodes)
        else:
            merged.append(item)
    program = merged
    if not any(isinstance(item, Segment) for item in program):
        raise NotGraphable("no op runs on the device without a host value")
    segment_of = {n: i for i, item in enumerate(program) if isinstance(item, Segment) for n in item.nodes}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is c10d.wait_tensor.default:
            issue = node.args[0]
            if segment_of.get(issue) != segment_of.get(node):
                raise NotGraphable(f"the collective {issue.name} and its wait {node.name} would run in different "
                                   "segments (an op between them reads a host value)")
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    for i, item in enumerate(program):
        if not isinstance(item, Segment):
            continue
        inside = set(item.nodes)
        item.inputs = list(dict.fromkeys(a for n in item.nodes for a in n.all_input_nodes if a not in inside))
        item.exports = [n for n in item.nodes if any(u not in inside for u in n.users) or any(u in outputs for u in n.users)]
    return program


def _same_place(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


def _copy_into(static, value) -> None:
    """Put ``value`` where the graphs read ``static`` (tensors, or tuples of them)."""
    if isinstance(static, torch.Tensor):
        if not _same_place(static, value):
            static.copy_(value)
    elif isinstance(static, (list, tuple)):
        for s, v in zip(static, value):
            _copy_into(s, v)


class _Emulated:
    """A recorded segment (``EMULATE``): replay re-runs each node on the
    tensors it produced at capture and copies the results into them."""

    def __init__(self, runner: "GraphedStep", segment: Segment, env: dict):
        self.steps = [(n, env[n]) for n in segment.nodes]
        self.runner = runner
        self.recorded = {n: env[n] for n in segment.nodes}
        self.inputs = {a: env[a] for a in segment.inputs}

    def replay(self) -> None:
        # inside the segment each node reads what the one before it returned
        # (a collective's wait must get the very tensor the collective did)
        values = dict(self.inputs)
        for node, static in self.steps:
            values[node] = result = self.runner.run_node(node, values)
            _copy_into(static, result)


class GraphedStep:
    """Capture and replay one plan's graph (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, device_type: str, signature, pool: PoolHolder | None = None):
        symbolic = [n.name for n in gm.graph.nodes if n.op == "placeholder"
                    and any(isinstance(s, torch.SymInt) for s in getattr(n.meta.get("val"), "shape", ()))]
        if symbolic:  # a CUDA graph replays the sizes it was recorded at
            raise NotGraphable(f"the batch sizes are symbolic ({symbolic[0]}; stepfx.dynamic): a CUDA graph replays "
                               "one size; set stepfx.dynamic false for a graph per size")
        from .host_optimizer import host_adam_start

        from .host_params import activation_store, host_fetch_start

        if any(n.target is host_adam_start for n in gm.graph.nodes):
            raise NotGraphable("the optimizer update runs on the host (zero_optimization.offload_optimizer)")
        if any(n.target is host_fetch_start for n in gm.graph.nodes):
            raise NotGraphable("the parameters' pieces live on the host (zero_optimization.offload_param)")
        if any(n.target is activation_store for n in gm.graph.nodes):
            raise NotGraphable("the saved activations go to the host (activation_checkpointing.cpu_checkpointing)")
        self.gm = gm
        self.pool = pool if pool is not None else PoolHolder()
        self.device_type = device_type
        self.program = partition(gm, device_type)
        self.interp = fx.Interpreter(gm)
        self.attrs = {n: self.interp.fetch_attr(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.output_node = next(n for n in gm.graph.nodes if n.op == "output")
        segment_inputs = {a for item in self.program if isinstance(item, Segment) for a in item.inputs}
        self.static_inputs = [ph in segment_inputs for ph in self.placeholders]
        # batches are copied into buffers of our own; every other input is
        # read where the user's objects (or the rank's store) keep it
        self.owned_inputs = [s.role is Role.BATCH for s in signature.inputs]
        self.eager_to_static = {item for item in self.program if not isinstance(item, Segment) and item in segment_inputs}
        self.static: dict[fx.Node, Any] = {}
        self.captured = False
        self.failed: str | None = None
        # outputs that update an input: where their new value must end up
        by_ident = {s.ident: i for i, s in enumerate(signature.inputs)}
        self.updates = [by_ident.get(s.ident) for s in signature.outputs]
        inside = {n for item in self.program if isinstance(item, Segment) for n in item.nodes}
        out_args = self.output_node.args[0]
        self.output_from_segment = [isinstance(a, fx.Node) and storage_root(a) in inside for a in out_args]
        self._last_use = self._last_uses()

    # -- describing ---------------------------------------------------------
    def describe(self) -> str:
        segments = [i for i in self.program if isinstance(i, Segment)]
        eager = [i for i in self.program if not isinstance(i, Segment)]
        ops = sum(len(s.nodes) for s in segments)
        names = ", ".join(n.name for n in eager[:8]) + (", ..." if len(eager) > 8 else "")
        state = ("captured" if self.captured else f"not captured: {self.failed}" if self.failed
                 else f"captured on the plan's run {WARMUP_RUNS + 1}")
        return (f"CUDA graphs ({state}): {len(segments)} segment(s) of {ops} ops, {len(eager)} ops run eagerly"
                + (f" ({names})" if eager else ""))

    # -- running nodes ------------------------------------------------------
    def run_node(self, node: fx.Node, env: dict) -> Any:
        interp = self.interp
        interp.env = env
        return interp.run_node(node)

    def _last_uses(self) -> dict:
        order = [n for item in self.program for n in (item.nodes if isinstance(item, Segment) else [item])]
        pos = {n: i for i, n in enumerate(order)}
        last: dict[int, list[fx.Node]] = {}
        keep = set(self.output_node.all_input_nodes)
        for n in order:
            if n in keep:
                continue
            users = [pos[u] for u in n.users if u in pos]
            last.setdefault(max(users, default=pos[n]), []).append(n)
        return {order[i]: nodes for i, nodes in last.items()}

    def _run_segment_eagerly(self, segment: Segment, env: dict, keep: set) -> None:
        for node in segment.nodes:
            env[node] = self.run_node(node, env)
            for dead in self._last_use.get(node, ()):
                if dead not in keep:
                    env.pop(dead, None)

    def _capture(self, segment: Segment, env: dict) -> Any:
        keep = set(segment.exports)
        if EMULATE:
            self._run_segment_eagerly(segment, env, set(segment.nodes) | set(segment.inputs))
            graph = _Emulated(self, segment, env)
            for n in segment.nodes:
                if n not in keep:
                    env.pop(n, None)
            return graph
        graph = torch.cuda.CUDAGraph()
        pool = self.pool.graph.pool() if self.pool.graph is not None else None
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self._run_segment_eagerly(segment, env, keep)
        if self.pool.graph is None:
            self.pool.graph = graph
        graph.replay()
        return graph

    # -- a step -------------------------------------------------------------
    def run(self, values: list) -> list:
        """One step from the binding's input values: capture on the first
        call, replay after. Returns the graph's outputs, ready to write back."""
        if self.captured and not self._inputs_in_place(values):
            log.info("stepfx: an input of the step moved (its tensor was replaced); capturing the CUDA graphs again")
            self._drop()
        if not self.captured:
            return self._capture_and_run(values)
        env: dict = dict(self.attrs)
        for ph, v, is_static, owned in zip(self.placeholders, values, self.static_inputs, self.owned_inputs):
            if is_static and owned:
                self.static[ph].copy_(v)
                env[ph] = self.static[ph]
            else:
                env[ph] = v
        for item in self.program:
            if isinstance(item, Segment):
                item.graph.replay()
                for n in item.exports:
                    env[n] = self.static[n]
            else:
                if item.target is operator.getitem:  # hundreds of these unpack the update's results
                    env[item] = value = env[item.args[0]][item.args[1]]
                else:
                    env[item] = value = self.run_node(item, env)
                if item in self.eager_to_static:
                    _copy_into(self.static[item], value)
        return self._outputs(env, values)

    def _inputs_in_place(self, values: list) -> bool:
        """Every input the graphs read where the user keeps it is still there."""
        for ph, v, is_static, owned in zip(self.placeholders, values, self.static_inputs, self.owned_inputs):
            if is_static and not owned and not _same_place(self.static[ph], v):
                return False
        return True

    def _drop(self) -> None:
        self.captured = False
        self.static.clear()
        for item in self.program:
            if isinstance(item, Segment):
                item.graph = None

    def _capture_and_run(self, values: list) -> list:
        env = {**self.attrs, **dict(zip(self.placeholders, values))}
        for ph, v, is_static, owned in zip(self.placeholders, values, self.static_inputs, self.owned_inputs):
            if is_static:
                self.static[ph] = v.clone() if owned else v.detach()
                env[ph] = self.static[ph]
        for k, item in enumerate(self.program):
            if not isinstance(item, Segment):
                env[item] = self.run_node(item, env)
                if item in self.eager_to_static:
                    self.static[item] = env[item]
                continue
            try:
                item.graph = self._capture(item, env)
            except Exception as exc:  # noqa: BLE001 - any failure leaves the step eager
                self._give_up(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
                for rest in self.program[k:]:
                    if isinstance(rest, Segment):
                        self._run_segment_eagerly(rest, env, set(rest.exports))
                    else:
                        env[rest] = self.run_node(rest, env)
                return self._outputs(env, values, clone=False)
            for n in item.exports:
                self.static[n] = env[n]
        self.captured = True
        log.info("stepfx: %s", self.describe())
        return self._outputs(env, values)

    def _give_up(self, why: str) -> None:
        self.failed = why
        self._drop()
        from ..codegen import multi_tensor  # tables built during a failed capture were never copied

        multi_tensor.clear_caches()
        log.warning("stepfx: could not capture the step as CUDA graphs (%s); it runs eagerly", why)

    def _outputs(self, env: dict, values: list, *, clone: bool = True) -> list:
        out = []
        for j, a in enumerate(self.output_node.args[0]):
            v = env[a] if isinstance(a, fx.Node) else a
            i = self.updates[j]
            if clone and i is not None and self.static_inputs[i] and not self.owned_inputs[i] and isinstance(v, torch.Tensor):
                ph = self.placeholders[i]
                s = self.static[ph]
                if not _same_place(s, v):
                    s.copy_(v)  # updated in place, as torch's optimizers do
                v = values[i]  # the input's own tensor, now holding the new value
            elif clone and self.output_from_segment[j] and isinstance(v, torch.Tensor):
                v = v.clone()  # the next replay writes there
            out.append(v)
        return out
