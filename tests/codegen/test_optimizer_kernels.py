"""adam_update / sgd_update: the Triton kernels against their eager references and torch.optim.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1). The references are checked bitwise against torch's
single-tensor optimizers; the kernels to a few fp32 ulps (rtol 1e-6): they
fuse multiply-adds where torch's CUDA kernels do and multiply by the
reciprocal of sqrt(bias_correction2) as torch's CUDA division by a scalar does,
while torch on CPU rounds some of those steps differently.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from stepfx.codegen import KERNELS, kernel_source
from stepfx.codegen.optimizer_kernels import adam_update, adam_update_reference, sgd_update, sgd_update_reference

# The kernels compiled for real where there is a GPU (the comparisons are then
# with torch's CUDA optimizers), in the interpreter on CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(9,), (41,), (341,), (4231,), (37, 113)]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STEPS = 3
# Kernel vs torch after each of 3 steps, values of order 1 (p, m) and 1e-3 (v):
# measured at most ~2.3 ulp of (|x| + lr) on p, 5 ulp on m near 0, 2 ulp on v.
TOL = dict(rtol=1e-6, atol=1e-7)
TOL_V = dict(rtol=1e-6, atol=1e-12)


def _grads(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(STEPS)]


def _run_adam_vs_torch(shape, grad_dtype, *, decoupled, weight_decay, maximize, grad_factor,
                       betas=(0.9, 0.999), lr=1e-2, eps=1e-8, inplace=False):
    """STEPS steps of the kernel, the reference and torch.optim.Adam/AdamW(foreach=False)."""
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(shape, generator=gen).to(DEVICE)
    torch_p = p0.clone().requires_grad_()
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([torch_p], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize, foreach=False)
    factor = None if grad_factor is None else torch.tensor(grad_factor, device=DEVICE)
    k = (p0.clone(), torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE))
    r = (p0.clone(), torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE))
    hyper = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay, decoupled=decoupled,
                 maximize=maximize, grad_factor=factor)
    for step, g in enumerate(_grads(shape, grad_dtype, 2), start=1):
        # torch.optim takes the fp32 gradient already multiplied by the factor
        # (as GradScaler.unscale_ and clip_grad_norm_ leave it).
        torch_p.grad = g.float() if factor is None else g.float() * factor
        opt.step()
        k = adam_update(*k[:1], g, *k[1:], step=float(step), inplace=inplace, **hyper)
        r = adam_update_reference(*r[:1], g, *r[1:], step=float(step), **hyper)
        state = opt.state[torch_p]
        want = (torch_p.detach(), state["exp_avg"], state["exp_avg_sq"])
        for name, ref, got, exp, tol in zip(("param", "exp_avg", "exp_avg_sq"), r, k, want, (TOL, TOL, TOL_V)):
            assert torch.equal(ref, exp), f"reference {name} differs from torch at step {step}"
            torch.testing.assert_close(got, exp, **tol, msg=lambda m: f"kernel {name}, step {step}: {m}")


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("decoupled,weight_decay,maximize,grad_factor",
                         list(itertools.product([True, False], [0.0, 0.1], [False, True], [None, 0.37])))
def test_adam_flags_vs_torch(grad_dtype, decoupled, weight_decay, maximize, grad_factor):
    _run_adam_vs_torch((341,), grad_dtype, decoupled=decoupled, weight_decay=weight_decay, maximize=maximize,
                       grad_factor=grad_factor)


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_adam_shapes_vs_torch(shape, grad_dtype):
    _run_adam_vs_torch(shape, grad_dtype, decoupled=True, weight_decay=0.01, maximize=False, grad_factor=0.37,
                       inplace=True)


def test_adam_large_lerp_weight_vs_torch():
    # 1 - beta1 >= 0.5 takes torch.lerp's other formula.
    _run_adam_vs_torch((4231,), torch.float32, decoupled=False, weight_decay=0.0, maximize=False, grad_factor=None,
                       betas=(0.3, 0.9))


def _adam_inputs(n=4231, grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(grad_dtype)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 1e-3
    return tuple(t.to(DEVICE) for t in (p, g, m, v))


ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=7.0, decoupled=True)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on the skipped inf gradient
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("flag", [torch.tensor(True), torch.tensor(1.0), torch.tensor(float("inf")),
                                  torch.tensor(float("nan"))], ids=["bool", "one", "inf", "nan"])
def test_adam_found_inf_writes_nothing(flag, inplace):
    p, g, m, v = _adam_inputs()
    g[17] = float("inf")  # the overflow found_inf reports: it must not leak into the state
    before = [t.clone() for t in (p, m, v)]
    flag = flag.to(DEVICE)
    out = adam_update(p, g, m, v, **ADAM, grad_factor=torch.tensor(0.5, device=DEVICE), found_inf=flag, inplace=inplace)
    ref = adam_update_reference(*(t.clone() for t in (p, g, m, v)), **ADAM, grad_factor=torch.tensor(0.5, device=DEVICE),
                                found_inf=flag)
    for got, r, old, given in zip(out, ref, before, (p, m, v)):
        assert torch.equal(got, old) and torch.equal(r, old)
        assert torch.equal(given, old)
        assert (got is given) == inplace


@pytest.mark.parametrize("flag", [torch.tensor(False), torch.tensor(0.0)], ids=["bool", "float"])
def test_adam_found_inf_zero_updates(flag):
    p, g, m, v = _adam_inputs()
    flag = flag.to(DEVICE)
    plain = adam_update(p, g, m, v, **ADAM)
    flagged = adam_update(p, g, m, v, **ADAM, found_inf=flag)
    for a, b, old in zip(flagged, plain, (p, m, v)):
        assert torch.equal(a, b) and not torch.equal(a, old)


def test_adam_inplace_and_out_of_place():
    p, g, m, v = _adam_inputs(grad_dtype=torch.bfloat16)
    given = (p, g, m, v)
    before = [t.clone() for t in given]
    out = adam_update(*given, **ADAM)
    assert all(a is not b for a, b in zip(out, (p, m, v)))
    assert all(torch.equal(t, b) for t, b in zip(given, before)), "out-of-place changed an input"
    out_inplace = adam_update(*given, **ADAM, inplace=True)
    assert all(a is b for a, b in zip(out_inplace, (p, m, v)))
    assert torch.equal(g, before[1]), "grad changed"
    for a, b in zip(out_inplace, out):
        assert torch.equal(a, b)


def test_adam_empty():
    e = torch.empty(0, device=DEVICE)
    out = adam_update(e, e, e, e, **ADAM)
    assert all(t.numel() == 0 for t in out)


def _bad_adam_cases():
    p, g, m, v = _adam_inputs(n=64)
    yield "param has dtype torch.float16", (p.half(), g, m, v), {}
    yield "grad has dtype torch.int64", (p, g.long(), m, v), {}
    yield "exp_avg has 63 elements", (p, g, m[:63], v), {}
    yield "exp_avg_sq is not contiguous", (p.view(8, 8), g, m, v.view(8, 8).t()), {}
    yield "grad must be a torch.Tensor", (p, None, m, v), {}
    yield "grad_factor has dtype torch.float64", (p, g, m, v), {"grad_factor": torch.tensor(1.0, dtype=torch.float64, device=DEVICE)}
    yield "found_inf has dtype torch.int32", (p, g, m, v), {"found_inf": torch.tensor(0, dtype=torch.int32, device=DEVICE)}
    yield "found_inf has 2 elements", (p, g, m, v), {"found_inf": torch.zeros(2, device=DEVICE)}
    yield "step must be >= 1", (p, g, m, v), {"step": 0.0}


@pytest.mark.parametrize("fn", [adam_update, adam_update_reference], ids=["kernel", "reference"])
def test_adam_bad_input(fn):
    for message, args, extra in _bad_adam_cases():
        with pytest.raises(ValueError, match=message):
            fn(*args, **{**ADAM, **extra})


# --------------------------------------------------------------------------- SGD

SGD_CASES = [
    # momentum, dampening, nesterov, weight_decay, maximize, grad_factor
    (0.0, 0.0, False, 0.0, False, None),
    (0.0, 0.0, False, 0.01, True, 0.37),
    (0.9, 0.0, False, 0.0, False, None),
    (0.9, 0.1, False, 0.01, False, 0.37),
    (0.9, 0.0, True, 0.01, True, None),
    (0.5, 0.0, True, 0.0, False, 0.37),
]


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("momentum,dampening,nesterov,weight_decay,maximize,grad_factor", SGD_CASES)
def test_sgd_vs_torch(momentum, dampening, nesterov, weight_decay, maximize, grad_factor, grad_dtype):
    shape, lr = (4231,), 0.05
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(shape, generator=gen).to(DEVICE)
    torch_p = p0.clone().requires_grad_()
    opt = torch.optim.SGD([torch_p], lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
                          weight_decay=weight_decay, maximize=maximize, foreach=False)
    factor = None if grad_factor is None else torch.tensor(grad_factor, device=DEVICE)
    hyper = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                 maximize=maximize, grad_factor=factor)
    k = r = None
    for step, g in enumerate(_grads(shape, grad_dtype, 2) + _grads(shape, grad_dtype, 5)):
        torch_p.grad = g.float() if factor is None else g.float() * factor
        opt.step()
        buf = opt.state[torch_p].get("momentum_buffer")
        if step == 0:
            # torch's first step creates the buffer; the kernels start from that steady state
            k = r = (torch_p.detach().clone(), None if buf is None else buf.clone())
            continue
        k = sgd_update(k[0], g, k[1], **hyper, inplace=step % 2 == 0)
        r = sgd_update_reference(r[0], g, r[1], **hyper)
        assert torch.equal(r[0], torch_p.detach()), f"reference param differs from torch at step {step}"
        torch.testing.assert_close(k[0], torch_p.detach(), **TOL)
        if momentum == 0:
            assert k[1] is None and r[1] is None
        else:
            assert torch.equal(r[1], buf), f"reference momentum buffer differs from torch at step {step}"
            torch.testing.assert_close(k[1], buf, **TOL)


SGD = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True)


@pytest.mark.parametrize("inplace", [False, True])
def test_sgd_found_inf(inplace):
    p, g, buf, _ = _adam_inputs(grad_dtype=torch.float16)
    before = (p.clone(), buf.clone())
    for flag, changes in ((torch.tensor(True, device=DEVICE), False), (torch.tensor(0.0, device=DEVICE), True)):
        out = sgd_update(p, g, buf, **SGD, found_inf=flag, inplace=inplace)
        for got, old, given in zip(out, before, (p, buf)):
            assert torch.equal(got, old) != changes
            assert (got is given) == inplace
            assert torch.equal(given, old) != (changes and inplace)


def test_int_hyperparameters_are_floats():
    # Ints would reach Triton as integer arguments (and 1 as a constant): the launchers convert them.
    p, g, buf, v = _adam_inputs()
    sgd_ints = dict(lr=1, momentum=1, dampening=0, weight_decay=0, nesterov=False)
    sgd_floats = {k: float(x) if k != "nesterov" else x for k, x in sgd_ints.items()}
    for a, b in zip(sgd_update(p, g, buf, **sgd_ints), sgd_update(p, g, buf, **sgd_floats)):
        assert torch.equal(a, b)
    adam_ints = dict(lr=1, beta1=0, beta2=0, eps=1, weight_decay=0, step=1, decoupled=True)
    adam_floats = {k: float(x) if k != "decoupled" else x for k, x in adam_ints.items()}
    for a, b in zip(adam_update(p, g, buf, v, **adam_ints), adam_update(p, g, buf, v, **adam_floats)):
        assert torch.equal(a, b)


def test_sgd_bad_input():
    p, g, buf, _ = _adam_inputs(n=64)
    cases = [
        ("momentum_buffer is None but momentum != 0", (p, g, None), {}),
        ("momentum_buffer given but momentum == 0", (p, g, buf), {"momentum": 0.0, "nesterov": False}),
        ("momentum_buffer has dtype torch.bfloat16", (p, g, buf.bfloat16()), {}),
        ("grad has 32 elements", (p, g[:32], buf), {}),
        ("found_inf is on", (p, g, buf), {"found_inf": torch.zeros((), device="meta")}),
    ]
    for fn in (sgd_update, sgd_update_reference):
        for message, args, extra in cases:
            with pytest.raises(ValueError, match=message):
                fn(*args, **{**SGD, **extra})


def test_registered():
    for name, ref in (("adam_update", adam_update_reference), ("sgd_update", sgd_update_reference)):
        kernel = KERNELS[name]
        assert kernel.reference is ref and kernel.what
        assert "@triton.jit" in kernel_source(name) and "tl.fma" in kernel_source(name)
    assert KERNELS["adam_update"].launch is adam_update and KERNELS["sgd_update"].launch is sgd_update


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_adam_cuda_vs_torch(grad_dtype):
    """Compiled on the GPU, against torch's CUDA single-tensor AdamW, found_inf on the device."""
    n = 1 << 20
    gen = torch.Generator().manual_seed(0)
    p, m = torch.randn(n, generator=gen).cuda(), torch.zeros(n, device="cuda")
    v = torch.zeros(n, device="cuda")
    torch_p = p.clone().requires_grad_()
    opt = torch.optim.AdamW([torch_p], lr=1e-3, weight_decay=0.01, foreach=False)
    factor = torch.tensor(0.37, device="cuda")
    for step in range(1, 4):
        g = torch.randn(n, generator=gen).to(grad_dtype).cuda()
        torch_p.grad = g.float() * factor
        opt.step()
        p, m, v = adam_update(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                              step=float(step), decoupled=True, grad_factor=factor,
                              found_inf=torch.zeros((), device="cuda"))
        state = opt.state[torch_p]
        torch.testing.assert_close(p, torch_p.detach(), **TOL)
        torch.testing.assert_close(m, state["exp_avg"], **TOL)
        torch.testing.assert_close(v, state["exp_avg_sq"], **TOL_V)
    skipped = adam_update(p, g, m, v, **ADAM, found_inf=torch.ones((), dtype=torch.bool, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(skipped, (p, m, v)))


@pytest.mark.parametrize("step", [1.0, 7.0, 1234.0])
def test_adam_device_scalars_equal_the_host_path(step):
    """The step count as a 0-d tensor (on the device under fp16 loss scaling):
    the step size and bias correction computed from it in fp64 and read by
    the kernel give the same bits as the host path's Python doubles."""
    from stepfx.codegen.optimizer_kernels import adam_device_scalars

    p, g, m, v = _adam_inputs(grad_dtype=torch.bfloat16)
    hyper = {k: x for k, x in ADAM.items() if k != "step"}
    scalars = adam_device_scalars(torch.tensor(step, device=DEVICE), lr=hyper["lr"], beta1=hyper["beta1"],
                                  beta2=hyper["beta2"])
    assert scalars.dtype == torch.float32 and scalars.shape == (2,) and scalars.device == p.device
    host = adam_update(p, g, m, v, **hyper, step=step)
    device = adam_update(p, g, m, v, **hyper, step=None, device_scalars=scalars)
    for a, b in zip(device, host):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="device_scalars has 3 elements"):
        adam_update(p, g, m, v, **hyper, step=None, device_scalars=torch.zeros(3, device=DEVICE))


@pytest.mark.parametrize("iters", [1, 2])
@pytest.mark.parametrize("variant", ["plain", "factor-and-flag", "flag-set", "device-scalars"])
def test_adam_many_equals_one_call_per_tensor(variant, iters, monkeypatch):
    """One launch for many tensors (odd sizes, fp32 and bf16 gradients, an
    empty one): bit-identical to adam_update on each in turn, with one block
    per program and with chunks of two blocks (4231 elements: a full chunk
    and a partial one; 2049: one chunk, its second block one element long)."""
    from stepfx.codegen import optimizer_kernels
    from stepfx.codegen.optimizer_kernels import adam_device_scalars, adam_update_many

    monkeypatch.setattr(optimizer_kernels, "MANY_ITERS", iters)

    gen = torch.Generator().manual_seed(5)
    shapes = [(9,), (41, 3), (4231,), (0,), (2048,), (2049,)]
    dtypes = [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, torch.float16]
    tensors = []
    for shape, dtype in zip(shapes, dtypes):
        p, m = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen) * 0.1
        v, g = torch.rand(shape, generator=gen) * 1e-3, torch.randn(shape, generator=gen).to(dtype)
        tensors.append(tuple(t.to(DEVICE) for t in (p, g, m, v)))
    hyper = {k: x for k, x in ADAM.items()}
    if variant in ("factor-and-flag", "flag-set"):
        hyper["grad_factor"] = torch.tensor(0.37, device=DEVICE)
        hyper["found_inf"] = torch.tensor(variant == "flag-set", device=DEVICE)
    if variant == "device-scalars":
        hyper["device_scalars"] = adam_device_scalars(torch.tensor(hyper["step"], device=DEVICE), lr=hyper["lr"],
                                                      beta1=hyper["beta1"], beta2=hyper["beta2"])
        hyper["step"] = None
    singles = [tuple(t.clone() for t in group) for group in tensors]
    for p, g, m, v in singles:
        adam_update(p, g, m, v, inplace=True, **hyper)
    many = [tuple(t.clone() for t in group) for group in tensors]
    params, grads, ms, vs = (list(x) for x in zip(*many))
    adam_update_many(params, grads, ms, vs, **hyper)
    for (p, _, m, v), (sp, _, sm, sv), (p0, _, m0, v0) in zip(many, singles, tensors):
        assert torch.equal(p, sp) and torch.equal(m, sm) and torch.equal(v, sv)
        assert torch.equal(p, p0) == (variant == "flag-set" or p.numel() == 0)
    from stepfx.codegen import multi_tensor

    assert multi_tensor.FALLBACK is None  # the multi-tensor kernel ran, not the per-tensor fallback
    with pytest.raises(ValueError, match="grad #1 must be a contiguous tensor"):
        adam_update_many(params[:2], [grads[0], torch.zeros(41, 6, device=DEVICE)[:, ::2]], ms[:2], vs[:2], **hyper)


def test_adam_many_falls_back_to_one_launch_per_tensor(monkeypatch):
    """A Triton that cannot build the multi-tensor kernel: the same bits from
    the one-tensor kernel, and the reason is kept."""
    from stepfx.codegen import multi_tensor, optimizer_kernels
    from stepfx.codegen.optimizer_kernels import adam_update_many

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no inttoptr here")
            return launch

    monkeypatch.setattr(optimizer_kernels, "_adam_many_kernel", Broken())
    monkeypatch.setattr(multi_tensor, "FALLBACK", None)
    p, g, m, v = _adam_inputs(grad_dtype=torch.bfloat16)
    singles = [t.clone() for t in (p, m, v)]
    adam_update(singles[0], g, singles[1], singles[2], **ADAM, inplace=True)
    many = [t.clone() for t in (p, m, v)]
    adam_update_many([many[0]], [g], [many[1]], [many[2]], **ADAM)
    assert all(torch.equal(a, b) for a, b in zip(many, singles))
    assert "no inttoptr here" in multi_tensor.FALLBACK


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["plain", "flag-set", "fallback"])
def test_adam_many_writes_each_parameters_16bit_copy(copy_dtype, variant, monkeypatch):
    """``copies``: the kernel writes each updated parameter, rounded, into its
    copy (views of one flat buffer at aligned offsets, one parameter without a
    copy): the bits of ``param.to(dtype)`` after the update, the buffer's gaps
    untouched; a skipped step (found_inf) writes no copy either; the
    per-tensor fallback writes the same bits; the reference agrees."""
    from stepfx.codegen import multi_tensor
    from stepfx.codegen.optimizer_kernels import adam_update_many, adam_update_many_reference

    if variant == "fallback":
        monkeypatch.setattr(multi_tensor, "FALLBACK", "forced by the test")
    gen = torch.Generator().manual_seed(11)
    shapes, offsets = [(9,), (41, 3), (4231,), (2049,)], [0, 64, 192, 4480]
    groups = []
    for shape in shapes:
        p, m = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen) * 0.1
        v, g = torch.rand(shape, generator=gen) * 1e-3, torch.randn(shape, generator=gen).to(torch.bfloat16)
        groups.append([t.to(DEVICE) for t in (p, g, m, v)])
    buf = torch.full((6600,), 7.0, dtype=copy_dtype, device=DEVICE)  # 7.0 marks what nobody may write
    copies = [buf[o:o + torch.Size(s).numel()] for o, s in zip(offsets, shapes)]
    copies[2] = None
    hyper = dict(ADAM)
    if variant == "flag-set":
        hyper["found_inf"] = torch.tensor(True, device=DEVICE)
    params, grads, ms, vs = (list(x) for x in zip(*groups))
    before = [p.clone() for p in params]
    ref = [[t.clone() for t in grp] for grp in groups]
    ref_buf = buf.clone()
    ref_copies = [None if c is None else ref_buf[o:o + c.numel()] for c, o in zip(copies, offsets)]
    adam_update_many(params, grads, ms, vs, copies=copies, **hyper)
    adam_update_many_reference(*(list(x) for x in zip(*ref)), copies=ref_copies, **hyper)
    written = torch.zeros(buf.numel(), dtype=torch.bool, device=DEVICE)
    for p, p0, c, o, r in zip(params, before, copies, offsets, ref):
        assert torch.equal(p, p0) == (variant == "flag-set")
        torch.testing.assert_close(p, r[0], rtol=1e-6, atol=1e-7)
        if c is None:
            continue
        written[o:o + c.numel()] = True
        expected = p.reshape(-1).to(copy_dtype) if variant != "flag-set" else torch.full_like(c, 7.0)
        assert torch.equal(c, expected)
    assert bool((buf[~written] == 7.0).all())  # the gaps and the copy-less parameter's range
    assert (multi_tensor.FALLBACK is None) == (variant != "fallback")
    with pytest.raises(ValueError, match="copy #1 must be a contiguous tensor"):
        adam_update_many(params[:2], grads[:2], ms[:2], vs[:2], copies=[copies[0], buf[:200]], **ADAM)
    with pytest.raises(ValueError, match="copies must all be bfloat16 or all float16"):
        adam_update_many(params[:1], grads[:1], ms[:1], vs[:1], copies=[torch.empty(9, device=DEVICE)], **ADAM)
