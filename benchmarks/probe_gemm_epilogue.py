"""Probe: does cuBLASLt's GELU epilogue beat a GEMM followed by a GELU kernel?

The MLP's first projection of the standard GPT is ``gelu(x @ W.T + b, approximate="tanh")``.
``torch._addmm_activation(b, x, W.T, use_gelu=True)`` asks cuBLASLt for the bias + GELU epilogue
(on CUDA it is the tanh form; on CPU torch applies the exact erf form, so a pass may use it only on
CUDA). This times, per shape, three ways in the same process: addmm then aten GELU, the epilogue, and
the GEMM alone (what the GELU costs on top), as device time from CUDA events over repeated calls,
and reports the largest difference of the epilogue from addmm + GELU(tanh) in the output's units.

    PYTHONPATH=. python3 benchmarks/probe_gemm_epilogue.py --out $OUT
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F


def device_ms(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def probe(rows, d_in, d_out, reps):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, d_in, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16, generator=g) * d_in ** -0.5
    b = torch.randn(d_out, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
    wt = w.t()
    plain = lambda: F.gelu(torch.addmm(b, x, wt), approximate="tanh")
    fused = lambda: torch._addmm_activation(b, x, wt, use_gelu=True)
    gemm = lambda: torch.addmm(b, x, wt)
    reference = F.gelu(torch.addmm(b, x, wt).float(), approximate="tanh")
    got = fused().float()
    exact = F.gelu(torch.addmm(b, x, wt).float())
    flops = 2 * rows * d_in * d_out
    row = {"rows": rows, "d_in": d_in, "d_out": d_out,
           "addmm_gelu_ms": device_ms(plain, reps), "epilogue_ms": device_ms(fused, reps),
           "addmm_ms": device_ms(gemm, reps),
           "max_diff_vs_tanh": (got - reference).abs().max().item(),
           "max_diff_vs_erf": (got - exact).abs().max().item(),
           "plain_bf16_max_diff_vs_tanh": (plain().float() - reference).abs().max().item()}
    row["epilogue_tflops"] = flops / row["epilogue_ms"] / 1e9
    row["addmm_tflops"] = flops / row["addmm_ms"] / 1e9
    row["saved_ms"] = row["addmm_gelu_ms"] - row["epilogue_ms"]
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(), "blas": str(torch.backends.cuda.preferred_blas_library())}
    path = os.path.join(args.out, "probe_gemm_epilogue.jsonl")
    # the standard GPT's MLP up-projection (d 2048 -> 8192) at micro-batches 4, 24 and 48 of 2048
    # tokens, a varying length (4 x 1674), and the 350M's (d 1024 -> 4096, micro-batch 8)
    for rows, d_in, d_out in [(8192, 2048, 8192), (6696, 2048, 8192), (49152, 2048, 8192),
                              (98304, 2048, 8192), (16384, 1024, 4096)]:
        row = dict(meta, **probe(rows, d_in, d_out, args.reps))
        print(json.dumps(row), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
