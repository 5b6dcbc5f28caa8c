"""linear_cross_entropy (chunked linear + cross-entropy, loss and gradients) against its eager spec.

On CPU the Triton kernel runs in the interpreter (tests/conftest.py sets
TRITON_INTERPRET=1). Tolerances:

- fp32 inputs and fp32 logits: against the eager reference, every element
  within 1e-5 relative plus 1e-6 of the tensor's largest magnitude
  (measured: 3e-7 of the largest magnitude at worst).
- bf16/fp16 (inputs or logits): judged against an fp64 computation from the
  same inputs; the kernel's error (2-norm over the tensor) may be at most
  twice the eager low-precision reference's own error, plus half an ulp of
  the output dtype at the rms element (:func:`assert_no_worse_than_eager`).
  Measured: at most 1.09 times eager's error, median 0.5-1.0.
- That rule cannot see a rounding skipped (it would only be more accurate),
  so the user's downcast of fp32 logits is also checked against an fp64
  emulation of autograd's rounding steps.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stepfx.codegen import KERNELS, cross_entropy_kernels, kernel_source
from stepfx.codegen.cross_entropy_kernels import (
    default_chunk_rows,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)

# compiled for real where there is a GPU, in the interpreter on CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(n, d, v, dtype, *, device=DEVICE, ignore_every=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).to(dtype)
    # logits of order 1-10: a softmax neither flat nor one-hot
    weight = (torch.randn(v, d, generator=g) * (2.0 / d**0.5)).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    target[::ignore_every] = -100
    return hidden.to(device), weight.to(device), target.to(device)


def exact_fp64(hidden, weight, target, *, ignore_index=-100, reduction="mean"):
    """The same math in fp64 from the same (already rounded) inputs, no intermediate rounding."""
    with torch.enable_grad():
        h = hidden.double().requires_grad_(True)
        w = weight.double().requires_grad_(True)
        loss = F.cross_entropy(h @ w.t(), target, ignore_index=ignore_index, reduction=reduction)
        gh, gw = torch.autograd.grad(loss, (h, w))
    return loss.detach(), gh, gw


def assert_no_worse_than_eager(ours, eager, exact, *, what, factor=2.0):
    """Low-precision rule, in the 2-norm over the tensor (a max over a few dozen
    elements is one-ulp noise): ||ours - exact|| <= factor * ||eager - exact||
    plus half an ulp of the output dtype at the rms exact element (one rounding
    of the result, which cannot average out when the result is one number)."""
    assert ours.dtype == eager.dtype, f"{what}: dtype {ours.dtype}, eager gives {eager.dtype}"
    assert ours.shape == eager.shape, f"{what}: shape {tuple(ours.shape)}, eager gives {tuple(eager.shape)}"
    err = (ours.double() - exact).norm().item()
    err_eager = (eager.double() - exact).norm().item()
    rms = exact.norm().item() / max(exact.numel(), 1) ** 0.5
    bound = factor * err_eager + 0.5 * torch.finfo(ours.dtype).eps * rms
    assert err <= bound, f"{what}: error {err:.3g} vs fp64, eager's {err_eager:.3g}, bound {bound:.3g}"


def assert_fp32_close(ours, ref, *, what):
    assert ours.dtype == ref.dtype, f"{what}: dtype {ours.dtype}, reference gives {ref.dtype}"
    atol = 1e-6 * ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def check_against_reference(n, d, v, dtype, logits_dtype, reduction, chunk_rows, ignore_index=-100, seed=0):
    hidden, weight, target = make_inputs(n, d, v, dtype, seed=seed)
    if ignore_index != -100:
        target[target == -100] = ignore_index
    kw = dict(ignore_index=ignore_index, reduction=reduction, logits_dtype=logits_dtype)
    ours = linear_cross_entropy(hidden, weight, target, chunk_rows=chunk_rows, **kw)
    ref = linear_cross_entropy_reference(hidden, weight, target, **kw)
    names = ("loss", "grad_hidden", "grad_weight")
    if dtype == torch.float32 and logits_dtype in (None, torch.float32):
        for name, a, b in zip(names, ours, ref):
            assert_fp32_close(a, b, what=name)
    else:
        exact = exact_fp64(hidden, weight, target, ignore_index=ignore_index, reduction=reduction)
        for name, a, b, e in zip(names, ours, ref, exact):
            assert_no_worse_than_eager(a, b, e, what=name)


# (N, d, V, chunk_rows): one chunk; three chunks (16, 16, 9 rows); rows wider
# than one Triton block (V=4231 > 4096) over chunks of 4 rows.
SMALL = [(9, 16, 41, None), (41, 41, 341, 16), (9, 41, 4231, 4)]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("logits_dtype", [None, torch.float32], ids=["logits-native", "logits-fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n,d,v,chunk_rows", SMALL, ids=[f"{n}x{d}x{v}" for n, d, v, _ in SMALL])
def test_matches_reference(n, d, v, chunk_rows, dtype, logits_dtype, reduction):
    check_against_reference(n, d, v, dtype, logits_dtype, reduction, chunk_rows)


@pytest.mark.parametrize(
    "dtype,logits_dtype,reduction,chunk_rows,v",
    [
        (torch.float32, None, "mean", None, 4231),  # default chunking: 4 MiB on CPU -> 2 chunks
        (torch.bfloat16, torch.float32, "mean", 100, 4231),  # the GPT workload's dtype flow
        (torch.float16, None, "sum", 128, 341),
    ],
    ids=["fp32-default-chunks", "bf16-logits-fp32", "fp16-sum"],
)
def test_341_rows(dtype, logits_dtype, reduction, chunk_rows, v):
    check_against_reference(341, 16, v, dtype, logits_dtype, reduction, chunk_rows)


def test_default_chunks_split_341_rows():
    rows = default_chunk_rows(341, 4231, torch.float32, "cpu")
    assert 1 < -(-341 // rows), "the test above must run several chunks"
    assert rows * 4231 * 4 <= 4 << 20


def test_default_chunk_rows_gpu_workload():
    # 8192 x 50304 bf16 logits are 824 MB: one chunk (grad_weight in one matmul);
    # twice the rows: two chunks of 8192 rows; fp32 logits of 8192 rows (1.6 GB): two of 4096
    assert default_chunk_rows(8192, 50304, torch.bfloat16, "cuda") == 8192
    assert default_chunk_rows(16384, 50304, torch.bfloat16, "cuda") == 8192
    assert default_chunk_rows(8192, 50304, torch.float32, "cuda") == 4096
    assert default_chunk_rows(100, 50304, torch.bfloat16, "cuda") == 100


def test_fp32_inputs_bf16_logits():
    # a downcast: the kernel rounds logits to bf16 and the gradient to bf16 and back
    check_against_reference(41, 16, 341, torch.float32, torch.bfloat16, "mean", 16)


def emulate_cast(hidden, weight, target, logits_dtype, *, round_grad):
    """fp32 inputs whose logits the user casts to ``logits_dtype``: the spec's
    math in fp64 from the rounded logits; the logits' gradient rounded to
    ``logits_dtype`` (``round_grad``, as autograd does) or not, then the fp32
    matmuls. Mean reduction, ignore_index -100."""
    logits = torch.mm(hidden, weight.t()).to(logits_dtype).double()
    valid = target != -100
    onehot = F.one_hot(target.clamp(min=0), logits.shape[1]).double()
    grad = (logits.softmax(1) - onehot) * valid[:, None] / valid.sum()
    grad = grad.to(logits_dtype).float() if round_grad else grad.float()
    return torch.mm(grad, weight), torch.mm(grad.t(), hidden)


@pytest.mark.parametrize("logits_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cast_logits_rounding_happens_where_autograd_does_it(logits_dtype):
    # The fp64 rule cannot see a kernel that skips the user's downcast (it would
    # only be more accurate): here the kernel must match the rounded emulation
    # ten times better than the emulation without the gradient's rounding.
    hidden, weight, target = make_inputs(41, 16, 341, torch.float32)
    _, gh, gw = linear_cross_entropy(hidden, weight, target, logits_dtype=logits_dtype, chunk_rows=16)
    rounded = emulate_cast(hidden, weight, target, logits_dtype, round_grad=True)
    unrounded = emulate_cast(hidden, weight, target, logits_dtype, round_grad=False)
    for name, ours, a, b in zip(("grad_hidden", "grad_weight"), (gh, gw), rounded, unrounded):
        off, effect = (ours - a).norm().item(), (b - a).norm().item()
        assert off <= 0.1 * effect, f"{name}: {off:.3g} from the rounded emulation, rounding moves it {effect:.3g}"


def test_rounded_accumulation_fallback(monkeypatch):
    # older torch on CUDA has no fp32-output bf16 matmul: chunks' products are
    # rounded to bf16 and summed in fp32; still within the low-precision rule
    monkeypatch.setattr(cross_entropy_kernels, "_fp32_accumulation", lambda device: "rounded")
    check_against_reference(41, 41, 341, torch.bfloat16, torch.float32, "mean", 16)


def test_ignore_index_that_is_a_class():
    check_against_reference(41, 16, 341, torch.float32, None, "mean", 16, ignore_index=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_ignored(dtype):
    hidden, weight, target = make_inputs(9, 16, 41, dtype)
    target.fill_(-100)
    loss, gh, gw = linear_cross_entropy(hidden, weight, target, chunk_rows=4)
    ref = F.cross_entropy((hidden @ weight.t()).float(), target)
    assert torch.isnan(loss) and torch.isnan(ref)
    assert loss.dtype == dtype
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0
    loss, gh, gw = linear_cross_entropy(hidden, weight, target, reduction="sum", chunk_rows=4)
    assert loss.item() == 0.0
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0


def test_target_out_of_range_gives_nan_loss():
    hidden, weight, target = make_inputs(9, 16, 41, torch.float32)
    target[1] = 41
    loss, _, _ = linear_cross_entropy(hidden, weight, target)
    assert torch.isnan(loss)


def test_no_rows():
    hidden, weight, target = make_inputs(0, 16, 41, torch.float32)
    loss, gh, gw = linear_cross_entropy(hidden, weight, target)
    ref = linear_cross_entropy_reference(hidden, weight, target)
    assert torch.isnan(loss) and torch.isnan(ref[0])
    assert gh.shape == (0, 16) and torch.count_nonzero(gw) == 0


def test_inputs_requiring_grad_give_plain_tensors():
    hidden, weight, target = make_inputs(9, 16, 41, torch.float32)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    outs = linear_cross_entropy(hidden, weight, target)
    assert not any(o.requires_grad for o in outs)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda h, w, t: (h[0], w, t), "hidden must be 2-D"),
        (lambda h, w, t: (h, w[None], t), "weight must be 2-D"),
        (lambda h, w, t: (h, w[:, :8].contiguous(), t), "disagree on d"),
        (lambda h, w, t: (h, w, t[:5]), "target must be 1-D"),
        (lambda h, w, t: (h.double(), w.double(), t), "hidden dtype"),
        (lambda h, w, t: (h, w.half(), t), "weight dtype"),
        (lambda h, w, t: (h, w, t.int()), "target dtype"),
        (lambda h, w, t: (h.t().contiguous().t(), w, t), "hidden must be contiguous"),
        (lambda h, w, t: (h, w.t().contiguous().t(), t), "weight must be contiguous"),
        (lambda h, w, t: (h, w, torch.stack([t, t], 1)[:, 0]), "target must be contiguous"),
        (lambda h, w, t: (h, w[:0], t), "vocabulary of size 0"),
    ],
)
def test_bad_input(change, match):
    args = change(*make_inputs(9, 16, 41, torch.float32))
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(*args)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(reduction="none"), "reduction"),
        (dict(logits_dtype=torch.float64), "logits_dtype"),
        (dict(chunk_rows=0), "chunk_rows"),
    ],
)
def test_bad_option(kw, match):
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(*make_inputs(9, 16, 41, torch.float32), **kw)


def test_registered():
    kernel = KERNELS["linear_cross_entropy"]
    assert kernel.launch is linear_cross_entropy
    assert kernel.reference is linear_cross_entropy_reference
    assert "def _lce_rows_kernel" in kernel_source("linear_cross_entropy")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,logits_dtype", [(torch.float32, None), (torch.bfloat16, torch.float32), (torch.bfloat16, None)])
def test_cuda_matches_reference_and_saves_memory(dtype, logits_dtype):
    n, d, v = 4231, 256, 50304
    hidden, weight, target = make_inputs(n, d, v, dtype, device="cuda")
    kw = dict(logits_dtype=logits_dtype)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ours = linear_cross_entropy(hidden, weight, target, chunk_rows=1024, **kw)
    torch.cuda.synchronize()
    ours_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    ref = linear_cross_entropy_reference(hidden, weight, target, **kw)
    torch.cuda.synchronize()
    ref_peak = torch.cuda.max_memory_allocated() - base
    # one 1024-row chunk of logits instead of 4231 rows of logits and their fp32 forms
    assert ours_peak < ref_peak / 2, (ours_peak, ref_peak)
    names = ("loss", "grad_hidden", "grad_weight")
    if dtype == torch.float32:
        # TF32 off by default: true fp32 matmuls; chunked grad_weight sums in another order
        for name, a, b in zip(names, ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item(), msg=lambda m: f"{name}: {m}")
    else:
        exact = exact_fp64(hidden, weight, target)
        for name, a, b, e in zip(names, ours, ref, exact):
            assert_no_worse_than_eager(a, b, e, what=name)


# -- the two halves over a vocabulary split between ranks (tensor parallelism) ---------------------------------


def _over_shards(hidden, weight, target, tp, *, reduction="mean", logits_dtype=None, chunk_rows=None, keep=True):
    """The split-vocabulary chain as fuse_linear_cross_entropy builds it around the group's all-reduces,
    with the all-reduces done here over the shards: (loss, grad_hidden, grad_weight)."""
    from stepfx.codegen.cross_entropy_kernels import vocab_cross_entropy_grads, vocab_cross_entropy_stats

    rows = weight.shape[0] // tp
    shards = [weight[r * rows:(r + 1) * rows].contiguous() for r in range(tp)]
    stats = [vocab_cross_entropy_stats(hidden, w, target, offset=r * rows, logits_dtype=logits_dtype,
                                       chunk_rows=chunk_rows) for r, w in enumerate(shards)]
    top = torch.stack([s[0] for s in stats]).amax(0)
    total = sum(s[1] * torch.exp(s[0] - top) for s in stats)
    lse = top + torch.log(total)
    count = (target != -100).sum().float()
    scale = count.reciprocal() if reduction == "mean" else torch.ones((), device=hidden.device)
    loss = 0
    grads_h, grads_w = 0, []
    for r, (w, (_, _, picked, logits)) in enumerate(zip(shards, stats)):
        local = target - r * rows
        held = (target != -100) & (local >= 0) & (local < rows)
        loss = loss + torch.where(held, lse - picked, 0.0).sum()
        gh, gw = vocab_cross_entropy_grads(hidden, w, target, lse, scale, logits if keep else None, offset=r * rows,
                                           logits_dtype=logits_dtype, chunk_rows=chunk_rows)
        grads_h = grads_h + gh.float()
        grads_w.append(gw)
    if reduction == "mean":
        loss = loss / count
    return loss, grads_h, torch.cat(grads_w)


@pytest.mark.parametrize("tp, chunk_rows, keep", [(2, None, True), (2, 16, True), (4, 16, False), (2, 7, False)],
                         ids=["tp2-one-chunk", "tp2-chunks", "tp4-recomputed", "tp2-odd-chunks"])
def test_vocab_shards_fp32_equal_the_whole_vocabulary(tp, chunk_rows, keep):
    """fp32: the shards' stats combined as the graph combines them, then each
    shard's gradients, equal the whole-vocabulary cross-entropy (1e-5)."""
    hidden, weight, target = make_inputs(40, 16, 64, torch.float32, seed=3)
    loss, gh, gw = _over_shards(hidden, weight, target, tp, chunk_rows=chunk_rows, keep=keep)
    ref_loss, ref_gh, ref_gw = linear_cross_entropy_reference(hidden, weight, target)
    assert_fp32_close(loss, ref_loss, what="loss")
    assert_fp32_close(gh, ref_gh, what="grad_hidden (summed over the ranks)")
    assert_fp32_close(gw, ref_gw, what="grad_weight (the ranks' rows)")


def test_vocab_shards_sum_reduction_and_fp32_logits_of_bf16_inputs():
    """reduction 'sum'; bf16 inputs with the user's .float() on the logits:
    no worse than the eager bf16 step against fp64."""
    hidden, weight, target = make_inputs(24, 16, 32, torch.bfloat16, seed=5)
    loss, gh, gw = _over_shards(hidden, weight, target, 2, reduction="sum", logits_dtype=torch.float32)
    e_loss, e_gh, e_gw = linear_cross_entropy_reference(hidden, weight, target, reduction="sum",
                                                        logits_dtype=torch.float32)
    x_loss, x_gh, x_gw = exact_fp64(hidden, weight, target, reduction="sum")
    assert_no_worse_than_eager(loss.float(), e_loss.float(), x_loss, what="loss")
    assert_no_worse_than_eager(gh.to(torch.bfloat16), e_gh, x_gh, what="grad_hidden")
    assert_no_worse_than_eager(gw, e_gw, x_gw, what="grad_weight")


@pytest.mark.parametrize("half", ["stats", "grads"])
def test_vocab_halves_match_their_references(half):
    from stepfx.codegen import cross_entropy_kernels as k

    hidden, weight, target = make_inputs(20, 8, 24, torch.float32, seed=9)
    if half == "stats":
        ours = k.vocab_cross_entropy_stats(hidden, weight[:12].contiguous(), target, offset=12, chunk_rows=8)
        ref = k.vocab_cross_entropy_stats_reference(hidden, weight[:12].contiguous(), target, offset=12)
        for a, b, what in zip(ours[:3], ref[:3], ("max", "sum", "picked")):
            assert_fp32_close(a, b, what=what)
    else:
        lse = torch.randn(20, device=DEVICE) + 3
        scale = torch.tensor(0.1, device=DEVICE)
        ours = k.vocab_cross_entropy_grads(hidden, weight[12:].contiguous(), target, lse, scale, offset=12, chunk_rows=8)
        ref = k.vocab_cross_entropy_grads_reference(hidden, weight[12:].contiguous(), target, lse, scale, offset=12)
        for a, b, what in zip(ours, ref, ("grad_hidden", "grad_weight")):
            assert_fp32_close(a, b, what=what)
