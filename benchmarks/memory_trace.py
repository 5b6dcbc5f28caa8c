"""The memory estimate against the allocator, node by node, on one GPU.

    python3 benchmarks/memory_trace.py --out $OUT --size 13B --batch 24 --recompute 0 --speculation off

Builds a system of benchmarks/offload.py (``--system``, default
``stepfx-offload-z3``), runs ``--warmup`` steps, then one step of a copy of
the plan's program with a mark after every node (in the executor's timer
slot, as ``wall_clock_breakdown`` runs its marked copy): the mark reads
``torch.cuda.memory_allocated()`` (host-side bookkeeping, no
synchronization) and the peak since the previous mark. Beside each it puts
what ``graph.accounting.liveness`` (the walk ``estimate_memory`` sums)
says is live there. Written to ``$OUT/memory_trace.json``: the measured and
predicted peaks and where they fall, the 25 nodes where the allocator's peak
most exceeds the estimate (with the op and what the estimate holds there),
and the drift (measured minus estimated after each node) sampled through the
step, so a value the estimate frees too early shows as a step up that stays.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.fx as fx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import offload  # noqa: E402
from stepfx import compat  # noqa: E402
from stepfx.graph.accounting import Sizes, liveness, size_values  # noqa: E402
from stepfx.graph.signature import HOST_STATE_KEY  # noqa: E402
from stepfx.graph.step_graph import META_PHASE  # noqa: E402
from stepfx.testing.models import GPT, gpt_config  # noqa: E402


class MemoryMarks:
    """A marked copy of ``gm`` for the executor's timer slot: after each call_function node, the allocator's
    bytes in use and its peak since the previous mark."""

    def __init__(self, gm: fx.GraphModule):
        graph = fx.Graph()
        env: dict = {}
        self.names: list[str] = []
        for node in gm.graph.nodes:
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.op == "call_function":
                graph.call_function(self.mark, (len(self.names),))
                self.names.append(node.name)
        self.program = compat.graph_module(gm, graph)
        self.after = [0] * len(self.names)
        self.peak = [0] * len(self.names)

    def mark(self, index: int) -> None:
        if not torch.cuda.is_available():  # --device cpu: a smoke test of the script, nothing measured
            return
        self.after[index] = torch.cuda.memory_allocated()
        self.peak[index] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def seconds(self) -> dict:
        return {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", default="stepfx-offload-z3")
    ap.add_argument("--size", default="1.3B")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--recompute", type=float, default=None)
    ap.add_argument("--speculation", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--dpu-exact-steps", type=int, default=0)
    ap.add_argument("--device", default="cuda")  # cpu: a smoke test of the script
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = gpt_config(args.size, seq_len=args.seq, **({"n_layers": args.layers} if args.layers else {}))
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    with device:
        model = GPT(cfg)
    one, step = offload._stepfx(args.system, model, args)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device) for _ in range(2)]
    for i in range(args.warmup * args.gas):
        one(batches[i % 2])
    offload.sync(device)
    step._apply_delayed_update()
    executor = step.plan.executor
    marks = MemoryMarks(executor.gm)
    previous, executor.timer = executor.timer, marks
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    one(batches[0])
    offload.sync(device)
    executor.timer = previous

    graph = step.plan.graph
    sizes = Sizes(size_values(graph))
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    live, at, after_free, held = 0, {}, {}, {}
    names = {}
    host = graph.signature.extra.get(HOST_STATE_KEY, ())
    for n, size, freed in liveness(graph, sizes):
        if n.op == "placeholder" and n.meta["slot"].ident in host:
            continue  # state held on the host (Adam's moments under offload): no device bytes, as estimate_memory
        if size is not None:
            live += sizes.value(size)
            if n.op == "call_function":
                held[n.name] = sizes.value(size)
        if n.op == "call_function":
            at[n.name] = live
        live -= sum(sizes.value(s) for _, s in freed)
        if n.op == "call_function":
            after_free[n.name] = live
        names[n.name] = n
    rows = []
    for i, name in enumerate(marks.names):
        if name not in at:
            continue
        node = nodes[name]
        rows.append({"i": i, "node": name, "op": str(getattr(node.target, "__name__", node.target)),
                     "phase": str(node.meta.get(META_PHASE)), "measured_peak": marks.peak[i],
                     "measured_after": marks.after[i], "estimated_at": at[name], "estimated_after": after_free[name],
                     "allocates": held.get(name, 0)})
    gib = 2**30
    top = sorted(rows, key=lambda r: r["measured_peak"] - r["estimated_at"], reverse=True)[:25]
    peak_row = max(rows, key=lambda r: r["measured_peak"])
    est_row = max(rows, key=lambda r: r["estimated_at"])
    drift = [{"i": r["i"], "node": r["node"], "phase": r["phase"],
              "drift_gib": round((r["measured_after"] - r["estimated_after"]) / gib, 3)}
             for r in rows[:: max(1, len(rows) // 60)]]
    steps = []  # where the drift changes by more than 256 MiB from one node to the next
    for a, b in zip(rows, rows[1:]):
        d = (b["measured_after"] - b["estimated_after"]) - (a["measured_after"] - a["estimated_after"])
        if abs(d) > 2**28:
            steps.append({"node": b["node"], "op": b["op"], "phase": b["phase"], "change_gib": round(d / gib, 3),
                          "allocates_gib": round(b["allocates"] / gib, 3),
                          "args": [str(a) for a in nodes[b["node"]].args][:4]})
    out = {"system": args.system, "size": args.size, "batch": args.batch, "layers": cfg.n_layers,
           "allocated_before_gib": round(before / gib, 3),
           "measured_peak_gib": round(peak_row["measured_peak"] / gib, 3), "measured_peak_node": peak_row["node"],
           "estimated_at_measured_peak_gib": round(peak_row["estimated_at"] / gib, 3),
           "estimated_peak_gib": round(est_row["estimated_at"] / gib, 3), "estimated_peak_node": est_row["node"],
           "measured_at_estimated_peak_gib": round(est_row["measured_peak"] / gib, 3),
           "top_excess": [{k: (round(v / gib, 3) if isinstance(v, int) and k not in ("i",) else v) for k, v in r.items()}
                          for r in top],
           "drift": drift, "drift_steps": steps[:80]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory_trace.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k not in ("top_excess", "drift", "drift_steps")}))
    for r in top[:8]:
        print(r["node"], r["op"], r["phase"], round(r["measured_peak"] / gib, 2), round(r["estimated_at"] / gib, 2))
    for s in steps[:20]:
        print("step", s)


if __name__ == "__main__":
    main()
