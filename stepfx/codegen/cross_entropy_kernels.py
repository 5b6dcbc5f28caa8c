"""Linear + cross-entropy, forward and backward together, in row chunks.

A GPT's head computes ``logits = hidden @ weight.T`` and then
``F.cross_entropy(logits[.float()], target)``. At the reference workload
(8192 rows, vocab 50304, bf16) the logits are 0.8 GB and their fp32 copy
and log-softmax several GB more. Here forward and backward are one call,
made in the forward, that returns the loss and the gradients for a unit
upstream gradient; the backward only scales them by the incoming scalar.
Chunk of rows by chunk of rows:

1. ``torch.mm`` writes the chunk's logits into one reused buffer
   (cuBLAS; no matmul is written here);
2. one Triton program per row (:func:`_lce_rows_kernel`) reads the row
   twice: once for max / logsumexp / the row's loss term, once to
   overwrite the logits in place with ``(softmax - onehot) * scale``;
3. ``torch.mm`` gives the chunk's rows of ``grad_hidden`` and adds the
   chunk's share of ``grad_weight`` into an fp32 accumulator.

The one large temporary is a chunk's logits. The count of non-ignored
targets is taken once, on the device, and read by the kernel from memory:
no host synchronization anywhere.

Cost at the reference workload (bf16, d 2048, one chunk of 8192 rows):
three matmuls of 2 * 8192 * 50304 * 2048 flop (5.1 Tflop, ~6.7 ms at
~750 Tflop/s) and the row kernel's <= 3 * 824 MB of traffic (~0.6 ms at
~4 TB/s): the matmuls bound it, as they bound the eager version, which
in addition moves the fp32 logits, log-softmax and gradient (GBs) through
memory.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .registry import interpreting, register

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "default_chunk_rows", "vocab_cross_entropy_stats",
           "vocab_cross_entropy_grads", "vocab_cross_entropy_stats_reference", "vocab_cross_entropy_grads_reference"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# The chunk's logits buffer. On a GPU 1 GiB: the reference workload's 8192
# rows x 50304 bf16 logits (824 MB) are one chunk, so grad_weight is one
# matmul, as in eager, instead of a sum of chunk products in an fp32
# accumulator (412 MB at d 2048, read and written by each chunk's matmul:
# with 256 MiB chunks the four chunks held 256 + 412 MB and took 8.28 ms on
# an H200). Several chunks where the rows' logits exceed it. Small on CPU,
# where only the interpreter runs the kernel.
_CHUNK_BYTES = {"cuda": 1 << 30, "cpu": 4 << 20}
# Rows per chunk are a multiple of this (tile-friendly matmul shapes).
_ROW_QUANTUM = 64
# Columns per Triton block: a 50304-wide row is 13 blocks per pass.
_MAX_BLOCK = 4096


@triton.jit
def _round_to(x, DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``DTYPE``. Compiled, ``.to`` does
    that; Triton's interpreter truncates fp32 -> bf16, so there (BF16_BY_HAND)
    the rounding is done on the bits: add 0x7FFF plus the lowest kept bit, keep
    the top 16 bits (inf and nan stay inf and nan)."""
    if BF16_BY_HAND and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _row_logsumexp(base, V, col, LOGITS_DTYPE: tl.constexpr, CAST_LOGITS: tl.constexpr, BLOCK: tl.constexpr,
                   BF16_BY_HAND: tl.constexpr):
    """One row of ``V`` logits at ``base``: (max m, sum exp(x - m), x[col]
    or 0 when ``col`` is not in [0, V)), online over blocks, in fp32 on x
    rounded to LOGITS_DTYPE (the user's cast, when there is one). x[col] is
    picked from the values read anyway rather than loaded on its own: the
    gradient pass of another warp may already be overwriting it."""
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    x_t = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + cols
        mask = offs < V
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if CAST_LOGITS:
            x = _round_to(x, LOGITS_DTYPE, BF16_BY_HAND).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        x_t += tl.where((offs == col) & mask, x, 0.0)
    return m, s, tl.sum(x_t, axis=0)


@triton.jit
def _row_gradient(base, V, col, lse, row_scale, LOGITS_DTYPE: tl.constexpr, CAST_LOGITS: tl.constexpr,
                  BLOCK: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """Overwrites the row's logits with ``((exp(x - lse) - [c == col]) *
    row_scale)`` rounded to LOGITS_DTYPE, then to the buffer's dtype
    (autograd's cast of a cast's gradient)."""
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        offs = start + cols
        mask = offs < V
        x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        if CAST_LOGITS:
            x = _round_to(x, LOGITS_DTYPE, BF16_BY_HAND).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(offs == col, 1.0, 0.0)) * row_scale
        if CAST_LOGITS:
            g = _round_to(g, LOGITS_DTYPE, BF16_BY_HAND).to(tl.float32)
        tl.store(base + offs, _round_to(g, base.dtype.element_ty, BF16_BY_HAND), mask=mask)


@triton.jit
def _lce_rows_kernel(
    logits_ptr,  # [rows, V] this chunk's logits, buffer dtype (the matmul's); overwritten with the gradient
    target_ptr,  # [rows] int64
    loss_ptr,  # [rows] fp32 out: the row's loss term (0 for an ignored target)
    scale_ptr,  # [] fp32: 1 / count of non-ignored targets (mean), 1 (sum)
    V,
    stride_row,
    ignore_index,
    LOGITS_DTYPE: tl.constexpr,  # dtype the user's loss sees (after an optional cast)
    CAST_LOGITS: tl.constexpr,  # LOGITS_DTYPE neither fp32 nor the buffer's: round to it and back
    BLOCK: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,  # interpreter only: see _round_to
):
    # One program per row x (V logits), t its target, s the scale. Math in fp32
    # on x rounded to LOGITS_DTYPE (the user's cast, when there is one):
    #   pass 1:  m = max x,  lse = m + log sum exp(x - m)      (online over blocks)
    #            loss term = lse - x[t]                        (0 if t is ignored)
    #   pass 2:  x <- ((exp(x - lse) - [col == t]) * s) rounded to LOGITS_DTYPE,
    #            then to the buffer dtype (autograd's cast of a cast's gradient)
    # Ignored row: gradient 0. Target outside [0, V) and not ignored: loss term
    # nan (torch raises; this cannot without a host sync).
    # Memory: reads the row twice and writes it once, 3 * V * sizeof(buffer)
    # bytes per row from HBM at most (the second read hits L2 only when the
    # rows in flight fit there); nothing else of size V is stored.
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    t = tl.load(target_ptr + row)
    m, s, x_t = _row_logsumexp(base, V, t, LOGITS_DTYPE, CAST_LOGITS, BLOCK, BF16_BY_HAND)
    lse = m + tl.log(s)

    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    loss = tl.where(in_range, lse - x_t, float("nan"))
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))

    row_scale = tl.where(valid, tl.load(scale_ptr), 0.0)
    _row_gradient(base, V, t, lse, row_scale, LOGITS_DTYPE, CAST_LOGITS, BLOCK, BF16_BY_HAND)


def _check(hidden, weight, target, ignore_index, reduction, logits_dtype, chunk_rows) -> None:
    """Raise ValueError naming the first argument that is not as documented."""
    for name, x in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"linear_cross_entropy: {name} must be a tensor, got {type(x).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"linear_cross_entropy: hidden must be 2-D [N, d], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"linear_cross_entropy: weight must be 2-D [V, d], got shape {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden [N, d] and weight [V, d] disagree on d: "
            f"{tuple(hidden.shape)} vs {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("linear_cross_entropy: weight has no rows (vocabulary of size 0)")
    if target.dim() != 1 or target.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"linear_cross_entropy: target must be 1-D [N] with N = {hidden.shape[0]} (hidden's rows), "
            f"got shape {tuple(target.shape)}"
        )
    if hidden.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"linear_cross_entropy: hidden dtype must be float32, bfloat16 or float16, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"linear_cross_entropy: weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if target.dtype != torch.int64:
        raise ValueError(f"linear_cross_entropy: target dtype must be int64, got {target.dtype}")
    if logits_dtype is not None and logits_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"linear_cross_entropy: logits_dtype must be None, float32, bfloat16 or float16, got {logits_dtype}")
    if not (hidden.device == weight.device == target.device):
        raise ValueError(
            f"linear_cross_entropy: hidden, weight and target must be on one device, "
            f"got {hidden.device}, {weight.device}, {target.device}"
        )
    for name, x in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not x.is_contiguous():
            raise ValueError(f"linear_cross_entropy: {name} must be contiguous (strides {x.stride()})")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    if not isinstance(ignore_index, int):
        raise ValueError(f"linear_cross_entropy: ignore_index must be an int, got {type(ignore_index).__name__}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"linear_cross_entropy: chunk_rows must be a positive int or None, got {chunk_rows!r}")


def default_chunk_rows(n_rows: int, vocab: int, dtype: torch.dtype, device_type: str) -> int:
    """Rows per chunk: the chunk's logits buffer stays under a per-device budget
    (1 GiB on CUDA, 4 MiB on CPU), rows split evenly between the chunks and
    rounded up to a multiple of 64."""
    budget = _CHUNK_BYTES.get(device_type, _CHUNK_BYTES["cuda"])
    most = max(1, budget // (vocab * dtype.itemsize))
    if n_rows <= most:
        return max(n_rows, 1)
    chunks = -(-n_rows // most)
    rows = -(-n_rows // chunks)
    rounded = -(-rows // _ROW_QUANTUM) * _ROW_QUANTUM
    return rounded if rounded <= most else rows


@functools.lru_cache(maxsize=None)
def _fp32_accumulation(device: torch.device) -> str:
    """How this torch sums bf16/fp16 products into an fp32 matrix here:
    ``"addmm"`` (cuBLAS reads and writes fp32 C: newer torch on CUDA), ``"mm"``
    (an fp32 product, then an add), ``"rounded"`` (a product rounded to the
    inputs' dtype, then an add: older torch on CUDA), ``"upcast"`` (CPU)."""
    if device.type != "cuda":
        return "upcast"
    acc = torch.zeros(2, 2, dtype=torch.float32, device=device)
    a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
    for mode, probe in (
        ("addmm", lambda: torch.addmm(acc, a, a, out_dtype=torch.float32, beta=1, out=acc)),
        ("mm", lambda: torch.mm(a, a, out_dtype=torch.float32)),
    ):
        try:
            probe()
            return mode
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    return "rounded"


def _accumulate_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``acc = a @ b`` (first) or ``acc += a @ b``, ``acc`` fp32, ``a`` and ``b`` bf16/fp16."""
    mode = _fp32_accumulation(acc.device)
    if mode == "addmm":
        torch.addmm(acc, a, b, out_dtype=torch.float32, beta=0 if first else 1, out=acc)
    elif mode == "upcast":
        acc.addmm_(a.float(), b.float(), beta=0 if first else 1)
    else:
        part = torch.mm(a, b, out_dtype=torch.float32) if mode == "mm" else torch.mm(a, b)
        if first:
            acc.copy_(part)
        else:
            acc.add_(part)


def linear_cross_entropy_reference(
    hidden, weight, target, *, ignore_index: int = -100, reduction: str = "mean",
    logits_dtype: torch.dtype | None = None, chunk_rows: int | None = None,
):
    """The spec: materialized logits, ``F.cross_entropy`` and autograd.

    Returns ``(loss, grad_hidden, grad_weight)`` for upstream gradient 1;
    ``chunk_rows`` is accepted and ignored."""
    _check(hidden, weight, target, ignore_index, reduction, logits_dtype, chunk_rows)
    with torch.enable_grad():
        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        logits = torch.mm(h, w.t())
        if logits_dtype is not None:
            logits = logits.to(logits_dtype)
        loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
        grad_hidden, grad_weight = torch.autograd.grad(loss, (h, w))
    return loss.detach(), grad_hidden, grad_weight


@register(
    "linear_cross_entropy",
    reference=linear_cross_entropy_reference,
    jit=(_lce_rows_kernel, _row_logsumexp, _row_gradient, _round_to),
    what="hidden @ weight.T + cross-entropy, loss and both gradients in row chunks (logits never whole)",
)
def linear_cross_entropy(
    hidden, weight, target, *, ignore_index: int = -100, reduction: str = "mean",
    logits_dtype: torch.dtype | None = None, chunk_rows: int | None = None,
):
    """Loss of ``F.cross_entropy((hidden @ weight.T).to(logits_dtype), target)``
    and its gradients w.r.t. ``hidden`` and ``weight`` for upstream gradient 1.

    Returns ``(loss, grad_hidden, grad_weight)``: ``loss`` a 0-dim tensor in the
    logits' dtype (``logits_dtype`` or the inputs'), the gradients in the
    inputs' dtype. Dtype flow as autograd's: the matmuls in the inputs' dtype,
    log-softmax in fp32, the logits' gradient rounded to the logits' dtype and
    then to the inputs' dtype; ``grad_weight`` summed over chunks in fp32.
    ``reduction="mean"`` with every target ignored gives a nan loss and zero
    gradients, like torch. A target outside ``[0, V)`` that is not
    ``ignore_index`` makes the loss nan (torch raises; this never syncs).
    Peak extra memory: one chunk of logits (``chunk_rows`` x V in the inputs'
    dtype; see :func:`default_chunk_rows`) plus, for bf16/fp16 over several
    chunks, an fp32 ``grad_weight`` accumulator.
    """
    _check(hidden, weight, target, ignore_index, reduction, logits_dtype, chunk_rows)
    device = hidden.device
    if device.type == "cpu" and not interpreting():
        raise RuntimeError("linear_cross_entropy: Triton kernels on CPU need TRITON_INTERPRET=1 (the interpreter, for tests)")
    n, v = hidden.shape[0], weight.shape[0]
    dtype = hidden.dtype
    out_dtype = logits_dtype or dtype
    rows = min(chunk_rows or default_chunk_rows(n, v, dtype, device.type), max(n, 1))

    with torch.no_grad(), (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
        count = (target != ignore_index).sum()
        if reduction == "mean":
            scale = count.to(torch.float32).reciprocal()  # inf when count is 0: no row uses it then
        else:
            scale = torch.ones((), dtype=torch.float32, device=device)
        row_loss = torch.empty(n, dtype=torch.float32, device=device)
        grad_hidden = torch.empty_like(hidden)
        # One chunk: grad_weight from one matmul, as the reference. Several: the
        # chunks' products summed in fp32 (straight into grad_weight when fp32).
        several = n > rows
        if not several:
            acc = torch.zeros_like(weight) if n == 0 else torch.empty_like(weight)
        else:
            acc = torch.empty(weight.shape, dtype=torch.float32, device=device)
        buf = torch.empty((rows, v), dtype=dtype, device=device) if n else None
        block = min(triton.next_power_of_2(v), _MAX_BLOCK)
        num_warps = 8 if block >= 2048 else 4
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            h = hidden[start:stop]
            logits = buf[: stop - start]
            torch.mm(h, weight.t(), out=logits)
            _lce_rows_kernel[(stop - start,)](
                logits, target[start:stop], row_loss[start:stop], scale,
                v, logits.stride(0), ignore_index,
                LOGITS_DTYPE=_TL_DTYPES[out_dtype], CAST_LOGITS=out_dtype not in (torch.float32, dtype),
                BLOCK=block, BF16_BY_HAND=interpreting(),
                num_warps=num_warps,
            )
            # logits now holds d loss / d logits (the inputs' dtype)
            torch.mm(logits, weight, out=grad_hidden[start:stop])
            if not several:
                torch.mm(logits.t(), h, out=acc)
            elif dtype == torch.float32:
                acc.addmm_(logits.t(), h, beta=0 if start == 0 else 1)
            else:
                _accumulate_fp32(acc, logits.t(), h, first=start == 0)
        grad_weight = acc.to(dtype)
        total = row_loss.sum()
        loss = total / count if reduction == "mean" else total
    return loss.to(out_dtype), grad_hidden, grad_weight



# -- over a vocabulary split between tensor-parallel ranks --------------------------------------------------
#
# Rank r of a group holds ``V_local`` rows of the head's weight (columns ``offset`` to ``offset + V_local`` of
# the logits). The log-softmax needs each row's maximum and sum of exponentials over the whole vocabulary, so
# the fused chain is cut in two around the group's all-reduces (graph nodes, made by
# passes/fusion/fuse_linear_cross_entropy.py):
#
#   vocab_cross_entropy_stats: per row, over the rank's columns: max m, sum exp(x - m), and x[target] where the
#                              rank holds the target (0 elsewhere); the chunk's logits are kept when the rows
#                              are one chunk (the second half then does not multiply again)
#   (graph)                    M = all_reduce_max(m); S = all_reduce_sum(sum * exp(m - M)); lse = M + log S
#   vocab_cross_entropy_grads: per row, over the rank's columns: (exp(x - lse) - [col == target]) * scale, then
#                              the rank's (partial) grad_hidden and its rows of grad_weight
#
# Neither holds the logits of more than one chunk of rows, nor of the whole vocabulary.


@triton.jit
def _vocab_stats_kernel(
    logits_ptr,  # [rows, V] the rank's columns of this chunk's logits (read only)
    target_ptr,  # [rows] int64, whole-vocabulary indices
    max_ptr,  # [rows] fp32 out
    sum_ptr,  # [rows] fp32 out: sum exp(x - max)
    picked_ptr,  # [rows] fp32 out: x[target - offset] where the rank holds a counted target, else 0
    V,
    stride_row,
    offset,
    ignore_index,
    LOGITS_DTYPE: tl.constexpr,
    CAST_LOGITS: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    t = tl.load(target_ptr + row)
    local = t - offset
    m, s, x_t = _row_logsumexp(base, V, local, LOGITS_DTYPE, CAST_LOGITS, BLOCK, BF16_BY_HAND)
    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)
    held = (t != ignore_index) & (local >= 0) & (local < V)
    tl.store(picked_ptr + row, tl.where(held, x_t, 0.0))


@triton.jit
def _vocab_grad_kernel(
    logits_ptr,  # [rows, V] the rank's columns of this chunk's logits; overwritten with their gradient
    target_ptr,  # [rows] int64, whole-vocabulary indices
    lse_ptr,  # [rows] fp32: log sum exp over the whole vocabulary
    scale_ptr,  # [] fp32: 1 / count of counted targets (mean), 1 (sum)
    V,
    stride_row,
    offset,
    ignore_index,
    LOGITS_DTYPE: tl.constexpr,
    CAST_LOGITS: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
):
    # x <- ((exp(x - lse) - [col == target]) * scale) rounded as _lce_rows_kernel rounds it; a row whose target
    # is ignored: 0; a row whose target another rank holds: the softmax term only
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(target_ptr + row)
    row_scale = tl.where(t != ignore_index, tl.load(scale_ptr), 0.0)
    _row_gradient(logits_ptr + row * stride_row, V, t - offset, tl.load(lse_ptr + row), row_scale, LOGITS_DTYPE,
                  CAST_LOGITS, BLOCK, BF16_BY_HAND)


def _vocab_launch_args(weight, logits_dtype, dtype):
    v = weight.shape[0]
    out_dtype = logits_dtype or dtype
    block = min(triton.next_power_of_2(v), _MAX_BLOCK)
    return dict(LOGITS_DTYPE=_TL_DTYPES[out_dtype], CAST_LOGITS=out_dtype not in (torch.float32, dtype), BLOCK=block,
                BF16_BY_HAND=interpreting(), num_warps=8 if block >= 2048 else 4)


def _vocab_check(hidden, weight, target, ignore_index, offset, logits_dtype, chunk_rows) -> None:
    _check(hidden, weight, target, ignore_index, "mean", logits_dtype, chunk_rows)
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"vocab_cross_entropy: offset must be a non-negative int, got {offset!r}")
    if hidden.device.type == "cpu" and not interpreting():
        raise RuntimeError("vocab_cross_entropy: Triton kernels on CPU need TRITON_INTERPRET=1 (the interpreter, for tests)")


def vocab_cross_entropy_stats_reference(hidden, weight, target, *, offset: int, ignore_index: int = -100,
                                        logits_dtype: torch.dtype | None = None, chunk_rows: int | None = None):
    """The spec of :func:`vocab_cross_entropy_stats`, on materialized logits."""
    _check(hidden, weight, target, ignore_index, "mean", logits_dtype, chunk_rows)
    logits = torch.mm(hidden, weight.t())
    x = (logits.to(logits_dtype) if logits_dtype is not None else logits).float()
    top = x.amax(dim=1)
    total = torch.exp(x - top[:, None]).sum(dim=1)
    local = target - offset
    held = (target != ignore_index) & (local >= 0) & (local < weight.shape[0])
    picked = torch.where(held, x.gather(1, local.clamp(0, weight.shape[0] - 1)[:, None])[:, 0], 0.0)
    return top, total, picked, logits


@register(
    "vocab_cross_entropy_stats",
    reference=vocab_cross_entropy_stats_reference,
    jit=(_vocab_stats_kernel, _row_logsumexp, _round_to),
    what="a vocabulary shard's hidden @ weight.T, per row: max, sum of exponentials, the target's logit (rows chunked)",
)
def vocab_cross_entropy_stats(hidden, weight, target, *, offset: int, ignore_index: int = -100,
                              logits_dtype: torch.dtype | None = None, chunk_rows: int | None = None):
    """Per row of ``hidden @ weight.T`` (the rank's ``V_local`` columns of the
    logits, starting at whole-vocabulary column ``offset``): ``(max, sum of
    exp(x - max), x[target - offset] where this rank holds a counted target
    else 0, logits)``, the first three fp32 ``[N]``. ``logits`` is the one
    chunk's logits in the inputs' dtype when every row fits one chunk (the
    grads half reuses it and writes over it), else an empty ``[0, V_local]``."""
    _vocab_check(hidden, weight, target, ignore_index, offset, logits_dtype, chunk_rows)
    device, dtype = hidden.device, hidden.dtype
    n, v = hidden.shape[0], weight.shape[0]
    rows = min(chunk_rows or default_chunk_rows(n, v, dtype, device.type), max(n, 1))
    launch = _vocab_launch_args(weight, logits_dtype, dtype)
    with torch.no_grad(), (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
        top = torch.empty(n, dtype=torch.float32, device=device)
        total = torch.empty(n, dtype=torch.float32, device=device)
        picked = torch.empty(n, dtype=torch.float32, device=device)
        buf = torch.empty((rows if n else 0, v), dtype=dtype, device=device)
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            logits = buf[: stop - start]
            torch.mm(hidden[start:stop], weight.t(), out=logits)
            _vocab_stats_kernel[(stop - start,)](
                logits, target[start:stop], top[start:stop], total[start:stop], picked[start:stop],
                v, logits.stride(0), offset, ignore_index, **launch)
        kept = buf if n <= rows else buf[:0]
    return top, total, picked, kept


def vocab_cross_entropy_grads_reference(hidden, weight, target, lse, scale, logits=None, *, offset: int,
                                        ignore_index: int = -100, logits_dtype: torch.dtype | None = None,
                                        chunk_rows: int | None = None):
    """The spec of :func:`vocab_cross_entropy_grads`, on materialized logits."""
    _check(hidden, weight, target, ignore_index, "mean", logits_dtype, chunk_rows)
    dtype = hidden.dtype
    x = torch.mm(hidden, weight.t())
    x = (x.to(logits_dtype) if logits_dtype is not None else x).float()
    local = target - offset
    onehot = torch.zeros_like(x)
    held = (local >= 0) & (local < weight.shape[0])
    onehot[held.nonzero()[:, 0], local[held]] = 1.0
    row_scale = torch.where(target != ignore_index, scale.float(), 0.0)[:, None]
    g = (torch.exp(x - lse[:, None]) - onehot) * row_scale
    if logits_dtype is not None:
        g = g.to(logits_dtype)
    g = g.to(dtype)
    return torch.mm(g, weight), torch.mm(g.t(), hidden)


@register(
    "vocab_cross_entropy_grads",
    reference=vocab_cross_entropy_grads_reference,
    jit=(_vocab_grad_kernel, _row_gradient, _round_to),
    what="a vocabulary shard's cross-entropy gradients from the group's log-sum-exp: partial grad_hidden, grad_weight rows",
)
def vocab_cross_entropy_grads(hidden, weight, target, lse, scale, logits=None, *, offset: int,
                              ignore_index: int = -100, logits_dtype: torch.dtype | None = None,
                              chunk_rows: int | None = None):
    """``(grad_hidden, grad_weight)`` of the cross-entropy over the whole
    vocabulary for a unit upstream gradient, from this rank's columns:
    ``lse`` ([N] fp32) is the group's log-sum-exp per row, ``scale`` (0-d
    fp32) 1 / the count of counted targets (mean) or 1 (sum).
    ``grad_hidden`` is this rank's summand (the group's sum is the
    gradient); ``grad_weight`` the gradient of the rank's rows. ``logits``:
    what :func:`vocab_cross_entropy_stats` kept (written over here), or
    empty: the logits are computed again chunk by chunk."""
    _vocab_check(hidden, weight, target, ignore_index, offset, logits_dtype, chunk_rows)
    device, dtype = hidden.device, hidden.dtype
    n, v = hidden.shape[0], weight.shape[0]
    kept = logits is not None and logits.shape[0] == n and n > 0
    rows = n if kept else min(chunk_rows or default_chunk_rows(n, v, dtype, device.type), max(n, 1))
    launch = _vocab_launch_args(weight, logits_dtype, dtype)
    with torch.no_grad(), (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
        scale = scale.to(device=device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden)
        several = n > rows
        acc = torch.empty(weight.shape, dtype=torch.float32, device=device) if several else \
            (torch.zeros_like(weight) if n == 0 else torch.empty_like(weight))
        buf = logits if kept else (torch.empty((rows, v), dtype=dtype, device=device) if n else None)
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            h = hidden[start:stop]
            chunk = buf[: stop - start]
            if not kept:
                torch.mm(h, weight.t(), out=chunk)
            _vocab_grad_kernel[(stop - start,)](chunk, target[start:stop], lse[start:stop], scale, v, chunk.stride(0),
                                                offset, ignore_index, **launch)
            torch.mm(chunk, weight, out=grad_hidden[start:stop])
            if not several:
                torch.mm(chunk.t(), h, out=acc)
            elif dtype == torch.float32:
                acc.addmm_(chunk.t(), h, beta=0 if start == 0 else 1)
            else:
                _accumulate_fp32(acc, chunk.t(), h, first=start == 0)
    return grad_hidden, acc.to(dtype)
