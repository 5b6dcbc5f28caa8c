"""LayerNorm / RMSNorm kernels against aten, op for op (Triton's interpreter on CPU).

Tolerances:
- fp32: max |kernel - fp64 exact| <= 1e-5 * max |exact| for every output.
- bf16 / fp16: the kernel's max error against the fp64 exact may be at most
  2x the eager low-precision op's own error against the same exact, plus one
  ulp (the dtype's eps) of max |exact| (:func:`assert_no_worse_than_eager`).
The fp64 exact of a backward takes the same (possibly rounded) mean/rstd that
kernel and eager are given, so all three answer the same question.

The one-ulp term is needed on CPU: Triton's interpreter rounds fp32 -> bf16
toward zero (a GPU rounds to nearest even), so there the kernel's bf16
outputs are up to 1 ulp off where eager's are within half an ulp.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch._decomp import decomposition_table

from stepfx.codegen import KERNELS, available, kernel_source
from stepfx.codegen import norm_kernels as nk

aten = torch.ops.aten
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not available(DEVICE)[0], reason=available(DEVICE)[1])

# (shape, number of trailing dims normalized)
SHAPES = [((9, 41), 1), ((41, 341), 1), ((5, 4231), 1), ((2, 3, 341), 1), ((3, 9, 41), 2)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32_RTOL = 1e-5
FACTOR = 2.0

# The eager RMSNorm backward: aten's op where it has a kernel (CUDA), else
# torch's own decomposition of it (what its meta function runs).
_eager_rms_backward = (aten._fused_rms_norm_backward.default if DEVICE == "cuda"
                       else decomposition_table[aten._fused_rms_norm_backward.default])


def assert_no_worse_than_eager(got, eager, exact, what, factor=FACTOR):
    """The low-precision rule: err(kernel) <= factor * err(eager) + 1 ulp of max|exact|,
    errors being max-abs against the fp64 ``exact``."""
    exact = exact.double()
    err_k = (got.double() - exact).abs().max().item()
    err_e = (eager.double() - exact).abs().max().item()
    ulp = torch.finfo(got.dtype).eps * exact.abs().max().item()
    assert err_k <= factor * err_e + ulp, (
        f"{what}: kernel error {err_k:.3g} > {factor} x eager error {err_e:.3g} + {ulp:.3g}")


def assert_fp32_close(got, exact, what):
    err = (got.double() - exact.double()).abs().max().item()
    bound = FP32_RTOL * exact.double().abs().max().item()
    assert err <= bound, f"{what}: fp32 error {err:.3g} > {FP32_RTOL} x max|exact| = {bound:.3g}"


def check(got, eager, exact, what, low_precision):
    """Same None-ness, shape and dtype as eager; numerics by the input dtype's rule."""
    assert (got is None) == (eager is None), f"{what}: kernel gives {got is not None}, eager {eager is not None}"
    if got is None:
        return
    assert got.shape == eager.shape and got.dtype == eager.dtype, (
        f"{what}: kernel {tuple(got.shape)} {got.dtype}, eager {tuple(eager.shape)} {eager.dtype}")
    if low_precision:
        assert_no_worse_than_eager(got, eager, exact, what)
    else:
        assert_fp32_close(got, exact, what)


def make(shape, k, dtype, affine, seed=0):
    g = torch.Generator().manual_seed(seed)
    ns = list(shape[len(shape) - k:])

    def rnd(*s, scale=1.0, shift=0.0):
        return (torch.randn(*s, generator=g, dtype=torch.float64) * scale + shift).to(dtype).to(DEVICE)

    x = rnd(*shape, scale=3.0, shift=0.5)  # an offset mean exercises the centred variance
    dy = rnd(*shape)
    w = rnd(*ns, scale=0.5, shift=1.0) if "w" in affine else None
    b = rnd(*ns) if "b" in affine else None
    return x, dy, ns, w, b


def d(t):
    return None if t is None else t.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("affine", ["wb", "w", ""], ids=["w_b", "w", "none"])
@pytest.mark.parametrize("shape,k", SHAPES, ids=[f"{s}_{k}" for s, k in SHAPES])
def test_layer_norm(shape, k, dtype, affine):
    x, dy, ns, w, b = make(shape, k, dtype, affine)
    eps = 1e-5
    got = nk.layer_norm_forward(x, ns, w, b, eps)
    eager = aten.native_layer_norm.default(x, ns, w, b, eps)
    exact = aten.native_layer_norm.default(d(x), ns, d(w), d(b), eps)
    for name, g_, e_, x_ in zip(("out", "mean", "rstd"), got, eager, exact):
        check(g_, e_, x_, f"layer_norm_forward {name}", dtype != torch.float32)

    # Backward from eager's own statistics, every output asked for that exists.
    mean, rstd = eager[1], eager[2]
    mask = [True, w is not None, b is not None]
    got = nk.layer_norm_backward(dy, x, ns, mean, rstd, w, b, mask)
    eager = aten.native_layer_norm_backward.default(dy, x, ns, mean, rstd, w, b, mask)
    exact = aten.native_layer_norm_backward.default(d(dy), d(x), ns, d(mean), d(rstd), d(w), d(b), mask)
    for name, g_, e_, x_ in zip(("grad_input", "grad_weight", "grad_bias"), got, eager, exact):
        check(g_, e_, x_, f"layer_norm_backward {name}", dtype != torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("affine", ["w", ""], ids=["w", "none"])
@pytest.mark.parametrize("shape,k", SHAPES, ids=[f"{s}_{k}" for s, k in SHAPES])
def test_rms_norm(shape, k, dtype, affine):
    x, dy, ns, w, _ = make(shape, k, dtype, affine)
    got = nk.rms_norm_forward(x, ns, w, None)  # eps=None: torch's default
    eager = aten._fused_rms_norm.default(x, ns, w, None)
    exact = aten._fused_rms_norm.default(d(x), ns, d(w), torch.finfo(torch.float32).eps)
    for name, g_, e_, x_ in zip(("out", "rstd"), got, eager, exact):
        check(g_, e_, x_, f"rms_norm_forward {name}", dtype != torch.float32)

    rstd = eager[1]
    mask = [True, w is not None]
    got = nk.rms_norm_backward(dy, x, ns, rstd, w, mask)
    eager = _eager_rms_backward(dy, x, ns, rstd, w, mask)
    exact = _eager_rms_backward(d(dy), d(x), ns, d(rstd), d(w), mask)
    for name, g_, e_, x_ in zip(("grad_input", "grad_weight"), got, eager, exact):
        check(g_, e_, x_, f"rms_norm_backward {name}", dtype != torch.float32)


def test_layer_norm_centred_variance():
    """Rows far from zero mean (1000 + N(0, 1)): a one-pass E[x^2] - E[x]^2 in fp32
    would get the variance ~30% wrong; the kernel's rstd stays at fp32 accuracy."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(41, 341, generator=g, dtype=torch.float64) + 1000).float().to(DEVICE)
    got = nk.layer_norm_forward(x, [341], None, None, 1e-5)
    eager = aten.native_layer_norm.default(x, [341], None, None, 1e-5)
    exact = aten.native_layer_norm.default(x.double(), [341], None, None, 1e-5)
    assert_fp32_close(got[2], exact[2], "rstd")
    assert_no_worse_than_eager(got[0], eager[0], exact[0], "out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_norm_backward_every_output_mask(dtype):
    """Each mask gives None exactly where aten does and, elsewhere, bitwise the all-true values."""
    x, dy, ns, w, b = make((41, 341), 1, dtype, "wb", seed=1)
    _, mean, rstd = aten.native_layer_norm.default(x, ns, w, b, 1e-5)
    full = nk.layer_norm_backward(dy, x, ns, mean, rstd, w, b, [True, True, True])
    for mask in itertools.product([False, True], repeat=3):
        got = nk.layer_norm_backward(dy, x, ns, mean, rstd, w, b, list(mask))
        eager = aten.native_layer_norm_backward.default(dy, x, ns, mean, rstd, w, b, list(mask))
        for g_, e_, f_ in zip(got, eager, full):
            assert (g_ is None) == (e_ is None), mask
            if g_ is not None:
                assert g_.dtype == e_.dtype and torch.equal(g_, f_), mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_backward_every_output_mask(dtype):
    x, dy, ns, w, _ = make((41, 341), 1, dtype, "w", seed=2)
    _, rstd = aten._fused_rms_norm.default(x, ns, w, None)
    full = nk.rms_norm_backward(dy, x, ns, rstd, w, [True, True])
    for mask in itertools.product([False, True], repeat=2):
        got = nk.rms_norm_backward(dy, x, ns, rstd, w, list(mask))
        eager = _eager_rms_backward(dy, x, ns, rstd, w, list(mask))
        for g_, e_, f_ in zip(got, eager, full):
            assert (g_ is None) == (e_ is None), mask
            if g_ is not None:
                assert g_.dtype == e_.dtype and torch.equal(g_, f_), mask


def test_missing_parameters_give_no_gradient():
    """As aten's meta functions: no weight (bias), no grad_weight (grad_bias), whatever the mask."""
    x, dy, ns, _, _ = make((9, 41), 1, torch.float32, "")
    _, mean, rstd = aten.native_layer_norm.default(x, ns, None, None, 1e-5)
    dx, dw, db = nk.layer_norm_backward(dy, x, ns, mean, rstd, None, None, [True, True, True])
    assert dx is not None and dw is None and db is None
    _, rstd = aten._fused_rms_norm.default(x, ns, None, None)
    dx, dw = nk.rms_norm_backward(dy, x, ns, rstd, None, [True, True])
    assert dx is not None and dw is None


def test_mixed_dtypes_follow_aten():
    """bf16 activations with fp32 parameters (and the reverse) get aten's output dtypes."""
    for xd, pd in [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]:
        x = torch.randn(9, 41, dtype=xd, device=DEVICE)
        w = torch.randn(41, dtype=pd, device=DEVICE)
        b = torch.randn(41, dtype=pd, device=DEVICE)
        got = nk.layer_norm_forward(x, [41], w, b, 1e-5)
        # meta is what a traced graph records; aten's CPU kernel refuses fp32
        # input with low-precision parameters, so only meta speaks for that case.
        meta = aten.native_layer_norm.default(x.to("meta"), [41], w.to("meta"), b.to("meta"), 1e-5)
        assert [t.dtype for t in got] == [t.dtype for t in meta]
        grads = nk.layer_norm_backward(x, x, [41], got[1], got[2], w, b, [True, True, True])
        assert [t.dtype for t in grads] == [xd, pd, pd]
        out, rstd = nk.rms_norm_forward(x, [41], w, None)
        assert (out.dtype, rstd.dtype) == (xd, torch.float32)
        meta = decomposition_table[aten._fused_rms_norm_backward.default](
            x.to("meta"), x.to("meta"), [41], rstd.to("meta"), w.to("meta"), [True, True])
        grads = nk.rms_norm_backward(x, x, [41], rstd, w, [True, True])
        assert [t.dtype for t in grads] == [t.dtype for t in meta]


def test_rms_eps_default_is_fp32_epsilon():
    """Tiny inputs, where eps is most of mean(x^2): None must mean finfo(float32).eps, as torch does."""
    x = (torch.randn(9, 41, dtype=torch.float64) * 3e-4).to(torch.bfloat16).to(DEVICE)
    got, _ = nk.rms_norm_forward(x, [41], None, None)
    eager, _ = aten._fused_rms_norm.default(x, [41], None, None)
    by_dtype, _ = nk.rms_norm_forward(x, [41], None, torch.finfo(torch.bfloat16).eps)
    assert (got.float() - eager.float()).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps
    assert (by_dtype.float() - eager.float()).abs().max() > 0.1


def test_no_rows():
    x = torch.randn(0, 41, device=DEVICE)
    w, b = torch.randn(41, device=DEVICE), torch.randn(41, device=DEVICE)
    out, mean, rstd = nk.layer_norm_forward(x, [41], w, b, 1e-5)
    assert out.shape == (0, 41) and mean.shape == rstd.shape == (0, 1)
    dx, dw, db = nk.layer_norm_backward(x, x, [41], mean, rstd, w, b, [True, True, True])
    assert dx.shape == (0, 41) and torch.equal(dw, torch.zeros(41, device=DEVICE)) and torch.equal(db, dw)


def test_partial_sums_over_many_programs():
    """The second-stage reduction over G > BLOCK_G (128) rows of partials (on CPU G stays small)."""
    part = torch.randn(2, 300, 341, dtype=torch.float32, device=DEVICE)
    out0 = torch.empty(341, dtype=torch.bfloat16, device=DEVICE)
    out1 = torch.empty(341, dtype=torch.float32, device=DEVICE)
    nk._reduce_partials(part[0], part[1], out0, out1)
    torch.testing.assert_close(out1, part[1].sum(0), rtol=1e-5, atol=1e-5)
    assert_no_worse_than_eager(out0, part[0].sum(0).to(torch.bfloat16), part[0].double().sum(0), "dw partials")


def test_bad_inputs_raise():
    x = torch.randn(9, 41, device=DEVICE)
    w = torch.randn(41, device=DEVICE)
    cases = [
        ("not contiguous", lambda: nk.layer_norm_forward(torch.randn(41, 9, device=DEVICE).t(), [41], w, None, 1e-5)),
        ("not the trailing dims", lambda: nk.layer_norm_forward(x, [9], None, None, 1e-5)),
        ("not the trailing dims", lambda: nk.rms_norm_forward(x, [], None, None)),
        ("wider than", lambda: nk.rms_norm_forward(torch.zeros(2, nk.MAX_COLS + 1, device=DEVICE),
                                                   [nk.MAX_COLS + 1], None, None)),
        ("dtype", lambda: nk.layer_norm_forward(x.double(), [41], None, None, 1e-5)),
        ("weight shape", lambda: nk.layer_norm_forward(x, [41], torch.randn(40, device=DEVICE), None, 1e-5)),
        ("grad_out shape", lambda: nk.rms_norm_backward(x[:3], x, [41], torch.ones(9, 1, device=DEVICE),
                                                        None, [True, False])),
        ("one per row", lambda: nk.layer_norm_backward(x, x, [41], torch.zeros(8, 1, device=DEVICE),
                                                       torch.ones(8, 1, device=DEVICE), w, None, [True] * 3)),
    ]
    for message, call in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert nk.unsupported_reason(x, [41], w) is None


def test_registered_with_reference_and_source():
    x, dy, ns, w, b = make((9, 41), 1, torch.float32, "wb")
    for name in ("layer_norm_forward", "layer_norm_backward", "rms_norm_forward", "rms_norm_backward"):
        assert "@triton.jit" in kernel_source(name) and KERNELS[name].what
    ln, lnb = KERNELS["layer_norm_forward"], KERNELS["layer_norm_backward"]
    out, mean, rstd = ln.launch(x, ns, w, b, 1e-5)
    for got, ref in zip(lnb.launch(dy, x, ns, mean, rstd, w, b, [True] * 3),
                        lnb.reference(dy, x, ns, mean, rstd, w, b, [True] * 3)):
        assert_fp32_close(got, ref, "layer_norm_backward vs its reference")
    rms, rmsb = KERNELS["rms_norm_forward"], KERNELS["rms_norm_backward"]
    for got, ref in zip(rms.launch(x, ns, w, 1e-6), rms.reference(x, ns, w, 1e-6)):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert_fp32_close(got, ref, "rms_norm_forward vs its reference")
    rstd = rms.launch(x, ns, w, 1e-6)[1]
    for got, ref in zip(rmsb.launch(dy, x, ns, rstd, w, [True, True]), rmsb.reference(dy, x, ns, rstd, w, [True, True])):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert_fp32_close(got, ref, "rms_norm_backward vs its reference")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("affine", ["wb", ""], ids=["w_b", "none"])
@pytest.mark.parametrize("shape,k", SHAPES, ids=[f"{s}_{k}" for s, k in SHAPES])
def test_add_layer_norm_is_the_add_then_the_norm(shape, k, dtype, affine):
    """The residual add and the LayerNorm in one kernel: the sum bitwise
    aten's add (rounded to nearest even before the norm reads it), the norm's
    outputs bitwise the LayerNorm kernel's on that sum (whose accuracy
    test_layer_norm judges)."""
    gen = torch.Generator().manual_seed(sum(shape) + k)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype).to(DEVICE)
    r = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    norm = list(shape[-k:])
    w = (torch.randn(norm, generator=gen) + 1).to(dtype).to(DEVICE) if affine else None
    b = torch.randn(norm, generator=gen).to(dtype).to(DEVICE) if affine else None
    s, out, mean, rstd = nk.add_layer_norm_forward(x, r, norm, w, b, 1e-5)
    want_s = x + r
    assert torch.equal(s, want_s)
    for got, want in zip((out, mean, rstd), nk.layer_norm_forward(want_s, norm, w, b, 1e-5)):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(nk._add_layer_norm_forward_reference(x, r, norm, w, b, 1e-5)[:1], (s,)))


def test_add_layer_norm_refuses_mismatched_addends():
    x = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="residual shape"):
        nk.add_layer_norm_forward(x, torch.zeros(4, 9, device=DEVICE), [8], None, None, 1e-5)
    with pytest.raises(ValueError, match="must match"):
        nk.add_layer_norm_forward(x, torch.zeros(4, 8, dtype=torch.bfloat16, device=DEVICE), [8], None, None, 1e-5)
    assert "HAS_R" in kernel_source("add_layer_norm_forward")  # the LayerNorm kernel, with its residual add


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,k", SHAPES, ids=[f"{s}_{k}" for s, k in SHAPES])
def test_layer_norm_backward_adds_the_residual_gradient_as_apart(shape, k, dtype):
    """``residual_grad``: grad_input + residual_grad written at once is
    bitwise the backward's grad_input then aten's add (dx rounded first),
    the weight and bias gradients unchanged."""
    gen = torch.Generator().manual_seed(sum(shape) + 7 * k)
    x = (torch.randn(shape, generator=gen) * 2).to(dtype).to(DEVICE)
    dy = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    r = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    norm = list(shape[-k:])
    w = (torch.randn(norm, generator=gen) + 1).to(dtype).to(DEVICE)
    b = torch.randn(norm, generator=gen).to(dtype).to(DEVICE)
    _, mean, rstd = nk.layer_norm_forward(x, norm, w, b, 1e-5)
    dx, dw, db = nk.layer_norm_backward(dy, x, norm, mean, rstd, w, b, [True, True, True])
    fused = nk.layer_norm_backward(dy, x, norm, mean, rstd, w, b, [True, True, True], residual_grad=r)
    for got, want in zip(fused, (r + dx, dw, db)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="residual_grad"):
        nk.layer_norm_backward(dy, x, norm, mean, rstd, w, b, [False, True, True], residual_grad=r)


@pytest.mark.parametrize("dtype,residual", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True),
                                            (torch.float16, False)], ids=["fp32", "fp32_residual", "bf16_residual", "fp16"])
@pytest.mark.parametrize("shape,k", SHAPES, ids=[f"{s}_{k}" for s, k in SHAPES])
def test_layer_norm_backward_sums_its_grad_input(shape, k, dtype, residual):
    """``grad_input_sum``: a fourth result, the column sum of grad_input as
    returned (the bias gradient of the layer it flows into): within fp32
    summation error of summing the returned grad_input, then one rounding;
    the other results bitwise those without it."""
    gen = torch.Generator().manual_seed(sum(shape) + 11 * k)
    x = (torch.randn(shape, generator=gen) * 2).to(dtype).to(DEVICE)
    dy = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    r = torch.randn(shape, generator=gen).to(dtype).to(DEVICE) if residual else None
    norm = list(shape[-k:])
    w = (torch.randn(norm, generator=gen) + 1).to(dtype).to(DEVICE)
    b = torch.randn(norm, generator=gen).to(dtype).to(DEVICE)
    _, mean, rstd = nk.layer_norm_forward(x, norm, w, b, 1e-5)
    apart = nk.layer_norm_backward(dy, x, norm, mean, rstd, w, b, [True, True, True], residual_grad=r)
    n = apart[0].shape[-1] if k == 1 else apart[0][0].numel()
    flat = apart[0].reshape(-1, n)
    for keep in ("keepdim", "flat"):
        fused = nk.layer_norm_backward(dy, x, norm, mean, rstd, w, b, [True, True, True], residual_grad=r,
                                       grad_input_sum=keep)
        assert len(fused) == 4
        for got, want in zip(fused[:3], apart):
            assert torch.equal(got, want)
        total = fused[3]
        want = flat.double().sum(0, keepdim=keep == "keepdim")
        assert total.shape == want.shape and total.dtype == dtype
        slack = 4 * EPS32 * flat.double().abs().sum(0, keepdim=keep == "keepdim") + torch.finfo(dtype).eps * want.abs()
        assert ((total.double() - want).abs() <= slack).all(), (total.double() - want).abs().max()
    reference = KERNELS["layer_norm_backward"].reference(dy, x, norm, mean, rstd, w, b, [True, True, True],
                                                         residual_grad=r, grad_input_sum="flat")
    assert len(reference) == 4 and reference[3].shape == (n,)
    with pytest.raises(ValueError, match="grad_input_sum"):
        nk.layer_norm_backward(dy, x, norm, mean, rstd, w, b, [False, True, True], grad_input_sum="flat")
    with pytest.raises(ValueError, match="grad_input_sum"):
        nk.layer_norm_backward(dy, x, norm, mean, rstd, w, b, [True, True, True], grad_input_sum="rows")


EPS32 = torch.finfo(torch.float32).eps


def test_rms_norm_an_fp32_weight_of_a_16_bit_input_gets_an_fp32_gradient():
    """Gemma multiplies the normalized fp32 value by ``1 + weight`` in fp32
    before the cast: the kernels take the fp32 weight, round the output
    once, and give the weight's gradient in fp32 (``grad_weight_dtype``)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 7, 40, generator=g).to(DEVICE, torch.bfloat16)
    dy = torch.randn(6, 7, 40, generator=g).to(DEVICE, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(DEVICE)
    out, rstd = nk.rms_norm_forward(x, [40], w, 1e-6)
    ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double())
    assert out.dtype == torch.bfloat16 and torch.allclose(out.double(), ref, rtol=8e-3, atol=1e-3)
    dx, dw = nk.rms_norm_backward(dy, x, [40], rstd, w, [True, True], torch.float32)
    ref_dx, ref_dw = nk._rms_norm_backward_reference(dy, x, [40], rstd, w, [True, True], torch.float32)
    assert dw.dtype == torch.float32 and dx.dtype == torch.bfloat16
    assert torch.allclose(dw, ref_dw, rtol=1e-5, atol=1e-5)
    assert torch.allclose(dx.float(), ref_dx.float(), rtol=8e-3, atol=1e-2)
