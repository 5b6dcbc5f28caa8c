"""Cases for the optimizer-side kernels: stepfx's Triton kernels against eager PyTorch, torch.compile and fused AdamW.

``cases(device)`` builds the tensors (nothing happens at import, so this
module imports on a CPU machine) and returns one dict per case:

- ``name``; ``bytes``: the least memory traffic the operation needs (each
  input read once, each output written once), for GB/s;
- ``stepfx``: zero-arg callable running the stepfx kernel on the prebuilt tensors;
- ``eager``: the same work in eager PyTorch, op for op as torch's single-tensor
  optimizer (or the obvious torch ops);
- ``compiled``: ``torch.compile`` of the eager function, compiled on first call;
- ``fused`` (Adam only): ``torch.optim.AdamW(fused=True).step`` on equal-sized
  tensors of its own (fp32 gradients: fused AdamW takes no bf16 gradient for
  fp32 parameters, so in the bf16 case it reads 2 B more per element).

Every callable updates its tensors in place, so repeated calls time the
steady state. The driver (``benchmarks/kernels.py``) times them with CUDA events.
Sizes: a 1.3B-model-like flat fp32 buffer of 64M elements and a 4M one, with
the standard workload's AdamW (lr 3e-4, betas 0.9/0.95, wd 0.1).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stepfx.codegen.optimizer_kernels import adam_update, sgd_update  # noqa: E402
from stepfx.codegen.reduction_kernels import cast_pack, sum_squares  # noqa: E402

M = 1 << 20
LR, BETA1, BETA2, EPS, WD = 3e-4, 0.9, 0.95, 1e-8, 0.1
STEP = 10.0  # a fixed step count: the timed work does not depend on it
SGD_LR, MOMENTUM = 0.1, 0.9


def _adamw_eager_(p, g, m, v):
    """AdamW, op for op as torch.optim.adam._single_tensor_adam (decoupled), in place."""
    g = g.float()
    p.mul_(1 - LR * WD)
    m.lerp_(g, 1 - BETA1)
    v.mul_(BETA2).addcmul_(g, g, value=1 - BETA2)
    bias_correction1 = 1 - BETA1**STEP
    bias_correction2 = 1 - BETA2**STEP
    denom = (v.sqrt() / bias_correction2**0.5).add_(EPS)
    p.addcdiv_(m, denom, value=-LR / bias_correction1)


def _sgd_eager_(p, g, buf):
    """SGD with momentum, op for op as torch.optim.sgd._single_tensor_sgd, in place."""
    g = g.float()
    buf.mul_(MOMENTUM).add_(g)
    p.add_(buf, alpha=-SGD_LR)


def _sum_squares_eager(x):
    return (x.float() ** 2).sum()


def _pack_eager(parts, total):
    out = torch.zeros(total, dtype=torch.bfloat16, device=parts[0][0].device)
    for t, offset in parts:
        out[offset:offset + t.numel()].copy_(t.reshape(-1))
    return out


def _lazy_compile(fn, *args):
    compiled = []

    def run():
        if not compiled:
            compiled.append(torch.compile(fn))
        return compiled[0](*args)

    return run


def _adam_case(name, n, grad_dtype, device, fused=True):
    gen = torch.Generator(device=device).manual_seed(0)
    p = torch.randn(n, device=device, generator=gen)
    g = torch.randn(n, device=device, generator=gen).to(grad_dtype)
    m = torch.zeros(n, device=device)
    v = torch.zeros(n, device=device)
    case = {
        "name": name,
        "bytes": n * (3 * 4 * 2 + g.element_size()),
        "stepfx": lambda: adam_update(p, g, m, v, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD,
                                      step=STEP, decoupled=True, inplace=True),
        "eager": lambda: _adamw_eager_(p, g, m, v),
        "compiled": _lazy_compile(_adamw_eager_, p, g, m, v),
    }
    if fused:
        fp = torch.nn.Parameter(p.clone())
        fp.grad = g.float()
        # capturable: its step and lr on the device, so a CUDA graph can hold it (as stepfx's kernels can)
        opt = torch.optim.AdamW([fp], lr=torch.tensor(LR, device=device), betas=(BETA1, BETA2), eps=EPS,
                                weight_decay=WD, fused=True, capturable=True)
        case["fused"] = opt.step
    return case


def cases(device: str = "cuda", scale: float = 1.0) -> list[dict]:
    """The benchmark cases on ``device``; ``scale`` shrinks every size (for a smoke run)."""

    def size(elements: int) -> int:
        return max(1, int(elements * scale))

    n64, n4 = size(64 * M), size(4 * M)
    fused = device != "cpu"  # fused AdamW has no CPU kernel in every build
    out = [
        _adam_case("adamw 64M fp32 grad", n64, torch.float32, device, fused),
        _adam_case("adamw 64M bf16 grad", n64, torch.bfloat16, device, fused),
        _adam_case("adamw 4M fp32 grad", n4, torch.float32, device, fused),
    ]

    gen = torch.Generator(device=device).manual_seed(1)
    p = torch.randn(n64, device=device, generator=gen)
    g = torch.randn(n64, device=device, generator=gen).to(torch.bfloat16)
    buf = torch.zeros(n64, device=device)
    out.append({
        "name": "sgd momentum 64M bf16 grad",
        "bytes": n64 * (2 * 4 * 2 + 2),
        "stepfx": lambda: sgd_update(p, g, buf, lr=SGD_LR, momentum=MOMENTUM, dampening=0.0, weight_decay=0.0,
                                     nesterov=False, inplace=True),
        "eager": lambda: _sgd_eager_(p, g, buf),
        "compiled": _lazy_compile(_sgd_eager_, p, g, buf),
    })

    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(n64, device=device, generator=gen).to(dtype)
        out.append({
            "name": f"sum_squares 64M {str(dtype).removeprefix('torch.')}",
            "bytes": n64 * x.element_size(),
            "stepfx": lambda x=x: sum_squares(x),
            "eager": lambda x=x: _sum_squares_eager(x),
            "compiled": _lazy_compile(_sum_squares_eager, x),
        })

    # 8 fp32 pieces of uneven sizes, each at an offset rounded up to 128
    # elements (the alignment padding collectives use), packed into one bf16 buffer.
    weights = [5, 1, 3, 8, 2, 7, 4, 2]
    sizes = [max(1, n64 * w // sum(weights) - 37 * i) for i, w in enumerate(weights)]
    parts, offset = [], 0
    for i, s in enumerate(sizes):
        parts.append((torch.randn(s, device=device, generator=gen), offset))
        offset = -(-(offset + s) // 128) * 128
    total = offset
    out.append({
        "name": "cast_pack 8 parts 64M fp32 -> bf16",
        "bytes": sum(s for s in sizes) * 4 + total * 2,
        "stepfx": lambda: cast_pack(parts, total, torch.bfloat16),
        "eager": lambda: _pack_eager(parts, total),
        "compiled": _lazy_compile(_pack_eager, parts, total),
    })
    return out
