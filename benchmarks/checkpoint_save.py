"""How long a checkpoint stops training: a synchronous save against an
asynchronous one (DCP's async save: the state is staged to host memory,
then written on a background thread while the steps go on).

    python3 benchmarks/checkpoint_save.py --out $OUT              # 350M GPT, one GPU

Workload: the GPT of BENCHMARKS.md (default 350M, micro-batch 4, 2048
tokens, bf16 with fp32 masters, AdamW, clipping 1.0), stepfx with codegen.
Reported: the bytes written, the synchronous save's seconds, the
asynchronous save's blocking seconds (until training may go on) and its
total seconds (until the checkpoint is complete and ``latest`` names it),
the step times while it writes against the steps before, and the overlap
(1 - blocked / synchronous). Then a load into a fresh process' objects is
timed too. JSON lines to ``$OUT/checkpoint_save.jsonl``; the checkpoints
go to --dir (default a temporary directory) and are deleted.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stepfx  # noqa: E402
from benchmarks.single_gpu import stepfx_step, sync  # noqa: E402
from stepfx.testing.models import GPT, gpt_config  # noqa: E402


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="350M")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    device = torch.device(args.device)
    root = args.dir or tempfile.mkdtemp(prefix="stepfx-ckpt-")
    torch.manual_seed(0)
    cfg = gpt_config(args.size, seq_len=args.seq)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    config = {"bf16": {"enabled": device.type == "cuda"}, "gradient_clipping": 1.0,
              "stepfx": {"codegen": device.type == "cuda"}}
    step = stepfx.parallelize(config)(stepfx_step)
    g = torch.Generator().manual_seed(7)
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)

    def timed_steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            start = time.perf_counter()
            step(model, opt, batch)
            sync(device)
            out.append(round((time.perf_counter() - start) * 1e3, 1))
        return out

    timed_steps(3)  # capture, compile, warm
    baseline = timed_steps(5)

    start = time.perf_counter()
    path = step.save_checkpoint(os.path.join(root, "sync"))
    sync_s = time.perf_counter() - start
    written = _dir_bytes(path)

    start = time.perf_counter()
    pending = step.save_checkpoint(os.path.join(root, "async"), async_save=True)
    blocked_s = time.perf_counter() - start
    during = []
    while not pending.done():
        during += timed_steps(1)
    pending.wait()
    total_s = time.perf_counter() - start
    after = timed_steps(3)

    fresh_model = GPT(cfg).to(device)
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    fresh = stepfx.parallelize(config)(stepfx_step)
    start = time.perf_counter()
    fresh.load_checkpoint(os.path.join(root, "async"), model=fresh_model, optimizer=fresh_opt)
    sync(device)
    load_s = time.perf_counter() - start

    row = {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "command": f"python3 benchmarks/checkpoint_save.py --size {args.size}",
        "size": args.size, "checkpoint_gib": round(written / 2**30, 2), "sync_save_s": round(sync_s, 2),
        "write_gib_per_s": round(written / 2**30 / sync_s, 2), "async_blocked_s": round(blocked_s, 2),
        "async_total_s": round(total_s, 2), "overlap": round(1 - blocked_s / sync_s, 3),
        "step_ms_before": baseline, "step_ms_during_async_write": during, "step_ms_after": after,
        "load_s": round(load_s, 2),
    }
    print(json.dumps(row), flush=True)
    if args.out:
        with open(os.path.join(args.out, "checkpoint_save.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
