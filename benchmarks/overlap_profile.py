"""Does stepfx's ZeRO communication really overlap compute on the GPU?

Runs a GPT (fp32, or bf16 with ``--precision bf16``) with stepfx ZeRO stages 2 and 3 on every GPU of the host,
with overlap (the default: collectives issued early, waited for late) and
without it (``overlap_comm: false``: each collective waited for at once),
in one process per GPU launched by torchrun:

    torchrun --standalone --nproc_per_node 2 benchmarks/overlap_profile.py --out $OUT

For each run it reports the step time (mean of timed steps, CUDA-synced)
and, from a torch.profiler trace of the overlapped run, the time NCCL
kernels ran and the part of it during which compute kernels ran too. Rank 0
writes JSON lines and the chrome trace (gzipped) of the stage-3 run.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stepfx  # noqa: E402
from stepfx.testing.models import GPT, GPTConfig, lm_loss  # noqa: E402


def train_step(model, optimizer, tokens):
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def intervals_overlap(comm, compute):
    """Total length of ``comm`` intervals covered by the union of ``compute``."""
    compute = sorted(compute)
    merged = []
    for a, b in compute:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    covered = 0.0
    for a, b in comm:
        for x, y in merged:
            if y <= a:
                continue
            if x >= b:
                break
            covered += min(b, y) - max(a, x)
    return covered


def kernel_intervals(prof):
    comm, compute = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (e.time_range.start, e.time_range.end)
        (comm if "nccl" in e.name.lower() else compute).append(span)
    return comm, compute


def run(stage: int, overlap: bool, args, rank: int, device) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50304, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    config = {
        "gradient_clipping": 0,
        **({args.precision: {"enabled": True}} if args.precision != "fp32" else {}),
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": overlap,
            "reduce_bucket_size": args.bucket,
            "stage3_prefetch_bucket_size": args.bucket,
            "stage3_param_persistence_threshold": 0,
        }
    }
    step = stepfx.parallelize(config)(train_step)
    g = torch.Generator(device="cpu").manual_seed(100 + rank)
    batch = lambda: torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)  # noqa: E731
    start = time.perf_counter()
    for _ in range(args.warmup):
        loss = step(model, optimizer, batch())
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step(model, optimizer, batch())
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / args.steps
    row = {
        "precision": args.precision,
        "stage": stage,
        "overlap": overlap,
        "step_ms": round(step_s * 1e3, 2),
        "warmup_incl_capture_s": round(warm_s, 2),
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
        "loss": round(loss.item(), 4),
    }
    if overlap:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profile_steps):
                step(model, optimizer, batch())
            torch.cuda.synchronize()
        comm, compute = kernel_intervals(prof)
        comm_us = sum(b - a for a, b in comm)
        covered = intervals_overlap(comm, compute)
        row.update(
            nccl_kernel_ms_per_step=round(comm_us / 1e3 / args.profile_steps, 2),
            compute_kernel_ms_per_step=round(sum(b - a for a, b in compute) / 1e3 / args.profile_steps, 2),
            nccl_overlapped_fraction=round(covered / comm_us, 3) if comm_us else None,
        )
        if rank == 0 and args.out and stage == 3:
            path = os.path.join(args.out, f"trace_stage3_{args.precision}_rank0.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:
                z.write(f.read())
            os.remove(path)
    del step, model, optimizer
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", dest="d_model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--bucket", type=int, default=20_000_000)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile-steps", dest="profile_steps", type=int, default=2)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    rows = []
    for stage in (3, 2):
        for overlap in (True, False):
            row = run(stage, overlap, args, int(os.environ.get("RANK", "0")), device)
            rows.append(row)
            if int(os.environ.get("RANK", "0")) == 0:
                print(json.dumps(row), flush=True)
    if int(os.environ.get("RANK", "0")) == 0 and args.out:
        meta = {
            "date": datetime.date.today().isoformat(),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "model": f"GPT d{args.d_model} L{args.layers} seq{args.seq} batch{args.batch} {args.precision}",
            "command": f"torchrun --standalone --nproc_per_node 2 benchmarks/overlap_profile.py --precision {args.precision}",
        }
        with open(os.path.join(args.out, f"overlap_{args.precision}.jsonl"), "w") as f:
            for row in rows:
                f.write(json.dumps({**meta, **row}) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
