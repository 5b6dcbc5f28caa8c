"""fuse_linear_gelu: a GELU(tanh) whose pre-activation the backward does not
read is its matmul's epilogue (cuBLASLt on CUDA; the two ops elsewhere,
bitwise), and only there."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from stepfx.codegen import available, graph_ops
from stepfx.graph.accounting import node_flops
from stepfx.graph.step_graph import META_PHASE, Phase
from tests.steps import adamw, ce_step, lm_step, tiny_gpt, token_batches


# the CPU steps run stepfx's other kernels in Triton's interpreter (not chosen where CUDA is)
cpu_codegen = pytest.mark.skipif(not available("cpu")[0], reason=available("cpu")[1])


def _gpt():
    return tiny_gpt(seq_len=32, d_model=32, n_layers=2)


def _run(config, make=_gpt, batches=None, step_fn=lm_step):
    torch.manual_seed(0)
    model = make()
    opt = adamw(model)
    step = stepfx.parallelize(config)(step_fn)
    losses = [step(model, opt, *batch).item() for batch in batches or token_batches(2, batch=2, seq=32)]
    return step, losses


def _fused(step) -> list:
    return [n for n in step.plan.graph.gm.graph.nodes if n.target is graph_ops.addmm_gelu]


@cpu_codegen
def test_recomputed_blocks_take_the_gelu_into_the_forward_matmul_bitwise_on_cpu():
    config = {"gradient_clipping": 1.0, "stepfx": {"codegen": True, "activation_memory_budget": 0.0}}
    step, losses = _run(config)
    fused = _fused(step)
    # every block's first forward (the backward reads its recomputed copy, never this pre-activation)
    assert len(fused) == 2 and all(n.meta[META_PHASE] == Phase.FORWARD for n in fused)
    assert all(u.target is not torch.ops.aten.gelu.default for n in fused for u in n.users)
    assert all(node_flops(n) == 2 * (2 * 31) * 32 * 128 for n in fused)  # the matmul it is (31 inputs a row)
    assert "GELU(tanh) by their matmul's epilogue" in step.explain()
    # on the CPU addmm_gelu is the two ops: the step is the unfused one's, bit for bit
    unfused, unfused_losses = _run({**config, "stepfx": {**config["stepfx"], "disable": ["fuse_linear_gelu"]}})
    assert not _fused(unfused) and losses == unfused_losses
    ours, theirs = step.model_state_dict(), unfused.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)


@cpu_codegen
def test_a_pre_activation_the_backward_reads_is_not_fused():
    # without recomputation the backward's GELU derivative reads the forward's pre-activation
    step, _ = _run({"gradient_clipping": 1.0, "stepfx": {"codegen": True}}, batches=token_batches(1, batch=2, seq=32))
    assert not _fused(step)
    assert any(n.target is torch.ops.aten.gelu.default for n in step.plan.graph.gm.graph.nodes)


class _ErfMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 4)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))  # the erf GELU: cuBLASLt's epilogue is the tanh form only


@cpu_codegen
def test_the_erf_gelu_is_not_fused():
    config = {"gradient_clipping": 0, "stepfx": {"codegen": True, "activation_memory_budget": 0.0}}
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))]
    step, _ = _run(config, make=_ErfMLP, batches=batches, step_fn=ce_step)
    assert not _fused(step)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt's epilogue: CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_epilogue_rounds_once_from_what_the_two_ops_compute(dtype):
    torch.manual_seed(0)
    x = torch.randn(4096, 1024, device="cuda", dtype=dtype)
    w = torch.randn(4096, 1024, device="cuda", dtype=dtype) / 32
    b = torch.randn(4096, device="cuda", dtype=dtype)
    fused = graph_ops.addmm_gelu(b, x, w.t())
    ops = F.gelu(torch.addmm(b, x, w.t()), approximate="tanh")
    exact = F.gelu(torch.addmm(b.double(), x.double(), w.double().t()), approximate="tanh")
    if dtype == torch.float32:
        torch.testing.assert_close(fused, ops, rtol=1e-5, atol=1e-5)
        return
    # rounded once from the fp32 accumulator: each element within half a unit in the last place of the exact
    # value (eps/2 relative) and the accumulation's own error (1e-5 absolute: where GELU crosses zero the
    # relative error of any fp32 sum is unbounded); and no less accurate than the two ops, which round twice
    # (on an H100: bf16 mean error 2.0e-3 against 3.1e-3 for h in [1, 3), max 0.0078 against 0.0162;
    # benchmarks/probe_gelu_epilogue_numerics.py)
    eps = torch.finfo(dtype).eps
    err, err_ops = (fused.double() - exact).abs(), (ops.double() - exact).abs()
    assert (err <= eps / 2 * exact.abs() * (1 + 1e-3) + 1e-5).all(), (err - eps / 2 * exact.abs()).max()
    assert err.max() <= err_ops.max() and err.mean() <= err_ops.mean()
