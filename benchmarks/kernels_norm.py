"""LayerNorm / RMSNorm kernel cases: stepfx's Triton kernels against aten and torch.compile.

A driver (not this file) times each case's callables with CUDA events:

    from benchmarks.kernels_norm import cases
    for case in cases("cuda"):
        ...  # time case["stepfx"], case["eager"], case["compiled"]; GB/s = case["bytes"] / seconds

Each case is a dict:

- ``name``: what and at which shape, e.g. ``layer_norm fwd+bwd 8192x2048 bf16``;
- ``stepfx``: zero-argument callable running stepfx's kernel(s) on tensors built once;
- ``eager``: the same work through aten (``native_layer_norm`` /
  ``native_layer_norm_backward``, ``_fused_rms_norm`` / ``_fused_rms_norm_backward``,
  or ``F.rms_norm`` and autograd where that aten backward has no CUDA kernel);
- ``compiled``: ``torch.compile`` of the eager function, built on first call
  (so the first call includes compilation: warm up before timing);
- ``bytes``: the least memory traffic the work needs (each tensor read or
  written once), for GB/s against the ~4.3 TB/s the H200 copies at.

Shapes: 8192 x 2048 is the 1.3B GPT's norm input (micro-batch 4 x seq 2048
rows, d_model 2048), 16384 x 1024 the 350M's (micro-batch 8 x seq 2048,
d_model 1024); bf16 as in BENCHMARKS.md. One fp32 LayerNorm case at the 1.3B
shape too, because autocast runs layer_norm in fp32.

Importing this module touches no GPU; ``cases()`` allocates on ``device``.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stepfx.codegen.norm_kernels import (  # noqa: E402
    layer_norm_backward,
    layer_norm_forward,
    rms_norm_backward,
    rms_norm_forward,
)

aten = torch.ops.aten
SHAPES = [(8192, 2048), (16384, 1024)]
LN_EPS = 1e-5
RMS_EPS = 1e-6


def _lazy_compile(fn: Callable) -> Callable[[], object]:
    compiled = []

    def run():
        if not compiled:
            compiled.append(torch.compile(fn))
        return compiled[0]()

    return run


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _layer_norm_cases(m: int, n: int, dtype: torch.dtype, device) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, n, device=device, dtype=dtype, generator=g)
    dy = torch.randn(m, n, device=device, dtype=dtype, generator=g)
    w = 1 + 0.1 * torch.randn(n, device=device, dtype=dtype, generator=g)
    b = 0.1 * torch.randn(n, device=device, dtype=dtype, generator=g)
    mask = [True, True, True]
    _, mean, rstd = aten.native_layer_norm.default(x, [n], w, b, LN_EPS)
    s, stat = _size(dtype), _size(mean.dtype)
    # fwd: read x, w, b; write y, mean, rstd.  bwd: read dy, x, w, mean, rstd; write dx, dw, db.
    fwd_bytes = 2 * m * n * s + 2 * n * s + 2 * m * stat
    bwd_bytes = 3 * m * n * s + 3 * n * s + 2 * m * stat

    def eager_fwd():
        return aten.native_layer_norm.default(x, [n], w, b, LN_EPS)

    def eager_bwd():
        return aten.native_layer_norm_backward.default(dy, x, [n], mean, rstd, w, b, mask)

    def eager_both():
        _, mu, rs = aten.native_layer_norm.default(x, [n], w, b, LN_EPS)
        return aten.native_layer_norm_backward.default(dy, x, [n], mu, rs, w, b, mask)

    def stepfx_both():
        _, mu, rs = layer_norm_forward(x, [n], w, b, LN_EPS)
        return layer_norm_backward(dy, x, [n], mu, rs, w, b, mask)

    tag = f"{m}x{n} {str(dtype).replace('torch.', '')}"
    return [
        dict(name=f"layer_norm fwd {tag}", stepfx=lambda: layer_norm_forward(x, [n], w, b, LN_EPS),
             eager=eager_fwd, compiled=_lazy_compile(eager_fwd), bytes=fwd_bytes),
        dict(name=f"layer_norm bwd {tag}",
             stepfx=lambda: layer_norm_backward(dy, x, [n], mean, rstd, w, b, mask),
             eager=eager_bwd, compiled=_lazy_compile(eager_bwd), bytes=bwd_bytes),
        # The forward's y is not needed by the backward, so fwd+bwd moves both sums.
        dict(name=f"layer_norm fwd+bwd {tag}", stepfx=stepfx_both,
             eager=eager_both, compiled=_lazy_compile(eager_both), bytes=fwd_bytes + bwd_bytes),
    ]


def _aten_rms_backward_runs(device) -> bool:
    """Whether aten._fused_rms_norm_backward has a kernel here (it has none on CPU)."""
    x = torch.ones(2, 8, device=device)
    try:
        _, rstd = aten._fused_rms_norm.default(x, [8], x[0], RMS_EPS)
        aten._fused_rms_norm_backward.default(x, x, [8], rstd, x[0], [True, True])
        return True
    except (AttributeError, NotImplementedError, RuntimeError):
        return False


def _rms_norm_cases(m: int, n: int, dtype: torch.dtype, device, aten_backward: bool) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(m, n, device=device, dtype=dtype, generator=g)
    dy = torch.randn(m, n, device=device, dtype=dtype, generator=g)
    w = 1 + 0.1 * torch.randn(n, device=device, dtype=dtype, generator=g)
    mask = [True, True]
    s = _size(dtype)
    # fwd: read x, w; write y, rstd (fp32).  bwd: read dy, x, w, rstd; write dx, dw.
    fwd_bytes = 2 * m * n * s + n * s + 4 * m
    bwd_bytes = 3 * m * n * s + 2 * n * s + 4 * m

    if aten_backward:
        _, rstd = aten._fused_rms_norm.default(x, [n], w, RMS_EPS)

        def eager_fwd():
            return aten._fused_rms_norm.default(x, [n], w, RMS_EPS)

        def eager_bwd():
            return aten._fused_rms_norm_backward.default(dy, x, [n], rstd, w, mask)

        def eager_both():
            _, rs = aten._fused_rms_norm.default(x, [n], w, RMS_EPS)
            return aten._fused_rms_norm_backward.default(dy, x, [n], rs, w, mask)
    else:
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = F.rms_norm(xg, [n], wg, RMS_EPS)
        _, rstd = rms_norm_forward(x, [n], w, RMS_EPS)

        def eager_fwd():
            return F.rms_norm(x, [n], w, RMS_EPS)

        def eager_bwd():
            return torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)

        def eager_both():
            out = F.rms_norm(xg, [n], wg, RMS_EPS)
            return torch.autograd.grad(out, (xg, wg), dy)

    def stepfx_both():
        _, rs = rms_norm_forward(x, [n], w, RMS_EPS)
        return rms_norm_backward(dy, x, [n], rs, w, mask)

    tag = f"{m}x{n} {str(dtype).replace('torch.', '')}"
    return [
        dict(name=f"rms_norm fwd {tag}", stepfx=lambda: rms_norm_forward(x, [n], w, RMS_EPS),
             eager=eager_fwd, compiled=_lazy_compile(eager_fwd), bytes=fwd_bytes),
        dict(name=f"rms_norm bwd {tag}", stepfx=lambda: rms_norm_backward(dy, x, [n], rstd, w, mask),
             eager=eager_bwd, compiled=_lazy_compile(eager_bwd), bytes=bwd_bytes),
        dict(name=f"rms_norm fwd+bwd {tag}", stepfx=stepfx_both,
             eager=eager_both, compiled=_lazy_compile(eager_both), bytes=fwd_bytes + bwd_bytes),
    ]


def cases(device="cuda") -> list[dict]:
    """Every case, its tensors allocated on ``device`` (see the module docstring)."""
    out = []
    for m, n in SHAPES:
        out += _layer_norm_cases(m, n, torch.bfloat16, device)
    out += _layer_norm_cases(*SHAPES[0], torch.float32, device)
    aten_backward = _aten_rms_backward_runs(device)
    for m, n in SHAPES:
        out += _rms_norm_cases(m, n, torch.bfloat16, device, aten_backward)
    return out
