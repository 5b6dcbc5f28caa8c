"""sum_squares / cast_pack: the Triton kernels against fp64 truth, torch, and their references.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1).
"""
from __future__ import annotations

import pytest
import torch

from stepfx.codegen import KERNELS, kernel_source
from stepfx.codegen.reduction_kernels import cast_pack, cast_pack_reference, sum_squares, sum_squares_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 50_000 spans 4 programs of 16K elements (partials summed by torch).
SHAPES = [(9,), (41,), (341,), (4231,), (37, 113), (50_000,)]
EPS32 = torch.finfo(torch.float32).eps
# compiled for real where there is a GPU, in the interpreter on CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sum_squares_accuracy(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE)
    got = sum_squares(x)
    eager = (x.float() ** 2).sum()
    truth = (x.double() ** 2).sum()
    assert got.shape == () and got.dtype == torch.float32 and got.device == x.device
    assert torch.equal(sum_squares_reference(x), eager)
    # No worse than twice eager's own error against fp64, plus 2 fp32 ulps of the result.
    err, eager_err = (got.double() - truth).abs(), (eager.double() - truth).abs()
    assert err <= 2 * eager_err + 2 * EPS32 * truth, f"error {err / truth:.3g} (relative), eager {eager_err / truth:.3g}"
    assert torch.equal(sum_squares(x), got), "not deterministic"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad,want", [((float("inf"),), "inf"), ((float("nan"),), "nan"),
                                      ((float("-inf"),), "inf"), ((float("inf"), float("nan")), "nan")])
def test_sum_squares_propagates_overflow(dtype, bad, want):
    x = torch.randn(20_000).to(dtype)
    x[[7, 19_000][:len(bad)]] = torch.tensor(bad, dtype=dtype)
    x = x.to(DEVICE)
    got = sum_squares(x)
    assert torch.isinf(got) and got > 0 if want == "inf" else torch.isnan(got)


def test_sum_squares_empty_and_bad_input():
    assert torch.equal(sum_squares(torch.empty(0, 3, device=DEVICE)), torch.zeros((), device=DEVICE))
    with pytest.raises(ValueError, match="x has dtype torch.int32"):
        sum_squares(torch.zeros(4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="x is not contiguous"):
        sum_squares(torch.zeros(4, 4, device=DEVICE).t())


def _cat_pack(parts, total, dtype):
    """The spec written differently: torch.cat of the pieces and zero pads, then one cast."""
    pieces, at, device = [], 0, parts[0][0].device
    for t, offset in sorted(parts, key=lambda part: part[1]):
        pieces += [torch.zeros(offset - at, device=device), t.reshape(-1).float()]
        at = offset + t.numel()
    pieces.append(torch.zeros(total - at, device=device))
    return torch.cat(pieces).to(dtype)


def _pack_parts():
    gen = torch.Generator().manual_seed(0)
    odd = torch.tensor([1e5, -7e4, float("inf"), float("-inf"), float("nan"), 3.4e38, 1e-40, -0.0, 65520.0])
    # fp32 values exactly halfway between two bf16 values: ties round to even
    ties = (torch.arange(300, dtype=torch.int32) * 65536 + 0x3F808000).view(torch.float32)
    parts = [
        (torch.randn(341, generator=gen) * 100, 9),  # leading gap of 9
        (torch.cat([odd, ties, -ties]), 400),  # gap of 50
        (torch.randn(9, 41, generator=gen).to(torch.bfloat16), 1009),  # right after the previous part
        (torch.randn(0), 1378),  # empty: covers nothing
        (torch.randn(4231, generator=gen).half(), 1500),  # gap, then a trailing gap
    ]
    return [(t.to(DEVICE), offset) for t, offset in parts]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, casting 1e5 to fp16 in the interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cast_pack_exact(dtype):
    parts, total = _pack_parts(), 5800
    want = _cat_pack(parts, total, dtype)
    for got in (cast_pack(parts, total, dtype), cast_pack(parts[::-1], total, dtype),
                cast_pack_reference(parts, total, dtype)):
        assert got.shape == (total,) and got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [0.5, 0.25, 0.3])
def test_cast_pack_scaled(dtype, scale):
    """With ``scale``: each value times scale in fp32, then one rounding (a
    power of two: exactly the scaled cast; 0.3: the fp32 product rounded)."""
    parts, total = _pack_parts(), 5800
    want = (_cat_pack(parts, total, torch.float32) * scale).to(dtype)
    for got in (cast_pack(parts, total, dtype, scale), cast_pack_reference(parts, total, dtype, scale)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    if scale in (0.5, 0.25):  # a power of two commutes with the rounding (no value here under- or overflows it)
        exact = [(t, o) for t, o in parts if t.numel() and bool(torch.isfinite(t).all())]
        torch.testing.assert_close(cast_pack(exact, total, dtype, scale), cast_pack(exact, total, dtype) * scale,
                                   rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [None, 0.5])
def test_cast_pack_one_launch_per_dtype_equals_one_per_part(monkeypatch, dtype, scale):
    """The address-table kernel (all parts of a source dtype in one launch:
    the fp32, bf16 and fp16 parts here in three) writes the bits the
    one-part kernel writes part by part, gaps included."""
    from stepfx.codegen import multi_tensor, reduction_kernels

    parts, total = _pack_parts(), 5800
    launches = []
    original = reduction_kernels._cast_pack_many
    monkeypatch.setattr(reduction_kernels, "_cast_pack_many",
                        lambda ranges, out, s: (launches.append(len({r[0].dtype for r in ranges})), original(ranges, out, s)))
    many = cast_pack(parts, total, dtype, scale)
    assert launches == [3] and multi_tensor.FALLBACK is None
    monkeypatch.setattr(multi_tensor, "FALLBACK", "test: one part per launch")
    one_by_one = cast_pack(parts, total, dtype, scale)
    assert launches == [3]
    torch.testing.assert_close(many, one_by_one, rtol=0, atol=0, equal_nan=True)


def test_cast_pack_no_parts_and_full_cover():
    assert torch.equal(cast_pack([], 5, torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16))
    x = torch.randn(41, device=DEVICE)
    assert torch.equal(cast_pack([(x[:9], 0), (x[9:], 9)], 41, torch.float32), x)


def test_cast_pack_bad_input():
    x = torch.randn(10, device=DEVICE)
    cases = [
        ("overlap", [(x, 0), (x, 5)], 20, torch.float32),
        ("does not fit in total 12", [(x, 3)], 12, torch.float32),
        ("offset -1", [(x, -1)], 12, torch.float32),
        ("dtype torch.int64", [(x, 0)], 12, torch.int64),
        ("part 1 has dtype torch.int32", [(x, 0), (x.int(), 10)], 20, torch.float32),
        ("part 0 is not contiguous", [(torch.randn(4, 4, device=DEVICE).t(), 0)], 20, torch.float32),
        ("part 0 must be a \\(tensor, offset\\) pair", [x], 20, torch.float32),
    ]
    for fn in (cast_pack, cast_pack_reference):
        for message, parts, total, dtype in cases:
            with pytest.raises(ValueError, match=message):
                fn(parts, total, dtype)


def test_registered():
    for name, launch, ref in (("sum_squares", sum_squares, sum_squares_reference),
                              ("cast_pack", cast_pack, cast_pack_reference)):
        assert KERNELS[name].launch is launch and KERNELS[name].reference is ref
        assert "@triton.jit" in kernel_source(name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda(dtype):
    """Compiled on the GPU: sum_squares against fp64, cast_pack bitwise against torch."""
    x = (torch.randn(3_000_017, device="cuda") * 3).to(dtype)
    truth = (x.double() ** 2).sum()
    eager = (x.float() ** 2).sum()
    got = sum_squares(x)
    assert (got.double() - truth).abs() <= 2 * (eager.double() - truth).abs() + 2 * EPS32 * truth
    parts = [(t.cuda(), offset) for t, offset in _pack_parts()]
    for out in DTYPES:
        torch.testing.assert_close(cast_pack(parts, 5800, out), _cat_pack(parts, 5800, out),
                                   rtol=0, atol=0, equal_nan=True)


def test_sum_squares_many():
    """Many tensors (dtypes mixed, an empty one, sizes across chunk edges):
    each sum no worse than twice eager's own error against fp64; inf/nan
    propagate to their own entry only; deterministic."""
    from stepfx.codegen.reduction_kernels import sum_squares_many

    gen = torch.Generator().manual_seed(7)
    shapes = [(9,), (41, 3), (16384,), (16385,), (0,), (50_000,), (341,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.float16, torch.bfloat16, torch.float16]
    xs = [(torch.randn(s, generator=gen) * 3).to(d).to(DEVICE) for s, d in zip(shapes, dtypes)]
    got = sum_squares_many(*xs)
    assert got.shape == (len(xs),) and got.dtype == torch.float32
    for i, x in enumerate(xs):
        truth, eager = (x.double() ** 2).sum(), (x.float() ** 2).sum()
        err, eager_err = (got[i].double() - truth).abs(), (eager.double() - truth).abs()
        assert err <= 2 * eager_err + 2 * EPS32 * truth, f"tensor {i}: error {err:.3g}, eager {eager_err:.3g}"
    assert torch.equal(sum_squares_many(*xs), got), "not deterministic"
    bad = [x.clone() for x in xs]
    bad[3][7], bad[5][100] = float("inf"), float("nan")
    out = sum_squares_many(*bad)
    assert torch.isinf(out[3]) and torch.isnan(out[5])
    assert torch.isfinite(out[[0, 1, 2, 4, 6]]).all()
    with pytest.raises(ValueError, match="x #1 has dtype torch.int32"):
        sum_squares_many(xs[0], torch.zeros(3, dtype=torch.int32, device=DEVICE))
    from stepfx.codegen import multi_tensor

    assert multi_tensor.FALLBACK is None  # the multi-tensor kernels ran, not the per-tensor fallback


# --------------------------------------------------------------------------- column_sum

COLUMN_SHAPES = [(9, 41), (41, 9), (341, 37), (4231, 9), (1, 130), (200, 341)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", COLUMN_SHAPES, ids=str)
def test_column_sum_accuracy(shape, dtype):
    from stepfx.codegen.reduction_kernels import column_sum, column_sum_reference

    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE)
    keepdim = shape[0] % 2 == 1
    got = column_sum(x, keepdim)
    eager = x.sum(0, keepdim=keepdim)
    assert torch.equal(column_sum_reference(x, keepdim), eager)
    assert got.shape == eager.shape and got.dtype == dtype and got.device == x.device
    truth = x.double().sum(0, keepdim=keepdim)
    # fp32 accumulation in another order: within twice eager's error plus a few fp32 ulps of sum |x|, and
    # then one rounding to the output dtype (a 16-bit result may land one ulp from eager's)
    slack = 4 * EPS32 * x.double().abs().sum(0, keepdim=keepdim) + torch.finfo(dtype).eps * truth.abs()
    err, eager_err = (got.double() - truth).abs(), (eager.double() - truth).abs()
    assert (err <= 2 * eager_err + slack).all(), f"worst error {err.max():.3g}, eager {eager_err.max():.3g}"
    assert torch.equal(column_sum(x, keepdim), got), "not deterministic"


def test_column_sum_16_bit_results_are_rounded_to_nearest():
    """A sum that fp32 holds exactly is rounded once, to nearest even, like torch's."""
    from stepfx.codegen.reduction_kernels import column_sum

    for dtype in (torch.bfloat16, torch.float16):
        x = torch.tensor([[1.0, 1.0], [2.0 ** -9, 3 * 2.0 ** -9], [0.0, 2.0 ** -12]]).to(dtype).to(DEVICE)
        assert torch.equal(column_sum(x), x.sum(0)), dtype


def test_column_sum_empty_and_bad_input():
    from stepfx.codegen.reduction_kernels import column_sum

    assert torch.equal(column_sum(torch.empty(0, 3, device=DEVICE)), torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="2-D"):
        column_sum(torch.zeros(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="x is not contiguous"):
        column_sum(torch.zeros(4, 6, device=DEVICE).t())
    assert "_column_partials_kernel" in kernel_source("column_sum") and "column_sum" in KERNELS


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs the kernels only on CPU-only machines here")
def test_the_interpreter_sets_up_the_language_once(monkeypatch):
    """Under TRITON_INTERPRET=1, registering stepfx's kernels wraps the
    interpreter's per-launch set-up of triton.language (compat's
    patch_triton_language_once): a Triton that renames it would silently
    bring back ~15% of every CPU codegen test's time. Launches after the
    first set nothing up again and still compute the reference."""
    from triton.runtime import interpreter

    assert getattr(interpreter, "_stepfx_patched_once", False)
    calls = []
    wrapped = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: calls.append(fn) or wrapped(fn))
    x = torch.randn(5000)
    for _ in range(2):
        torch.testing.assert_close(sum_squares(x), sum_squares_reference(x), rtol=1e-6, atol=0)
    assert calls and all(not scope._changes for scope in map(wrapped, calls))
