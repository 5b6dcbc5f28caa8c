"""stepfx.cast_buffers: under bf16/fp16 a floating buffer that meets the
16-bit weights in a matrix product (a sinusoidal position table, as XGLM
keeps one) is read in the compute dtype, as DeepSpeed's module.bfloat16()
holds every buffer; every other buffer stays as it is."""
from __future__ import annotations

import math

import pytest
import torch

import stepfx
from stepfx.errors import CaptureError
from stepfx.testing.equivalence import assert_step_equivalent, mixed_precision_reference
from tests.steps import lm_step

BF16 = {"bf16": {"enabled": True}, "gradient_clipping": 0}


class SinusoidalLM(torch.nn.Module):
    """Token embeddings plus a fixed fp32 sinusoid table (a buffer); ``ema``: a buffer the step writes."""

    def __init__(self, vocab=32, d=16, length=16, track=False):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        pos = torch.arange(length)[:, None] * torch.exp(torch.arange(0, d, 2) * (-math.log(1e4) / d))
        self.register_buffer("table", torch.cat([pos.sin(), pos.cos()], dim=1), persistent=False)
        self.register_buffer("scale", torch.ones(()))  # fp32, read elementwise: stays fp32
        self.track = track
        if track:
            self.register_buffer("ema", torch.zeros(length, d))
        self.mix = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        positions = self.table[: ids.shape[1]]
        if self.track:
            positions = self.ema[: ids.shape[1]].mul_(0.9).add_(0.1 * positions)
        h = self.emb(ids) + positions  # bf16 + fp32: fp32, which the bf16 weights then meet
        return self.head(torch.relu(self.mix(h)) * self.scale)


def _batches(steps=3, length=9):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 32, (2, length), generator=g),) for _ in range(steps)]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_a_read_only_buffer_meeting_16_bit_weights_is_read_in_bf16_as_deepspeed_holds_it():
    torch.manual_seed(0)
    model = SinusoidalLM()
    table = model.table.clone()
    step = stepfx.parallelize(BF16)(lm_step)
    opt = _adamw(model)
    for batch in _batches():
        step(model, opt, *batch)
    assert model.table.dtype == torch.float32 and torch.equal(model.table, table)  # its own value kept
    assert model.scale.dtype == torch.float32
    assert "buffers read in bf16, as DeepSpeed holds them (module.bfloat16()): table (fp32" in step.explain()
    reference = mixed_precision_reference(lm_step, torch.bfloat16, buffers=("table",))
    report = assert_step_equivalent(lm_step, SinusoidalLM, _adamw, _batches(), config=BF16, exact=True,
                                    reference_fn=reference)
    assert report.bitwise


def test_with_cast_buffers_off_the_step_is_refused_naming_the_buffer():
    torch.manual_seed(0)
    model = SinusoidalLM()
    step = stepfx.parallelize({**BF16, "stepfx": {"cast_buffers": False}})(lm_step)
    with pytest.raises(CaptureError, match=r"(?s)computed from the buffer\(s\) table.*stepfx.cast_buffers"):
        step(model, _adamw(model), *_batches(1)[0])


def test_a_buffer_the_step_writes_is_not_replaced_by_a_copy():
    torch.manual_seed(0)
    model = SinusoidalLM(track=True)
    step = stepfx.parallelize(BF16)(lm_step)
    with pytest.raises(CaptureError, match=r"(?s)buffer\(s\) ema.*the step writes ema"):
        step(model, _adamw(model), *_batches(1)[0])
    assert torch.equal(model.ema, torch.zeros(16, 16))


def test_xglm_trains_in_bf16_as_under_deepspeed():
    transformers = pytest.importorskip("transformers")
    from tests.steps import padded_batch, padded_step

    def xglm():
        return transformers.XGLMForCausalLM(transformers.XGLMConfig(
            vocab_size=64, d_model=16, ffn_dim=32, num_layers=2, attention_heads=2, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=0, eos_token_id=0))

    g = torch.Generator().manual_seed(3)
    batches = [(padded_batch(lengths, generator=g),) for lengths in ([5, 9], [12, 4], [3, 8])]
    reference = mixed_precision_reference(padded_step, torch.bfloat16, buffers=("model.embed_positions.weights",))
    report = assert_step_equivalent(padded_step, xglm, _adamw, batches, config=BF16, exact=True,
                                    reference_fn=reference)
    assert report.bitwise
