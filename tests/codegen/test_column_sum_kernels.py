"""cat_column_sum against aten (Triton's interpreter on CPU): the
concatenation bitwise, the sum within fp32 summation error of the column sum
of what was written.
"""
from __future__ import annotations

import pytest
import torch

from stepfx.codegen import available, kernel_source

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not available(DEVICE)[0], reason=available(DEVICE)[1])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS32 = torch.finfo(torch.float32).eps


# --------------------------------------------------------------------------- cat_column_sum

CAT_CASES = [((9, 41), 3), ((3, 7, 256), 3), ((341, 37), 2), ((600, 128), 4), ((2, 5, 256), 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,k", CAT_CASES, ids=[f"{s}x{k}" for s, k in CAT_CASES])
def test_cat_column_sum(shape, k, dtype):
    """The concatenation bitwise aten's; the sum within fp32 summation error
    of the column sum of it (parts of a width the column blocks divide, and
    of one they do not)."""
    from stepfx.codegen.column_sum_kernels import cat_column_sum, cat_column_sum_reference

    gen = torch.Generator().manual_seed(sum(shape) + k)
    parts = [(torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE) for _ in range(k)]
    keepdim = k % 2 == 1
    out, total = cat_column_sum(parts, keepdim)
    ref_out, ref_total = cat_column_sum_reference(parts, keepdim)
    assert torch.equal(out, ref_out) and torch.equal(ref_out, torch.cat(parts, -1))
    assert total.shape == ref_total.shape and total.dtype == dtype
    flat = out.reshape(-1, out.shape[-1])
    want = flat.double().sum(0, keepdim=keepdim)
    slack = 4 * EPS32 * flat.double().abs().sum(0, keepdim=keepdim) + torch.finfo(dtype).eps * want.abs()
    assert ((total.double() - want).abs() <= slack).all()


def test_cat_column_sum_bad_input():
    from stepfx.codegen.column_sum_kernels import cat_column_sum

    x = torch.zeros(4, 6, device=DEVICE)
    with pytest.raises(ValueError, match="2 to 4 parts"):
        cat_column_sum([x])
    with pytest.raises(ValueError, match="part #1"):
        cat_column_sum([x, torch.zeros(4, 5, device=DEVICE)])
    with pytest.raises(ValueError, match="not contiguous"):
        cat_column_sum([x, x.t().contiguous().t()])
    assert "_cat_sum_kernel" in kernel_source("cat_column_sum")
