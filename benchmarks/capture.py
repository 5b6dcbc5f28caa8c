"""Capture + pass-pipeline host time for the standard GPT at growing depth.

The standard workload of BENCHMARKS.md (d_model 2048, seq 2048, micro-batch
4, AdamW, gradient clipping 1.0 in the user's step) at 6, 12, 24 and 48
layers, built on the meta device so no memory is allocated: capture and
passes only look at shapes. Reports seconds per size, ops, and a least-
squares line through the points (seconds per layer and R^2) to show growth
is linear. Target (BENCHMARKS.md): <= 10 s for the 24-layer 1.3B model.

    python benchmarks/capture.py [--layers 6 12 24 48] [--out benchmarks/results/capture.jsonl]

Host-only: runs on the CPU machine (no GPU needed).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stepfx.capture import capture_step  # noqa: E402
from stepfx.passes import PIPELINE, PassManager, PassOptions  # noqa: E402
from stepfx.testing.models import GPT, gpt_config, lm_loss  # noqa: E402


def train_step(model, optimizer, idx, targets):
    loss = lm_loss(model(idx), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def build(layers: int, batch: int, seq: int):
    cfg = gpt_config("1.3B", n_layers=layers, seq_len=seq)
    with torch.device("meta"):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    # steady state: the optimizer already holds its state (as after step 1)
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    idx = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, opt, (idx, idx)


def measure(layers: int, batch: int, seq: int) -> dict:
    model, opt, args = build(layers, batch, seq)
    start = time.perf_counter()
    graph = capture_step(train_step, model, opt, args, {})
    captured = time.perf_counter()
    records = PassManager(PIPELINE).run(graph, PassOptions(device_type="cpu"))
    done = time.perf_counter()
    return {
        "layers": layers,
        "params": sum(p.numel() for p in model.parameters()),
        "ops_captured": graph.count_ops(),
        "ops_final": records[-1].graph.count_ops(),
        "capture_s": round(captured - start, 3),
        "passes_s": round(done - captured, 3),
        "total_s": round(done - start, 3),
        "per_pass_s": {r.name: round(r.seconds, 3) for r in records},
    }


def linear_fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return slope, intercept, 1 - ss_res / ss_tot if ss_tot else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[6, 12, 24, 48])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--out", default=None, help="append JSON lines here")
    args = ap.parse_args()

    # warm-up: imports, op registrations and fake-tensor caches are one-time costs
    measure(1, 1, 8)
    rows = [measure(n, args.batch, args.seq) for n in args.layers]
    slope, intercept, r2 = linear_fit([r["layers"] for r in rows], [r["total_s"] for r in rows])
    meta = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": f"{platform.machine()} x{os.cpu_count()} cpu",
        "command": " ".join(["python"] + sys.argv),
    }
    print(f"{'layers':>6} {'params':>14} {'ops':>7} {'capture s':>10} {'passes s':>9} {'total s':>8}")
    for r in rows:
        print(f"{r['layers']:>6} {r['params']:>14,} {r['ops_captured']:>7} {r['capture_s']:>10.2f} {r['passes_s']:>9.2f} {r['total_s']:>8.2f}")
    print(f"linear fit: {slope:.3f} s/layer + {intercept:.2f} s, R^2 = {r2:.4f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({**meta, **r}) + "\n")
            f.write(json.dumps({**meta, "fit_s_per_layer": round(slope, 4), "fit_intercept_s": round(intercept, 3), "fit_r2": round(r2, 5)}) + "\n")


if __name__ == "__main__":
    main()
