"""Training steps and model builders shared by the tests."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stepfx.testing.models import GPT, MLP, SmallCNN, gpt_config, lm_loss  # noqa: F401  (SmallCNN re-exported to the tests)


def ce_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def square_step(model, optimizer, x):
    """The mean square of the model's output, one update: the smallest whole step."""
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def image_step(model, optimizer, pixel_values, labels):
    """A Hugging Face image classifier's step (pixel_values, labels)."""
    out = model(pixel_values=pixel_values, labels=labels)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return out.loss


def scaled_ce_step(model, optimizer, x, y, blowup):
    """ce_step with the loss multiplied by ``blowup`` (a tensor): 1e30 overflows fp16 gradients."""
    loss = F.cross_entropy(model(x).float(), y) * blowup
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


def one_block_gpt():
    """The tiny GPT with one block (a picklable factory): about half the
    capture cost, for properties that do not depend on the depth."""
    return tiny_gpt(n_layers=1)


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def hf_bloom():
    """Bloom: ALiBi position bias added by ``alibi.baddbmm(q, k)`` with a
    broadcasting [batch*heads, 1, length] bias."""
    from transformers import BloomConfig, BloomForCausalLM

    cfg = BloomConfig(vocab_size=64, hidden_size=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0)
    return BloomForCausalLM(cfg)


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




def captured_mlp(optimizer="adamw", warm=True, dropout=0.0, frozen=False):
    """A freshly captured (not yet passed) step graph of a small MLP, plus
    the live model, optimizer and batch it was captured from. ``warm`` runs
    one eager step first so the optimizer state exists (steady-state graph)."""
    from stepfx.capture import capture_step

    torch.manual_seed(0)
    model = MLP((8, 16, 4), dropout=dropout)
    if frozen:
        model.net[0].bias.requires_grad_(False)
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    }[optimizer]
    opt = make([p for p in model.parameters() if p.requires_grad])
    x, y = mlp_batches(1)[0]
    if warm:
        ce_step(model, opt, x, y)
    graph = capture_step(ce_step, model, opt, (x, y), {})
    return graph, model, opt, (x, y)


def run_graph(graph, model, opt, batch):
    """Run a step graph on copies of the live state (nothing is written back)."""
    from stepfx.runtime import ModuleBinding

    binding = ModuleBinding(graph.signature, model, opt)
    inputs = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in binding.inputs(list(batch))]
    with torch.no_grad():
        return graph.gm(*inputs)


# picklable factories for data-parallel tests (rank processes import them)
def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def sgd_momentum(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)


def small_mlp():
    return MLP((8, 24, 16, 4))


def dp_batches(world, steps=3, kind="tokens", seed=7, **kw):
    """Per-rank batch lists: rank r's i-th batch differs from every other."""
    make = {"tokens": token_batches, "mlp": mlp_batches}[kind]
    return [make(steps, seed=seed + 1000 * r, **kw) for r in range(world)]


def adamw_single_tensor(model):
    """AdamW as stepfx traces it: the single-tensor algorithm (eager CUDA
    defaults to the foreach kernels, which round differently)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def sgd_single_tensor(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3, foreach=False)


def lm_step_bf16_reference(model, optimizer, idx):
    """lm_step as DeepSpeed's bf16 mode runs it (picklable for rank processes)."""
    from stepfx.testing.equivalence import mixed_precision_reference

    return mixed_precision_reference(lm_step, torch.bfloat16)(model, optimizer, idx)


def hf_step_bf16_reference(model, optimizer, input_ids):
    from stepfx.testing.equivalence import mixed_precision_reference

    return mixed_precision_reference(hf_step, torch.bfloat16)(model, optimizer, input_ids)


# the config blocks below, and the optimizer/scheduler they describe, built by hand
CONFIG_ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.1}}
CONFIG_WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 3}}


def config_adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.8, 0.99), eps=1e-7,
                             weight_decay=0.1, foreach=False)


def config_warmup(optimizer):
    from stepfx.schedules import WarmupLR

    return WarmupLR(optimizer, warmup_min_lr=1e-3, warmup_max_lr=1e-2, warmup_num_steps=3)


# -- padded variable-length batches (DataCollatorWithPadding + causal LM) -------


def padded_step(model, optimizer, batch):
    """A Hugging Face causal-LM step on a dict batch (input_ids, attention_mask, labels)."""
    out = model(**batch)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return out.loss


def padded_step_bf16_reference(model, optimizer, batch):
    from stepfx.testing.equivalence import mixed_precision_reference

    return mixed_precision_reference(padded_step, torch.bfloat16)(model, optimizer, batch)


def padded_batch(lengths, vocab=64, generator=None):
    """One batch padded to its longest sequence, as DataCollatorWithPadding
    pads it (right padding, attention mask 0 there) with causal-LM labels
    of -100 on the padding."""
    longest = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), longest), generator=generator)
    mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def padded_rank_batches(world, steps, batch=2, lo=3, hi=15, seed=0):
    """``[rank][step]`` padded batches whose lengths differ per rank and step."""
    g = torch.Generator().manual_seed(seed)
    return [[(padded_batch(torch.randint(lo, hi + 1, (batch,), generator=g).tolist(), generator=g),)
             for _ in range(steps)] for _ in range(world)]


class Top2MoE(torch.nn.Module):
    """A hand-written top-2 mixture of experts: each expert takes the rows
    routed to it (``torch.where``: a data-dependent number of rows) and
    ``index_add`` puts its weighted output back."""

    def __init__(self, d=16, experts=4, classes=5):
        super().__init__()
        self.router = torch.nn.Linear(d, experts)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.GELU(), torch.nn.Linear(32, d)) for _ in range(experts))
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x):
        weights, chosen = F.softmax(self.router(x), dim=-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return self.head(out)


def parallelized_steps(monkeypatch) -> list:
    """The steps ``stepfx.parallelize`` makes from here on in the test, in
    order — assert_step_equivalent's own among them —, so a test reads the
    plans of the very run it compared with eager instead of capturing a
    second run to count them."""
    import stepfx

    made = []
    real = stepfx.parallelize

    def recording(config=None):
        wrap = real(config)

        def decorate(fn):
            made.append(wrap(fn))
            return made[-1]

        return decorate

    monkeypatch.setattr(stepfx, "parallelize", recording)
    return made


def token_sum_step(model, optimizer, x, y, n_tokens):
    """Cross-entropy summed and divided by ``n_tokens``, a Python int each
    rank counts from its own batch (Hugging Face's ``num_items_in_batch``
    style): the step holds it as a constant, so each rank captures at its
    own new values."""
    loss = F.cross_entropy(model(x), y, reduction="sum") / n_tokens
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def maybe_update_step(model, optimizer, x, y, update):
    """ce_step whose update a Python flag skips (no backward, no collective)."""
    loss = F.cross_entropy(model(x), y)
    if update:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss


def token_lm_step(model, optimizer, idx, n_tokens):
    """lm_step's loss summed and divided by ``n_tokens``, a Python int the
    caller counts per rank (as Hugging Face passes ``num_items_in_batch``)."""
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1), reduction="sum")
    loss = loss / n_tokens
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def token_lm_step_bf16_reference(model, optimizer, idx, n_tokens):
    from stepfx.testing.equivalence import mixed_precision_reference

    return mixed_precision_reference(token_lm_step, torch.bfloat16)(model, optimizer, idx, n_tokens)
