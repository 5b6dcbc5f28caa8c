"""Kernels that write a tensor and sum its columns as they write it: the
bias gradient of the linear layer whose output gradient that tensor is.

A bias gradient is the column sum of the layer's output gradient (rows:
tokens), and the kernel that produced that gradient just had every value in
registers; a separate sum reads it all back. Here: :func:`cat_column_sum`,
the concatenation of attention's q, k and v gradients along the last dim
into the qkv projection's output gradient, and that projection's bias
gradient (8192 x 6144 bf16 per layer of the 1.3B GPT). The LayerNorm
backward's is ``norm_kernels.layer_norm_backward(..., grad_input_sum=...)``.

Each program writes ITERS tiles of the output and one row of fp32 column
partials over their rows (the values as stored, so the sum is of what a
separate sum would read); a second small kernel adds the partials and
rounds once. Many short programs, as torch's own elementwise kernels run.

Measured and not kept: the same for the MLP's GELU backward (fc's bias
gradient). aten's backward runs at 94% of the copy bandwidth (99 us on
8192 x 8192 bf16, H200) and the column sum after it 47 us; a Triton kernel
doing both, aten's math with libdevice's tanh, took 208 us at its best
geometry: ~40 fp32 operations an element make it bound by the issue rate
(results/2026-12-02_kernel_sweep_gelu_h200.jsonl; an earlier one with an
exp-and-divide tanh 213 us). The fc bias gradient stays ``column_sum``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reduction_kernels import _check_input, _column_total, _column_total_kernel, _device_guard, _rounded
from .registry import register

__all__ = ["cat_column_sum", "cat_column_sum_reference"]

# cat_column_sum: programs of ITERS ROWS x BLOCK_N tiles over WARPS warps. On the
# 1.3B GPT's q, k, v gradients (3 x 8192 x 2048 bf16, H200): 4 x 512 x 4 warps x 8 tiles 64.0 us, against
# 80.8 for aten's cat and stepfx's column_sum apart; 8 x 256 x 4 x 4 83.8, 8 x 256 x 4 x 2 135.2
# (results/2026-12-02_kernel_sweep_column_sums_h200.jsonl).
CAT_ROWS = 4
CAT_BLOCK_N = 512
CAT_WARPS = 4
CAT_ITERS = 8


@triton.jit(do_not_specialize=["M"])  # row counts vary with the batch: one compile for all (Triton would specialize on divisibility by 16)
def _cat_sum_kernel(P0, P1, P2, P3, OUT, PART, M, W, N, K: tl.constexpr, ALIGNED: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ITERS: tl.constexpr):
    # out[r, k*W + c] = part_k[r, c] for K parts of W columns (N = K*W), and
    # part[i, c] = the sum of out[r, c] over this program's ITERS*ROWS rows.
    # ALIGNED (BLOCK_N divides W): a column block lies in one part, picked once;
    # else every part is loaded under its own mask.
    # Memory: reads the parts once (M*N), writes out once (M*N) and
    # M/(ITERS*ROWS) * N fp32 partials.
    i = tl.program_id(0)
    j = tl.program_id(1)
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if ALIGNED:
        k = (j * BLOCK_N) // W
        src = tl.where(k == 0, P0, tl.where(k == 1, P1, tl.where(k == 2, P2, P3)))
        src_cols = cols - k * W
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for it in tl.static_range(ITERS):
        rows = (i * ITERS + it).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        mask = (rows < M)[:, None] & col_ok[None, :]
        if ALIGNED:
            v = tl.load(src + rows[:, None] * W + src_cols[None, :], mask=mask, other=0.0)
        else:
            part_of = cols // W
            within = (cols - part_of * W)[None, :]
            v = tl.load(P0 + rows[:, None] * W + within, mask=mask & (part_of == 0)[None, :], other=0.0)
            v += tl.load(P1 + rows[:, None] * W + within, mask=mask & (part_of == 1)[None, :], other=0.0)
            if K > 2:
                v += tl.load(P2 + rows[:, None] * W + within, mask=mask & (part_of == 2)[None, :], other=0.0)
            if K > 3:
                v += tl.load(P3 + rows[:, None] * W + within, mask=mask & (part_of == 3)[None, :], other=0.0)
        tl.store(OUT + rows[:, None] * N + cols[None, :], v, mask=mask)
        acc += tl.where(mask, v.to(tl.float32), 0.0)
    tl.store(PART + i.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=col_ok)


def cat_column_sum_reference(parts, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(``aten.cat(parts, -1)``, its sum over all but the last dim)."""
    out = torch.ops.aten.cat.default(list(parts), -1)
    return out, torch.ops.aten.sum.dim_IntList(out.reshape(-1, out.shape[-1]), [0], keepdim)


@register("cat_column_sum", reference=cat_column_sum_reference, jit=(_rounded, _cat_sum_kernel, _column_total_kernel),
          what="concatenation along the last dim and the sum of the result over rows (a bias gradient) in one pass")
def cat_column_sum(parts, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.cat(parts, -1)`` of 2 to 4 contiguous tensors of one shape and
    dtype, and the sum of that over every dim but the last (``keepdim``:
    shape [1, N]) with fp32 accumulation, in one pass: the concatenation is
    written once and summed as written."""
    parts = list(parts)
    if not 2 <= len(parts) <= 4:
        raise ValueError(f"cat_column_sum: takes 2 to 4 parts, got {len(parts)}")
    for index, part in enumerate(parts):
        _check_input(f"part #{index}", part)
        if part.shape != parts[0].shape or part.dtype != parts[0].dtype or part.device != parts[0].device:
            raise ValueError(f"cat_column_sum: part #{index} is {tuple(part.shape)} {part.dtype} on {part.device}, "
                             f"part #0 {tuple(parts[0].shape)} {parts[0].dtype} on {parts[0].device}; they must match")
    first = parts[0]
    if first.dim() == 0:
        raise ValueError("cat_column_sum: parts must be at least 1-D")
    w = first.shape[-1]
    n = w * len(parts)
    m = first.numel() // w if w else 0
    out = torch.empty((*first.shape[:-1], n), dtype=first.dtype, device=first.device)
    total = torch.empty((1, n) if keepdim else (n,), dtype=first.dtype, device=first.device)
    if m == 0 or n == 0:
        return out, total.zero_()
    block_n = min(CAT_BLOCK_N, triton.next_power_of_2(n))
    rows = min(256, CAT_ROWS * CAT_BLOCK_N // block_n)
    groups = triton.cdiv(m, rows * CAT_ITERS)
    part = torch.empty((groups, n), dtype=torch.float32, device=first.device)
    ptrs = parts + [first] * (4 - len(parts))
    with _device_guard(first):
        _cat_sum_kernel[(groups, triton.cdiv(n, block_n))](
            *ptrs, out, part, m, w, n, K=len(parts), ALIGNED=w % block_n == 0, ROWS=rows, BLOCK_N=block_n,
            ITERS=CAT_ITERS, num_warps=CAT_WARPS)
        _column_total(part, total)
    return out, total
