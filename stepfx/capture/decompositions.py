"""Decompositions used when batch sizes are symbolic (``stepfx.dynamic``).

Some ops' fake kernels read sizes as plain ints, which makes the trace
specialize on them (a guard ``s0 == 9``: the captured step then serves one
size only, and the next length is captured again). Each op here is traced
as ops whose fake kernels keep sizes symbolic, computing the same values
(only copies: no arithmetic changes, so results stay bitwise equal).
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

__all__ = ["SYMBOLIC_DECOMPOSITIONS"]


def _constant_pad_nd(x: torch.Tensor, pad: list, value=0.0) -> torch.Tensor:
    """``F.pad(x, pad, value=value)`` in constant mode as narrows (negative
    pads) and concatenations with filled blocks (positive pads), last
    dimension first as ``pad`` lists them. Measured: the fake kernel of
    ``aten.constant_pad_nd`` guards every size of its input (Hugging Face's
    causal-LM loss pads the labels so)."""
    out = x
    for i in range(len(pad) // 2):
        dim = x.dim() - 1 - i
        left, right = pad[2 * i], pad[2 * i + 1]
        if left < 0:
            out = out.narrow(dim, -left, out.size(dim) + left)
        if right < 0:
            out = out.narrow(dim, 0, out.size(dim) + right)
        parts = []
        for width in (left, right):
            if width > 0:
                shape = list(out.shape)
                shape[dim] = width
                parts.append(out.new_full(shape, value))
            else:
                parts.append(None)
        if parts[0] is not None or parts[1] is not None:
            out = torch.cat([p for p in (parts[0], out, parts[1]) if p is not None], dim)
    if out is x:
        out = x.clone()
    return out


SYMBOLIC_DECOMPOSITIONS = {aten.constant_pad_nd.default: _constant_pad_nd}
