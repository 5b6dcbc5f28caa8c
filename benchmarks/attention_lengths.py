"""Where a step with varying lengths loses time per token: attention kernels
and the block's matmuls at the 1.3B GPT's shapes, per length (one GPU).

    python3 benchmarks/attention_lengths.py --out $OUT

For each length: causal attention forward + backward on [batch, heads,
length, head_dim] bf16 with flash, cuDNN (its plan built before timing) and
cuDNN on the length padded up to a multiple of 128 (the pad and the slice
counted); and the block's four matmuls forward and backward (qkv, output
projection, MLP up and down) on ``batch * length`` rows. Milliseconds per
call and per 1,000 tokens, median of the timed repetitions, CUDA events.
JSON lines to ``$OUT/attention_lengths.jsonl``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kernels import time_ms  # noqa: E402


def attention(backend, b: int, h: int, t: int, d: int, pad_to: int = 0):
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)

    def run():
        with sdpa_kernel([backend]):
            if pad_to:
                extra = -t % pad_to
                qp, kp, vp = (F.pad(x, (0, 0, 0, extra)) for x in (q, k, v))
                out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)[:, :, :t]
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(grad)
    return run


def matmuls(rows: int, d: int):
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(rows, 4 * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
          for n, k in ((3 * d, d), (d, d), (4 * d, d))]
    down = torch.randn(d, 4 * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def run():
        outs = [x @ w.t() for w in ws] + [h @ down.t()]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,1245,1281,1536,1600,1678,1733,1792,1920,2041,2048")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    d = args.heads * args.head_dim
    rows = []
    for t in (int(x) for x in args.lengths.split(",")):
        tokens = args.batch * t
        row = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "length": t, "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim}
        cases = {"flash": (SDPBackend.FLASH_ATTENTION, 0), "cudnn": (SDPBackend.CUDNN_ATTENTION, 0),
                 "cudnn_pad128": (SDPBackend.CUDNN_ATTENTION, 128), "efficient": (SDPBackend.EFFICIENT_ATTENTION, 0)}
        for name, (backend, pad) in cases.items():
            try:
                ms = time_ms(attention(backend, args.batch, args.heads, t, args.head_dim, pad), 3, args.reps)
                row[f"attn_{name}_ms"] = round(ms, 3)
            except RuntimeError as exc:
                row[f"attn_{name}_ms"] = f"error: {str(exc).splitlines()[0][:120]}"
        ms = time_ms(matmuls(tokens, d), 3, args.reps)
        row["matmuls_ms"] = round(ms, 3)
        row["matmuls_tflops"] = round(3 * 2 * tokens * d * d * 12 / ms / 1e9, 1)
        row["matmuls_ms_per_ktok"] = round(ms / tokens * 1e3, 4)
        for name in ("flash", "cudnn"):
            if isinstance(row[f"attn_{name}_ms"], float):
                row[f"attn_{name}_ms_per_ktok"] = round(row[f"attn_{name}_ms"] / tokens * 1e3, 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention_lengths.jsonl"), "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
