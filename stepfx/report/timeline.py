"""A predicted timeline of the step per stream, from the plan alone.

The program runs in order on the compute stream; a collective is issued on
its group's communication stream when its input is ready and the stream is
free, and the ``wait_tensor`` that reads it holds the compute stream until
it finishes (that hold is *exposed* communication); a copy between host and
device runs on the copy stream, and its first reader waits for it. Each op
costs a launch overhead plus the larger of its FLOPs over the device's rate
and the bytes it reads and writes over memory bandwidth; a collective costs
the bytes a rank sends (ring algorithm, ``graph.accounting.communication``)
over the link's bus bandwidth. Views cost nothing.

The device numbers are assumptions written into the report (DeviceModel):
an H200 over NVLink for CUDA (bus bandwidths measured, NOTES-torch.md), a
nominal CPU otherwise. The picture says where time would go and which
collectives would be exposed; it is not a measurement.
"""
from __future__ import annotations

import operator
from dataclasses import asdict, dataclass

import torch
import torch.fx as fx

from ..graph import StepGraph
from ..graph.accounting import Sizes, communication, node_flops, size_values
from ..graph.ops import allocates_nothing, is_collective
from ..graph.printer import format_target

__all__ = ["DeviceModel", "DEVICE_MODELS", "predicted_timeline"]

aten = torch.ops.aten
_WAIT = torch.ops._c10d_functional.wait_tensor.default


@dataclass(frozen=True)
class DeviceModel:
    name: str
    flops: float  # dense matmul FLOP/s
    memory_bandwidth: float  # bytes/s
    bus_bandwidth: dict  # collective -> bytes/s of bus bandwidth (what a rank sends per second)
    host_bandwidth: float  # bytes/s between host and device
    launch: float  # seconds per op


DEVICE_MODELS = {
    "cuda": DeviceModel("NVIDIA H200, NVLink (bf16 dense 990 TFLOP/s at 70%)", 0.7 * 989e12, 4.0e12,
                        {"all_reduce": 330e9, "all_gather": 276e9, "reduce_scatter": 259e9}, 50e9, 4e-6),
    "cpu": DeviceModel("CPU (nominal: 50 GFLOP/s, 10 GB/s memory, gloo at 2 GB/s)", 50e9, 10e9,
                       {"all_reduce": 2e9, "all_gather": 2e9, "reduce_scatter": 2e9}, 10e9, 5e-6),
}


def _bytes(val, sizes: Sizes) -> int:
    return sizes.value(sizes.bytes_of(val))


def _device_of(val) -> str | None:
    return val.device.type if isinstance(val, torch.Tensor) else None


def _is_host_copy(node: fx.Node) -> bool:
    src = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    dst = node.meta.get("val")
    a, b = _device_of(src), _device_of(dst)
    return a is not None and b is not None and a != b


def predicted_timeline(graph: StepGraph, device_type: str, world_size: int, values=None) -> dict:
    """Plain data: ``events`` (stream, node, op, start, end in seconds; a
    collective's ``bytes``; ``exposed`` on the compute stream's waits),
    ``streams`` in drawing order, ``seconds`` (the step) and the device model."""
    model = DEVICE_MODELS.get(device_type, DEVICE_MODELS["cpu"])
    sizes = Sizes(size_values(graph) if values is None else values)
    comm = {item.node: item for item in communication(graph, world_size, values)}
    ready: dict[fx.Node, float] = {}
    free: dict[str, float] = {"compute": 0.0}
    events: list[dict] = []
    for node in graph.gm.graph.nodes:
        if node.op == "placeholder":
            ready[node] = 0.0
            continue
        if node.op != "call_function":
            continue
        inputs = max((ready.get(a, 0.0) for a in node.all_input_nodes), default=0.0)
        op = format_target(node.target)
        if is_collective(node) and node.target is not _WAIT:
            item = comm.get(node.name)
            group = node.args[-1] if node.args and isinstance(node.args[-1], str) else "default"
            stream = f"comm {group}"
            sent = item.sent_bytes if item is not None else 0.0
            seconds = model.launch + sent / model.bus_bandwidth.get(item.op if item else "all_reduce", 1e9)
            start = max(free.get(stream, 0.0), inputs, free["compute"])  # issued when the program reaches it
            event = {"stream": stream, "node": node.name, "op": item.op if item else op, "start": start,
                     "end": start + seconds, "bytes": item.payload_bytes if item else 0}
        elif _is_host_copy(node):
            stream = "host-device copy"
            seconds = model.launch + _bytes(node.meta.get("val"), sizes) / model.host_bandwidth
            start = max(free.get(stream, 0.0), inputs, free["compute"])
            event = {"stream": stream, "node": node.name, "op": op, "start": start, "end": start + seconds,
                     "bytes": _bytes(node.meta.get("val"), sizes)}
        elif node.target is _WAIT or node.target is operator.getitem or allocates_nothing(node):
            stream = "compute"
            start = max(free["compute"], inputs)
            exposed = start - free["compute"]
            ready[node] = start
            if node.target is _WAIT and exposed > 0:  # the compute stream idles until the collective is done
                events.append({"stream": stream, "node": node.name, "op": "wait", "start": free["compute"],
                               "end": start, "exposed": True})
            free["compute"] = start
            continue
        else:
            stream = "compute"
            moved = _bytes(node.meta.get("val"), sizes) + sum(_bytes(a.meta.get("val"), sizes) for a in node.all_input_nodes)
            seconds = model.launch + max(node_flops(node) / model.flops, moved / model.memory_bandwidth)
            start = max(free["compute"], inputs)
            event = {"stream": stream, "node": node.name, "op": op, "start": start, "end": start + seconds}
        events.append(event)
        free[stream] = event["end"]
        ready[node] = event["end"]
    streams = ["compute"] + sorted(s for s in free if s != "compute")
    end = max((e["end"] for e in events), default=0.0)
    exposed = sum(e["end"] - e["start"] for e in events if e.get("exposed"))
    return {"events": events, "streams": streams, "seconds": end, "exposed_seconds": exposed,
            "device_model": asdict(model), "collectives": len(comm)}
