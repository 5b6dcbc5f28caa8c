"""A step that draws random numbers on the host is refused at capture: the
draw would be baked into the graph and reused on every call."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import stepfx
from stepfx import CaptureError
from tests.steps import MLP, ce_step, mlp_batches

THIS_FILE = __file__.rstrip("c")


def _refused(step):
    model = MLP((8, 16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    ((x, y),) = mlp_batches(1)
    with pytest.raises(CaptureError) as info:
        stepfx.parallelize()(step)(model, optimizer, x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return info.value


def test_python_random_names_the_line():
    def step(model, optimizer, x, y):
        scale = random.random()  # the host draw
        loss = F.cross_entropy(model(x), y) * scale
        loss.backward()
        optimizer.step()
        return loss

    err = _refused(step)
    assert "draws random numbers on the host (random.random)" in str(err)
    assert err.source is not None and THIS_FILE in err.source and "scale = random.random()" in err.source
    assert "torch.rand" in str(err) and "argument" in str(err)


def test_numpy_random_names_the_line():
    def step(model, optimizer, x, y):
        keep = torch.from_numpy(np.random.rand(x.shape[0]) > 0.5)  # the host draw
        loss = F.cross_entropy(model(x)[keep], y[keep]) if keep.any() else F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    err = _refused(step)
    assert "(np.random.rand)" in str(err)
    assert "keep = torch.from_numpy(np.random.rand" in err.source


def test_unseeded_default_rng_is_refused():
    def step(model, optimizer, x, y):
        noise = torch.from_numpy(np.random.default_rng().standard_normal(x.shape).astype("float32"))
        loss = F.cross_entropy(model(x + noise), y)
        loss.backward()
        optimizer.step()
        return loss

    err = _refused(step)
    assert "default_rng() without a seed" in str(err) and "noise = " in err.source


def test_draw_bound_before_the_step_is_caught_by_the_state():
    from random import random as bound_random  # bypasses the module attribute

    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x), y) * bound_random()
        loss.backward()
        optimizer.step()
        return loss

    err = _refused(step)
    assert "changed the state of Python's random" in str(err)


def test_a_step_without_host_draws_is_unaffected_and_restores_the_modules():
    saved = (random.random, np.random.rand, np.random.default_rng)
    model = MLP((8, 16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = stepfx.parallelize()(ce_step)
    for x, y in mlp_batches(2):
        step(model, optimizer, x, y)
    assert (random.random, np.random.rand, np.random.default_rng) == saved


def _wav2vec2(**overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(4, 4), conv_kernel=(8, 8), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        mask_time_length=2, mask_time_min_masks=1, num_labels=3, **overrides,
    )
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForSequenceClassification(config).train()


def audio_step(model, optimizer, audio, labels):
    loss = model(input_values=audio, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _audio_batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 400, generator=g), torch.randint(0, 3, (2,), generator=g)) for _ in range(n)]


def test_wav2vec2_spec_augment_is_refused_naming_the_mask_draw():
    model = _wav2vec2(mask_time_prob=0.3, layerdrop=0.1)
    with pytest.raises(CaptureError) as info:
        stepfx.parallelize()(audio_step)(model, torch.optim.AdamW(model.parameters(), lr=1e-3), *_audio_batches(1)[0])
    assert "draws random numbers on the host (np.random.rand)" in str(info.value)
    assert "modeling_wav2vec2.py" in info.value.source and "_compute_mask_indices" in info.value.source


@pytest.mark.slow
def test_wav2vec2_without_masking_and_layerdrop_trains_like_eager():
    import copy

    model = _wav2vec2(mask_time_prob=0.0, layerdrop=0.0)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    step = stepfx.parallelize()(audio_step)
    for i, (audio, labels) in enumerate(_audio_batches(2)):
        torch.manual_seed(i)  # the same dropout masks
        loss = step(model, opt, audio, labels)
        torch.manual_seed(i)
        assert torch.equal(loss, audio_step(ref, ref_opt, audio, labels))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
