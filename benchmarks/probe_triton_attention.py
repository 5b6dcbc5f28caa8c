"""Probe: stepfx's Triton attention (stepfx/codegen/attention_kernels.py) against flash and cuDNN (plan built)
at the 1.3B GPT's attention shapes, causal, bf16, forward and forward + backward, per length; dense [B, H, L, D]
inputs and slices of a fused [B, L, 3, H, D] projection. Sweeps each kernel's block shapes and reports the best.

    python3 benchmarks/probe_triton_attention.py --out $OUT

Milliseconds a call (calls queued back to back between CUDA events, median of 5 runs), TFLOP/s on the causal
FLOPs (forward 2 matmuls, backward 5, half of each square), and each kernel's largest difference from an fp32
reference next to flash's. Where the device has TMA (Hopper) the kernels run both ways, through pointers and
through TMA descriptors.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kernels import queued_ms  # noqa: E402
from stepfx.codegen import attention_kernels as ak  # noqa: E402


FWD = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 4),
       (128, 32, 4, 3), (128, 64, 8, 5), (128, 64, 4, 4)]
DKDV = [(64, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3),
        (16, 128, 8, 3), (64, 128, 4, 2)]
DQ = [(128, 64, 8, 2), (128, 32, 8, 3), (128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3),
      (128, 128, 8, 2)]


def inputs(b, h, t, d, fused):
    if fused:
        qkv = torch.randn(b, t, 3, h, d, device="cuda", dtype=torch.bfloat16)
        return [qkv[:, :, i].transpose(1, 2) for i in range(3)]
    return [torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


def reference(q, k, v, grad):
    qf, kf, vf = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    out.backward(grad.float())
    return out, qf.grad, kf.grad, vf.grad


def sdpa_run(backend, q, k, v, grad):
    qs, ks, vs = (x.detach().requires_grad_(True) for x in (q, k, v))

    def fwd():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    def both():
        qs.grad = ks.grad = vs.grad = None
        fwd().backward(grad)
        return None

    def result():
        both()
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True), qs.grad, ks.grad, vs.grad
    return fwd, both, result


def err(got, ref):
    return max((g.float() - r).abs().max().item() for g, r in zip(got, ref))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,1536,1674,2048")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20, help="calls per timed run")
    ap.add_argument("--sweep-length", type=int, default=1674)
    ap.add_argument("--no-sweep", action="store_true", help="time the launchers' default shapes only")
    ap.add_argument("--settings-file", default="",
                    help="write the fastest kernels' settings here, as dynamic_lengths.py's --set takes them")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    b, h, d = args.batch, args.heads, args.head_dim
    rows = []

    def emit(row):
        row.update(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__)
        rows.append(row)
        print(json.dumps(row), flush=True)

    # 1. each kernel's block shapes at one length (fused layout, as in the step)
    q, k, v = inputs(b, h, args.sweep_length, d, True)
    grad = torch.randn(b, h, args.sweep_length, d, device="cuda", dtype=torch.bfloat16)
    out, lse = ak.attention_forward(q, k, v, True)
    best = {}
    tmas = (False, True) if ak._use_tma(True, q, k, v) else (False,)
    if args.no_sweep:  # the launchers' defaults, both ways of reading
        best.update({(name, m): cfg for name, cfg in (("fwd", ak.FWD), ("dkdv", ak.BWD_DKDV), ("dq", ak.BWD_DQ))
                     for m in tmas})
    for name, configs in () if args.no_sweep else (("fwd", FWD), ("dkdv", DKDV), ("dq", DQ)):
        timings = {}
        for cfg, tma in itertools.product(configs, tmas):
            if name == "fwd":
                fn = lambda cfg=cfg, tma=tma: ak.attention_forward(q, k, v, True, config=cfg, tma=tma)
            elif name == "dkdv":
                fn = lambda cfg=cfg, tma=tma: ak.attention_backward(grad, q, k, v, out, lse, True, dkdv=cfg,
                                                                    dq=ak.BWD_DQ, tma=tma)
            else:
                fn = lambda cfg=cfg, tma=tma: ak.attention_backward(grad, q, k, v, out, lse, True, dkdv=ak.BWD_DKDV,
                                                                    dq=cfg, tma=tma)
            try:
                timings[cfg, tma] = queued_ms(fn, 3, args.reps)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                timings[cfg, tma] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        for tma in tmas:
            ok = {c: t for (c, m), t in timings.items() if m == tma and isinstance(t, float)}
            if ok:
                best[name, tma] = min(ok, key=ok.get)
        emit({"sweep": name, "length": args.sweep_length,
              "ms": {",".join(map(str, c)) + (" tma" if m else ""): (round(t, 4) if isinstance(t, float) else t)
                     for (c, m), t in timings.items()},
              "best": {("tma" if m else "pointers"): best.get((name, m)) for m in tmas}})
    tmas = tuple(m for m in tmas if all((name, m) in best for name in ("fwd", "dkdv", "dq")))

    # 2. per length: flash, cuDNN, Triton (best configs), dense and fused layouts
    for t, fused in itertools.product((int(x) for x in args.lengths.split(",")), (False, True)):
        q, k, v = inputs(b, h, t, d, fused)
        grad = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
        flops_fwd = 4 * b * h * t * t * d / 2
        row = {"length": t, "layout": "fused" if fused else "dense", "batch": b, "heads": h, "head_dim": d}
        ref = reference(q, k, v, grad)
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            fwd, both, result = sdpa_run(backend, q, k, v, grad)
            row[f"{name}_err"] = round(err(result(), ref), 5)
            row[f"{name}_fwd_ms"] = round(queued_ms(fwd, 3, args.reps), 4)
            row[f"{name}_fwd_bwd_ms"] = round(queued_ms(both, 3, args.reps), 4)

        names = ["flash", "cudnn"]
        for tma in tmas:
            name = "triton_tma" if tma else "triton"
            names.append(name)

            def triton_fwd(tma=tma):
                return ak.attention_forward(q, k, v, True, config=best["fwd", tma], tma=tma)

            def triton_both(tma=tma):
                o, l = triton_fwd()
                return ak.attention_backward(grad, q, k, v, o, l, True, dkdv=best["dkdv", tma], dq=best["dq", tma],
                                             tma=tma)
            o, _ = triton_fwd()
            row[f"{name}_err"] = round(err((o, *triton_both()), ref), 5)
            row[f"{name}_fwd_ms"] = round(queued_ms(triton_fwd, 3, args.reps), 4)
            row[f"{name}_fwd_bwd_ms"] = round(queued_ms(triton_both, 3, args.reps), 4)
            row[f"{name}_over_flash"] = round(row["flash_fwd_bwd_ms"] / row[f"{name}_fwd_bwd_ms"], 3)
            row[f"{name}_over_cudnn"] = round(row["cudnn_fwd_bwd_ms"] / row[f"{name}_fwd_bwd_ms"], 3)
        for name in names:
            row[f"{name}_tflops"] = round(3.5 * flops_fwd / row[f"{name}_fwd_bwd_ms"] / 1e9, 1)
        emit(row)
        torch.cuda.empty_cache()
    if args.settings_file:
        # pointers or TMA: the one whose forward + backward (fused layout) is faster over the lengths probed
        total = {tma: sum(r[f"triton{'_tma' if tma else ''}_fwd_bwd_ms"] for r in rows
                          if r.get("layout") == "fused") for tma in tmas}
        tma = min(total, key=total.get)
        fmt = lambda c: "(" + ",".join(map(str, c)) + ")"  # noqa: E731
        text = (f"attention_kernels.TMA={tma},attention_kernels.FWD={fmt(best['fwd', tma])},"
                f"attention_kernels.BWD_DKDV={fmt(best['dkdv', tma])},attention_kernels.BWD_DQ={fmt(best['dq', tma])}")
        emit({"settings": text, "fwd_bwd_ms_summed": {str(k): round(v, 4) for k, v in total.items()}})
        with open(args.settings_file, "w") as f:
            f.write(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_triton_attention.jsonl"), "a") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")


if __name__ == "__main__":
    main()
