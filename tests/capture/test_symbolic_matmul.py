"""With symbolic batch sizes, ``torch.matmul`` / ``@`` of batched matrices
runs as the ops the composite runs (``compat.matmul_with_symbolic_sizes``):
on torch 2.11 the C++ composite read the sizes as ints, and Hugging Face's
rotary embedding (``inv_freq_expanded @ position_ids_expanded``) put a guard
``Eq(length, 83)`` on every Llama-family step on the GPU machine, captured
again at every new length (2026-12-06). torch 2.13 (this machine) does not
specialize there, so these tests check what the shim must keep: the same
bits as matmul, no guard on the length, the step bitwise eager with two
captures, and torch's own methods restored after the capture."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from stepfx import compat
from stepfx.testing.equivalence import assert_step_equivalent
from tests.steps import lm_step, parallelized_steps


@pytest.mark.parametrize("shapes", [((3, 8, 1), (3, 1, 11)), ((2, 4, 11, 8), (2, 4, 8, 11)), ((2, 3, 5), (2, 5, 7))])
def test_the_same_bits_as_matmul(shapes):
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(*s, generator=g) for s in shapes)

    def shim(x, y):
        return compat.matmul_with_symbolic_sizes(x, y)

    traced = make_fx(shim, tracing_mode="symbolic")(a, b)
    assert torch.equal(traced(a, b), a @ b)
    env = next(n.meta["val"] for n in traced.graph.nodes if n.op == "placeholder").fake_mode.shape_env
    assert not [g for g in env.guards if "Eq(" in str(g.expr) and any(str(v) in str(g.expr) for v in ("11", "7"))]


def test_other_operands_are_left_to_torch():
    a = torch.randn(2, 3, 4)
    assert compat.matmul_with_symbolic_sizes(a, torch.randn(2, 4, 5)) is None  # static sizes
    traced_none = []

    def probe(x, y, z):
        traced_none.append(compat.matmul_with_symbolic_sizes(x, y) is None)  # broadcast batch
        traced_none.append(compat.matmul_with_symbolic_sizes(x, z) is None)  # a matrix: the fold into one mm
        return x

    make_fx(probe, tracing_mode="symbolic")(torch.randn(2, 3, 4), torch.randn(1, 4, 5), torch.randn(4, 5))
    assert traced_none == [True, True]


class Rotary(nn.Module):
    """Rotary embedding as transformers wrote it before 5.2x (the GPU machine's version), and eager attention
    scores with ``@``."""

    def __init__(self, vocab=32, d=16, heads=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, vocab)
        self.heads = heads
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d // heads, 2).float() / (d // heads))),
                             persistent=False)

    def forward(self, ids):
        b, t = ids.shape
        position_ids = torch.arange(t, device=ids.device)[None].expand(b, t)
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(b, -1, 1)
        freqs = (inv_freq_expanded @ position_ids[:, None, :].float()).transpose(1, 2)
        cos = torch.cat((freqs, freqs), dim=-1).cos()[:, None]
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.emb(ids)).chunk(3, dim=-1))
        q, k = q * cos, k * cos
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        scores = (q @ k.transpose(-1, -2)).masked_fill(~causal, float("-inf")) / q.shape[-1] ** 0.5
        h = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        return self.out(h)


def test_a_rotary_step_with_new_lengths_is_bitwise_eager_with_two_captures(monkeypatch):
    made = parallelized_steps(monkeypatch)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 32, (2, t), generator=g),) for t in (9, 13, 7, 16)]
    used = []
    real = compat.matmul_with_symbolic_sizes
    monkeypatch.setattr(compat, "matmul_with_symbolic_sizes", lambda a, b: used.append(real(a, b)) or used[-1])
    assert_step_equivalent(lm_step, Rotary, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), batches,
                           exact=True, config={"gradient_clipping": 0, "stepfx": {"dynamic": "auto"}})
    assert len(made[0].plans) == 2 and made[0].plans[1].guard is not None
    assert sum(u is not None for u in used) == 3  # the rotary product, the scores, the weighted values
    assert "__matmul__" not in torch.Tensor.__dict__ and "matmul" not in torch.Tensor.__dict__
    assert torch.matmul is torch._C._VariableFunctions.matmul
