"""transformers 4.x (and the GPU machine's 5.17) skips layers at random in
training with ``dropout_probability = torch.rand([])`` then
``if dropout_probability < self.layerdrop: continue`` (OPT, BART, mBART,
Whisper, M2M100, ...), layerdrop 0.0 by default. A branch on a device value
was refused as tensor-dependent control flow, so these models could not be
trained at all (found 2026-12-06 on the H100 with OPT). A uniform draw
compared with a number that every draw answers alike (``u < 0.0`` is never
true) is now a branch Python takes without reading the device; the draw
stays in the graph (it advances the generator, as in eager). A real
layerdrop (0 < p < 1) is still refused, naming the line."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from stepfx.errors import CaptureError
from stepfx.testing.equivalence import assert_step_equivalent
from tests.steps import lm_step as step, token_batches


class LayerDropNet(nn.Module):
    def __init__(self, layerdrop: float = 0.0, compare: str = "lt", vocab: int = 64, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.head = nn.Linear(d, vocab)
        self.layerdrop, self.compare = layerdrop, compare

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if self.compare == "lt" and dropout_probability < self.layerdrop:
                    continue
                if self.compare == "ge" and not (dropout_probability >= self.layerdrop):
                    continue
            h = h + F.dropout(torch.tanh(layer(h)), p=0.1, training=self.training)
        return self.head(h)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("compare", ["lt", "ge"])
def test_layerdrop_zero_trains_bitwise_eager_with_dropout(compare):
    report = assert_step_equivalent(step, lambda: LayerDropNet(0.0, compare), _sgd, token_batches(3), exact=True,
                                    config={"gradient_clipping": 0})
    assert report.bitwise and report.steps == 3


def test_the_draws_stay_in_the_graph():
    torch.manual_seed(0)
    model = LayerDropNet(0.0)
    s = stepfx.parallelize({"gradient_clipping": 0})(step)
    s(model, _sgd(model), *token_batches(1)[0])
    draws = [n for n in s.plan.graph.gm.graph.nodes if n.target is torch.ops.aten.rand.default]
    assert len(draws) == 3


def test_a_real_layerdrop_is_refused_with_the_line():
    torch.manual_seed(0)
    model = LayerDropNet(0.5)
    s = stepfx.parallelize({"gradient_clipping": 0})(step)
    with pytest.raises(CaptureError) as info:
        s(model, _sgd(model), *token_batches(1)[0])
    assert "dropout_probability < self.layerdrop" in str(info.value) and "random draw" in str(info.value)
    assert "layerdrop = 0" in str(info.value)
