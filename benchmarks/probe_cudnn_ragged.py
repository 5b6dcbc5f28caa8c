"""Does torch's ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` give cuDNN attention's
speed at every length without a plan per length? (one GPU)

    TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 python3 benchmarks/probe_cudnn_ragged.py --out $OUT
    python3 benchmarks/probe_cudnn_ragged.py --out $OUT          # the same without it

With the variable set, torch runs dense cuDNN attention through cuDNN's
ragged-offset path when q, k, v and the output are laid out [batch, length,
heads, head_dim] (``x.transpose(1, 2).is_contiguous()``) and there is no bias,
and keys its plan cache on the lengths rounded up to powers of two. For each
length (causal, [4, 16, L, 128] bf16, forward + backward): the first call's
wall time (a plan built or not), the median of the timed calls, and the
largest difference of the output and q/k/v gradients from an fp32 reference
(the math kernel on fp32 copies), next to flash attention's. Two layouts: the
contiguous one, and the one a fused qkv projection gives (q, k, v slices of
one [B, L, 3, H, D] tensor: not contiguous per tensor). JSON lines to
``$OUT/probe_cudnn_ragged.jsonl``; results of 2026-12-06 (H100) in
``results/2026-12-06_probe_cudnn_ragged_h100.jsonl`` and benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kernels import time_ms  # noqa: E402


def make(layout: str, b: int, h: int, t: int, d: int):
    if layout == "bshd":
        q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    else:
        qkv = torch.randn(b, t, 3, h, d, device="cuda", dtype=torch.bfloat16)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    grad = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return q, k, v, grad


def call(backend, q, k, v, grad):
    for x in (q, k, v):
        x.grad = None
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(grad)
    return out


def errors(out, q, k, v, ref) -> dict:
    got = (out, q.grad, k.grad, v.grad)
    return {name: float((g.float() - r).abs().max()) for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}


def reference(q, k, v, grad):
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
    out.backward(grad.float())
    return out.detach(), q32.grad, k32.grad, v32.grad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,1245,1281,1536,1600,1678,1733,1792,1920,2041,2048,1100,1999")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    env = os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "")
    rows = []
    for layout in ("bshd", "fused_qkv"):
        for t in (int(x) for x in args.lengths.split(",")):
            q, k, v, grad = make(layout, args.batch, args.heads, t, args.head_dim)
            ref = reference(q, k, v, grad)
            row = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "avoid_recompile": env,
                   "layout": layout, "length": t}
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                try:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    out = call(backend, q, k, v, grad)
                    torch.cuda.synchronize()
                    row[f"{name}_first_ms"] = round((time.perf_counter() - start) * 1e3, 2)
                    row[f"{name}_err"] = errors(out, q, k, v, ref)
                    row[f"{name}_ms"] = round(time_ms(lambda: call(backend, q, k, v, grad), 2, args.reps), 3)
                except RuntimeError as exc:
                    row[f"{name}_ms"] = f"error: {str(exc).splitlines()[0][:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            del q, k, v, grad, ref
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_cudnn_ragged.jsonl"), "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
