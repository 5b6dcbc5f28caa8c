"""Scaled dot-product attention forward and backward in Triton, for any length without a per-length plan.

Why: with symbolic sequence lengths cuDNN builds an execution plan per new length (~100 ms each, forward and
backward), so ``choose_attention_kernels`` moves such calls to flash attention, which is 1.5-1.8x slower than
cuDNN on the H200 (benchmarks/README.md, "Variable sequence lengths"). These kernels are the FlashAttention-2
algorithm written for Triton, whose compile depends on the block shapes alone: one compile serves every length
(lengths are ``do_not_specialize``).

=========================  =========================================================================
launcher                   computes
=========================  =========================================================================
``attention_forward``      ``(out, lse)``: softmax(q k^T * scale [+ causal mask]) v, and the rows'
                           log-sum-exp in base 2 (fp32, [B, H, L_q])
``attention_backward``     ``(grad_q, grad_k, grad_v)`` from ``grad_out``, q, k, v, out and lse
=========================  =========================================================================

q, k, v are [B, H, L, D] with any strides whose last one is 1 (slices of a fused projection are read in
place); ``out`` and the gradients come out as flash attention's do: [B, H, L, D] over [B, L, H, D] memory, so
the usual transpose and reshape after attention is a view. k and v may have fewer heads than q (grouped-query
attention, as ``enable_gqa``: query head h reads key/value head h // (H_q / H_kv)), D
is 16..128 and a power of two, q/k/v are bf16 or fp16; ``unsupported_reason`` says what else is not taken.
Statistics and accumulators are fp32. The causal mask is top-left aligned (query i reads keys 0..i), the
meaning of ``is_causal`` in SDPA; it needs L_q == L_k.

On Hopper and newer (compute capability 9+) the kernels read q, k, v and grad_out through TMA tensor
descriptors where the strides allow (16-byte aligned; :data:`TMA`); elsewhere, and in Triton's interpreter
unless asked, through pointers. Both compute the same values (bitwise in the interpreter).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .registry import interpreting, register

try:  # Triton >= 3.4: host-side TMA descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer kernels only
    TensorDescriptor = None

__all__ = ["attention_forward", "attention_backward", "unsupported_reason"]

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _program_block(H, LONGEST_FIRST: tl.constexpr):
    """This program's (row block, batch * heads index, batch, head) on the grid (row blocks, batch * heads);
    with ``LONGEST_FIRST`` the last row block (under a causal mask the longest to walk) runs first."""
    pid = tl.program_id(0)
    if LONGEST_FIRST:
        pid = tl.num_programs(0) - 1 - pid
    bh = tl.program_id(1)
    return pid, bh, (bh // H).to(tl.int64), (bh % H).to(tl.int64)


# Each kernel reads q, k, v and grad_out one of two ways, chosen by the constexpr TMA (each way its own compile):
# through pointers (masked loads past the length), or through TMA tensor descriptors given in place of the
# pointers (Hopper's bulk copies: a block is [1, 1, rows, D] of the [B, H, L, D] descriptor, rows past the
# length come back as zeros, so no masks). Both load the same numbers into the same arithmetic.


@triton.jit
def _load(T, ptrs, b, h, start, offs, L, stride, ROWS: tl.constexpr, D: tl.constexpr, TRANSPOSED: tl.constexpr,
          TMA: tl.constexpr, MASKED: tl.constexpr):
    """``ROWS`` rows of one (batch, head) from row ``start``: [ROWS, D], or [D, ROWS] if ``TRANSPOSED`` (pointer
    path: ``ptrs`` + ``start`` rows, ``ptrs`` laid out in the shape asked)."""
    if TMA:
        x = T.load([b.to(tl.int32), h.to(tl.int32), start, 0]).reshape(ROWS, D)
        if TRANSPOSED:
            x = tl.trans(x)
    elif MASKED:
        if TRANSPOSED:
            x = tl.load(ptrs + start * stride, mask=(start + offs)[None, :] < L, other=0.0)
        else:
            x = tl.load(ptrs + start * stride, mask=(start + offs)[:, None] < L, other=0.0)
    else:
        x = tl.load(ptrs + start * stride)
    return x


@triton.jit
def _rows(T, ptrs, b, h, start, offs, L, stride, ROWS: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr,
          MASKED: tl.constexpr):
    return _load(T, ptrs, b, h, start, offs, L, stride, ROWS, D, False, TMA, MASKED)


@triton.jit
def _cols(T, ptrs, b, h, start, offs, L, stride, ROWS: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr,
          MASKED: tl.constexpr):
    return _load(T, ptrs, b, h, start, offs, L, stride, ROWS, D, True, TMA, MASKED)


@triton.jit
def _rows_and_cols(T, ptrs, b, h, start, offs, L, stride, ROWS: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr,
                   MASKED: tl.constexpr):
    """Both orientations of the rows, for kernels that multiply by each: loaded in the one the path reads (TMA:
    rows; pointers: ``ptrs`` laid out [D, ROWS]) and transposed once, never transposed back."""
    if TMA:
        x = _rows(T, ptrs, b, h, start, offs, L, stride, ROWS, D, TMA, MASKED)
        xT = tl.trans(x)
    else:
        xT = _cols(T, ptrs, b, h, start, offs, L, stride, ROWS, D, TMA, MASKED)
        x = tl.trans(xT)
    return x, xT


@triton.jit
def _fwd_block(acc, m_i, l_i, q, K, V, k_ptrs, v_ptrs, b, h, start_n, offs_m, offs_n, LK, qk_scale, skl, svl,
               BLOCK_N: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr):
    k = _cols(K, k_ptrs, b, h, start_n, offs_n, LK, skl, BLOCK_N, D, TMA, MASKED)
    v = _rows(V, v_ptrs, b, h, start_n, offs_n, LK, svl, BLOCK_N, D, TMA, MASKED)
    qk = tl.dot(q, k) * qk_scale
    if MASKED:
        cols = start_n + offs_n
        keep = cols[None, :] < LK
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["LQ", "LK"])  # lengths vary with the batch: one compile for all
def _attn_fwd_kernel(Q, K, V, O, LSE, qk_scale,
                     sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sob, soh, sol,
                     H, LQ, LK,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     TMA: tl.constexpr, GROUP: tl.constexpr):
    pid_m, bh, b, h = _program_block(H, CAUSAL)
    hk = h // GROUP  # the key/value head of this query head (grouped heads: GROUP query heads share one)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    if TMA:  # the descriptors stand for the pointers; these are unused
        q_ptrs, k_ptrs, v_ptrs = Q, K, V
    else:
        q_ptrs = Q + b * sqb + h * sqh + tl.arange(0, BLOCK_M)[:, None] * sql + offs_d[None, :]
        k_ptrs = K + b * skb + hk * skh + offs_n[None, :] * skl + offs_d[:, None]
        v_ptrs = V + b * svb + hk * svh + offs_n[:, None] * svl + offs_d[None, :]
    q = _rows(Q, q_ptrs, b, h, start_m, tl.arange(0, BLOCK_M), LQ, sql, BLOCK_M, D, TMA, True)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:
        full = start_m  # keys before this block's first query: every row reads them all
        end = tl.minimum(start_m + BLOCK_M, LK)
    else:
        full = (LK // BLOCK_N) * BLOCK_N
        end = LK
    for start_n in range(0, full, BLOCK_N):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, K, V, k_ptrs, v_ptrs, b, hk, start_n, offs_m, offs_n, LK,
                                   qk_scale, skl, svl, BLOCK_N, D, TMA, False, CAUSAL)
    for start_n in range(full, end, BLOCK_N):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, K, V, k_ptrs, v_ptrs, b, hk, start_n, offs_m, offs_n, LK,
                                   qk_scale, skl, svl, BLOCK_N, D, TMA, True, CAUSAL)
    acc = acc / l_i[:, None]
    row_ok = offs_m < LQ
    tl.store(O + b * sob + h * soh + offs_m[:, None] * sol + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + bh.to(tl.int64) * LQ + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit(do_not_specialize=["LQ"])
def _attn_bwd_delta_kernel(O, DO, DELTA, sob, soh, sol, sdb, sdh, sdl, H, LQ,
                           D: tl.constexpr, BLOCK_M: tl.constexpr):
    """DELTA[b, h, i] = sum_d out[b, h, i, d] * grad_out[b, h, i, d] (fp32): the softmax backward's row term."""
    pid_m, bh, b, h = _program_block(H, False)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    ok = offs_m[:, None] < LQ
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sol + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdl + offs_d[None, :], mask=ok, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * LQ + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1),
             mask=offs_m < LQ)


@triton.jit
def _dkdv_block(dk, dv, k, v, Q, DO, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, b, h, start_m, offs_m, offs_n, LQ,
                qk_scale, sql, sdl, BLOCK_M: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    rows = start_m + offs_m
    q, qT = _rows_and_cols(Q, q_ptrs, b, h, start_m, offs_m, LQ, sql, BLOCK_M, D, TMA, MASKED)
    do = _rows(DO, do_ptrs, b, h, start_m, offs_m, LQ, sdl, BLOCK_M, D, TMA, MASKED)
    if MASKED:
        ok = rows < LQ
        lse = tl.load(lse_ptrs + start_m, mask=ok, other=0.0)
        delta = tl.load(delta_ptrs + start_m, mask=ok, other=0.0)
    else:
        lse = tl.load(lse_ptrs + start_m)
        delta = tl.load(delta_ptrs + start_m)
    pT = tl.math.exp2(tl.dot(k, qT) * qk_scale - lse[None, :])
    if MASKED:
        keep = ok[None, :]
        if CAUSAL:
            keep = keep & (rows[None, :] >= offs_n[:, None])
        pT = tl.where(keep, pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv)
    dpT = tl.dot(v, tl.trans(do))
    dsT = pT * (dpT - delta[None, :])
    dk = tl.dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.jit(do_not_specialize=["LQ", "LK"])
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, qk_scale, sm_scale,
                          sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sdb, sdh, sdl,
                          sgkb, sgkh, sgkl, sgvb, sgvh, sgvl,
                          H, LQ, LK,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                          TMA: tl.constexpr, GROUP: tl.constexpr):
    """One program: BLOCK_N keys of one (batch, key/value head); walks the queries that read them, of each of
    the GROUP query heads that share the key/value head (their gradients summed in fp32, rounded once)."""
    pid_n, bhk, b, hk = _program_block(H // GROUP, False)  # the first key blocks are the longest to walk: first already
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    if TMA:  # the descriptors stand for the pointers; these are unused
        k_ptrs, v_ptrs = K, V
    else:
        k_ptrs = K + b * skb + hk * skh + tl.arange(0, BLOCK_N)[:, None] * skl + offs_d[None, :]
        v_ptrs = V + b * svb + hk * svh + tl.arange(0, BLOCK_N)[:, None] * svl + offs_d[None, :]
    k = _rows(K, k_ptrs, b, hk, start_n, tl.arange(0, BLOCK_N), LK, skl, BLOCK_N, D, TMA, True)
    v = _rows(V, v_ptrs, b, hk, start_n, tl.arange(0, BLOCK_N), LK, svl, BLOCK_N, D, TMA, True)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    if CAUSAL:
        lo = start_n  # queries before this block's first key read none of it
        diagonal = tl.minimum(start_n + BLOCK_N, LQ)  # BLOCK_N % BLOCK_M == 0
    else:
        lo = 0
        diagonal = 0
    full = (LQ // BLOCK_M) * BLOCK_M
    for g in range(0, GROUP):
        h = hk * GROUP + g
        row = (bhk * GROUP + g).to(tl.int64) * LQ  # (batch, query head)'s first row of lse and delta
        if TMA:
            q_ptrs, do_ptrs = Q, DO
        else:
            q_ptrs = Q + b * sqb + h * sqh + offs_m[None, :] * sql + offs_d[:, None]
            do_ptrs = DO + b * sdb + h * sdh + offs_m[:, None] * sdl + offs_d[None, :]
        lse_ptrs = LSE + row + offs_m
        delta_ptrs = DELTA + row + offs_m
        for start_m in range(lo, diagonal, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, Q, DO, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, b, h, start_m, offs_m,
                                 offs_n, LQ, qk_scale, sql, sdl, BLOCK_M, D, TMA, True, CAUSAL)
        for start_m in range(tl.maximum(diagonal, lo), full, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, Q, DO, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, b, h, start_m, offs_m,
                                 offs_n, LQ, qk_scale, sql, sdl, BLOCK_M, D, TMA, False, CAUSAL)
        for start_m in range(tl.maximum(full, tl.maximum(diagonal, lo)), LQ, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, Q, DO, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, b, h, start_m, offs_m,
                                 offs_n, LQ, qk_scale, sql, sdl, BLOCK_M, D, TMA, True, CAUSAL)
    dk = dk * sm_scale
    kv_ok = offs_n[:, None] < LK
    tl.store(DK + b * sgkb + hk * sgkh + offs_n[:, None] * sgkl + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=kv_ok)
    tl.store(DV + b * sgvb + hk * sgvh + offs_n[:, None] * sgvl + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_ok)


@triton.jit
def _dq_block(dq, q, do, lse, delta, K, V, k_ptrs, v_ptrs, b, h, start_n, offs_m, offs_n, LK, qk_scale, skl, svl,
              BLOCK_N: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr):
    k, kT = _rows_and_cols(K, k_ptrs, b, h, start_n, offs_n, LK, skl, BLOCK_N, D, TMA, MASKED)
    vT = _cols(V, v_ptrs, b, h, start_n, offs_n, LK, svl, BLOCK_N, D, TMA, MASKED)
    p = tl.math.exp2(tl.dot(q, kT) * qk_scale - lse[:, None])
    if MASKED:
        cols = start_n + offs_n
        keep = cols[None, :] < LK
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        p = tl.where(keep, p, 0.0)
    dp = tl.dot(do, vT)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit(do_not_specialize=["LQ", "LK"])
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, qk_scale, sm_scale,
                        sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sdb, sdh, sdl, sgqb, sgqh, sgql,
                        H, LQ, LK,
                        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                        TMA: tl.constexpr, GROUP: tl.constexpr):
    """One program: BLOCK_M queries of one (batch, head); walks the keys they read."""
    pid_m, bh, b, h = _program_block(H, CAUSAL)
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < LQ
    if TMA:  # the descriptors stand for the pointers; these are unused
        q_ptrs, do_ptrs, k_ptrs, v_ptrs = Q, DO, K, V
    else:
        q_ptrs = Q + b * sqb + h * sqh + tl.arange(0, BLOCK_M)[:, None] * sql + offs_d[None, :]
        do_ptrs = DO + b * sdb + h * sdh + tl.arange(0, BLOCK_M)[:, None] * sdl + offs_d[None, :]
        k_ptrs = K + b * skb + hk * skh + offs_n[None, :] * skl + offs_d[:, None]
        v_ptrs = V + b * svb + hk * svh + offs_n[None, :] * svl + offs_d[:, None]
    q = _rows(Q, q_ptrs, b, h, start_m, tl.arange(0, BLOCK_M), LQ, sql, BLOCK_M, D, TMA, True)
    do = _rows(DO, do_ptrs, b, h, start_m, tl.arange(0, BLOCK_M), LQ, sdl, BLOCK_M, D, TMA, True)
    lse = tl.load(LSE + bh.to(tl.int64) * LQ + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * LQ + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:
        full = start_m  # BLOCK_M % BLOCK_N == 0
        end = tl.minimum(start_m + BLOCK_M, LK)
    else:
        full = (LK // BLOCK_N) * BLOCK_N
        end = LK
    for start_n in range(0, full, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, K, V, k_ptrs, v_ptrs, b, hk, start_n, offs_m, offs_n, LK, qk_scale,
                       skl, svl, BLOCK_N, D, TMA, False, CAUSAL)
    for start_n in range(full, end, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, K, V, k_ptrs, v_ptrs, b, hk, start_n, offs_m, offs_n, LK, qk_scale,
                       skl, svl, BLOCK_N, D, TMA, True, CAUSAL)
    dq = dq * sm_scale
    tl.store(DQ + b * sgqb + h * sgqh + offs_m[:, None] * sgql + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------

#: Block shapes and launch settings: (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, the fastest of
#: benchmarks/probe_triton_attention.py's sweep (one H100, [4, 16, 1674, 128] bf16 causal, q/k/v slices of a
#: fused projection, calls queued back to back, 2026-12-07; results/2026-12-07_probe_triton_attention_tma_h100.jsonl),
#: through TMA descriptors: forward 0.127 ms (0.151 with (128, 128, 8, 3)); the whole backward 0.472 ms with
#: these key/value gradient shapes (0.550 with (32, 128, 8, 3)) and 0.513 with these query gradient shapes (0.522
#: with (128, 64, 8, 3)), each with the other kernel at its earlier shapes. Through pointers the same shapes are
#: the fastest or within 1.3% (query gradient: (128, 64, 8, 3) 0.523 ms, these 0.530).
FWD = (64, 64, 4, 3)
BWD_DKDV = (32, 64, 4, 3)   # (BLOCK_M queries walked, BLOCK_N keys a program holds, ...)
BWD_DQ = (64, 32, 4, 3)     # (BLOCK_M queries a program holds, BLOCK_N keys walked, ...)
DELTA = (64, 4)


def unsupported_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = False,
                       attn_mask=None, dropout_p: float = 0.0) -> str | None:
    """Why these kernels cannot take the call, or None."""
    if attn_mask is not None:
        return "an attention mask"
    if dropout_p:
        return "dropout"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "not [batch, heads, length, head_dim]"
    if query.dtype not in (torch.bfloat16, torch.float16) or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtype {query.dtype} (bf16 or fp16 only)"
    if query.dtype == torch.bfloat16 and query.device.type == "cpu":
        return "bf16 on the CPU (Triton's interpreter multiplies bf16 matrices wrongly; fp16 is taken)"
    d = query.shape[-1]
    if key.shape[-1] != d or value.shape[-1] != d or not isinstance(d, int) or d < 16 or d > 128 or d & (d - 1):
        return f"head_dim {d} (a power of two from 16 to 128, equal for q, k and v)"
    if key.shape[1] != value.shape[1] or query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads over {key.shape[1]} key and {value.shape[1]} value heads"
    if query.shape[0] != key.shape[0] or key.shape[2] != value.shape[2]:
        return "batch or key/value lengths differ"
    if is_causal and query.shape[2] != key.shape[2]:
        return "causal with different query and key lengths"
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return "a head_dim stride other than 1"
    return None


#: read q, k, v and grad_out through TMA descriptors: None = where the device has them (compute capability 9+)
#: and the layout allows (16-byte aligned base and strides); False = never; True = also in Triton's interpreter
TMA: bool | None = None


def _use_tma(tma: bool | None, *tensors: torch.Tensor) -> bool:
    """Whether this launch reads through TMA descriptors (``tma``: the caller's choice, None = :data:`TMA`)."""
    tma = TMA if tma is None else tma
    if tma is False or TensorDescriptor is None:
        return False
    device = tensors[0].device
    if device.type == "cuda":
        if _capability(device.index if device.index is not None else torch.cuda.current_device()) < 9:
            return False
    elif not (tma and interpreting()):
        return False
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or t.stride(-1) != 1 or any(s <= 0 or s * size % 16 for s in t.stride()[:-1]):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _desc(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A [B, H, L, D] tensor's TMA descriptor, a block being ``rows`` rows of one (batch, head)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]])


#: the grid's second dimension (batch x heads) is at most this: larger batches launch in chunks of sequences
_GRID_Y = 65535


def _batch_chunks(b: int, h: int) -> list[slice | None]:
    """The batch's chunks, one launch each: [None] (the whole batch, no slicing) when it fits the grid."""
    if b * h <= _GRID_Y:
        return [None]
    step = max(1, _GRID_Y // h)
    return [slice(i, min(b, i + step)) for i in range(0, b, step)]


def _chunk(part: slice | None, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(tensors) if part is None else [t[part] for t in tensors]


#: [B, H, L, D] over [B, L, H, D] memory: flash attention's output layout on CUDA
FLASH_ORDER = (0, 2, 1, 3)


def _empty(like: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """An empty tensor of ``like``'s shape and dtype whose dims lie in memory in ``order`` (outermost first)."""
    order = tuple(order) if order is not None else FLASH_ORDER
    out = torch.empty([like.shape[i] for i in order], dtype=like.dtype, device=like.device)
    return out.permute([order.index(i) for i in range(like.dim())])


def _reference_forward(query, key, value, is_causal=False, scale=None, config=None, out_order=None):
    """Eager PyTorch with :func:`attention_forward`'s contract (fp32 math, one rounding)."""
    q, k, v = (t.float() for t in (query, key, value))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))  # grouped heads: each its group's
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if is_causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = _empty(query, out_order)
    out.copy_(torch.exp(s - lse[..., None]) @ v)
    return out, lse * _LOG2E


def _reference_backward(grad_out, query, key, value, out, lse, is_causal=False, scale=None, dkdv=None, dq=None,
                        grad_orders=None):
    """Eager PyTorch with :func:`attention_backward`'s contract (autograd over fp32 math)."""
    q, k, v = (t.detach().float().requires_grad_(True) for t in (query, key, value))
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    with torch.enable_grad():
        kr, vr = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
        s = q @ kr.transpose(-1, -2) * scale
        if is_causal:
            n = q.shape[2]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        (torch.softmax(s, -1) @ vr).backward(grad_out.float())
    orders = grad_orders or (None, None, None)
    grads = []
    for t, g, o in zip((query, key, value), (q.grad, k.grad, v.grad), orders, strict=True):
        grads.append(_empty(t, o).copy_(g))
    return tuple(grads)


@register("attention_forward", reference=_reference_forward,
          jit=(_program_block, _load, _rows, _cols, _fwd_block, _attn_fwd_kernel))
def attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = False,
                      scale: float | None = None, config: tuple[int, int, int, int] | None = None,
                      out_order: tuple[int, ...] | None = None, check: bool = True, tma: bool | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: attention of ``query`` over ``key``/``value``; lse is log2 of each row's softmax sum.
    ``out`` lies in memory in ``out_order`` (default: flash's [B, L, H, D]). ``check=False``: the caller checked
    :func:`unsupported_reason` already (``fuse_attention`` at capture), so a step's calls skip it."""
    reason = unsupported_reason(query, key, value, is_causal) if check else None
    if reason is not None:
        raise ValueError(f"attention_forward: {reason}")
    b, h, lq, d = query.shape
    lk = key.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = _empty(query, out_order)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=query.device)
    block_m, block_n, warps, stages = config or FWD
    assert block_m % block_n == 0, "the forward's query block is a multiple of its key block"
    use_tma = _use_tma(tma, query, key, value)
    for part in _batch_chunks(b, h):
        q, k, v, o, ls = _chunk(part, query, key, value, out, lse)
        grid = (triton.cdiv(lq, block_m), q.shape[0] * h)
        reads = (_desc(q, block_m), _desc(k, block_n), _desc(v, block_n)) if use_tma else (q, k, v)
        _attn_fwd_kernel[grid](*reads, o, ls, scale * _LOG2E,
                               *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
                               h, lq, lk, D=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(is_causal),
                               TMA=use_tma, GROUP=h // key.shape[1], num_warps=warps, num_stages=stages)
    return out, lse


@register("attention_backward", reference=_reference_backward,
          jit=(_program_block, _load, _rows, _cols, _rows_and_cols, _attn_bwd_delta_kernel, _dkdv_block,
               _attn_bwd_dkdv_kernel, _dq_block, _attn_bwd_dq_kernel))
def attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, is_causal: bool = False, scale: float | None = None,
                       dkdv: tuple[int, int, int, int] | None = None, dq: tuple[int, int, int, int] | None = None,
                       grad_orders=None, tma: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_query, grad_key, grad_value)`` of :func:`attention_forward`'s output, each in the memory order
    ``grad_orders`` gives (default: flash's [B, L, H, D])."""
    b, h, lq, d = query.shape
    hk, lk = key.shape[1], key.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    delta = torch.empty(b, h, lq, dtype=torch.float32, device=query.device)
    orders = grad_orders or (None, None, None)
    grad_q, grad_k, grad_v = (_empty(t, o) for t, o in zip((query, key, value), orders, strict=True))
    kv_m, kv_n, kv_warps, kv_stages = dkdv or BWD_DKDV
    assert kv_n % kv_m == 0, "the key/value gradients' key block is a multiple of their query block"
    q_m, q_n, q_warps, q_stages = dq or BWD_DQ
    assert q_m % q_n == 0, "the query gradient's query block is a multiple of its key block"
    rows, warps = DELTA
    use_tma = _use_tma(tma, query, key, value, grad_out)
    for part in _batch_chunks(b, h):
        q, k, v, o, g, dl, gq, gk, gv, ls = _chunk(part, query, key, value, out, grad_out, delta, grad_q, grad_k,
                                                    grad_v, lse)
        n = q.shape[0] * h
        _attn_bwd_delta_kernel[(triton.cdiv(lq, rows), n)](o, g, dl, *o.stride()[:3], *g.stride()[:3], h, lq,
                                                           D=d, BLOCK_M=rows, num_warps=warps)
        strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride()[:3])
        reads = (_desc(q, kv_m), _desc(k, kv_n), _desc(v, kv_n), _desc(g, kv_m)) if use_tma else (q, k, v, g)
        _attn_bwd_dkdv_kernel[(triton.cdiv(lk, kv_n), q.shape[0] * hk)](
            *reads, ls, dl, gk, gv, scale * _LOG2E, scale, *strides, *gk.stride()[:3], *gv.stride()[:3],
            h, lq, lk, D=d, BLOCK_M=kv_m, BLOCK_N=kv_n, CAUSAL=bool(is_causal), TMA=use_tma, GROUP=h // hk,
            num_warps=kv_warps, num_stages=kv_stages)
        reads = (_desc(q, q_m), _desc(k, q_n), _desc(v, q_n), _desc(g, q_m)) if use_tma else (q, k, v, g)
        _attn_bwd_dq_kernel[(triton.cdiv(lq, q_m), n)](
            *reads, ls, dl, gq, scale * _LOG2E, scale, *strides, *gq.stride()[:3],
            h, lq, lk, D=d, BLOCK_M=q_m, BLOCK_N=q_n, CAUSAL=bool(is_causal), TMA=use_tma, GROUP=h // hk,
            num_warps=q_warps, num_stages=q_stages)
    return grad_q, grad_k, grad_v
