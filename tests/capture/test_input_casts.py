"""bf16 with floating-point batch inputs (images, audio features):
``stepfx.cast_inputs`` (None = on under bf16/fp16) casts them to the compute
dtype as the Hugging Face Trainer does for DeepSpeed; with it off, a dtype
mismatch in a matrix product is refused at capture with the user's line
(capture/checks.py: check_operand_dtypes).

Tolerances: bitwise against the eager mixed-precision step that casts its
inputs the same way (the same ops in the same order).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from stepfx import CaptureError
from stepfx.testing.equivalence import assert_step_equivalent, mixed_precision_reference
from tests.steps import adamw, image_step

BF16 = {"bf16": {"enabled": True}, "gradient_clipping": 0}
THIS_FILE = __file__.rstrip("c")


def tiny_vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=5,
    ))


def tiny_whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=64, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    ))


vit_step = image_step


def whisper_step(model, optimizer, input_features, labels):
    out = model(input_features=input_features, labels=labels)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return out.loss


def _image_batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 5, (2,), generator=g)) for _ in range(n)]


def _audio_batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 8, 16, generator=g), torch.randint(3, 64, (2, 5), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("make, step, batches", [(tiny_vit, vit_step, _image_batches), (tiny_whisper, whisper_step, _audio_batches)],
                         ids=["vit", "whisper"])
def test_bf16_with_float_inputs_equals_the_eager_mixed_precision_step(make, step, batches):
    reference = mixed_precision_reference(step, torch.bfloat16, cast_inputs=True)
    report = assert_step_equivalent(step, make, adamw, batches(), config=BF16, reference_fn=reference, exact=True)
    assert report.bitwise


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)))


def conv_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_cast_inputs_is_on_by_default_under_bf16():
    torch.manual_seed(0)
    model = ConvNet()
    step = stepfx.parallelize(BF16)(conv_step)
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 5, (2,))
    step(model, adamw(model), x, y)
    (conv,) = [n for n in step.graphs["capture"].gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
    assert conv.args[0].meta["val"].dtype is torch.bfloat16
    assert x.dtype is torch.float32  # the caller's tensor is not changed


class LinearNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)  # the offending line


def test_a_dtype_mismatch_without_cast_inputs_is_refused_at_capture_with_the_line():
    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()
        return loss

    model = LinearNet()
    before = [p.detach().clone() for p in model.parameters()]
    compiled = stepfx.parallelize({**BF16, "stepfx": {"cast_inputs": False}})(step)
    with pytest.raises(CaptureError) as info:
        compiled(model, adamw(model), torch.randn(6, 8), torch.randint(0, 4, (6,)))
    msg = str(info.value)
    assert "different dtypes (bfloat16, float32)" in msg and "cast_inputs" in msg
    assert info.value.source is not None and THIS_FILE in info.value.source and "return self.fc(x)" in info.value.source
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
