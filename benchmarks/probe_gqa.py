"""Which SDPA kernels on this GPU take grouped-query K/V unrepeated (fewer
key/value heads than query heads), forward and backward, and do they equal
the repeated computation? (Decides what fold_causal_masks' companion may
rewrite.)  python3 benchmarks/probe_gqa.py"""
import torch

aten = torch.ops.aten
torch.manual_seed(0)
B, H, HKV, S, D = 2, 8, 2, 256, 64
q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16)
kr = k.repeat_interleave(H // HKV, dim=1)
vr = v.repeat_interleave(H // HKV, dim=1)
dy = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
for name in ("cudnn", "efficient", "flash"):
    try:
        if name == "cudnn":
            f = lambda k_, v_: aten._scaled_dot_product_cudnn_attention(q, k_, v_, None, True, 0.0, True, False, scale=0.125)
        elif name == "efficient":
            f = lambda k_, v_: aten._scaled_dot_product_efficient_attention(q, k_, v_, None, True, 0.0, True, scale=0.125)
        else:
            f = lambda k_, v_: aten._scaled_dot_product_flash_attention(q, k_, v_, 0.0, True, False, scale=0.125)
        ref = f(kr, vr)[0]
        out = f(k, v)[0]
        print(name, "forward gqa ok", tuple(out.shape), "max diff vs repeated", (out.float() - ref.float()).abs().max().item())
    except Exception as exc:
        print(name, "forward gqa FAILS:", type(exc).__name__, str(exc).splitlines()[0][:150])
