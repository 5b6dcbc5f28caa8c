"""stepfx's Triton attention against an fp64 exact, next to eager SDPA's own error (Triton's interpreter on CPU,
fp16: its bf16 matrix products are wrong, so bf16 is refused there; on CUDA also bf16 and the GPT's sizes).

Tolerance (as the norm kernels'): the kernel's largest error against the fp64 exact is at most 2x eager fp16
SDPA's error against the same exact plus one fp16 ulp of the exact's largest magnitude, for the output and each
gradient. The lengths are chosen to leave partial blocks at both block sizes (64 and 128 rows), and the
inputs are also given as slices of one fused projection ([B, L, 3, H, D] memory) as the GPT step gives them."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from stepfx.codegen import KERNELS, available, kernel_source
from stepfx.codegen import attention_kernels as ak

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not available(DEVICE)[0], reason=available(DEVICE)[1])
FACTOR = 2.0


# bf16 where it can run (CUDA); D up to 128 there (the GPT's head size)
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
CASES = [(37, 16, True, False), (130, 32, True, True), (200, 16, True, True), (64, 16, False, False),
         (150, 32, False, True)] + ([(1000, 128, True, True), (333, 64, False, False), (2048, 128, True, False)]
                                    if DEVICE == "cuda" else [])


def _inputs(b, h, n, d, fused, gen, dtype=torch.float16):
    if fused:
        qkv = torch.randn(b, n, 3, h, d, generator=gen).to(DEVICE, dtype)
        return [qkv[:, :, i].transpose(1, 2) for i in range(3)]
    return [torch.randn(b, h, n, d, generator=gen).to(DEVICE, dtype) for _ in range(3)]


def _exact(q, k, v, grad, causal, scale):
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ v
    out.backward(grad.double())
    return out, q.grad, k.grad, v.grad


def _eager(q, k, v, grad, causal, scale):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    out.backward(grad)
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,d,causal,fused", CASES)
def test_forward_and_backward_are_no_worse_than_eager(n, d, causal, fused, dtype):
    """Eager is SDPA's own choice of kernel on the device (flash or cuDNN on CUDA, flash-for-CPU here)."""
    gen = torch.Generator().manual_seed(n * d)
    q, k, v = _inputs(2, 3, n, d, fused, gen, dtype)
    grad = torch.randn(2, 3, n, d, generator=gen).to(DEVICE, dtype)
    scale = 1.0 / math.sqrt(d) if n % 2 else 0.3
    out, lse = ak.attention_forward(q, k, v, causal, scale)
    ours = (out, *ak.attention_backward(grad, q, k, v, out, lse, causal, scale))
    exact = _exact(q, k, v, grad, causal, scale)
    eager = _eager(q, k, v, grad, causal, scale)
    for name, got, ref, e in zip(("output", "grad_query", "grad_key", "grad_value"), ours, exact, eager):
        assert got.shape == ref.shape and got.dtype == dtype
        err_k = (got.double() - ref).abs().max().item()
        err_e = (e.double() - ref).abs().max().item()
        ulp = torch.finfo(dtype).eps * ref.abs().max().item()
        assert err_k <= FACTOR * err_e + ulp, f"{name}: kernel error {err_k:.3g} > {FACTOR} x eager {err_e:.3g} + {ulp:.3g}"
    # base-2 log-sum-exp of each row's scaled scores
    s = q.double() @ k.double().transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1) / math.log(2), rtol=0, atol=1e-3)


@pytest.mark.parametrize("order", [(0, 2, 1, 3), (0, 1, 2, 3), (2, 0, 1, 3)])
def test_outputs_and_gradients_lie_in_the_memory_order_asked(order):
    gen = torch.Generator().manual_seed(1)
    q, k, v = _inputs(2, 2, 40, 16, False, gen)
    grad = torch.randn(2, 2, 40, 16, generator=gen).to(DEVICE, torch.float16)
    out, lse = ak.attention_forward(q, k, v, True, out_order=order)
    plain, _ = ak.attention_forward(q, k, v, True)
    grads = ak.attention_backward(grad, q, k, v, out, lse, True, grad_orders=(order, order, order))
    dense = ak.attention_backward(grad, q, k, v, plain, lse, True)
    for got, ref in zip((out, *grads), (plain, *dense)):
        assert [got.stride(i) for i in order] == list(torch.empty_permuted(got.shape, order).stride(i) for i in order)
        assert torch.equal(got, ref)  # the layout changes where values are written, not what they are


def test_cross_attention_over_another_length():
    """Queries over keys/values of another length (an encoder-decoder's cross-attention), not causal."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 37, 16, generator=gen).to(DEVICE, torch.float16)
    k, v = (torch.randn(2, 2, 83, 16, generator=gen).to(DEVICE, torch.float16) for _ in range(2))
    grad = torch.randn(2, 2, 37, 16, generator=gen).to(DEVICE, torch.float16)
    out, lse = ak.attention_forward(q, k, v, False)
    ours = (out, *ak.attention_backward(grad, q, k, v, out, lse, False))
    exact = _exact(q, k, v, grad, False, 0.25)
    eager = _eager(q, k, v, grad, False, 0.25)
    for got, ref, e in zip(ours, exact, eager):
        assert got.shape == ref.shape
        err_k, err_e = (got.double() - ref).abs().max().item(), (e.double() - ref).abs().max().item()
        assert err_k <= FACTOR * err_e + torch.finfo(torch.float16).eps * ref.abs().max().item()


def test_batches_wider_than_the_grid_launch_in_chunks(monkeypatch):
    """batch x heads above the grid's second dimension (65,535 on CUDA) runs in chunks of sequences: here the
    limit is lowered to 5 so that 3 sequences x 2 heads take three launches, the last one partial."""
    monkeypatch.setattr(ak, "_GRID_Y", 5)
    assert [(p.start, p.stop) for p in ak._batch_chunks(3, 2)] == [(0, 2), (2, 3)]
    assert ak._batch_chunks(2, 2) == [None]  # fits: the tensors as given
    monkeypatch.setattr(ak, "_GRID_Y", 2)
    gen = torch.Generator().manual_seed(4)
    q, k, v = _inputs(3, 2, 29, 16, True, gen)
    grad = torch.randn(3, 2, 29, 16, generator=gen).to(DEVICE, torch.float16)
    out, lse = ak.attention_forward(q, k, v, True)
    ours = (out, *ak.attention_backward(grad, q, k, v, out, lse, True))
    monkeypatch.setattr(ak, "_GRID_Y", 65535)
    whole, lse_whole = ak.attention_forward(q, k, v, True)
    for got, ref in zip(ours, (whole, *ak.attention_backward(grad, q, k, v, whole, lse_whole, True))):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("kv_heads,causal", [(2, True), (1, False), (1, True)])
def test_grouped_key_value_heads(kv_heads, causal, tma):
    """Grouped-query attention (4 query heads over 2 or 1 key/value heads, as ``enable_gqa`` gives them): against
    the fp64 exact of the repeated heads, no worse than eager SDPA with ``enable_gqa``; the key/value gradients
    sum their group's query heads. The pointer and TMA ways compute the same values."""
    if tma and not ak._use_tma(True, torch.zeros(1, 1, 1, 16, dtype=torch.float16, device=DEVICE)):
        pytest.skip("no TMA here")
    gen = torch.Generator().manual_seed(kv_heads * 10 + causal)
    n, d = 70, 16
    q = torch.randn(2, 4, n, d, generator=gen).to(DEVICE, torch.float16)
    k, v = (torch.randn(2, kv_heads, n, d, generator=gen).to(DEVICE, torch.float16) for _ in range(2))
    grad = torch.randn(2, 4, n, d, generator=gen).to(DEVICE, torch.float16)
    out, lse = ak.attention_forward(q, k, v, causal, tma=tma)
    ours = (out, *ak.attention_backward(grad, q, k, v, out, lse, causal, tma=tma))
    assert [t.shape[1] for t in ours] == [4, 4, kv_heads, kv_heads]
    scale = 1.0 / math.sqrt(d)
    groups = 4 // kv_heads
    kr, vr = (t.detach().double().requires_grad_(True) for t in (k, v))
    qr = q.detach().double().requires_grad_(True)
    s = qr @ kr.repeat_interleave(groups, 1).transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    exact_out = torch.softmax(s, -1) @ vr.repeat_interleave(groups, 1)
    exact_out.backward(grad.double())
    exact = (exact_out, qr.grad, kr.grad, vr.grad)
    qe, ke, ve = (t.detach().requires_grad_(True) for t in (q, k, v))
    eager_out = F.scaled_dot_product_attention(qe, ke, ve, is_causal=causal, enable_gqa=True)
    eager_out.backward(grad)
    eager = (eager_out, qe.grad, ke.grad, ve.grad)
    for name, got, ref, e in zip(("output", "grad_query", "grad_key", "grad_value"), ours, exact, eager):
        err_k, err_e = (got.double() - ref).abs().max().item(), (e.double() - ref).abs().max().item()
        ulp = torch.finfo(torch.float16).eps * ref.abs().max().item()
        assert err_k <= FACTOR * err_e + ulp, f"{name}: error {err_k:.3g} > {FACTOR} x eager {err_e:.3g} + {ulp:.3g}"


@pytest.mark.parametrize("n,d,causal,fused", [(37, 16, True, False), (130, 32, True, True), (150, 32, False, True)])
def test_tma_descriptors_compute_what_pointer_loads_compute(n, d, causal, fused):
    """The kernels reading through TMA descriptors (Hopper; rows past the length come back as zeros, no masks)
    against the pointer kernels: the same values (bitwise in the interpreter, where both load the same numbers
    into the same arithmetic; on CUDA the matmuls may take their operands in another layout, so there: no worse
    than eager, as every kernel here). Descriptors need 16-byte aligned strides: an odd stride is not taken."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9")
    gen = torch.Generator().manual_seed(n + d)
    q, k, v = _inputs(2, 3, n, d, fused, gen)
    grad = torch.randn(2, 3, n, d, generator=gen).to(DEVICE, torch.float16)
    assert ak._use_tma(True, q, k, v, grad)
    assert not ak._use_tma(False, q, k, v, grad)
    assert not ak._use_tma(True, torch.zeros(2, 3, n, d + 1, dtype=torch.float16, device=DEVICE)[..., :d], k, v)
    runs = []
    for tma in (False, True):
        out, lse = ak.attention_forward(q, k, v, causal, tma=tma)
        runs.append((out, lse, *ak.attention_backward(grad, q, k, v, out, lse, causal, tma=tma)))
    if DEVICE == "cpu":
        for pointers, tma in zip(*runs):
            assert torch.equal(pointers, tma)
        return
    exact = _exact(q, k, v, grad, causal, 1.0 / math.sqrt(d))
    eager = _eager(q, k, v, grad, causal, 1.0 / math.sqrt(d))
    got = (runs[1][0], *runs[1][2:])
    for g, ref, e in zip(got, exact, eager):
        err_k, err_e = (g.double() - ref).abs().max().item(), (e.double() - ref).abs().max().item()
        assert err_k <= FACTOR * err_e + torch.finfo(torch.float16).eps * ref.abs().max().item()


_HOPPER_COMPILE = r"""
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stepfx.codegen import attention_kernels as ak

tma, group = sys.argv[1] == "tma", int(sys.argv[2])
found = {}
kernels = ((ak._attn_fwd_kernel, ak.FWD), (ak._attn_bwd_dkdv_kernel, ak.BWD_DKDV), (ak._attn_bwd_dq_kernel, ak.BWD_DQ))
for kernel, (block_m, block_n, warps, stages) in kernels:
    rows = {"Q": block_m, "DO": block_m, "K": block_n, "V": block_n}
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in rows:  # a bf16 [B, H, L, 128] tensor: its descriptor's block, or a pointer
            sig[name] = f"tensordesc<bf16[1,1,{rows[name]},128]>" if tma else "*bf16"
        elif name in ("O", "DK", "DV", "DQ"):
            sig[name] = "*bf16"
        elif name in ("LSE", "DELTA"):
            sig[name] = "*fp32"
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        elif name in ("D", "BLOCK_M", "BLOCK_N", "CAUSAL", "TMA", "GROUP"):
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    consts = {"D": 128, "BLOCK_M": block_m, "BLOCK_N": block_n, "CAUSAL": True, "TMA": tma, "GROUP": group}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    ptx = compiled.asm["ptx"]
    found[kernel.fn.__name__] = {"tma_copies": "cp.async.bulk.tensor" in ptx, "wgmma": "wgmma" in ptx}
print(json.dumps(found))
"""


@pytest.mark.parametrize("tma,group", [(False, 1), (True, 1), (True, 4)], ids=["pointers", "tma", "tma-grouped"])
def test_kernels_compile_for_hopper(tma, group):
    """The kernels as the GPU compiles them (sm_90, both ways of reading, the default shapes, head size 128,
    one or four query heads a key/value head):
    Triton's interpreter runs the Python, not the lowering to the GPU, which this checks without one (in a
    process without the interpreter: its jit functions cannot be compiled)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", _HOPPER_COMPILE, "tma" if tma else "pointers", str(group)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    if done.returncode and "ptxas" in done.stderr.lower() and "not found" in done.stderr.lower():
        pytest.skip("no ptxas with this Triton")
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(found) == {"_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"}
    for name, got in found.items():
        assert got["tma_copies"] == tma, name  # TMA copies exactly where asked
        assert got["wgmma"], name  # Hopper's warp-group matrix products


def test_unsupported_inputs_are_named():
    q = torch.zeros(1, 2, 8, 16, dtype=torch.float16)
    assert ak.unsupported_reason(q, q, q, attn_mask=torch.zeros(8, 8)) == "an attention mask"
    assert ak.unsupported_reason(q, q, q, dropout_p=0.1) == "dropout"
    assert "head_dim 24" in ak.unsupported_reason(*(torch.zeros(1, 2, 8, 24, dtype=torch.float16),) * 3)
    assert ak.unsupported_reason(q, q[:, :1], q[:, :1]) is None  # grouped heads: 2 query heads over 1
    assert "3 query heads over 2 key" in ak.unsupported_reason(torch.zeros(1, 3, 8, 16, dtype=torch.float16), q, q)
    assert "dtype torch.float32" in ak.unsupported_reason(q.float(), q.float(), q.float())
    assert "causal" in ak.unsupported_reason(q, q[:, :, :4], q[:, :, :4], is_causal=True)
    if DEVICE == "cpu":
        assert "interpreter" in ak.unsupported_reason(q.bfloat16(), q.bfloat16(), q.bfloat16())
    with pytest.raises(ValueError, match="attention_forward: head_dim"):
        ak.attention_forward(q, q, q[:, :, :, :8])
    assert "_attn_fwd_kernel" in kernel_source("attention_forward")
    assert KERNELS["attention_backward"].reference is not None
