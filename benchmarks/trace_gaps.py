"""Where a GPU sits idle in a profiled step: device busy time, and the idle
gaps between kernels grouped by the kernels on either side.

    python3 benchmarks/trace_gaps.py results/2026-12-02_trace_1.3B_stepfx-codegen_h200_run2.json.gz [--steps 3]

Reads a Chrome trace written by ``single_gpu.py --profile --trace`` (or
train_gpt.py's), takes the device's kernels, memsets and copies in time
order, and prints per step: busy ms, span ms, idle ms and the largest
sources of idle time as (kernel before, kernel after) pairs. Runs anywhere
(no GPU needed).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps in the trace (single_gpu.py profiles 3)")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                    key=lambda e: e["ts"])
    if not device:
        raise SystemExit("no device events in the trace")
    busy = sum(e["dur"] for e in device)
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    gaps: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    end, last = device[0]["ts"] + device[0]["dur"], device[0]
    for e in device[1:]:
        if e["ts"] > end:
            key = (last["name"][:48], e["name"][:48])
            gaps[key] += e["ts"] - end
            count[key] += 1
        if e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    n = args.steps
    print(f"{len(device) / n:.0f} device events per step; busy {busy / 1e3 / n:.2f} ms, span {span / 1e3 / n:.2f} ms, "
          f"idle {sum(gaps.values()) / 1e3 / n:.2f} ms in {sum(count.values()) / n:.0f} gaps per step")
    for (before, after), us in gaps.most_common(args.top):
        print(f"{us / 1e3 / n:8.3f} ms {count[(before, after)] / n:6.0f}x  {before}  ->  {after}")


if __name__ == "__main__":
    main()
