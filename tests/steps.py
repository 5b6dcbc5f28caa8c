"""Training steps and model builders shared by the tests."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stepfx.testing.models import GPT, MLP, SmallCNN, gpt_config, lm_loss


def ce_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def lm_step(model, optimizer, idx):
    logits = model(idx[:, :-1])
    loss = lm_loss(logits, idx[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def hf_step(model, optimizer, input_ids):
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return out.loss


def mlp_batches(n=5, batch=6, d_in=8, classes=4, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]


def token_batches(n=5, batch=2, seq=9, vocab=64, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g),) for _ in range(n)]


def image_batches(n=5, batch=4, classes=5, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]


def tiny_gpt(**overrides):
    return GPT(gpt_config("tiny", **overrides))


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(cfg)


__all__ = [
    "ce_step",
    "lm_step",
    "hf_step",
    "mlp_batches",
    "token_batches",
    "image_batches",
    "tiny_gpt",
    "hf_gpt2",
    "hf_llama",
    "MLP",
    "SmallCNN",
]
