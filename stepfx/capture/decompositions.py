"""Decompositions used when batch sizes are symbolic (``stepfx.dynamic``).

Some ops' fake kernels read sizes as plain ints, which makes the trace
specialize on them (a guard ``s0 == 9``: the captured step then serves one
size only, and the next length is captured again). Each op here is traced
as ops whose fake kernels keep sizes symbolic, computing the same values
(only copies: no arithmetic changes, so results stay bitwise equal).
"""
from __future__ import annotations

import threading

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


_inside = threading.local()


def _with_self_expanded(op, shape_of):
    """``op(self, a, b, beta=, alpha=)`` with ``self`` expanded to the result's
    shape by a view in the graph, then ``op`` itself (traced as it is: the
    decomposition steps aside when ``op`` comes back to it). Measured on
    ``aten.baddbmm``: its meta kernel expands a broadcasting ``self`` inside
    the fake kernel, where torch 2.13's ``expand`` takes concrete sizes only
    ("SymIntArrayRef expected to contain only concrete integers"), so Bloom's
    ALiBi bias (``alibi.baddbmm(q, k)``, [batch*heads, 1, length]) failed the
    symbolic capture; ``aten.addbmm``'s meta kernel expands ``self`` the same
    way (read in torch's source, not seen failing). The kernels expand
    ``self`` the same way themselves, so the result is the same."""

    def decomposition(self, a, b, *, beta=1, alpha=1):
        outer = getattr(_inside, "op", None)
        if outer is op:
            return NotImplemented  # make_fx then traces the op as it is
        _inside.op = op
        try:
            return op(self.expand(shape_of(a, b)), a, b, beta=beta, alpha=alpha)
        finally:
            _inside.op = outer

    decomposition.__name__ = f"_{op.__name__.split('.')[0]}_self_expanded"
    return decomposition


SYMBOLIC_DECOMPOSITIONS = {
    aten.constant_pad_nd.default: _constant_pad_nd,
    aten.baddbmm.default: _with_self_expanded(aten.baddbmm.default, lambda a, b: (a.size(0), a.size(1), b.size(2))),
    aten.addbmm.default: _with_self_expanded(aten.addbmm.default, lambda a, b: (a.size(1), b.size(2))),
}
