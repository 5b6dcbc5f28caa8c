"""Activation checkpointing on one GPU: stepfx's recompute_activations
(``stepfx.activation_memory_budget``) against eager ``torch.utils.checkpoint``
per block and torch.compile's activation memory budget, at a micro-batch
that does not fit without recomputation.

    python3 benchmarks/remat.py --out $OUT                     # 1.3B, seq 2048, micro-batch 24
    python3 benchmarks/remat.py --batch 4 --systems stepfx-0,stepfx   # what remat costs where it is not needed

Workload as benchmarks/single_gpu.py (BENCHMARKS.md's GPT, bf16 with fp32
masters, AdamW, clipping 1.0). Systems, each in its own process (a failed
one, out of memory, is recorded as such):

- ``stepfx``: no recomputation (expected to run out of memory at the
  default micro-batch: that is the point);
- ``stepfx-<b>``: ``"stepfx": {"activation_memory_budget": b}`` (codegen on);
- ``stepfx-gib<X>``: ``"stepfx": {"memory_budget_gib": X}``: the planner's
  least recomputation whose predicted peak fits X GiB;
- ``eager-ckpt``: autocast, every block under ``torch.utils.checkpoint``
  (non-reentrant), fused AdamW;
- ``compile-<b>``: every block ``torch.compile``d with
  ``torch._functorch.config.activation_memory_budget = b``;
- ``bound``: BENCHMARKS.md's compute bound measured at this run's micro-batch
  and sequence on this GPU: the step's GEMMs (each linear layer's forward
  and both backward GEMMs, the tied head's too) and flash attention
  (forward + backward) timed back to back, each at its shapes; the useful
  FLOPs over that time is the bound's MFU. Run first when listed, and the
  other systems report their fraction of it too (``of_measured_bound``).

Reported per system: tokens/s, MFU with recomputation *not* counted (the
workload's useful FLOPs); for stepfx also MFU with it counted (the useful
MFU times the plan's matmul and attention FLOPs over those it does not
recompute) and that as a fraction of BENCHMARKS.md's compute bound (74%); peak memory;
stepfx's pass summary (the level chosen, saved bytes per level). JSON lines
to ``$OUT/remat.jsonl``.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stepfx  # noqa: E402
from benchmarks.single_gpu import (PEAK_FLOPS, apply_settings, eager_step, failure_row, profile, record_row,  # noqa: E402
                                   stepfx_step, sync, timed)
from stepfx.graph.accounting import node_flops  # noqa: E402
from stepfx.passes.memory.recompute_activations import META_RECOMPUTED  # noqa: E402
from stepfx.testing.models import GPT, gpt_config  # noqa: E402

# BENCHMARKS.md, "the workload's own limit": the 1.3B step's GEMMs and flash attention back to back on one H200
# run at 74% MFU; a step's MFU with its recomputed FLOPs counted, against that, is the fraction reported
COMPUTE_BOUND_MFU = 0.74


def measure_bound(args) -> dict:
    """The workload's compute bound at this micro-batch (BENCHMARKS.md's method): every GEMM of a step
    (forward, input gradient, weight gradient) and flash attention's forward and backward, each timed with
    its calls queued back to back (benchmarks/kernels.py's queued_ms); layers times one block, plus the
    head. Returned: the bound's step ms and MFU (the useful FLOPs over that time)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.kernels import queued_ms

    cfg = gpt_config(args.size, seq_len=args.seq)
    with torch.device("meta"):
        model = GPT(cfg)
    rows, dt, dev = args.batch * args.seq, torch.bfloat16, torch.device(args.device)
    block = [m for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)]
    parts = {}
    for name, linears, count in (("block GEMMs", block, cfg.n_layers), ("head GEMMs", [model.head], 1)):
        total = 0.0
        for m in linears:
            x = torch.randn(rows, m.in_features, device=dev, dtype=dt)
            w = torch.randn(m.out_features, m.in_features, device=dev, dtype=dt) / m.in_features ** 0.5
            dy = torch.randn(rows, m.out_features, device=dev, dtype=dt)
            b = torch.randn(m.out_features, device=dev, dtype=dt) if m.bias is not None else None
            forward = (lambda: torch.addmm(b, x, w.t())) if b is not None else (lambda: x @ w.t())
            for fn in (forward, lambda: dy @ w, lambda: dy.t() @ x):
                total += queued_ms(fn, 3, 10, reps=3)
            del x, w, dy, b
        parts[name] = total * count
    heads, hd = cfg.n_heads, cfg.d_model // cfg.n_heads
    q, k, v = (torch.randn(args.batch, heads, args.seq, hd, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    grad = torch.randn(args.batch, heads, args.seq, hd, device=dev, dtype=dt)

    def attention(backend):
        def run():
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad)
        return run

    parts["flash attention"] = queued_ms(attention(SDPBackend.FLASH_ATTENTION), 3, 10, reps=3) * cfg.n_layers
    # not in BENCHMARKS.md's method, which times flash: cuDNN's (what stepfx's step runs at fixed lengths)
    cudnn = queued_ms(attention(SDPBackend.CUDNN_ATTENTION), 3, 10, reps=3) * cfg.n_layers
    step_ms = sum(parts.values())
    flops_per_token = 6 * model.matmul_params() + 12 * cfg.n_layers * cfg.d_model * args.seq
    mfu = flops_per_token * rows / (step_ms / 1e3) / PEAK_FLOPS
    cudnn_ms = step_ms - parts["flash attention"] + cudnn
    return {"system": "bound", "size": args.size, "batch": args.batch, "seq": args.seq,
            "bound_step_ms": round(step_ms, 1), "bound_mfu": round(mfu, 4),
            "parts_ms": {k: round(v, 1) for k, v in parts.items()}, "cudnn_attention_ms": round(cudnn, 1),
            "bound_with_cudnn_mfu": round(flops_per_token * rows / (cudnn_ms / 1e3) / PEAK_FLOPS, 4)}


def run(kind: str, args) -> dict:
    if kind == "bound":
        return measure_bound(args)
    torch.manual_seed(0)
    device = torch.device(args.device)
    cfg = gpt_config(args.size, seq_len=args.seq)
    model = GPT(cfg).to(device)
    adamw = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    summary = None
    if kind.startswith("stepfx"):
        arg = kind.split("-", 1)[1] if "-" in kind else None
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)
        config = {"bf16": {"enabled": True}, "gradient_clipping": 1.0, "stepfx": {"codegen": device.type == "cuda" or None}}
        if arg is not None and arg.startswith("gib"):  # the planner: the least recomputation that fits
            config["stepfx"]["memory_budget_gib"] = float(arg[3:])
        elif arg is not None:
            config["stepfx"]["activation_memory_budget"] = float(arg)
        step = stepfx.parallelize(config)(stepfx_step)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), fused=device.type == "cuda", **adamw)
        if kind == "eager-ckpt":
            for block in model.blocks:
                forward = block.forward
                block.forward = lambda x, f=forward: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)
        elif kind.startswith("compile-"):
            import torch._functorch.config as functorch_config  # the knob torch.compile reads (private)

            functorch_config.activation_memory_budget = float(kind.split("-", 1)[1])
            for block in model.blocks:
                block.compile()
        step = eager_step
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device) for _ in range(2)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warm = []
    for i in range(args.warmup):
        start = time.perf_counter()
        step(model, optimizer, batches[i % 2])
        sync(device)
        warm.append(round(time.perf_counter() - start, 2))
    times, loss = timed(lambda i: step(model, optimizer, batches[i % 2]), args.steps, device)
    tps = args.batch * args.seq / (times["step_ms"] / 1e3)
    flops_per_token = 6 * model.matmul_params() + 12 * cfg.n_layers * cfg.d_model * args.seq
    if args.profile and device.type == "cuda":  # 3 more steps under torch.profiler: device ms by kind of kernel
        row_profile = profile(kind, lambda i: step(model, optimizer, batches[i % 2]), args, trace=args.trace)
    counted = None
    if kind.startswith("stepfx"):
        summary = next((r.summary for r in step.plan.records if r.name == "recompute_activations"), None)
        if step.plan.planned_choice is not None:
            summary = f"planner: {step.plan.planned_choice}; {summary}"
        counted = recomputed_flops(step.plan.graph)
    row = {"system": kind, "size": args.size, "batch": args.batch, "seq": args.seq, "tokens_per_s": round(tps),
            "mfu_useful": round(flops_per_token * tps / PEAK_FLOPS, 4), "first_call_s": warm[0],
            "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
            "final_loss": round(float(loss.detach()), 4), "timing": times, "remat": summary}
    if args.profile and device.type == "cuda":
        row["profile"] = row_profile
    if counted is not None:  # the useful MFU scaled by the plan's matmul and attention FLOPs over those not recomputed
        # (a ratio: node_flops misses the head inside the fused linear + cross-entropy kernel, never recomputed)
        total, again = counted
        counted_mfu = row["mfu_useful"] * total / (total - again)
        row.update(step_flops=total, recomputed_flops=again, mfu_counted=round(counted_mfu, 4),
                   of_compute_bound=round(counted_mfu / COMPUTE_BOUND_MFU, 4))
    if args.bound_mfu:  # the bound measured in this run, at this micro-batch
        row["of_measured_bound"] = round(row.get("mfu_counted", row["mfu_useful"]) / args.bound_mfu, 4)
    return row


def recomputed_flops(graph) -> tuple[float, float]:
    """(all, recomputed) matmul and attention FLOPs of one step of the plan's program (node_flops at the
    traced sizes); recomputed: the nodes recompute_activations copied into the backward."""
    total = again = 0.0
    for node in graph.gm.graph.nodes:
        flops = node_flops(node) if node.op == "call_function" else 0.0
        total += flops
        if META_RECOMPUTED in node.meta:
            again += flops
    return total, again


def read_rows(path: str) -> list:
    import json

    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.3B")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--systems", default="stepfx,stepfx-0.5,stepfx-0,eager-ckpt,compile-0.5,compile-0")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--profile", action="store_true", help="also profile 3 steps (single_gpu.profile: $OUT/profile_<system>.txt)")
    ap.add_argument("--trace", action="store_true", help="with --profile: keep the Chrome trace (gzipped)")
    ap.add_argument("--set", default="", metavar="MODULE.NAME=INT,...",
                    help="override stepfx.codegen module constants for this run (single_gpu.py's --set)")
    ap.add_argument("--bound-mfu", type=float, default=None,
                    help="the compute bound's MFU at this micro-batch (the 'bound' system's, which passes it on)")
    args = ap.parse_args()
    apply_settings(args.set)
    systems = args.systems.split(",")
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "command": f"python3 benchmarks/remat.py --size {args.size} --seq {args.seq} --batch {args.batch} "
                       f"--systems {args.systems}" + (f" --set {args.set}" if args.set else "")}
    if len(systems) > 1:  # one process per system: an out-of-memory failure leaves nothing behind for the next
        if "bound" in systems:  # first: the others report their fraction of it
            systems = ["bound"] + [k for k in systems if k != "bound"]
        for kind in systems:
            if args.bound_mfu is None and kind != "bound" and "bound" in systems and args.out:
                bounds = [r for r in read_rows(os.path.join(args.out, "remat.jsonl")) if r.get("system") == "bound"
                          and r.get("batch") == args.batch and r.get("bound_mfu")]
                args.bound_mfu = bounds[-1]["bound_mfu"] if bounds else None
            cmd = [sys.executable, os.path.abspath(__file__), "--systems", kind, "--size", args.size, "--seq",
                   str(args.seq), "--batch", str(args.batch), "--warmup", str(args.warmup), "--steps",
                   str(args.steps), "--device", args.device] + (["--out", args.out] if args.out else []) + \
                  (["--profile"] if args.profile else []) + (["--trace"] if args.trace else []) + \
                  (["--set", args.set] if args.set else []) + \
                  (["--bound-mfu", str(args.bound_mfu)] if args.bound_mfu else [])
            subprocess.run(cmd, check=False)
        return
    kind = systems[0]
    try:
        row = run(kind, args)
    except Exception as exc:  # a peer's failure is a result
        row = failure_row(kind, exc)
    gc.collect()
    record_row({**meta, **row}, args.out, "remat.jsonl")

if __name__ == "__main__":
    main()
