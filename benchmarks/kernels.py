"""stepfx's Triton kernels against eager PyTorch, torch.compile and (for the
optimizer update) torch's fused AdamW, in one run on one GPU.

    python3 benchmarks/kernels.py --out $OUT

Each case (from ``kernels_optimizer.py``, ``kernels_norm.py``,
``kernels_cross_entropy.py``) names the minimum bytes the operation must
move; the report gives each implementation's device time per call
(CUDA-graph replays of 10 calls, after warm-up, which includes torch.compile's
compilation; ``*_call_ms``: CUDA events around single calls, host launch
overhead included), its GB/s and fraction of the H200's ~4.3 TB/s copy bandwidth
(BENCHMARKS.md), peak memory, and the ratios stepfx / peer. JSON lines go
to ``$OUT/kernels.jsonl``; a table to stdout.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

COPY_BANDWIDTH = 4.3e12  # bytes/s, measured device copy bandwidth of the H200 (BENCHMARKS.md)
MODULES = ("kernels_optimizer", "kernels_norm", "kernels_cross_entropy")
IMPLEMENTATIONS = ("stepfx", "eager", "compiled", "fused")


def queued_ms(fn, warmup: int, iters: int, reps: int = 5) -> float:
    """Milliseconds a call: ``iters`` calls queued back to back between two events (as a step queues them:
    the host's launch cost hides behind the device's work), median of ``reps`` such runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / iters)
    return statistics.median(runs)


def time_ms(fn, warmup: int, iters: int) -> float:
    """Milliseconds a call, each of ``iters`` calls timed alone (its launch cost included), median."""
    return queued_ms(fn, warmup, 1, reps=iters)


def graph_ms(fn, iters: int, reps: int = 10) -> float:
    """Device time per call: ``reps`` calls captured in one CUDA graph, the
    median replay over ``iters`` divided by ``reps``. Host launch overhead
    (Python wrappers, Triton's launcher) is out: in a training step the host
    runs ahead of the GPU, so device time is what a kernel costs there."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    ms = time_ms(graph.replay, 1, iters) / reps
    del graph
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    args = ap.parse_args()
    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": "python3 benchmarks/kernels.py"}
    rows = []
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            print(f"{module_name}: cannot import ({type(exc).__name__}: {exc})", flush=True)
            continue
        for case in module.cases("cuda"):
            if args.only and not any(s in case["name"] for s in args.only.split(",")):
                continue
            row = {**meta, "case": case["name"], "bytes": case["bytes"]}
            for impl in IMPLEMENTATIONS:
                fn = case.get(impl)
                if fn is None:
                    continue
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                try:
                    ms = time_ms(fn, args.warmup, args.iters)
                except Exception as exc:  # a peer that cannot run this case is reported, not fatal
                    row[f"{impl}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    continue
                row[f"{impl}_call_ms"] = round(ms, 4)  # events around each call: launch overhead included
                row[f"{impl}_extra_peak_MiB"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
                try:
                    ms = graph_ms(fn, args.iters)
                except Exception as exc:  # not capturable: the per-call time stands
                    row[f"{impl}_graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    torch.cuda.synchronize()
                row[f"{impl}_ms"] = round(ms, 4)
                row[f"{impl}_GBps"] = round(case["bytes"] / ms / 1e6, 1)
                row[f"{impl}_of_copy_bw"] = round(case["bytes"] / (ms / 1e3) / COPY_BANDWIDTH, 3)
            for peer in IMPLEMENTATIONS[1:]:
                if f"{peer}_ms" in row and "stepfx_ms" in row:
                    row[f"speedup_vs_{peer}"] = round(row[f"{peer}_ms"] / row["stepfx_ms"], 3)
                if f"{peer}_call_ms" in row and "stepfx_call_ms" in row:
                    row[f"call_speedup_vs_{peer}"] = round(row[f"{peer}_call_ms"] / row["stepfx_call_ms"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:  # line by line: a run cut short keeps what it measured
                with open(os.path.join(args.out, "kernels.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
    print()
    print(f"{'case':<44} {'stepfx GB/s':>11} {'of bw':>6} {'x eager':>8} {'x compile':>9} {'x fused':>8}")
    for row in rows:
        print(f"{row['case']:<44} {row.get('stepfx_GBps', float('nan')):>11} {row.get('stepfx_of_copy_bw', float('nan')):>6} "
              f"{row.get('speedup_vs_eager', float('nan')):>8} {row.get('speedup_vs_compiled', float('nan')):>9} "
              f"{row.get('speedup_vs_fused', float('nan')):>8}")


if __name__ == "__main__":
    main()
