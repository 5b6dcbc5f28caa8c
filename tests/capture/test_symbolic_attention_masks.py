"""With symbolic lengths on CUDA, ``compat.sdpa_with_symbolic_sizes`` calls
the fused kernel's op itself, so it must hand it the mask as torch's SDPA
composite does: a boolean mask made additive in the query's dtype (-inf,
-65504 for cuDNN), rows padded to 8 elements for memory-efficient attention.
Found on the H100 (2026-12-06): Hugging Face GPT-2 with padded batches failed
at its first symbolic run ("invalid dtype for bias - should match query's
dtype"). The kernels are CUDA-only; here the conversion itself is checked
on CPU (values, layout, no guard on the length) and through the math kernel,
which reads a boolean and an additive mask alike."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from stepfx.compat import attention_mask_for


def _padding_mask(lengths, width):
    keep = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return keep[:, None, None, :] & causal[None, None]


@pytest.mark.parametrize("kernel, masked", [("cudnn", -65504.0), ("efficient", float("-inf"))])
def test_a_boolean_mask_becomes_additive_in_the_query_dtype(kernel, masked):
    q = torch.randn(2, 3, 14, 8, dtype=torch.bfloat16)
    mask = _padding_mask([14, 9], 14)
    out = attention_mask_for(kernel, mask, q, q)
    assert out.dtype == torch.bfloat16
    expected = torch.full(mask.shape, masked).to(torch.bfloat16).masked_fill(mask, 0.0)
    assert torch.equal(out[:, :1], expected)


@pytest.mark.parametrize("width", [14, 16])
def test_memory_efficient_attention_gets_rows_aligned_to_8_and_expanded(width):
    q = torch.randn(2, 3, width, 8)
    additive = torch.randn(2, 1, width, width)
    out = attention_mask_for("efficient", additive, q, q)
    assert out.shape == (2, 3, width, width)
    assert out.stride(-1) == 1 and out.stride(-2) % 8 == 0 and out.stride(1) == 0
    assert torch.equal(out, additive.expand(2, 3, width, width))
    assert attention_mask_for("cudnn", additive, q, q) is additive
    assert attention_mask_for("efficient", None, q, q) is None


@pytest.mark.parametrize("kernel", ["cudnn", "efficient"])
def test_attention_reads_the_converted_mask_as_the_boolean_one(kernel):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 14, 8, generator=g) for _ in range(3))
    mask = _padding_mask([14, 9], 14)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask_for(kernel, mask, q, k))
    assert torch.equal(got, expected)


def test_the_conversion_traced_at_one_length_serves_others():
    def convert(q, mask):
        return attention_mask_for("efficient", mask, q, q) * 1

    q = torch.randn(2, 3, 14, 8)
    traced = make_fx(convert, tracing_mode="symbolic")(q, _padding_mask([14, 9], 14))
    for width in (9, 16, 21):
        q, mask = torch.randn(2, 3, width, 8), _padding_mask([width, 5], width)
        assert torch.equal(traced(q, mask), convert(q, mask))
