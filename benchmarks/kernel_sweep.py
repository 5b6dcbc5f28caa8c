"""The memory-bound kernels of the 1.3B GPT's step on its own shapes, over a
sweep of launch geometries, against the aten ops they replace, on one GPU.

    python3 benchmarks/kernel_sweep.py --out $OUT

Shapes: 8192 tokens (batch 4 x seq 2048), d_model 2048, MLP width 8192,
bf16. Cases: the bias gradients' column sums (2048, 6144 and 8192
columns); the LayerNorm backward with the residual gradient added; the
q, k, v gradients' concatenation with the qkv bias gradient (fused or
apart); the LayerNorm backward with its grad_input's column sum (fused or
apart); the LayerNorm forward in fp32 and bf16 (``lnfwd``); causal
attention forward + backward under each SDPA backend. Each stepfx kernel
runs at every geometry of its flag (module constants patched for the run);
every time is device time (``kernels.graph_ms``: CUDA-graph replays; events
around calls where a graph cannot hold the work). JSON lines to
``$OUT/kernel_sweep.jsonl``.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernels import COPY_BANDWIDTH, graph_ms, time_ms  # noqa: E402

from stepfx.codegen import norm_kernels as norm  # noqa: E402
from stepfx.codegen import reduction_kernels as red  # noqa: E402

aten = torch.ops.aten
TOKENS, D, FF = 8192, 2048, 8192


def _ints(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


@contextlib.contextmanager
def _patched(module, **values):
    """Set a kernel module's launch constants for a measurement; restore them after."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _layer_norm_inputs(dev, gen):
    """A bf16 LayerNorm backward's inputs as in the bf16 step (fp32 stats): x, dy, the residual gradient r,
    w, b, mean, rstd."""
    x, g, r = (torch.randn(TOKENS, D, device=dev, generator=gen).to(torch.bfloat16) for _ in range(3))
    w, b = (torch.randn(D, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, mean, rstd = aten.native_layer_norm(x, [D], w, b, 1e-5)
    return x, g, r, w, b, mean, rstd


def best_constants(path: str) -> str:
    """``module.NAME=value,...``: the constants of the fastest stepfx row of each case in a sweep's JSON lines."""
    best: dict[str, dict] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row.get("consts") and (row["case"] not in best or row["us"] < best[row["case"]]["us"]):
                best[row["case"]] = row
    return ",".join(f"{k}={v}" for row in best.values() for k, v in row["consts"].items())


def main() -> None:
    global TOKENS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--column", default="64x128x4x4,32x128x4x8,16x256x4x8,32x256x8x4,16x128x4x16,8x256x8x8",
                    help="ROWSxBLOCK_NxWARPSxPER_SM")
    ap.add_argument("--ln-bwd", default="4096x16x16,4096x16x32,2048x8x16,2048x8x32,8192x16x16",
                    help="TILExPER_THREADxWARPS_PER_SM[xSTAGES] (the backward's _BWD, BWD_WARPS_PER_SM, BWD_STAGES)")
    ap.add_argument("--tokens", type=int, default=TOKENS, help="rows of every case (8192: batch 4 x seq 2048; the "
                    "inputs of a case then fit the H200's 50 MB L2 - 98304, micro-batch 48, does not)")
    ap.add_argument("--ln-fwd", default="2048x8,2048x4,2048x16,4096x8,4096x16,8192x16,1024x4",
                    help="TILExPER_THREAD (the forward's _FWD)")
    ap.add_argument("--cat", default="8x256x4x4,8x256x4x2,16x256x8x2,4x512x4x8,8x512x8x4,32x256x8x1",
                    help="ROWSxBLOCK_NxWARPSxITERS")
    ap.add_argument("--best", metavar="JSONL", help="print, for each case of a finished sweep whose stepfx rows carry "
                    "module constants, the fastest row's as single_gpu.py's --set argument, and exit")
    ap.add_argument("--cases", default="column,ln,cat,lnsum,addmm,sdpa", help="which sections run")
    args = ap.parse_args()
    if args.best:
        print(best_constants(args.best))
        return
    cases = args.cases.split(",")
    TOKENS = args.tokens
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": "python3 benchmarks/kernel_sweep.py", "tokens": TOKENS}

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if args.out:  # line by line: a run cut short keeps what it measured
            with open(os.path.join(args.out, "kernel_sweep.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")

    def record(case: str, impl: str, nbytes: int, fn, **geometry) -> None:
        ms = graph_ms(fn, args.iters, reps=10)
        emit({**meta, "case": case, "impl": impl, **geometry, "us": round(ms * 1e3, 1),
              "of_copy_bw": round(nbytes / (ms / 1e3) / COPY_BANDWIDTH, 3)})

    bf16 = torch.bfloat16
    dy = torch.randn(TOKENS, FF, device=dev, generator=gen).to(bf16)

    if "column" in cases:
        # bias gradients
        for cols in (D, 3 * D, FF):
            x = dy[:, :cols].contiguous()
            case = f"column sum {TOKENS}x{cols}"
            record(case, "aten sum", 2 * x.numel(), lambda: aten.sum(x, [0], True))
            for rows, block_n, warps, per_sm in _ints(args.column):
                with _patched(red, COLUMN_ROWS=rows, COLUMN_BLOCK_N=block_n, COLUMN_WARPS=warps, COLUMN_PER_SM=per_sm):
                    record(case, "stepfx", 2 * x.numel(), lambda: red.column_sum(x, True), rows=rows, block_n=block_n,
                           warps=warps, per_sm=per_sm)
            del x

    if "ln" in cases:
        # LayerNorm backward with the residual gradient added
        x, g, r, w, b, mean, rstd = _layer_norm_inputs(dev, gen)
        case = f"layer norm bwd + residual {TOKENS}x{D}"
        record(case, "aten+add", 10 * x.numel(),
               lambda: aten.add(aten.native_layer_norm_backward(g, x, [D], mean, rstd, w, b, [True, True, True])[0], r))
        for tile, per_thread, warps_per_sm, *more in _ints(args.ln_bwd):
            stages = more[0] if more else 1
            with _patched(norm, _BWD=dict(tile=tile, per_thread=per_thread), BWD_WARPS_PER_SM=warps_per_sm,
                          BWD_STAGES=stages):
                record(case, "stepfx", 8 * x.numel(),
                       lambda: norm.layer_norm_backward(g, x, [D], mean, rstd, w, b, [True, True, True], r),
                       tile=tile, per_thread=per_thread, warps_per_sm=warps_per_sm, stages=stages)

    if "cat" in cases:
        # attention's q, k, v gradients concatenated into the qkv projection's, and its bias gradient
        from stepfx.codegen import column_sum_kernels as csk

        qkv = [torch.randn(TOKENS, D, device=dev, generator=gen).to(bf16) for _ in range(3)]
        case = f"cat qkv grads + bias grad {TOKENS}x3x{D}"
        record(case, "aten cat", 4 * 3 * TOKENS * D, lambda: aten.cat(qkv, 1))
        record(case, "aten cat + stepfx column_sum", 4 * 3 * TOKENS * D, lambda: red.column_sum(aten.cat(qkv, 1), True))
        names = ("CAT_ROWS", "CAT_BLOCK_N", "CAT_WARPS", "CAT_ITERS")
        for geometry in _ints(args.cat):
            with _patched(csk, **dict(zip(names, geometry))):
                record(case, "stepfx fused", 4 * 3 * TOKENS * D, lambda: csk.cat_column_sum(qkv, True),
                       consts={f"column_sum_kernels.{n}": v for n, v in zip(names, geometry)})
        del qkv

    if "lnfwd" in cases:
        # LayerNorm forward (weight and bias, fp32 statistics) against aten, fp32 and bf16, two widths
        for dtype, rows_, cols in ((torch.float32, TOKENS, D), (bf16, TOKENS, D), (torch.float32, 2 * TOKENS, D // 2)):
            x = torch.randn(rows_, cols, device=dev, generator=gen).to(dtype)
            w, b = (torch.randn(cols, device=dev, generator=gen).to(dtype) for _ in range(2))
            case = f"layer norm fwd {rows_}x{cols} {str(dtype).removeprefix('torch.')}"
            nbytes = 2 * x.numel() * x.element_size()
            record(case, "aten", nbytes, lambda: aten.native_layer_norm(x, [cols], w, b, 1e-5))
            for tile, per_thread in _ints(args.ln_fwd):
                with _patched(norm, _FWD=dict(tile=tile, per_thread=per_thread)):
                    record(case, "stepfx", nbytes, lambda: norm.layer_norm_forward(x, [cols], w, b, 1e-5),
                           tile=tile, per_thread=per_thread)
            del x

    if "lnsum" in cases:
        # LayerNorm backward + residual gradient, and the column sum of the result (a bias gradient):
        # apart (stepfx's kernel, then column_sum) and summed by the backward kernel (grad_input_sum)
        x, g, r, w, b, mean, rstd = _layer_norm_inputs(dev, gen)
        case = f"layer norm bwd + residual + column sum {TOKENS}x{D}"
        record(case, "stepfx apart", 8 * x.numel(), lambda: red.column_sum(
            norm.layer_norm_backward(g, x, [D], mean, rstd, w, b, [True, True, True], r)[0], True))
        record(case, "stepfx without the sum", 8 * x.numel(),
               lambda: norm.layer_norm_backward(g, x, [D], mean, rstd, w, b, [True, True, True], r))
        for tile, per_thread, warps_per_sm, *more in _ints(args.ln_bwd):
            stages = more[0] if more else 1
            with _patched(norm, _BWD=dict(tile=tile, per_thread=per_thread), BWD_WARPS_PER_SM=warps_per_sm,
                          BWD_STAGES=stages):
                record(case, "stepfx summed by the backward", 8 * x.numel(),
                       lambda: norm.layer_norm_backward(g, x, [D], mean, rstd, w, b, [True, True, True], r, "keepdim"),
                       tile=tile, per_thread=per_thread, warps_per_sm=warps_per_sm, stages=stages)

    if "addmm" in cases:
        # the forward linear layers (cuBLAS, bias epilogue) with the weight a tensor of
        # its own or a view into one packed buffer at an offset of 64, 256, 1024
        # elements and up (128 bytes to 2 MB; batch_parameter_casts packs the bf16
        # parameters so): does the operand's alignment change cuBLAS's speed?
        xin = torch.randn(TOKENS, D, device=dev, generator=gen).to(bf16)
        for rows in (3 * D, FF):
            w = torch.randn(rows, D, device=dev, generator=gen).to(bf16)
            bias = torch.randn(rows, device=dev, generator=gen).to(bf16)
            flops = 2 * TOKENS * D * rows
            for offset in (None, 64, 256, 1024, 2048, 8192, 65536, 1 << 20, None):
                if offset is None:
                    wv = w
                else:
                    buf = torch.empty(offset + w.numel(), device=dev, dtype=bf16)
                    wv = buf[offset:].view(rows, D)
                    wv.copy_(w)
                ms = graph_ms(lambda: aten.addmm(bias, xin, wv.t()), args.iters, reps=10)
                emit({**meta, "case": f"addmm bias {TOKENS}x{D} @ {D}x{rows}", "impl": "cuBLAS",
                      "weight_offset": offset, "us": round(ms * 1e3, 1), "TFLOPs": round(flops / (ms / 1e3) / 1e12, 1)})

    if "sdpa" in cases:
        # causal attention forward + backward (batch 4, 16 heads, 2048 x 128), per SDPA backend
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = (torch.randn(4, 16, 2048, 128, device=dev, generator=gen).to(bf16).requires_grad_() for _ in range(3))
        do = torch.randn(4, 16, 2048, 128, device=dev, generator=gen).to(bf16)
        flops = 4 * 4 * 16 * 2048 * 2048 * 128 // 2 * 7 // 2  # causal: forward 2 matmuls, backward 5
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            def attention(backend=backend):
                with sdpa_kernel([backend]):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                return torch.autograd.grad(out, (q, k, v), do)
            try:
                try:
                    ms = graph_ms(attention, args.iters, reps=10)
                except Exception:
                    torch.cuda.synchronize()
                    ms = time_ms(attention, 3, args.iters)
            except Exception as exc:
                print(f"{backend.name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            emit({**meta, "case": "sdpa causal fwd+bwd 4x16x2048x128", "impl": backend.name, "us": round(ms * 1e3, 1),
                  "TFLOPs": round(flops / (ms / 1e3) / 1e12, 1)})


if __name__ == "__main__":
    main()
