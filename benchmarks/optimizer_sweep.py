"""The whole-model optimizer kernels on the 1.3B GPT's own parameter shapes,
over a sweep of launch geometries, against torch's fused AdamW, on one GPU.

    python3 benchmarks/optimizer_sweep.py --out $OUT

The kernel microbenchmarks (``kernels.py``) time one flat 64M buffer; in the
training step the multi-tensor kernels run over the model's ~290 tensors
(1.3B elements, ~34 GB of traffic for AdamW with bf16 gradients), where the
profile showed the update well below the flat buffer's bandwidth. This
times ``adam_update_many`` (bf16 gradients, as under bf16 training),
``sum_squares_many`` (the clip norm) and ``cast_pack`` of all parameters to
bf16 (the step's bf16 parameter copy) for each geometry in ``--adam`` /
``--sum`` / ``--pack``, and torch's ``AdamW(fused=True)`` over the same
shapes (fp32 gradients: it takes no bf16 gradient for fp32 parameters).
Times are device times (``kernels.graph_ms``: CUDA-graph replays, so
the host's table lookups are out, as they are in a step the host runs ahead
of). A geometry is ``BLOCKxITERSxWARPS``. Controls: ``adam_update`` (one tensor) on a flat buffer
of the same 1.3B elements and on a 64M one; ``adam_update_many`` also writing
each parameter's bf16 copy (``carry_parameter_copies``), which replaces the
update plus ``cast_pack`` in the step. JSON lines to ``$OUT/optimizer_sweep.jsonl``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernels import COPY_BANDWIDTH, graph_ms  # noqa: E402

from stepfx.codegen import multi_tensor, optimizer_kernels, reduction_kernels  # noqa: E402
from stepfx.testing.models import GPT, gpt_config  # noqa: E402

LR, BETA1, BETA2, EPS, WD = 3e-4, 0.9, 0.95, 1e-8, 0.1


def _shapes(size: str) -> list[torch.Size]:
    with torch.device("meta"):
        model = GPT(gpt_config(size))
    return [p.shape for p in model.parameters()]


def _geometries(text: str) -> list[tuple[int, int, int]]:
    """``"2048x1x8,4096x4x8"`` -> [(block, iters, warps), ...]"""
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--size", default="1.3B")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--adam", default="2048x1x8,2048x2x8,2048x4x8,2048x8x8,1024x4x4,1024x8x4")
    ap.add_argument("--sum", default="2048x8x8,1024x16x4,4096x8x8")
    ap.add_argument("--pack", default="2048x1x4,4096x1x8")
    ap.add_argument("--no-flat", action="store_true", help="skip the one-tensor controls")
    args = ap.parse_args()
    device = torch.device("cuda")
    shapes = _shapes(args.size)
    n = sum(s.numel() for s in shapes)
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, device=device, generator=gen).to(torch.bfloat16) for s in shapes]
    exp_avgs = [torch.zeros(s, device=device) for s in shapes]
    exp_avg_sqs = [torch.zeros(s, device=device) for s in shapes]
    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": "python3 benchmarks/optimizer_sweep.py", "size": args.size, "tensors": len(shapes),
            "elements": n}
    rows = []

    def record(case: str, nbytes: int, ms: float, **extra) -> None:
        row = {**meta, "case": case, **extra, "ms": round(ms, 3), "GBps": round(nbytes / ms / 1e6, 1),
               "of_copy_bw": round(nbytes / (ms / 1e3) / COPY_BANDWIDTH, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(os.path.join(args.out, "optimizer_sweep.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")

    adam_bytes = n * (3 * 4 * 2 + 2)
    hyper = dict(lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD, step=10.0, decoupled=True)
    defaults = optimizer_kernels.BLOCK, optimizer_kernels.MANY_ITERS, optimizer_kernels.NUM_WARPS
    for block, iters, warps in _geometries(args.adam):
        optimizer_kernels.BLOCK, optimizer_kernels.MANY_ITERS, optimizer_kernels.NUM_WARPS = block, iters, warps
        multi_tensor.clear_caches()
        record("adam_update_many bf16 grad", adam_bytes,
               graph_ms(lambda: optimizer_kernels.adam_update_many(params, grads, exp_avgs, exp_avg_sqs, **hyper),
                        args.iters, reps=3),
               block=block, iters=iters, warps=warps)
    optimizer_kernels.BLOCK, optimizer_kernels.MANY_ITERS, optimizer_kernels.NUM_WARPS = defaults
    # the update writing each parameter's bf16 copy too (carry_parameter_copies), at the default geometry:
    # against the update alone plus cast_pack below, which it replaces in the step
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total = -(-(total + p.numel()) // 64) * 64
    carried = torch.zeros(total, dtype=torch.bfloat16, device=device)
    copies = [carried[o:o + p.numel()] for p, o in zip(params, offsets)]
    multi_tensor.clear_caches()
    record("adam_update_many bf16 grad + bf16 copies", adam_bytes + n * 2,
           graph_ms(lambda: optimizer_kernels.adam_update_many(params, grads, exp_avgs, exp_avg_sqs, copies=copies,
                                                               **hyper), args.iters, reps=3),
           block=defaults[0], iters=defaults[1], warps=defaults[2])
    del carried, copies

    if not args.no_flat:
        for count in (n, 64 << 20):
            flat = [torch.randn(count, device=device, generator=gen) * 0.02,
                    torch.randn(count, device=device, generator=gen).to(torch.bfloat16),
                    torch.zeros(count, device=device), torch.zeros(count, device=device)]
            record(f"adam_update one tensor of {count} bf16 grad", count * 26,
                   graph_ms(lambda: optimizer_kernels.adam_update(*flat, inplace=True, **hyper), args.iters, reps=3),
                   block=optimizer_kernels.BLOCK, warps=optimizer_kernels.NUM_WARPS)
            del flat
            torch.cuda.empty_cache()

    sum_bytes = n * 2
    for block, iters, warps in _geometries(args.sum):
        reduction_kernels.SUM_BLOCK, reduction_kernels.SUM_ITERS, reduction_kernels.NUM_WARPS = block, iters, warps
        multi_tensor.clear_caches()
        record("sum_squares_many bf16", sum_bytes, graph_ms(lambda: reduction_kernels.sum_squares_many(*grads),
                                                             args.iters, reps=3), block=block, iters=iters, warps=warps)
    reduction_kernels.SUM_BLOCK, reduction_kernels.SUM_ITERS, reduction_kernels.NUM_WARPS = 2048, 8, 8

    parts = [(p, o) for p, o in zip(params, offsets)]
    for block, _iters, warps in _geometries(args.pack):
        reduction_kernels.PACK_BLOCK, reduction_kernels.PACK_WARPS = block, warps
        multi_tensor.clear_caches()
        record("cast_pack fp32 -> bf16", n * 6, graph_ms(lambda: reduction_kernels.cast_pack(parts, total, torch.bfloat16),
                                                          args.iters, reps=3), block=block, warps=warps)

    grads.clear()
    torch.cuda.empty_cache()
    fused_params = [torch.nn.Parameter(p) for p in params]
    for p in fused_params:
        p.grad = torch.randn(p.shape, device=device, generator=gen)
    opt = torch.optim.AdamW(fused_params, lr=torch.tensor(LR, device=device), betas=(BETA1, BETA2), eps=EPS,
                            weight_decay=WD, fused=True, capturable=True)
    record("torch AdamW fused fp32 grad", n * 28, graph_ms(opt.step, args.iters, reps=3))


if __name__ == "__main__":
    main()
