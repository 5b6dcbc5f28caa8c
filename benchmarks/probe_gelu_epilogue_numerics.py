"""cuBLASLt's GELU(tanh) epilogue (graph_ops.addmm_gelu on CUDA) against addmm then GELU, both against
the fp64 value, by band of the pre-activation: the error statistics behind the CUDA test in
tests/passes/test_fuse_linear_gelu.py.

    python3 benchmarks/probe_gelu_epilogue_numerics.py       # on the GPU machine
"""
import torch, torch.nn.functional as F
torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float16):
    x = torch.randn(8192, 2048, device="cuda", dtype=dtype)
    w = torch.randn(8192, 2048, device="cuda", dtype=dtype) / 2048 ** 0.5
    b = torch.randn(8192, device="cuda", dtype=dtype) * 0.1
    fused = torch._addmm_activation(b, x, w.t(), use_gelu=True).double()
    pre = torch.addmm(b, x, w.t())
    ops = F.gelu(pre, approximate="tanh").double()
    h = torch.addmm(b.double(), x.double(), w.double().t())
    exact = F.gelu(h, approximate="tanh")
    exact_of_rounded = F.gelu(pre.double(), approximate="tanh")
    eps = torch.finfo(dtype).eps
    for lo, hi in ((-10, -3), (-3, -1), (-1, 0), (0, 1), (1, 3), (3, 10)):
        m = (h >= lo) & (h < hi)
        if m.sum() == 0: continue
        ef, eo = (fused - exact)[m].abs(), (ops - exact)[m].abs()
        scale = exact[m].abs().clamp_min(1e-30)
        print(dtype, f"h in [{lo},{hi}) n={int(m.sum())} |gelu|max={exact[m].abs().max():.3g}",
              f"fused abs max {ef.max():.3g} rel-ulp max {(ef/(eps*scale)).max():.3g} mean abs {ef.mean():.3g}",
              f"| ops abs max {eo.max():.3g} rel-ulp max {(eo/(eps*scale)).max():.3g} mean abs {eo.mean():.3g}")
    print(dtype, "fused vs exact-of-bf16-pre: max abs", (fused - exact_of_rounded).abs().max().item())
    print(dtype, "mean signed err fused", (fused-exact).mean().item(), "ops", (ops-exact).mean().item())
