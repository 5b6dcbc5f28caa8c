"""Hugging Face transformers counts fake tensors as tracing: a causal LM with
``use_cache=False`` and no attention mask then builds an explicit causal mask
(it cannot read the position ids to rule out packed sequences) where eager
calls SDPA with ``is_causal=True`` — and, the mask in hand, repeats the
grouped K/V heads where eager passes ``enable_gqa``. ``fold_causal_masks``
and ``unrepeat_kv_heads`` undo both, so the step is bitwise eager's again;
explain() still names the library line that took the path and the model
line that led there, and says what was undone. With the cache object (the
default) the check is not made at all."""
from __future__ import annotations

import pytest
import torch

import stepfx
from stepfx.testing.equivalence import assert_step_equivalent
from tests.steps import adamw, sgd_momentum

transformers = pytest.importorskip("transformers")


def qwen2(use_cache: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                        use_cache=use_cache))


def lm_step(model, optimizer, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _batches(n=4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(1, 64, (2, 12), generator=g),) for _ in range(n)]


def test_qwen2_without_cache_is_bitwise_and_explain_names_the_tracing_path():
    for make_optimizer in (sgd_momentum, adamw):
        report = assert_step_equivalent(lm_step, lambda: qwen2(False), make_optimizer, _batches(), exact=True)
        assert report.steps == 4 and report.bitwise
    torch.manual_seed(0)
    model = qwen2(False)
    step = stepfx.parallelize({"gradient_clipping": 0})(lm_step)
    step(model, adamw(model), *_batches(1)[0])
    text = step.explain()
    assert "the model's library saw tracing" in text
    assert "masking_utils.py:" in text and "in find_packed_sequence_indices" in text
    assert "modeling_qwen2.py:" in text and "create_causal_mask(" in text
    assert "undone where it built SDPA's causal mask" in text


def test_qwen2_with_its_cache_object_is_bitwise_and_has_no_such_note():
    report = assert_step_equivalent(lm_step, lambda: qwen2(True), adamw, _batches(), exact=True)
    assert report.bitwise
    torch.manual_seed(0)
    model = qwen2(True)
    step = stepfx.parallelize({"gradient_clipping": 0})(lm_step)
    step(model, adamw(model), *_batches(1)[0])
    assert "saw tracing" not in step.explain()
