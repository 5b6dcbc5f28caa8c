"""fuse_rms_norm: a hand-written RMSNorm (Hugging Face's way), forward and
backward, on stepfx's RMSNorm kernels (Triton's interpreter on CPU), on odd
shapes, against eager; and what it leaves alone, with the reason."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from stepfx.testing.equivalence import assert_step_equivalent

CODEGEN = {"stepfx": {"codegen": True}, "gradient_clipping": 0}


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, as written there."""

    def __init__(self, width: int, eps: float = 1e-6, *, leak: bool = False):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.eps, self.leak = eps, leak
        self.seen = None

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        normed = x * torch.rsqrt(variance + self.eps)
        out = self.weight * normed.to(dtype)
        return out + normed.sum() * 0 if self.leak else out  # leak: the normalized value read elsewhere


class GemmaRMSNorm(nn.Module):
    """transformers' GemmaRMSNorm: the fp32 normalized value times ``1 + weight`` in fp32, then the cast."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(width))
        self.eps = eps

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return (self._norm(x.float()) * (1.0 + self.weight.float())).type_as(x)


class Net(nn.Module):
    def __init__(self, width=13, leak=False, norm=RMSNorm):
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.norm1 = RMSNorm(width, leak=leak) if norm is RMSNorm else norm(width)
        self.mid = nn.Linear(width, width)
        self.norm2 = norm(width, eps=1e-5)
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.mid(self.norm1(h))  # a residual around the norm: x's gradient has two more parts
        return self.out(self.norm2(h))


def step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _batches(shape=(3, 7), n=3):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(*shape, 5, generator=g), torch.randint(0, 3, shape, generator=g)) for _ in range(n)]


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _fused(config, make, batches):
    torch.manual_seed(0)
    model = make()
    s = stepfx.parallelize(config)(step)
    opt = _sgd(model)
    for batch in batches:
        s(model, opt, *batch)
    return s


@pytest.mark.parametrize("shape", [(3, 7), (1, 1), (2, 5, 3)], ids=["3x7", "1x1", "2x5x3"])
def test_hand_written_rms_norms_run_the_kernels_and_equal_eager(shape):
    make = lambda: Net(13)  # noqa: E731
    s = _fused(CODEGEN, make, _batches(shape))
    record = next(r for r in s.plan.records if r.name == "fuse_rms_norm")
    assert record.summary.startswith("2 RMSNorm(s) forward and backward on stepfx's kernels"), record.summary
    names = [getattr(n.target, "__name__", "") for n in s.plan.graph.gm.graph.nodes]
    assert names.count("rms_norm") == names.count("rms_norm_backward") == 2
    assert not any(n.target is torch.ops.aten.rsqrt.default for n in s.plan.graph.gm.graph.nodes)
    report = assert_step_equivalent(step, make, _sgd, _batches(shape), config=CODEGEN, rtol=1e-5, atol=1e-7, resync=True)
    assert report.steps == 3


@pytest.mark.parametrize("norm", [RMSNorm, GemmaRMSNorm], ids=["llama", "gemma"])
def test_bf16_norms_are_matched_with_their_casts_and_track_the_unfused_bf16_step(norm):
    bf16 = {**CODEGEN, "bf16": {"enabled": True}}
    unfused = {**bf16, "stepfx": {"codegen": True, "disable": ["fuse_rms_norm"]}}
    fp32 = {**CODEGEN, "stepfx": {"codegen": False}}
    batches = _batches((4, 9), n=4)
    runs = [_fused(c, lambda: Net(13, norm=norm), batches) for c in (bf16, unfused, fp32)]
    assert next(r for r in runs[0].plan.records if r.name == "fuse_rms_norm").summary.startswith("2 RMSNorm(s)")
    states = [r.model_state_dict() for r in runs]

    def err(a):
        return max(((a[k] - states[2][k]).norm() / states[2][k].norm()).item() for k in states[2])

    assert err(states[0]) <= 2 * err(states[1]) + 1e-6, (err(states[0]), err(states[1]))


def test_a_norm_whose_values_are_read_elsewhere_is_left_with_the_reason():
    s = _fused(CODEGEN, lambda: Net(13, leak=True), _batches())
    record = next(r for r in s.plan.records if r.name == "fuse_rms_norm")
    assert record.summary.startswith("1 RMSNorm(s)") and "left: the normalized value is read elsewhere" in record.summary
    assert any(n.target is torch.ops.aten.rsqrt.default for n in s.plan.graph.gm.graph.nodes)


def test_symbolic_lengths_run_the_kernels_and_equal_eager():
    """A new length every step (stepfx.dynamic "auto"): the symbolic capture fuses its norms too (it failed with
    "unhashable type: SymInt" on the GPU, a bf16 Llama with padded batches, 2026-12-06) and equals eager."""
    from tests.steps import parallelized_steps

    config = {**CODEGEN, "stepfx": {"codegen": True, "dynamic": "auto"}}
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(3, t, 5, generator=g), torch.randint(0, 3, (3, t), generator=g)) for t in (7, 9, 5, 12)]
    mp = pytest.MonkeyPatch()
    try:
        made = parallelized_steps(mp)
        report = assert_step_equivalent(step, lambda: Net(13), _sgd, batches, config=config, rtol=1e-5, atol=1e-7,
                                        resync=True)
    finally:
        mp.undo()
    assert report.steps == 4
    plans = made[0].plans
    assert len(plans) == 2 and plans[1].guard is not None
    record = next(r for r in plans[1].records if r.name == "fuse_rms_norm")
    assert record.summary.startswith("2 RMSNorm(s) forward and backward on stepfx's kernels"), record.summary


class HeadNormNet(nn.Module):
    """A norm over each head's dims, then heads moved before the length (Qwen3's q/k norms before attention): the
    norm's output gradient comes back through the transpose, not contiguous."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 12)
        self.norm = RMSNorm(4)
        self.w = nn.Parameter(torch.randn(4, 4) / 2)
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm(self.inp(x).view(b, t, 3, 4)).transpose(1, 2) @ self.w  # [b, 3, t, 4], contiguous
        return self.out(h.transpose(1, 2).reshape(b, t, 12))


def test_a_norm_whose_output_gradient_is_transposed_runs_the_kernels_and_equals_eager():
    """Found on Qwen3 with codegen (every CUDA run): the kernel refused the transposed gradient at run #1; the
    gradient is copied dense before the backward kernel."""
    s = _fused(CODEGEN, HeadNormNet, _batches((2, 7)))
    record = next(r for r in s.plan.records if r.name == "fuse_rms_norm")
    assert record.summary.startswith("1 RMSNorm(s) forward and backward on stepfx's kernels"), record.summary
    assert any(n.name.startswith("rms_grad_dense") for n in s.plan.graph.gm.graph.nodes)
    assert_step_equivalent(step, HeadNormNet, _sgd, _batches((2, 7)), config=CODEGEN, rtol=1e-5, atol=1e-7, resync=True)
