"""Does cuDNN's packed ("varlen") attention serve every length under one
maximum without a plan per length? A probe for issue 17's last 5% (one GPU).

    python3 benchmarks/probe_cudnn_varlen.py --out $OUT

The dynamic-length step runs attention on flash attention because dense
cuDNN builds an execution plan for every new length (~70 ms of host time a
length; benchmarks/README.md, "Variable sequence lengths"), though cuDNN's
kernel is 1.5-1.8x faster once built. ``aten._cudnn_attention_forward``
also takes packed sequences ([tokens, heads, head_dim] with cumulative
offsets and a maximum length): if its plan depends on the maximum only, one
plan serves every length up to it.

For each new length L (causal, [batch, heads, L, head_dim] bf16, the 1.3B
GPT's shapes): forward + backward of flash (dense), dense cuDNN (its first
call, which builds the plan, and the steady calls after), and packed cuDNN
with the maximum fixed at ``--max`` (first and steady calls), plus the
largest difference of the packed result from flash's. Milliseconds, CUDA
events around each call. JSON lines to ``$OUT/probe_cudnn_varlen.jsonl``;
a failure of the packed call is recorded as such (this torch may not take
it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

aten = torch.ops.aten


def timed(fn, reps: int) -> tuple[float, float]:
    """(first call ms, median of ``reps`` later calls ms)."""
    def once() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    first = once()
    return first, statistics.median(once() for _ in range(reps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", dest="head_dim", type=int, default=128)
    ap.add_argument("--max", type=int, default=2048)
    ap.add_argument("--lengths", default="1024,1333,1590,1674,1906,2048")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    b, h, d = args.batch, args.heads, args.head_dim
    rows = []
    for t in (int(x) for x in args.lengths.split(",")):
        torch.manual_seed(t)
        q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        grad = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16)
        row = {"length": t, "batch": b, "heads": h, "head_dim": d, "max": args.max}

        def dense(backend):
            qd, kd, vd = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))

            def run():
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
                out.backward(grad.transpose(1, 2))
                return out
            return run, (qd, kd, vd)

        run, flash_inputs = dense(SDPBackend.FLASH_ATTENTION)
        flash_out = run().transpose(1, 2).detach()
        flash_grads = [x.grad.transpose(1, 2).clone() for x in flash_inputs]
        row["flash_ms"] = timed(run, args.reps)[1]
        run, _ = dense(SDPBackend.CUDNN_ATTENTION)
        row["cudnn_dense_first_ms"], row["cudnn_dense_ms"] = timed(run, args.reps)

        qp, kp, vp = (x.reshape(b * t, h, d).detach().requires_grad_() for x in (q, k, v))
        cum = torch.arange(0, (b + 1) * t, t, device="cuda", dtype=torch.int32)

        def packed():
            out = aten._cudnn_attention_forward(qp, kp, vp, None, cum, cum, args.max, args.max, True, 0.0, True,
                                                False)[0]
            out.backward(grad.reshape(b * t, h, d))
            return out
        try:
            out = packed().view(b, t, h, d).detach()
            row["packed_max_diff_out"] = float((out.float() - flash_out.float()).abs().max())
            row["packed_max_diff_grad"] = max(float((x.grad.view(b, t, h, d).float() - g.float()).abs().max())
                                              for x, g in zip((qp, kp, vp), flash_grads))
            for x in (qp, kp, vp):
                x.grad = None
            row["cudnn_packed_first_ms"], row["cudnn_packed_ms"] = timed(packed, args.reps)
        except Exception as exc:  # this torch or cuDNN may not take packed sequences
            row["cudnn_packed_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        print(json.dumps(row))
    os.makedirs(args.out, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name()}
    with open(os.path.join(args.out, "probe_cudnn_varlen.jsonl"), "a") as f:
        for row in rows:
            f.write(json.dumps({**meta, **row}) + "\n")


if __name__ == "__main__":
    main()
