"""Reductions and packing around the optimizer: sum of squares, cast-and-pack for collectives.

``sum_squares`` is the one read of a gradient behind the clipping norm and the
overflow check (inf/nan in the input give inf/nan out). ``cast_pack`` writes
pieces into one flat buffer of the collective's dtype (e.g. fp32 shards into
one bf16 buffer for an all-gather), casting on the way, so the pieces are read
once and the buffer written once. ``column_sum`` sums a 2-D tensor's rows
(a linear layer's bias gradient).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import multi_tensor
from .registry import register

__all__ = ["sum_squares", "sum_squares_reference", "sum_squares_many", "sum_squares_many_reference", "cast_pack",
           "cast_pack_reference", "column_sum", "column_sum_reference"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# sum_squares: each program reduces CHUNK = SUM_BLOCK * SUM_ITERS elements,
# so 64M elements leave 4096 fp32 partials (16 KB) for the second pass.
SUM_BLOCK = 2048
SUM_ITERS = 8
# cast_pack: 2048 elements per program over 4 warps, 16 per thread. The
# 1.3B GPT's parameters cast to one bf16 buffer (292 parts, H200 device
# time, benchmarks/optimizer_sweep.py): 1.89 ms, 97% of the copy bandwidth;
# 4096 over 8 warps 2.01 ms, 8192 over 16 warps 2.10 ms.
PACK_BLOCK = 2048
PACK_WARPS = 4
NUM_WARPS = 8
# column_sum: COLUMN_ROWS x BLOCK_N tiles (BLOCK_N = COLUMN_BLOCK_N for 16-bit
# inputs, half that for fp32) over COLUMN_WARPS warps, COLUMN_PER_SM programs
# per SM over all column blocks.
COLUMN_ROWS = 64
COLUMN_BLOCK_N = 128
COLUMN_WARPS = 4
COLUMN_PER_SM = 4


def _device_guard(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _check_input(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; expected float32, bfloat16 or float16")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); pass a contiguous tensor")


# --------------------------------------------------------------------------- sum_squares


@triton.jit
def _sum_squares_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # partial[pid] = sum(x[i].float()**2 for i in this program's chunk of BLOCK*ITERS)
    # Each lane accumulates ITERS squares in fp32 in a fixed order (fused
    # multiply-adds when compiled), then the block is summed as a tree: the
    # result depends on n only (deterministic).
    # Memory: reads x once (2 or 4 B per element), writes 4 B per program.
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def sum_squares_reference(x: torch.Tensor) -> torch.Tensor:
    """Eager sum of squares in fp32: ``(x.float() ** 2).sum()``."""
    _check_input("x", x)
    return (x.float() ** 2).sum()


@register("sum_squares", reference=sum_squares_reference, jit=(_sum_squares_kernel,),
          what="sum of squares in fp32 (clip norm, overflow check): one read, deterministic")
def sum_squares(x: torch.Tensor) -> torch.Tensor:
    """0-d fp32 tensor ``(x.float() ** 2).sum()``: one read of ``x``, fp32 accumulation.

    Deterministic: per-program partial sums in a fixed order, then a torch
    ``.sum()`` of the partials (one per 16K elements). inf/nan propagate.
    """
    _check_input("x", x)
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    programs = triton.cdiv(n, SUM_BLOCK * SUM_ITERS)
    partials = torch.empty(programs, dtype=torch.float32, device=x.device)
    with _device_guard(x):
        _sum_squares_kernel[(programs,)](x, partials, n, BLOCK=SUM_BLOCK, ITERS=SUM_ITERS, num_warps=NUM_WARPS)
    return partials.sum() if programs > 1 else partials.reshape(())


@triton.jit
def _sum_squares_many_kernel(table_ptr, chunks_ptr, partial_ptr, X_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                             ITERS: tl.constexpr):
    # _sum_squares_kernel over many tensors in one launch: program c takes
    # chunk (tensor t, first element, number of elements n, slot in
    # partials) from the chunk table and the tensor's address from the
    # address table; the same lanes, order and tree as the one-tensor kernel.
    c = tl.program_id(0).to(tl.int64)
    t = tl.load(chunks_ptr + 4 * c)
    base = tl.load(chunks_ptr + 4 * c + 1)
    n = tl.load(chunks_ptr + 4 * c + 2)
    slot = tl.load(chunks_ptr + 4 * c + 3)
    x_ptr = tl.load(table_ptr + t).to(tl.pointer_type(X_DTYPE), bitcast=True)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        # blocks wholly past the chunk's end would add zeros: skipped
        if i * BLOCK < n - base:
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
            acc += x * x
    tl.store(partial_ptr + slot, tl.sum(acc, axis=0))


@triton.jit
def _segment_sum_kernel(partial_ptr, segments_ptr, out_ptr, BLOCK: tl.constexpr):
    # out[t] = the sum of tensor t's partials, lanes then a tree: deterministic
    t = tl.program_id(0).to(tl.int64)
    start = tl.load(segments_ptr + 2 * t)
    count = tl.load(segments_ptr + 2 * t + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, count, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + start + offs, mask=offs < count, other=0.0)
    tl.store(out_ptr + t, tl.sum(acc, axis=0))


def sum_squares_many_reference(*xs: torch.Tensor) -> torch.Tensor:
    """Eager: ``torch.stack([(x.float() ** 2).sum() for x in xs])``."""
    return torch.stack([sum_squares_reference(x) for x in xs])


@register("sum_squares_many", reference=sum_squares_many_reference, jit=(_sum_squares_many_kernel, _segment_sum_kernel),
          what="sums of squares of many tensors, one launch per dtype plus one for the per-tensor sums")
def sum_squares_many(*xs: torch.Tensor) -> torch.Tensor:
    """fp32 tensor ``[len(xs)]`` of each ``(x.float() ** 2).sum()``: two
    launches per input dtype however many tensors (the clipping norm of a
    transformer's ~300 gradients), deterministic, inf/nan propagate."""
    if not xs:
        raise ValueError("sum_squares_many needs at least one tensor")
    device = xs[0].device
    for i, x in enumerate(xs):
        _check_input(f"x #{i}", x)
        if x.device != device:
            raise ValueError(f"x #{i} is on {x.device}; x #0 is on {device}")
    chunk = SUM_BLOCK * SUM_ITERS
    out = torch.zeros(len(xs), dtype=torch.float32, device=device)
    by_dtype: dict = {}
    for i, x in enumerate(xs):
        if x.numel():
            by_dtype.setdefault(x.dtype, []).append(i)
    for dtype, members in by_dtype.items():
        numels = tuple(xs[i].numel() for i in members)

        def tables():
            # chunk rows (tensor, first element, its numel, slot in partials); per tensor (first slot, count)
            index, first = multi_tensor.blocks(numels, chunk)
            sizes = torch.tensor(numels, dtype=torch.int64)
            slots = torch.arange(index.numel(), dtype=torch.int64)
            counts = torch.bincount(index, minlength=len(numels))
            chunks = torch.stack([index, first, sizes[index], slots], dim=1)
            segments = torch.stack([torch.cumsum(counts, 0) - counts, counts], dim=1)
            n = index.numel()
            return multi_tensor.device_table(chunks, device), multi_tensor.device_table(segments, device), n, n

        chunk_table, segment_table, slots, programs = multi_tensor.cached(("sumsq chunks", chunk, numels, device), tables,
                                                                          geometry=True)
        ptrs = tuple(xs[i].data_ptr() for i in members)
        table = multi_tensor.cached(("sumsq ptrs", ptrs, device), lambda: multi_tensor.device_table(list(ptrs), device))
        sums = None
        if multi_tensor.FALLBACK is None:
            partials = torch.empty(slots, dtype=torch.float32, device=device)
            sums = torch.empty(len(members), dtype=torch.float32, device=device)
            try:
                with _device_guard(xs[0]):
                    _sum_squares_many_kernel[(programs,)](table, chunk_table, partials, X_DTYPE=multi_tensor.TRITON_DTYPES[dtype],
                                                          BLOCK=SUM_BLOCK, ITERS=SUM_ITERS, num_warps=NUM_WARPS)
                    _segment_sum_kernel[(len(members),)](partials, segment_table, sums, BLOCK=1024, num_warps=4)
            except Exception as exc:  # a Triton that cannot build it: the one-tensor kernel does the same work
                multi_tensor.failed("sum-of-squares", exc)
                sums = None
        if sums is None:
            sums = torch.stack([sum_squares(xs[i]) for i in members])
        if len(members) == len(xs):
            return sums  # one dtype, no empty tensor: the usual case
        index = multi_tensor.cached(("sumsq index", tuple(members), device), lambda: multi_tensor.device_table(members, device),
                                     geometry=True)
        out.index_copy_(0, index, sums)
    return out


# --------------------------------------------------------------------------- cast_pack


@triton.jit
def _rounded(x, out_ptr, OUT_BF16: tl.constexpr):
    # fp32 ``x`` in out's dtype, rounded to nearest even. bf16 by hand, as
    # torch's c10::BFloat16 does it: add half an ulp of bf16 (minus one when
    # the kept lsb is 0, for ties to even) and drop the low 16 bits; NaN
    # becomes the quiet NaN 0x7FC0. The same values as CUDA's
    # cvt.rn.bf16.f32, and Triton's interpreter (whose fp32 -> bf16 cast
    # truncates) then agrees too.
    if OUT_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        bits = tl.where(x != x, 0x7FC00000, bits)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(out_ptr.dtype.element_ty)
    return y


@triton.jit
def _cast_pack_kernel(src_ptr, out_ptr, src_numel, offset, lo, hi, scale, OUT_BF16: tl.constexpr,
                      HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    # out[j] = src[j - offset] (times scale) cast to out's dtype, for j in
    # [lo, hi); 0 where j - offset falls outside src (the gaps around it).
    # Memory: reads src once, writes out[lo:hi] once; nothing else.
    pid = tl.program_id(0)
    j = lo + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = j - offset
    # Through fp32 (exact for every input dtype), then one rounding to out's
    # dtype, to nearest even: the same bits as torch's ``.to(dtype)``.
    x = tl.load(src_ptr + k, mask=(k >= 0) & (k < src_numel), other=0.0).to(tl.float32)
    if HAS_SCALE:
        x = x * scale
    tl.store(out_ptr + j, _rounded(x, out_ptr, OUT_BF16), mask=j < hi)


@triton.jit
def _cast_pack_many_kernel(table_ptr, blocks_ptr, ranges_ptr, out_ptr, scale, SRC_DTYPE: tl.constexpr,
                           OUT_BF16: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    # _cast_pack_kernel for many parts in one launch: program c takes block
    # (part p, first element of its range) from the block table, the part's
    # (numel, offset, lo, hi) from the range table and its address from the
    # address table; each element is computed as the one-part kernel does.
    c = tl.program_id(0).to(tl.int64)
    p = tl.load(blocks_ptr + 2 * c)
    first = tl.load(blocks_ptr + 2 * c + 1)
    src_numel = tl.load(ranges_ptr + 4 * p)
    offset = tl.load(ranges_ptr + 4 * p + 1)
    lo = tl.load(ranges_ptr + 4 * p + 2)
    hi = tl.load(ranges_ptr + 4 * p + 3)
    src_ptr = tl.load(table_ptr + p).to(tl.pointer_type(SRC_DTYPE), bitcast=True)
    j = lo + first + tl.arange(0, BLOCK)
    k = j - offset
    x = tl.load(src_ptr + k, mask=(k >= 0) & (k < src_numel), other=0.0).to(tl.float32)
    if HAS_SCALE:
        x = x * scale
    tl.store(out_ptr + j, _rounded(x, out_ptr, OUT_BF16), mask=j < hi)


def _check_pack(parts, total: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, int]]:
    """Validated parts, sorted by offset, empty ones left out."""
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"cast_pack dtype {dtype}; expected float32, bfloat16 or float16")
    if not isinstance(total, int) or total < 0:
        raise ValueError(f"cast_pack total must be a non-negative int, got {total!r}")
    device = None
    live = []
    for i, part in enumerate(parts):
        if not (isinstance(part, (tuple, list)) and len(part) == 2):
            raise ValueError(f"cast_pack part {i} must be a (tensor, offset) pair, got {part!r}")
        t, offset = part
        _check_input(f"cast_pack part {i}", t)
        if device is not None and t.device != device:
            raise ValueError(f"cast_pack part {i} is on {t.device}; part 0 is on {device}")
        device = t.device
        if not isinstance(offset, int) or offset < 0 or offset + t.numel() > total:
            raise ValueError(f"cast_pack part {i}: offset {offset!r} + {t.numel()} elements does not fit in total {total}")
        if t.numel():
            live.append((t, offset, i))
    live.sort(key=lambda item: item[1])
    for (a, off_a, i), (_, off_b, j) in zip(live, live[1:]):
        if off_a + a.numel() > off_b:
            raise ValueError(f"cast_pack parts {i} and {j} overlap: [{off_a}, {off_a + a.numel()}) and offset {off_b}")
    return [(t, offset) for t, offset, _ in live]


def cast_pack_reference(parts: list[tuple[torch.Tensor, int]], total: int, dtype: torch.dtype,
                        scale: float | None = None) -> torch.Tensor:
    """Eager pack: zero buffer, each part flattened and copied (cast; with
    ``scale``, multiplied by it in fp32 first) in at its offset."""
    live = _check_pack(parts, total, dtype)
    device = parts[0][0].device if parts else None
    out = torch.zeros(total, dtype=dtype, device=device)
    for t, offset in live:
        flat = t.reshape(-1)
        out[offset:offset + t.numel()] = (flat.float() * scale if scale is not None else flat).to(dtype)
    return out


def _cast_pack_many(ranges, out: torch.Tensor, scale) -> None:
    """All of ``ranges`` ((part, offset, lo, hi)) in one launch per part dtype."""
    device = out.device
    by_dtype: dict = {}
    for r in ranges:
        by_dtype.setdefault(r[0].dtype, []).append(r)
    for src_dtype, group in by_dtype.items():
        geometry = tuple((t.numel(), offset, lo, hi) for t, offset, lo, hi in group)

        def tables(geometry=geometry):
            index, first = multi_tensor.blocks([hi - lo for _, _, lo, hi in geometry], PACK_BLOCK)
            return (multi_tensor.device_table(torch.stack([index, first], dim=1), device),
                    multi_tensor.device_table(list(geometry), device), index.numel())

        block_table, range_table, programs = multi_tensor.cached(("pack blocks", PACK_BLOCK, geometry, device), tables, geometry=True)
        ptrs = tuple(t.data_ptr() for t, _, _, _ in group)
        table = multi_tensor.cached(("pack ptrs", ptrs, device), lambda ptrs=ptrs: multi_tensor.device_table(list(ptrs), device))
        with _device_guard(out):
            _cast_pack_many_kernel[(programs,)](
                table, block_table, range_table, out, 1.0 if scale is None else float(scale),
                SRC_DTYPE=multi_tensor.TRITON_DTYPES[src_dtype], OUT_BF16=out.dtype == torch.bfloat16,
                HAS_SCALE=scale is not None, BLOCK=PACK_BLOCK, num_warps=PACK_WARPS)


@register("cast_pack", reference=cast_pack_reference, jit=(_rounded, _cast_pack_kernel, _cast_pack_many_kernel),
          what="pack pieces into one flat buffer of the collective's dtype, casting; gaps zeroed")
def cast_pack(parts: list[tuple[torch.Tensor, int]], total: int, dtype: torch.dtype,
              scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """New flat ``total``-element tensor of ``dtype`` (or ``out``, written
    over): each ``(tensor, offset)`` is
    flattened, cast and written at ``offset``; every element not covered is 0.
    ``scale``: each value is multiplied by it in fp32 before the rounding
    (a power of two, e.g. 1/N before a sum over N ranks, changes no bit of
    the result beyond the exact scaling, barring under- and overflow).

    Part i (by offset) writes from its offset (0 for the first) up to the
    next part's offset (``total`` for the last), so the gaps are zeroed by
    the same programs and the buffer is written exactly once: one launch
    per source dtype for all the parts (the address-table kernel; the
    one-part kernel per part where this Triton cannot build it). Parts must
    be contiguous floating tensors on one device and must not overlap.
    Without parts the buffer is all zeros (on the CPU).
    """
    live = _check_pack(parts, total, dtype)
    if out is not None and not (out.dtype == dtype and out.shape == (total,) and out.is_contiguous()):
        raise ValueError(f"cast_pack out must be a contiguous flat {dtype} tensor of {total} elements, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if not live:
        device = parts[0][0].device if parts else None
        return torch.zeros(total, dtype=dtype, device=device) if out is None else out.zero_()
    device = live[0][0].device
    out = torch.empty(total, dtype=dtype, device=device) if out is None else out
    bounds = [0] + [offset for _, offset in live[1:]] + [total]
    ranges = [(t, offset, lo, hi) for (t, offset), lo, hi in zip(live, bounds, bounds[1:])]
    one_by_one = ranges
    if len(ranges) > 1 and multi_tensor.FALLBACK is None:
        try:
            _cast_pack_many(ranges, out, scale)
            one_by_one = []
        except Exception as exc:  # a Triton that cannot build it: the one-part kernel does the same work
            multi_tensor.failed("cast-pack", exc)
    with _device_guard(out):
        for t, offset, lo, hi in one_by_one:
            _cast_pack_kernel[(triton.cdiv(hi - lo, PACK_BLOCK),)](
                t, out, t.numel(), offset, lo, hi, 1.0 if scale is None else float(scale),
                OUT_BF16=dtype == torch.bfloat16, HAS_SCALE=scale is not None, BLOCK=PACK_BLOCK,
                num_warps=PACK_WARPS)
    return out


# --------------------------------------------------------------------------- column_sum


@triton.jit(do_not_specialize=["M", "rows_per_group"])  # row counts vary with the batch: one compile for all (Triton would specialize on divisibility by 16)
def _column_partials_kernel(x_ptr, part_ptr, M, N, rows_per_group,
                            ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # part[r, c] = sum over rows [r*rows_per_group, (r+1)*rows_per_group) of
    # x[row, c], in fp32: program (r, j) takes row group r and columns
    # j*BLOCK_N..; ROWS x BLOCK_N tiles, fp32 accumulators in registers, one
    # tree sum over the tile's rows at the end (deterministic for a given
    # grid). Memory: reads x once (M*N), writes G*N fp32 partials (G << M).
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    first = r.to(tl.int64) * rows_per_group
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for start in tl.range(0, rows_per_group, ROWS):
        rows = first + start + tl.arange(0, ROWS)
        mask = ((rows < M) & (start + tl.arange(0, ROWS) < rows_per_group))[:, None] & col_ok[None, :]
        acc += tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(part_ptr + r.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit(do_not_specialize=["G"])  # row counts vary with the batch: one compile for all (Triton would specialize on divisibility by 16)
def _column_total_kernel(part_ptr, out_ptr, G, N, OUT_BF16: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    # out[c] = sum_g part[g, c], rounded once to out's dtype (to nearest even,
    # also in the interpreter: _rounded). Reads G*N fp32, writes N.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_G, BLOCK_C), dtype=tl.float32)
    for g0 in tl.range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        mask = (g < G)[:, None] & col_ok[None, :]
        acc += tl.load(part_ptr + g.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, _rounded(tl.sum(acc, axis=0), out_ptr, OUT_BF16), mask=col_ok)


def column_sum_reference(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """``x.sum(0, keepdim)`` for a 2-D ``x`` (aten: fp32 accumulation, one rounding)."""
    return torch.ops.aten.sum.dim_IntList(x, [0], keepdim)


def _column_groups(device: torch.device, m: int, col_blocks: int) -> int:
    """Row groups: COLUMN_PER_SM programs per SM over all column blocks, each
    group at least 64 rows (fewer, larger partial buffers otherwise); on CPU
    (the interpreter) a few, so that groups, tiles and masks are all exercised."""
    if device.type == "cuda":
        target = COLUMN_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(triton.cdiv(m, 64), triton.cdiv(target, col_blocks)))
    return max(1, min(m, 3))


@register("column_sum", reference=column_sum_reference, jit=(_rounded, _column_partials_kernel, _column_total_kernel),
          what="sum over the rows of a 2-D tensor (bias gradients): fp32 partials per row group, then one rounding")
def column_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """``x.sum(0, keepdim=keepdim)`` of a contiguous 2-D float tensor, in
    ``x``'s dtype, accumulated in fp32: a linear layer's bias gradient
    (torch's reduction kernel ran at about half the copy bandwidth on the
    1.3B GPT's, with a memset before each). Two launches: partial sums per
    row group, then the sum of those, rounded once."""
    _check_input("x", x)
    if x.dim() != 2:
        raise ValueError(f"column_sum takes a 2-D tensor, got shape {tuple(x.shape)}")
    m, n = x.shape
    out = torch.empty((1, n) if keepdim else (n,), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.zero_()
    block_n, col_blocks, groups, rows_per_group = _row_groups(x, m, n)
    part = torch.empty((groups, n), dtype=torch.float32, device=x.device)
    with _device_guard(x):
        _column_partials_kernel[(groups, col_blocks)](x, part, m, n, rows_per_group, ROWS=COLUMN_ROWS, BLOCK_N=block_n,
                                                      num_warps=COLUMN_WARPS)
        _column_total(part, out)
    return out


def _row_groups(x: torch.Tensor, m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, column blocks, row groups, rows per group) for an M x N pass."""
    block_n = COLUMN_BLOCK_N if x.element_size() == 2 else COLUMN_BLOCK_N // 2
    col_blocks = triton.cdiv(n, block_n)
    rows_per_group = triton.cdiv(m, _column_groups(x.device, m, col_blocks))
    return block_n, col_blocks, triton.cdiv(m, rows_per_group), rows_per_group


def _column_total(part: torch.Tensor, out: torch.Tensor) -> None:
    groups, n = part.shape
    _column_total_kernel[(triton.cdiv(n, 16),)](part, out, groups, n, OUT_BF16=out.dtype == torch.bfloat16,
                                               BLOCK_G=64, BLOCK_C=16, num_warps=4)
