"""fold_causal_masks: attention masks that are SDPA's causal mask, computed
from shapes only, become ``is_causal=True``; every other mask stays."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import stepfx
from stepfx.passes.cleanup.fold_causal_masks import _get, _is_causal_mask, attention_ops
from stepfx.testing.equivalence import assert_step_equivalent

transformers = pytest.importorskip("transformers")


class MaskedAttention(torch.nn.Module):
    """One attention layer whose mask ``kind`` is built in forward."""

    def __init__(self, kind: str, d: int = 16, heads: int = 2):
        super().__init__()
        self.kind, self.heads = kind, heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, 4)

    def mask(self, x, pad):
        n = x.shape[1]
        ones = torch.ones(n, n, dtype=torch.bool, device=x.device)
        if self.kind == "bool_tril":
            return ones.tril()
        if self.kind == "float_triu":
            return torch.full((n, n), float("-inf"), device=x.device).triu(1)
        if self.kind == "window":  # sliding window of 2: not causal
            return ones.tril() & ones.triu(-2)
        if self.kind == "wide_window":  # sliding window of 8: causal up to 8 positions, not beyond
            return ones.tril() & ones.triu(-8)
        if self.kind == "soft":  # -1e4 does not underflow every softmax weight to 0
            return torch.full((n, n), -1e4, device=x.device).triu(1)
        if self.kind == "padding":  # from the batch's values
            return ones.tril()[None, None] & pad[:, None, None, :].bool()
        raise ValueError(self.kind)

    def forward(self, x, pad):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(x, pad))
        return self.out(y.transpose(1, 2).reshape(b, n, d))


def attention_step(model, optimizer, x, pad, y):
    loss = F.cross_entropy(model(x, pad).flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _batches(lengths=(7, 7, 7), batch=3):
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        pad = torch.ones(batch, n, dtype=torch.long)
        pad[0, n - 2:] = 0
        out.append((torch.randn(batch, n, 16, generator=g), pad, torch.randint(0, 4, (batch, n), generator=g)))
    return out


def _attention_calls(step):
    ops = attention_ops()
    return [n for n in step.plan.graph.gm.graph.nodes if n.op == "call_function" and n.target in ops]


def _run(kind, lengths=(7, 7, 7), config=None):
    torch.manual_seed(0)
    model = MaskedAttention(kind)
    step = stepfx.parallelize(config or {"gradient_clipping": 0})(attention_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in _batches(lengths):
        step(model, opt, *batch)
    return step


def _summary(step) -> str:
    return next(r.summary for r in step.plan.records if r.name == "fold_causal_masks")


@pytest.mark.parametrize("kind", ["bool_tril", "float_triu"])
def test_a_causal_mask_built_from_the_length_becomes_is_causal(kind):
    step = _run(kind)
    calls = _attention_calls(step)
    assert len(calls) == 2  # forward and backward
    ops = attention_ops()
    for node in calls:
        mask_name = ops[node.target][0]
        assert _get(node, mask_name) is None and _get(node, "is_causal") is True
    assert "1 causal mask(s) folded" in _summary(step)
    # the mask's computation is gone with it
    assert not any(n.target in (torch.ops.aten.tril.default, torch.ops.aten.triu.default) for n in step.plan.graph.gm.graph.nodes)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    report = assert_step_equivalent(attention_step, lambda: MaskedAttention(kind), sgd, _batches(), rtol=1e-6, atol=1e-7,
                                    config={"gradient_clipping": 0})
    assert report.steps == 3


@pytest.mark.parametrize("kind, why", [("window", "not the causal mask"), ("soft", "not the causal mask"),
                                       ("padding", "computed from input")])
def test_other_masks_are_kept_with_the_reason(kind, why):
    step = _run(kind)
    assert all(_get(n, "attn_mask") is not None for n in _attention_calls(step))
    assert why in _summary(step)


def test_a_symbolic_length_is_folded_after_trial_sizes():
    step = _run("bool_tril", lengths=(5, 9, 12), config={"gradient_clipping": 0, "stepfx": {"dynamic": True}})
    assert len(step.plans) == 1
    assert "1 causal mask(s) folded" in _summary(step)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    assert_step_equivalent(attention_step, lambda: MaskedAttention("bool_tril"), sgd, _batches((5, 9, 12)), rtol=1e-6,
                           atol=1e-7, config={"gradient_clipping": 0, "stepfx": {"dynamic": True}})


def test_a_symbolic_window_mask_is_kept():
    # causal at no trial size but 1: every trial must pass
    step = _run("window", lengths=(5, 9), config={"gradient_clipping": 0, "stepfx": {"dynamic": True}})
    assert "not the causal mask" in _summary(step)


def test_a_symbolic_window_wider_than_every_trial_size_is_evaluated_past_it():
    # first length 5 and the trial sizes 1, 3, 7 are all inside the window of 8: the mask is causal at each of them,
    # not at the lengths 12 and 16 that the same plan serves. The window's constant makes it evaluated at 10 too
    lengths = (5, 12, 16)
    config = {"gradient_clipping": 0, "stepfx": {"dynamic": True}}
    step = _run("wide_window", lengths=lengths, config=config)
    assert len(step.plans) == 1 and "not the causal mask at sizes" in _summary(step)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    assert_step_equivalent(attention_step, lambda: MaskedAttention("wide_window"), sgd, _batches(lengths), rtol=1e-6,
                           atol=1e-7, config=config)


def test_hugging_face_masks_under_symbolic_lengths_are_folded():
    # their computation reads the length and the length + 1: each trial evaluates both from the one length (setting
    # every size read to the trial size failed with an IndexError, and the masks were kept)
    from tests.steps import hf_step

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (2, n), generator=g),) for n in (5, 9, 12)]
    config = {"gradient_clipping": 0, "stepfx": {"dynamic": True}}
    torch.manual_seed(0)
    model = _llama_without_cache()
    step = stepfx.parallelize(config)(hf_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches:
        step(model, opt, *batch)
    assert len(step.plans) == 1 and _summary(step).startswith("2 causal mask(s) folded"), _summary(step)
    assert all(_get(n, "attn_mask") is None for n in _attention_calls(step))
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    assert_step_equivalent(hf_step, _llama_without_cache, sgd, batches, exact=True, config=config)


def _llama_without_cache():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                      attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(cfg)


def test_hugging_face_masks_built_because_of_tracing_are_folded(monkeypatch):
    """transformers cannot rule out packed sequences under tracing, so with
    use_cache=False it builds the causal mask itself; eager calls SDPA with
    is_causal. After the pass no attention reads a mask, and explain()
    says so next to the library's tracing path. The layers' masks are
    computed alike: evaluated once."""
    from stepfx.passes.cleanup import fold_causal_masks as pass_module
    from tests.steps import hf_step, token_batches

    evaluated = []
    real = pass_module._evaluate
    monkeypatch.setattr(pass_module, "_evaluate", lambda *a, **k: evaluated.append(a[3]) or real(*a, **k))
    torch.manual_seed(0)
    model = _llama_without_cache()
    step = stepfx.parallelize({"gradient_clipping": 0})(hf_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in token_batches(2):
        step(model, opt, *batch)
    calls = _attention_calls(step)
    assert len(calls) == 4 and all(_get(n, "attn_mask") is None and _get(n, "is_causal") is True for n in calls)
    folded = next(r.summary for r in step.plan.records if r.name == "fold_causal_masks")
    assert folded.startswith("2 causal mask(s) folded") and len(evaluated) == 1, (folded, evaluated)
    text = step.explain()
    assert "undone where it built SDPA's causal mask" in text
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    assert_step_equivalent(hf_step, _llama_without_cache, sgd, token_batches(3), rtol=1e-6, atol=1e-7,
                           config={"gradient_clipping": 0})


def test_the_causal_check_itself():
    n = 5
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    assert _is_causal_mask(tril) and _is_causal_mask(tril.expand(2, 3, n, n))
    assert not _is_causal_mask(tril.T) and not _is_causal_mask(torch.ones(n, n, dtype=torch.bool))
    additive = torch.zeros(n, n).masked_fill(~tril, -65504.0)
    assert _is_causal_mask(additive) and _is_causal_mask(additive.masked_fill(~tril, -math.inf))
    assert not _is_causal_mask(additive.masked_fill(~tril, -1e4))
    assert not _is_causal_mask(additive + 1) and not _is_causal_mask(tril.long())
    # rectangular: top-left aligned, as SDPA's is_causal
    assert _is_causal_mask(torch.ones(3, 5, dtype=torch.bool).tril())
