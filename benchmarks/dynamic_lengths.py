"""The standard GPT step on one GPU with a new sequence length every step:
stepfx (stepfx.dynamic "auto", codegen) against eager and torch.compile on
the same stream of lengths, in one run; and stepfx on fixed 2048 tokens for
the per-token comparison.

    python3 benchmarks/dynamic_lengths.py --out $OUT          # 1.3B, lengths uniform in [1024, 2048]

Workload as benchmarks/single_gpu.py (BENCHMARKS.md's 1.3B GPT, micro-batch
4, bf16 with fp32 masters, AdamW, clipping 1.0); each step's length is drawn
uniformly from [--min-seq, --seq] with a fixed seed, so every system sees
the same lengths. Peers:

- ``eager``: autocast(bf16), ``clip_grad_norm_``, ``AdamW(fused=True)``;
- ``compile``: the same with every block ``torch.compile``d with its default
  ``dynamic=None`` (it recompiles once with symbolic sizes after it sees a
  length change);
- ``stepfx-codegen``: stepfx with its kernels and ``stepfx.dynamic`` left at
  "auto" (captures once at the first length, once more with symbolic sizes);
- ``stepfx-codegen-fixed``: the same at the fixed length --seq (reference
  for tokens/s per processed token).

Reported per system: tokens/s over the processed tokens (the sum of the
steps' lengths), the ratio to the fixed-length step, captures (stepfx),
the first call's time, the time of the warm-up steps that met new lengths,
peak memory. JSON lines to ``$OUT/dynamic_lengths.jsonl``.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stepfx  # noqa: E402
from benchmarks.single_gpu import PEAK_FLOPS, apply_settings, eager_step, stepfx_step, sync, timed  # noqa: E402
from stepfx.testing.models import GPT, gpt_config  # noqa: E402


def lengths(args, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(args.min_seq, args.seq + 1, (n,), generator=g).tolist()


_COMPILES: list[dict] = []
_CALL = [0]


def log_compiles() -> None:
    """Record every Triton compile (kernel name, the call it happened in,
    seconds, the specialization key) and torch.compile's recompiles: which
    kernel a new length recompiles, and why."""
    import triton.runtime.jit as jit

    original = jit.JITFunction._do_compile

    def logged(self, key, signature, device, constexprs, options, attrs, warmup):
        start = time.perf_counter()
        kernel = original(self, key, signature, device, constexprs, options, attrs, warmup)
        _COMPILES.append({"call": _CALL[0], "kernel": getattr(self.fn, "__name__", str(self.fn)),
                          "s": round(time.perf_counter() - start, 3), "key": str(key)[:400], "attrs": str(attrs)[:400]})
        return kernel

    jit.JITFunction._do_compile = logged
    torch._logging.set_logs(recompiles=True)


def run(kind: str, args) -> dict:
    torch.manual_seed(0)
    cfg = gpt_config(args.size, seq_len=args.seq)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = GPT(cfg).to(device)
    adamw = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    fixed = kind.endswith("-fixed")
    if kind.startswith("stepfx"):
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)
        config = {"bf16": {"enabled": True}, "gradient_clipping": 1.0,
                  "stepfx": {"codegen": kind.startswith("stepfx-codegen"), "dynamic": args.dynamic,
                             "attention_pad_multiple": args.attention_pad_multiple,
                             "disable": [n for n in args.disable.split(",") if n]}}
        step = stepfx.parallelize(config)(stepfx_step)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), fused=device.type == "cuda", **adamw)
        if kind == "compile":
            for block in model.blocks:
                block.compile()
        step = eager_step
    n = args.warmup + args.steps
    seqs = [args.fixed_seq or args.seq] * n if fixed else lengths(args, n, seed=123)
    g = torch.Generator(device="cpu").manual_seed(7)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, t + 1), generator=g).to(device) for t in seqs]
    warm = []
    for i in range(args.warmup):
        _CALL[0] = i
        start = time.perf_counter()
        loss = step(model, optimizer, batches[i])
        sync(device)
        warm.append(round(time.perf_counter() - start, 2))
    timed_batches = batches[args.warmup:]
    def call(i):
        _CALL[0] = args.warmup + i
        if _CALL[0] != args.profile_call:
            return step(model, optimizer, timed_batches[i])
        from torch.profiler import ProfilerActivity, profile

        cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sync(device)
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            result = step(model, optimizer, timed_batches[i])
            sync(device)
        wall = time.perf_counter() - start
        events = prof.key_averages()
        table = events.table(sort_by="self_cpu_time_total", row_limit=25)
        print(f"profile of call {_CALL[0]} (length {seqs[_CALL[0]]}):\n{table}", flush=True)
        if cuda:
            print(events.table(sort_by="self_device_time_total", row_limit=40), flush=True)
            busy = sum(e.self_device_time_total for e in events) / 1e3
            print(f"device kernel time {busy:.1f} ms of {wall * 1e3:.1f} ms wall (profiled)", flush=True)
        return result

    times, loss = timed(call, args.steps, device)
    tokens = args.batch * sum(seqs[args.warmup:])
    wall_s = times["step_ms"] * args.steps / 1e3
    tps = tokens / wall_s
    mean_seq = sum(seqs[args.warmup:]) / args.steps
    flops_per_token = 6 * model.matmul_params() + 12 * cfg.n_layers * cfg.d_model * mean_seq
    row = {
        "system": kind, "disable": args.disable, "attention_pad_multiple": args.attention_pad_multiple, "size": args.size, "lengths": f"fixed {seqs[0]}" if fixed else f"uniform [{args.min_seq}, {args.seq}]",
        "distinct_lengths": len(set(seqs)), "tokens_per_s": round(tps), "mfu": round(flops_per_token * tps / PEAK_FLOPS, 4),
        "step_ms": times["step_ms"], "first_call_s": warm[0], "warmup_s": warm,
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if device.type == "cuda" else None,
        "final_loss": round(float(loss), 4), "timing": times,
    }
    if _COMPILES:
        row["compiles_after_first_call"] = [c for c in _COMPILES if c["call"] > 0]
        row["lengths_per_call"] = seqs
    if kind.startswith("stepfx"):
        row["captures"] = len(step.plans)
        row["capture_s"] = [round(p.capture_seconds + p.passes_seconds, 1) for p in step.plans]
        row["symbolic"] = [p.guard is not None for p in step.plans]
        row["replay"] = step.plan.executor.graphs_note
        text = step.explain()
        row["codegen"] = [line.strip() for line in text.split("codegen:", 1)[1].split("\n\n", 1)[0].splitlines()]
        if "symbolic sizes" in text:
            row["dynamic_explain"] = text.split("symbolic sizes", 1)[1].split("\n\n", 1)[0].splitlines()[:8]
    del step, model, optimizer, batches, timed_batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.3B")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--min-seq", type=int, default=1024)
    ap.add_argument("--fixed-seq", type=int, default=0, help="length of the -fixed systems (default --seq)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dynamic", default="auto", help='stepfx.dynamic for the stepfx systems ("auto", true, false)')
    ap.add_argument("--attention-pad-multiple", default="auto",
                    help='stepfx.attention_pad_multiple ("auto", or a number; 0 = flash attention for symbolic lengths)')
    ap.add_argument("--disable", default="", help="stepfx passes to turn off (comma-separated), for before/after runs")
    ap.add_argument("--systems", default="stepfx-codegen,eager,compile,stepfx-codegen-fixed")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (tiny sizes)")
    ap.add_argument("--same-process", action="store_true", help="run every system in this process (cuDNN's plan cache is then shared)")
    ap.add_argument("--profile-call", type=int, default=-1, help="host profile (torch.profiler, CPU) of this call, counting warm-up calls")
    ap.add_argument("--log-compiles", action="store_true", help="record Triton compiles and torch.compile recompiles per call")
    ap.add_argument("--set", default="", metavar="MODULE.NAME=VALUE,...",
                    help="override stepfx.codegen module constants for this run (single_gpu.py's --set)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    apply_settings(args.set)
    if args.log_compiles:
        log_compiles()
    args.dynamic = {"true": True, "false": False}.get(args.dynamic, args.dynamic)
    if args.attention_pad_multiple != "auto":
        args.attention_pad_multiple = int(args.attention_pad_multiple)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = {"date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
            "command": f"python3 benchmarks/dynamic_lengths.py --size {args.size} --systems {args.systems} "
                       f"--min-seq {args.min_seq} --seq {args.seq} --attention-pad-multiple {args.attention_pad_multiple}"
                       + (f" --disable {args.disable}" if args.disable else "")
                       + (f" --set '{args.set}'" if args.set else "")}
    rows = []
    systems = args.systems.split(",")
    if len(systems) > 1 and not args.same_process:
        # one process per system: cuDNN caches an attention plan per shape process-wide, so a system run
        # after another on the same lengths would find the first one's plans built (measured: ~1.6 ms of
        # host time per attention call on a new length, 2026-12-04)
        import subprocess

        for kind in systems:
            cmd = [sys.executable, os.path.abspath(__file__), "--systems", kind, "--size", args.size, "--seq", str(args.seq),
                   "--min-seq", str(args.min_seq), "--batch", str(args.batch), "--warmup", str(args.warmup),
                   "--steps", str(args.steps), "--dynamic", str(args.dynamic).lower(), "--device", args.device,
                   "--fixed-seq", str(args.fixed_seq), "--attention-pad-multiple", str(args.attention_pad_multiple),
                   "--disable", args.disable]
            if args.log_compiles:
                cmd.append("--log-compiles")
            cmd += ["--profile-call", str(args.profile_call), "--set", args.set]
            if args.out:
                cmd += ["--out", args.out]
            subprocess.run(cmd, check=False)
        if args.out and os.path.exists(os.path.join(args.out, "dynamic_lengths.jsonl")):
            with open(os.path.join(args.out, "dynamic_lengths.jsonl")) as f:
                rows = [json.loads(line) for line in f]
        systems = []
    for kind in systems:
        try:
            row = run(kind, args)
        except Exception as exc:
            row = {"system": kind, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        rows.append({**meta, **row, "process": "own" if len(args.systems.split(",")) == 1 else "shared"})
        print(json.dumps(rows[-1]), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "dynamic_lengths.jsonl"), "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    by = {r["system"]: r for r in rows if "tokens_per_s" in r}
    if "stepfx-codegen" in by:
        for peer in ("stepfx-codegen-fixed", "eager", "compile"):
            if peer in by:
                print(f"stepfx-codegen (varying) / {peer}: tokens/s x{by['stepfx-codegen']['tokens_per_s'] / by[peer]['tokens_per_s']:.3f}")


if __name__ == "__main__":
    main()
