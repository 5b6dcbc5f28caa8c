"""The standard GPT workload (BENCHMARKS.md) trained data-parallel: stepfx at
ZeRO stages 0-3 and its peers, in one torchrun invocation.

    torchrun --standalone --nproc_per_node 2 benchmarks/train_gpt.py --out $OUT
    torchrun --standalone --nproc_per_node 2 benchmarks/train_gpt.py --device cpu --size tiny   # a smoke test (gloo)

Systems (``--systems``, comma-separated, run one after another in the same
processes, each on a freshly built model with the same seed):

- ``stepfx-0`` .. ``stepfx-3``: ``{"bf16": {"enabled": true}, "gradient_clipping": 1.0,
  "zero_optimization": {"stage": s, "overlap_comm": true, ...}}`` (buckets of
  ``--bucket`` elements, ``--prefetch`` elements of ZeRO-3 gathers in
  flight), codegen as configured (on by default on CUDA);
- ``ddp``: DistributedDataParallel, autocast(bf16), clip_grad_norm_, fused AdamW;
- ``fsdp2`` / ``fsdp2-compile``: ``fully_shard`` per block and at the root,
  bf16 params, fp32 reduce (``MixedPrecisionPolicy``), clip_grad_norm_,
  AdamW; ``-compile`` compiles each block first;
- ``deepspeed-1`` .. ``deepspeed-3``: ``deepspeed.initialize`` with bf16,
  the same ZeRO stage, clipping 1.0 and torch's AdamW (reported as
  unavailable when DeepSpeed is not importable: it travels to the GPU
  machine as a wheel, see benchmarks/README.md);
- ``single-eager`` / ``single-compile``: rank 0 alone (the other ranks
  wait), autocast + fused AdamW, each block compiled for ``-compile``.

Each run: ``--warmup`` steps (capture and compilation happen there,
reported as ``warmup_s``), then ``--steps`` timed steps between
synchronizations; peak memory counters reset after warm-up. Reported per
run (rank 0, one JSON line each to ``$OUT/train_gpt.jsonl``): tokens/s in
all and per GPU, TFLOP/s and MFU per GPU (BENCHMARKS.md's formula), peak
allocated and reserved memory (max over ranks), step time, warm-up time,
the final loss (mean over ranks); for stepfx also the peak its accounting
predicts before the first step (max over ranks) against the measured one.
A table of stepfx/peer ratios ends the output.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stepfx  # noqa: E402
from single_gpu import eager_step, profile, stepfx_step, timed  # noqa: E402
from stepfx.testing.models import GPT, gpt_config, lm_loss  # noqa: E402

PEAK_FLOPS = 989e12  # H200 dense bf16
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
MICRO_BATCH = {"350M": 8, "1.3B": 4, "6.6B": 2}
ALL = ("stepfx-0,stepfx-1,stepfx-2,stepfx-3,ddp,fsdp2,fsdp2-compile,deepspeed-1,deepspeed-2,deepspeed-3,"
       "single-eager,single-compile")


class Unavailable(Exception):
    """A peer that cannot run here (not installed, no such API in this torch)."""


def eager_train_step(model, optimizer, device, mixed: bool = True):
    """single_gpu.py's eager step on ``model`` (DDP, FSDP2 or plain)."""
    return functools.partial(eager_step, model, optimizer, mixed=mixed)


def adamw(params, device, fused: bool = True):
    return torch.optim.AdamW(params, fused=fused and device.type == "cuda", **ADAMW)


def build(kind: str, cfg, args, device, world: int):
    """(train one step: tokens -> loss, the stepfx step or None) for ``kind``."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if kind.startswith("stepfx-"):
        stage = int(kind.split("-")[1])  # stepfx-3, or stepfx-3-graphs (replayed as CUDA graphs)
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "bf16": {"enabled": True},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": args.bucket,
                                  "stage3_prefetch_bucket_size": args.prefetch,
                                  "stage3_param_persistence_threshold": args.persistence},
        }
        config["stepfx"] = {"cuda_graphs": kind.endswith("-graphs") and device.type == "cuda"}
        if args.codegen != "default":
            config["stepfx"]["codegen"] = args.codegen == "on"
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        step = stepfx.parallelize(config)(stepfx_step)
        return (lambda tokens: step(model, optimizer, tokens)), step
    if kind.startswith("single-"):
        if kind == "single-compile":
            for block in model.blocks:
                block.compile()
        return eager_train_step(model, adamw(model.parameters(), device), device), None
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        return eager_train_step(ddp, adamw(ddp.parameters(), device), device), None
    if kind.startswith("fsdp2"):
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError as exc:
            raise Unavailable(f"FSDP2 (torch.distributed.fsdp.fully_shard): {exc}") from exc
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            if kind == "fsdp2-compile":
                block.compile()
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = adamw(model.parameters(), device, fused=False)  # foreach over DTensors
        return eager_train_step(model, optimizer, device, mixed=False), None
    if kind.startswith("deepspeed-"):
        try:
            import deepspeed
        except ImportError as exc:
            raise Unavailable(f"DeepSpeed is not installed ({exc})") from exc
        stage = int(kind.split("-")[1])
        ds_config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
        }
        optimizer = adamw(model.parameters(), device)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

        def run(tokens):
            loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            return loss

        return run, None
    raise ValueError(f"unknown system {kind!r}; known: {ALL}")


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def reduce(value: float, op, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def measure(kind: str, cfg, args, device, rank: int, world: int) -> dict:
    solo = kind.startswith("single-")
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device) for _ in range(4)]
    row: dict = {"system": kind}
    if solo and rank != 0:
        return row
    # what earlier systems left allocated (DeepSpeed's engines keep their
    # flat buffers alive after they are dropped: ~10 GiB at 1.3B) is not
    # this system's: peaks are reported above this baseline
    held_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":  # peaks from here: the warm-up (and a CUDA-graph capture) counts
        torch.cuda.reset_peak_memory_stats()
    train, step = build(kind, cfg, args, device, world)
    start = time.perf_counter()
    for i in range(args.warmup):
        loss = train(batches[i % 4])
    sync(device)
    warmup_s = time.perf_counter() - start
    times, loss = timed(lambda i, train=train: train(batches[i % 4]), args.steps, device)
    step_s = times["step_ms"] / 1e3
    gpus = 1 if solo else world
    tokens_per_gpu = args.batch * args.seq / step_s
    n = _matmul_params(cfg)
    flops_per_token = 6 * n + 12 * cfg.n_layers * cfg.d_model * args.seq
    row.update({
        "gpus": gpus, "step_ms": round(step_s * 1e3, 2), "tokens_per_s": round(tokens_per_gpu * gpus),
        "tokens_per_s_per_gpu": round(tokens_per_gpu),
        "tflops_per_gpu": round(flops_per_token * tokens_per_gpu / 1e12, 1),
        "mfu": round(flops_per_token * tokens_per_gpu / PEAK_FLOPS, 4), "warmup_s": round(warmup_s, 1),
        "loss": float(loss.detach().float()), "timing": times,
    })
    if device.type == "cuda":
        row["peak_alloc_gib"] = (torch.cuda.max_memory_allocated() - held_before) / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        row["held_before_gib"] = round(held_before / 2**30, 2)
    if kind in args.profile.split(",") and device.type == "cuda":
        row["profile"] = profile(f"{kind}_rank{rank}", lambda i, train=train: train(batches[i % 4]), args, trace=args.trace and rank == 0)
    if step is not None:
        from stepfx.graph.accounting import estimate_memory

        row["predicted_peak_gib"] = max(estimate_memory(plan.graph).peak for plan in step.plans) / 2**30
        row["captures"] = len(step.plans)
        row["replay"] = step.plan.executor.graphs_note
    del train, step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _matmul_params(cfg) -> int:
    """BENCHMARKS.md's N without building the model: GPT(cfg).matmul_params()."""
    with torch.device("meta"):
        return GPT(cfg).matmul_params()


def combine(row: dict, device, world: int) -> dict:
    """Max memory and mean loss over the ranks (a collective: every rank
    calls it, for the systems all ranks ran)."""
    for key in ("peak_alloc_gib", "peak_reserved_gib", "predicted_peak_gib", "held_before_gib"):
        if key in row:
            row[key] = round(reduce(row[key], dist.ReduceOp.MAX, device), 2)
    row["loss"] = reduce(row["loss"], dist.ReduceOp.SUM, device) / world
    return row


def summary(rows: list[dict]) -> list[str]:
    by = {r["system"]: r for r in rows if "tokens_per_s_per_gpu" in r}
    pairs = [("stepfx-3", "fsdp2"), ("stepfx-3", "fsdp2-compile"), ("stepfx-3", "deepspeed-3"),
             ("stepfx-2", "deepspeed-2"), ("stepfx-1", "deepspeed-1"), ("stepfx-0", "ddp"),
             ("stepfx-3", "single-compile"), ("stepfx-0", "single-eager")]
    lines = [f"{'stepfx / peer':<30} {'tokens/s/GPU':>12} {'peak alloc':>16}"]
    for ours, peer in pairs:
        if ours in by and peer in by:
            a, b = by[ours], by[peer]
            mem = f"{a.get('peak_alloc_gib', float('nan')):.1f} vs {b.get('peak_alloc_gib', float('nan')):.1f}"
            lines.append(f"{ours + ' / ' + peer:<30} {a['tokens_per_s_per_gpu'] / b['tokens_per_s_per_gpu']:>11.3f}x {mem:>16}")
    for name, r in by.items():
        if "predicted_peak_gib" in r and r.get("peak_alloc_gib"):
            lines.append(f"{name}: predicted peak {r['predicted_peak_gib']:.2f} GiB, measured {r['peak_alloc_gib']:.2f} GiB "
                         f"({r['predicted_peak_gib'] / r['peak_alloc_gib'] - 1:+.1%})")
    return lines


def init_distributed(kind: str) -> torch.device:
    """torchrun's process group (NCCL on this rank's GPU, gloo on CPU); this rank's device."""
    if kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10))
        return torch.device("cuda", local)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return torch.device("cpu")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.3B")
    ap.add_argument("--seq", type=int, default=None, help="default: 2048 (the size's own for tiny/small)")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch per GPU; default: BENCHMARKS.md's")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--systems", default=ALL)
    ap.add_argument("--bucket", type=int, default=50_000_000, help="reduce bucket size (elements)")
    ap.add_argument("--prefetch", type=int, default=50_000_000,
                    help="stage3_prefetch_bucket_size (elements; DeepSpeed's default): one of the ~46M-element gather "
                         "buckets in flight. 1e8 (two) measured slower on 2xH200 (ZeRO-3 157.6 vs 141.7 ms: results/2026-11-30_train_gpt_1.3B_h200x2_run6 vs run5)")
    ap.add_argument("--persistence", type=int, default=100_000, help="stage3_param_persistence_threshold")
    ap.add_argument("--codegen", choices=("default", "on", "off"), default="default")
    ap.add_argument("--profile", default="", help="systems to profile for 3 more steps (tables per rank, rank 0's trace)")
    ap.add_argument("--trace", action="store_true", help="with --profile: also rank 0's Chrome trace (gzipped)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    small = args.size in ("tiny", "small")
    args.batch = args.batch or MICRO_BATCH.get(args.size, 2)
    cfg = gpt_config(args.size, **({} if small and args.seq is None else {"seq_len": args.seq or 2048}))
    args.seq = cfg.seq_len

    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "world": world,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "size": args.size,
            "seq": args.seq, "micro_batch": args.batch,
            "command": "torchrun --nproc_per_node {} benchmarks/train_gpt.py ".format(world) + " ".join(sys.argv[1:])}
    rows = []
    for kind in args.systems.split(","):
        try:
            row = measure(kind, cfg, args, device, rank, world)
            failed = 0.0
        except Unavailable as exc:
            row, failed = {"system": kind, "unavailable": str(exc)}, 0.0
        except Exception as exc:  # one system's failure is reported; the others still run
            row, failed = {"system": kind, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}, 1.0
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        # every rank learns whether any rank failed, then the ranks line up for the next system
        if reduce(failed, dist.ReduceOp.MAX, device) and "error" not in row:
            row = {"system": kind, "error": "failed on another rank"}
        if "error" not in row and "unavailable" not in row and not kind.startswith("single-"):
            row = combine(row, device, world)
        dist.barrier()
        if rank == 0:
            row = {**meta, **row}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(os.path.join(args.out, "train_gpt.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
    if rank == 0:
        print()
        print("\n".join(summary(rows)))
    dist.destroy_process_group()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
