"""LayerNorm and RMSNorm forward and backward in Triton, op for op with aten.

The launchers take exactly the arguments of the aten ops a graph pass swaps
them for, and return what those ops return (shapes, dtypes, ``None``s):

=========================  ==================================================
launcher                   replaces
=========================  ==================================================
``layer_norm_forward``     ``aten.native_layer_norm.default``
``layer_norm_backward``    ``aten.native_layer_norm_backward.default``
``rms_norm_forward``       ``aten._fused_rms_norm.default``
``rms_norm_backward``      ``aten._fused_rms_norm_backward.default``
=========================  ==================================================

Leading dims are flattened to M rows of N = prod(normalized_shape) columns.
Every statistic is computed in fp32 whatever the input dtype; a row lives in
registers whole (BLOCK_N = next power of 2 of N, N <= MAX_COLS), so the
variance is the exact two-pass one, with no Welford and no second read.

dtype conventions (read off torch 2.13: CPU and the meta device, which is
what the CUDA kernels return and what a traced graph records):

- ``out`` / ``grad_input`` take the input's dtype.
- LayerNorm ``mean``/``rstd`` are fp32, except on CPU for a bf16/fp16 input
  whose defined weight/bias are not fp32: there aten keeps them in the input
  dtype, and so does :func:`layer_norm_forward` on CPU (the kernel still
  computes them in fp32 and rounds once when storing).
- LayerNorm ``grad_weight``/``grad_bias`` take the weight's/bias's dtype;
  RMSNorm ``grad_weight`` takes the *input's* dtype (torch's meta function
  for ``_fused_rms_norm_backward`` casts it so).
- RMSNorm ``rstd`` is always fp32; ``eps=None`` means fp32's machine epsilon
  for fp32/bf16/fp16 inputs (torch picks it from the accumulation dtype, not
  ``finfo(input.dtype)`` as ``F.rms_norm``'s docstring says).
- A gradient is ``None`` where ``output_mask`` is False, and also where its
  parameter is ``None`` (as the meta functions do; aten's CPU kernel raises).

The weight/bias gradient is a column sum over all M rows. The backward
kernel runs G persistent programs (a few per SM): each walks its share of
row tiles, keeps fp32 column partial sums in registers, and writes one row
of a (G, N) fp32 buffer; a second small kernel sums that buffer's G rows.
No atomics, so the result is deterministic for a given G.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .reduction_kernels import _rounded
from .registry import register

__all__ = [
    "MAX_COLS",
    "layer_norm_forward",
    "add_layer_norm_forward",
    "layer_norm_backward",
    "rms_norm_forward",
    "rms_norm_backward",
    "unsupported_reason",
]

aten = torch.ops.aten

#: Widest row handled (a whole row is held in registers by one program).
MAX_COLS = 16384
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])  # row counts vary with the batch: one compile for all (Triton would specialize on divisibility by 16)
def _layer_norm_fwd_kernel(X, W, B, Y, MEAN, RSTD, R, S, M, N, eps,
                           HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                           HAS_R: tl.constexpr, S_BF16: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program normalizes ROWS rows of N columns, each row whole in registers:
    #   mean = sum(x)/N;  var = sum((x-mean)^2)/N;  rstd = 1/sqrt(var+eps)
    #   y = (x-mean)*rstd*w + b                      (all in fp32, y rounded once)
    # HAS_R: a residual add first, s = x + r (fp32, rounded once to s's dtype
    # as aten's add; written to S), and the norm of that rounded s.
    # Memory: reads x (and r) (M*N elements) once, w and b (N each, cached
    # across programs); writes y (and s) (M*N) and mean, rstd (M each).
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        s = _rounded(x + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32), S, S_BF16)
        tl.store(S + offs, s, mask=mask)
        x = s.to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean.to(MEAN.dtype.element_ty), mask=row_ok)
    tl.store(RSTD + rows, rstd.to(RSTD.dtype.element_ty), mask=row_ok)


@triton.jit
def _layer_norm_bwd_loads(DY, X, MEAN, RSTD, R, tile, M, N, cols, col_ok,
                          NEED_X: tl.constexpr, NEED_R: tl.constexpr, ROWS: tl.constexpr):
    # One row tile's inputs as stored (dy, x, r in their dtype; mean, rstd): every load issued
    # before any is used, so their latencies overlap (x and r are dy again where not needed).
    rows = tile * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    dy = tl.load(DY + offs, mask=mask, other=0.0)
    x = dy
    r = dy
    mean = tl.zeros((ROWS,), dtype=tl.float32)
    rstd = mean
    if NEED_X:
        x = tl.load(X + offs, mask=mask, other=0.0)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0).to(tl.float32)
    if NEED_R:
        r = tl.load(R + offs, mask=mask, other=0.0)
    return dy, x, r, mean, rstd


@triton.jit(do_not_specialize=["M"])  # row counts vary with the batch: one compile for all (Triton would specialize on divisibility by 16)
def _layer_norm_bwd_kernel(DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, DS_PART, R, M, N,
                           HAS_W: tl.constexpr, DO_DX: tl.constexpr,
                           DO_DW: tl.constexpr, DO_DB: tl.constexpr,
                           HAS_R: tl.constexpr, DO_DS: tl.constexpr, DX_BF16: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    # Persistent: program p of G handles row tiles p, p+G, p+2G, ... For a row,
    #   xhat = (x-mean)*rstd;  g = w*dy
    #   dx   = rstd * (g - mean(g) - xhat*mean(g*xhat))     (means over the row)
    # and, summed over rows into this program's fp32 registers,
    #   dw_p = sum dy*xhat;  db_p = sum dy      -> row p of DW_PART / DB_PART (G, N)
    # DO_DS: also ds_p = sum of dx as stored (+ r with HAS_R) -> DS_PART: the
    # column sum of grad_input, the bias gradient of the linear layer whose
    # output gradient it is (no second read of dx).
    # STAGES: tl.range's software pipelining of the tile loop (its loads issued ahead).
    # Memory: reads dy, x (2*M*N), mean, rstd (2*M), w (N, once per program);
    # writes dx (M*N) and the partials (2-3 * G*N fp32, G ~ a few per SM << M).
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    NEED_X: tl.constexpr = DO_DX or DO_DW
    NEED_R: tl.constexpr = DO_DX and HAS_R
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dw_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    ds_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for tile in tl.range(pid, tl.cdiv(M, ROWS), G, num_stages=STAGES):
        dy_s, x_s, r_s, mean, rstd = _layer_norm_bwd_loads(DY, X, MEAN, RSTD, R, tile, M, N, cols, col_ok,
                                                           NEED_X, NEED_R, ROWS)
        rows = tile * ROWS + tl.arange(0, ROWS)
        mask = (rows < M)[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        dy = dy_s.to(tl.float32)
        if NEED_X:
            xhat = tl.where(mask, (x_s.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
        if DO_DX:
            g = dy * w if HAS_W else dy
            c_g = tl.sum(g, axis=1) / N
            c_gx = tl.sum(g * xhat, axis=1) / N
            dx = (g - c_g[:, None] - xhat * c_gx[:, None]) * rstd[:, None]
            if HAS_R:
                # dx + r, the residual stream's gradient: dx rounded as it would be stored, then the
                # sum rounded once (aten's add of the two) - the values the add apart gives
                dx = _rounded(dx.to(DX.dtype.element_ty).to(tl.float32) + r_s.to(tl.float32), DX, DX_BF16)
            dx = dx.to(DX.dtype.element_ty)
            tl.store(DX + offs, dx, mask=mask)
            if DO_DS:
                ds_acc += tl.where(mask, dx.to(tl.float32), 0.0)
        if DO_DW:
            dw_acc += dy * xhat
        if DO_DB:
            db_acc += dy
    if DO_DW:
        tl.store(DW_PART + pid.to(tl.int64) * N + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
    if DO_DB:
        tl.store(DB_PART + pid.to(tl.int64) * N + cols, tl.sum(db_acc, axis=0), mask=col_ok)
    if DO_DS:
        tl.store(DS_PART + pid.to(tl.int64) * N + cols, tl.sum(ds_acc, axis=0), mask=col_ok)


@triton.jit(do_not_specialize=["M"])  # row counts vary with the batch: one compile for all (Triton would specialize on divisibility by 16)
def _rms_norm_fwd_kernel(X, W, Y, RSTD, M, N, eps,
                         HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program normalizes ROWS whole rows:
    #   rstd = 1/sqrt(sum(x^2)/N + eps);  y = x*rstd*w     (fp32, y rounded once)
    # Memory: reads x (M*N) and w (N, cached); writes y (M*N) and rstd (M).
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit(do_not_specialize=["M"])  # row counts vary with the batch: one compile for all (Triton would specialize on divisibility by 16)
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PART, M, N,
                         HAS_W: tl.constexpr, DO_DX: tl.constexpr, DO_DW: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    # Persistent like the LayerNorm backward. For a row,
    #   xhat = x*rstd;  g = w*dy;  dx = rstd * (g - xhat*mean(g*xhat))
    # and dw_p = sum over this program's rows of dy*xhat -> row p of DW_PART (G, N).
    # Memory: reads dy, x (2*M*N), rstd (M), w (N per program); writes dx (M*N)
    # and the partials (G*N fp32).
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dw_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for tile in tl.range(pid, tl.cdiv(M, ROWS), G, num_stages=STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0).to(tl.float32)
        xhat = x * rstd[:, None]
        if DO_DX:
            g = dy * w if HAS_W else dy
            c_gx = tl.sum(g * xhat, axis=1) / N
            dx = (g - xhat * c_gx[:, None]) * rstd[:, None]
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if DO_DW:
            dw_acc += dy * xhat
    if DO_DW:
        tl.store(DW_PART + pid.to(tl.int64) * N + cols, tl.sum(dw_acc, axis=0), mask=col_ok)


@triton.jit(do_not_specialize=["G"])  # row counts vary with the batch: one compile for all (Triton would specialize on divisibility by 16)
def _sum_partials_kernel(P0, P1, P2, OUT0, OUT1, OUT2, G, N,
                         DO_0: tl.constexpr, DO_1: tl.constexpr, DO_2: tl.constexpr, OUT2_BF16: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr):
    # out[c] = sum_g P[g, c] for up to three (G, N) fp32 partial buffers (dw,
    # db, and grad_input's column sum), one program per BLOCK_C columns,
    # rounded once to the output dtype (OUT2 to nearest even also under the
    # interpreter, as stepfx's column sums are).
    # Memory: reads 3*G*N fp32, writes 3*N: small next to the M*N passes.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < N
    acc0 = tl.zeros((BLOCK_G, BLOCK_C), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_G, BLOCK_C), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_G, BLOCK_C), dtype=tl.float32)
    for g0 in tl.range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        mask = (g < G)[:, None] & col_ok[None, :]
        offs = g.to(tl.int64)[:, None] * N + cols[None, :]
        if DO_0:
            acc0 += tl.load(P0 + offs, mask=mask, other=0.0)
        if DO_1:
            acc1 += tl.load(P1 + offs, mask=mask, other=0.0)
        if DO_2:
            acc2 += tl.load(P2 + offs, mask=mask, other=0.0)
    if DO_0:
        tl.store(OUT0 + cols, tl.sum(acc0, axis=0).to(OUT0.dtype.element_ty), mask=col_ok)
    if DO_1:
        tl.store(OUT1 + cols, tl.sum(acc1, axis=0).to(OUT1.dtype.element_ty), mask=col_ok)
    if DO_2:
        tl.store(OUT2 + cols, _rounded(tl.sum(acc2, axis=0), OUT2, OUT2_BF16), mask=col_ok)


# ----------------------------------------------------------------------------
# Launch configuration and checks
# ----------------------------------------------------------------------------


def _config(n: int, tile: int, per_thread: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) for rows of ``n`` columns.

    A program's tile is ROWS x BLOCK_N with about ``tile`` elements, so narrow
    rows are batched several to a program, and each thread holds about
    ``per_thread`` elements of each tensor (up to 16 warps; wider rows give a
    thread more). Forward: 2048-element tiles, 8 a thread (one 16-byte bf16
    vector); many short programs keep the loads in flight. Backward: 4096,
    16 a thread; each persistent program keeps two tensors' tiles in flight
    per iteration, and two programs share an SM (~100 registers a thread).
    """
    block_n = triton.next_power_of_2(n)
    rows = max(1, min(64, tile // block_n))
    num_warps = max(1, min(16, rows * block_n // (32 * per_thread)))
    return block_n, rows, num_warps


_FWD = dict(tile=2048, per_thread=8)
_BWD = dict(tile=4096, per_thread=16)
# backward programs: about this many warps per SM (two 8-warp programs)
BWD_WARPS_PER_SM = 16
# software-pipelining stages of the LayerNorm backward's row-tile loop (tl.range's num_stages; 1: none). 3: at 98304 x
# 2048 bf16 with the residual gradient and grad_input's column sum (the 1.3B step at micro-batch 48, inputs far
# past L2) 571 us against 771 with none, without the sum 580 against 614 (one H100, 2026-12-06,
# results/2026-12-06_kernel_sweep_ln_bwd_98304_h100.jsonl; a hand-written one-tile prefetch in its place: 591 / 579)
BWD_STAGES = 3
# the RMSNorm backward's stages: not swept yet, so as before
RMS_BWD_STAGES = 1


def _persistent_programs(device: torch.device, tiles: int, num_warps: int) -> int:
    """G for the backward: programs to fill each SM with ~16 warps (two 8-warp
    programs), never more than there are tiles. More programs put more loads
    in flight but write a larger (G, N) fp32 partial buffer (16*G*N bytes of
    traffic for dw and db against 6*M*N for bf16 dy, x, dx). On CPU (the
    interpreter) a small G that still makes every program walk several tiles."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        per_sm = max(1, BWD_WARPS_PER_SM // num_warps)
        return max(1, min(tiles, sms * per_sm))
    return max(1, min(tiles, 3))


def unsupported_reason(input: torch.Tensor, normalized_shape, weight=None, bias=None) -> str | None:
    """Why these kernels cannot run ``input`` normalized over ``normalized_shape``
    with ``weight``/``bias``, or None when they can. A pass can ask this
    before swapping an aten node; the launchers raise ValueError with it."""
    shape = tuple(int(s) for s in normalized_shape)
    if input.dtype not in _DTYPES:
        return f"input dtype {input.dtype} is not float32, bfloat16 or float16"
    if len(shape) == 0 or input.dim() < len(shape) or tuple(input.shape[input.dim() - len(shape):]) != shape:
        return f"normalized_shape {list(shape)} is not the trailing dims of the input's shape {list(input.shape)}"
    if not input.is_contiguous():
        return f"input (shape {list(input.shape)}, strides {list(input.stride())}) is not contiguous"
    n = math.prod(shape)
    if n == 0:
        return "normalized_shape has no elements"
    if n > MAX_COLS:
        return f"rows of {n} elements are wider than the {MAX_COLS} these kernels hold in registers"
    for label, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if tuple(p.shape) != shape:
            return f"{label} shape {list(p.shape)} is not normalized_shape {list(shape)}"
        if p.dtype not in _DTYPES:
            return f"{label} dtype {p.dtype} is not float32, bfloat16 or float16"
        if not p.is_contiguous():
            return f"{label} is not contiguous"
        if p.device != input.device:
            return f"{label} is on {p.device}, the input on {input.device}"
    return None


def _check(input, normalized_shape, weight=None, bias=None) -> tuple[int, int]:
    reason = unsupported_reason(input, normalized_shape, weight, bias)
    if reason is not None:
        raise ValueError(f"stepfx norm kernel: {reason}")
    n = math.prod(int(s) for s in normalized_shape)
    return input.numel() // n, n


def _check_like(name: str, t: torch.Tensor, input: torch.Tensor, numel: int | None = None) -> None:
    if numel is None and tuple(t.shape) != tuple(input.shape):
        raise ValueError(f"stepfx norm kernel: {name} shape {list(t.shape)} is not the input's {list(input.shape)}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"stepfx norm kernel: {name} has {t.numel()} elements, expected one per row ({numel})")
    if t.dtype not in _DTYPES or not t.is_contiguous() or t.device != input.device:
        raise ValueError(f"stepfx norm kernel: {name} must be a contiguous float32/bfloat16/float16 "
                         f"tensor on {input.device} (got {t.dtype}, contiguous={t.is_contiguous()}, {t.device})")


def _stat_shape(input: torch.Tensor, normalized_shape) -> list[int]:
    axis = input.dim() - len(normalized_shape)
    return list(input.shape[:axis]) + [1] * len(normalized_shape)


def _layer_norm_stat_dtype(input, weight, bias) -> torch.dtype:
    # aten's CPU kernel keeps a low-precision input's statistics in its own
    # dtype unless a parameter is fp32 ("mixed type"); CUDA (and meta) always
    # uses the fp32 accumulation type.
    if input.device.type == "cpu" and input.dtype != torch.float32:
        mixed = any(p is not None and p.dtype == torch.float32 for p in (weight, bias))
        return torch.float32 if mixed else input.dtype
    return torch.float32


def _reduce_partials(part0, part1, out0, out1, part2=None, out2=None) -> None:
    """out = column sums of the (G, N) fp32 partials; any pair may be None.

    Narrow column blocks (16) give N/16 programs, enough to spread even
    N = 2048 over the SMs; the partials were just written and sit in L2."""
    like = next(p for p in (part0, part1, part2) if p is not None)
    g, n = like.shape

    def given(t):
        return t if t is not None else like

    block_c = 16
    _sum_partials_kernel[(triton.cdiv(n, block_c),)](
        given(part0), given(part1), given(part2), given(out0), given(out1), given(out2),
        g, n, DO_0=part0 is not None, DO_1=part1 is not None, DO_2=part2 is not None,
        OUT2_BF16=out2 is not None and out2.dtype == torch.bfloat16, BLOCK_G=128, BLOCK_C=block_c, num_warps=4)


# ----------------------------------------------------------------------------
# Eager references (same signatures and outputs as the launchers)
# ----------------------------------------------------------------------------


def _rms_norm_forward_reference(input, normalized_shape, weight, eps):
    """RMSNorm forward in plain torch ops, fp32 statistics (the aten decomposition's math)."""
    dims = list(range(input.dim() - len(normalized_shape), input.dim()))
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    x = input.float()
    rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)
    out = x * rstd
    if weight is not None:
        out = out * weight.float()
    return out.to(input.dtype), rstd


def _rms_norm_backward_reference(grad_out, input, normalized_shape, rstd, weight, output_mask, grad_weight_dtype=None):
    """RMSNorm backward in plain torch ops, fp32 accumulation."""
    axis = input.dim() - len(normalized_shape)
    dims = list(range(axis, input.dim()))
    x, dy = input.float(), grad_out.float()
    r = rstd.float().reshape(_stat_shape(input, normalized_shape))
    xhat = x * r
    g = dy * weight.float() if weight is not None else dy
    grad_input = grad_weight = None
    if output_mask[0]:
        grad_input = ((g - xhat * (g * xhat).mean(dim=dims, keepdim=True)) * r).to(input.dtype)
    if output_mask[1] and weight is not None:
        dw = (dy * xhat).sum(dim=list(range(axis))) if axis else dy * xhat
        grad_weight = dw.to(grad_weight_dtype or input.dtype)
    return grad_input, grad_weight


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


@register("layer_norm_forward", reference=aten.native_layer_norm.default,
          jit=(_rounded, _layer_norm_fwd_kernel),
          what="LayerNorm forward: (out, mean, rstd) as aten.native_layer_norm, fp32 statistics")
def layer_norm_forward(input, normalized_shape, weight, bias, eps):
    """``aten.native_layer_norm``: ``(out, mean, rstd)``, one read of x, one write of out."""
    m, n = _check(input, normalized_shape, weight, bias)
    out = torch.empty_like(input)
    stat_dtype = _layer_norm_stat_dtype(input, weight, bias)
    mean = torch.empty(_stat_shape(input, normalized_shape), dtype=stat_dtype, device=input.device)
    rstd = torch.empty_like(mean)
    if m == 0:
        return out, mean, rstd
    block_n, rows, num_warps = _config(n, **_FWD)
    _layer_norm_fwd_kernel[(triton.cdiv(m, rows),)](
        input, weight if weight is not None else input, bias if bias is not None else input,
        out, mean, rstd, input, input, m, n, float(eps),
        HAS_W=weight is not None, HAS_B=bias is not None, HAS_R=False, S_BF16=False,
        ROWS=rows, BLOCK_N=block_n, num_warps=num_warps)
    return out, mean, rstd


def _layer_norm_backward_reference(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask,
                                   residual_grad=None, grad_input_sum=None):
    """aten's LayerNorm backward, the residual add and grad_input's column sum as separate ops."""
    out = list(aten.native_layer_norm_backward.default(grad_out, input, normalized_shape, mean, rstd, weight, bias,
                                                       output_mask))
    if residual_grad is not None:
        out[0] = aten.add.Tensor(out[0], residual_grad)
    if grad_input_sum is not None:
        flat = out[0].reshape(-1, math.prod(normalized_shape))
        out.append(aten.sum.dim_IntList(flat, [0], grad_input_sum == "keepdim"))
    return tuple(out)


@register("layer_norm_backward", reference=_layer_norm_backward_reference,
          jit=(_rounded, _layer_norm_bwd_loads, _layer_norm_bwd_kernel, _sum_partials_kernel),
          what="LayerNorm backward: dx, dw, db in one pass over (dy, x), dw/db from per-program partials")
def layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask, residual_grad=None,
                        grad_input_sum=None):
    """``aten.native_layer_norm_backward``: ``(grad_input, grad_weight, grad_bias)``.
    ``residual_grad``: grad_input comes back as ``grad_input + residual_grad``
    (the residual stream's gradient, added as aten's add would: both rounded
    as apart), written once instead of written, read and added.
    ``grad_input_sum`` ("keepdim" or "flat"): a fourth result, grad_input
    (as returned) summed over its rows, fp32 accumulation, in its dtype,
    shape [1, N] or [N] - the bias gradient of the linear layer whose output
    gradient grad_input is, without a second read of it."""
    m, n = _check(input, normalized_shape, weight, bias)
    _check_like("grad_out", grad_out, input)
    _check_like("mean", mean, input, numel=m)
    _check_like("rstd", rstd, input, numel=m)
    do_dx = bool(output_mask[0])
    do_dw = bool(output_mask[1]) and weight is not None
    do_db = bool(output_mask[2]) and bias is not None
    if residual_grad is not None:
        _check_like("residual_grad", residual_grad, input)
        if residual_grad.dtype != input.dtype or not do_dx:
            raise ValueError(f"stepfx norm kernel: residual_grad ({residual_grad.dtype}) needs grad_input "
                             f"(output_mask[0]) and the input's dtype ({input.dtype})")
    if grad_input_sum not in (None, "keepdim", "flat") or (grad_input_sum is not None and not do_dx):
        raise ValueError(f"stepfx norm kernel: grad_input_sum must be None, 'keepdim' or 'flat' and needs grad_input "
                         f"(output_mask[0]); got {grad_input_sum!r} with output_mask {list(output_mask)}")
    do_ds = grad_input_sum is not None
    dx = torch.empty_like(input) if do_dx else None
    dw = torch.empty_like(weight) if do_dw else None
    db = torch.empty_like(bias) if do_db else None
    ds = torch.empty([1, n] if grad_input_sum == "keepdim" else [n], dtype=input.dtype, device=input.device) if do_ds else None
    if m == 0 or not (do_dx or do_dw or do_db):
        zeroed = (dx, dw.zero_() if do_dw else None, db.zero_() if do_db else None)
        return (*zeroed, ds.zero_()) if do_ds else zeroed
    block_n, rows, num_warps = _config(n, **_BWD)
    tiles = triton.cdiv(m, rows)
    g = _persistent_programs(input.device, tiles, num_warps)
    part = torch.empty((int(do_dw) + int(do_db) + int(do_ds), g, n), dtype=torch.float32, device=input.device)
    dw_part = part[0] if do_dw else None
    db_part = part[int(do_dw)] if do_db else None
    ds_part = part[-1] if do_ds else None
    _layer_norm_bwd_kernel[(g,)](
        grad_out, input, weight if weight is not None else input, mean, rstd,
        dx if do_dx else input, dw_part if do_dw else input, db_part if do_db else input,
        ds_part if do_ds else input, residual_grad if residual_grad is not None else input, m, n,
        HAS_W=weight is not None, DO_DX=do_dx, DO_DW=do_dw, DO_DB=do_db,
        HAS_R=residual_grad is not None, DO_DS=do_ds, DX_BF16=input.dtype == torch.bfloat16,
        ROWS=rows, BLOCK_N=block_n, STAGES=BWD_STAGES, num_warps=num_warps,
        # no fused multiply-adds: in fp32 the compiler contracted dx * rstd + r into one rounding, so
        # grad_input + residual_grad differed in the last bit from dx and the add apart (H200: results/2026-11-30_gpu_tests_h200x2_run6.txt)
        enable_fp_fusion=False)
    if do_dw or do_db or do_ds:
        _reduce_partials(dw_part, db_part, dw, db, ds_part, ds)
    return (dx, dw, db, ds) if do_ds else (dx, dw, db)


@register("rms_norm_forward", reference=_rms_norm_forward_reference,
          jit=(_rms_norm_fwd_kernel,),
          what="RMSNorm forward: (out, rstd) as aten._fused_rms_norm, fp32 statistics")
def rms_norm_forward(input, normalized_shape, weight, eps):
    """``aten._fused_rms_norm``: ``(out, rstd)``; ``eps=None`` is fp32's machine epsilon."""
    m, n = _check(input, normalized_shape, weight)
    out = torch.empty_like(input)
    rstd = torch.empty(_stat_shape(input, normalized_shape), dtype=torch.float32, device=input.device)
    if m == 0:
        return out, rstd
    eps = torch.finfo(torch.float32).eps if eps is None else float(eps)
    block_n, rows, num_warps = _config(n, **_FWD)
    _rms_norm_fwd_kernel[(triton.cdiv(m, rows),)](
        input, weight if weight is not None else input, out, rstd, m, n, eps,
        HAS_W=weight is not None, ROWS=rows, BLOCK_N=block_n, num_warps=num_warps)
    return out, rstd


@register("rms_norm_backward", reference=_rms_norm_backward_reference,
          jit=(_rms_norm_bwd_kernel, _sum_partials_kernel),
          what="RMSNorm backward: dx and dw in one pass over (dy, x), dw from per-program partials")
def rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask, grad_weight_dtype=None):
    """``aten._fused_rms_norm_backward``: ``(grad_input, grad_weight)``, grad_weight in the input's dtype
    (or ``grad_weight_dtype``: an fp32 weight applied to a 16-bit input, as Gemma's ``1 + weight``)."""
    m, n = _check(input, normalized_shape, weight)
    _check_like("grad_out", grad_out, input)
    _check_like("rstd", rstd, input, numel=m)
    do_dx = bool(output_mask[0])
    do_dw = bool(output_mask[1]) and weight is not None
    dx = torch.empty_like(input) if do_dx else None
    dw = torch.empty(weight.shape, dtype=grad_weight_dtype or input.dtype, device=input.device) if do_dw else None
    if m == 0 or not (do_dx or do_dw):
        return dx, dw.zero_() if do_dw else None
    block_n, rows, num_warps = _config(n, **_BWD)
    g = _persistent_programs(input.device, triton.cdiv(m, rows), num_warps)
    dw_part = torch.empty((g, n), dtype=torch.float32, device=input.device) if do_dw else None
    _rms_norm_bwd_kernel[(g,)](
        grad_out, input, weight if weight is not None else input, rstd,
        dx if do_dx else input, dw_part if do_dw else input, m, n,
        HAS_W=weight is not None, DO_DX=do_dx, DO_DW=do_dw,
        ROWS=rows, BLOCK_N=block_n, STAGES=RMS_BWD_STAGES, num_warps=num_warps)
    if do_dw:
        _reduce_partials(dw_part, None, dw, None)
    return dx, dw


def _add_layer_norm_forward_reference(input, residual, normalized_shape, weight, bias, eps):
    s = torch.ops.aten.add.Tensor(input, residual)
    return (s, *torch.ops.aten.native_layer_norm.default(s, normalized_shape, weight, bias, eps))


@register("add_layer_norm_forward", reference=_add_layer_norm_forward_reference,
          jit=(_rounded, _layer_norm_fwd_kernel),
          what="residual add + LayerNorm forward: (sum, out, mean, rstd), one read of each addend")
def add_layer_norm_forward(input, residual, normalized_shape, weight, bias, eps):
    """``s = input + residual`` and ``aten.native_layer_norm(s, ...)``:
    ``(s, out, mean, rstd)``; s is rounded to its dtype before the norm reads
    it, so every output is what the add and the norm give apart."""
    m, n = _check(input, normalized_shape, weight, bias)
    _check_like("residual", residual, input)
    if residual.dtype != input.dtype:
        raise ValueError(f"stepfx norm kernel: residual is {residual.dtype}, input {input.dtype}; they must match")
    s = torch.empty_like(input)
    out = torch.empty_like(input)
    stat_dtype = _layer_norm_stat_dtype(input, weight, bias)
    mean = torch.empty(_stat_shape(input, normalized_shape), dtype=stat_dtype, device=input.device)
    rstd = torch.empty_like(mean)
    if m == 0:
        return s, out, mean, rstd
    block_n, rows, num_warps = _config(n, **_FWD)
    _layer_norm_fwd_kernel[(triton.cdiv(m, rows),)](
        input, weight if weight is not None else input, bias if bias is not None else input,
        out, mean, rstd, residual, s, m, n, float(eps),
        HAS_W=weight is not None, HAS_B=bias is not None, HAS_R=True, S_BF16=input.dtype == torch.bfloat16,
        ROWS=rows, BLOCK_N=block_n, num_warps=num_warps)
    return s, out, mean, rstd
