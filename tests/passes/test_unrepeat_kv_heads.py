"""unrepeat_kv_heads: grouped-query attention reads K/V unrepeated where the
kernel takes grouped heads (as eager's ``enable_gqa``), and nowhere else."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import stepfx
from stepfx.passes.cleanup.fold_causal_masks import _get, attention_ops
from stepfx.testing.equivalence import assert_step_equivalent
from tests.steps import hf_step, token_batches

transformers = pytest.importorskip("transformers")


def llama(kv_heads=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=kv_heads,
                                        max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                        attn_implementation="sdpa", use_cache=False))


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.1)


def _run(make, step_fn=hf_step, batches=None, config=None):
    torch.manual_seed(0)
    model = make()
    step = stepfx.parallelize(config or {"gradient_clipping": 0})(step_fn)
    opt = adamw(model)
    for batch in batches or token_batches(2):
        step(model, opt, *batch)
    return step


def _summary(step) -> str:
    return next(r.summary for r in step.plan.records if r.name == "unrepeat_kv_heads")


def _key_heads(step) -> list[int]:
    ops = attention_ops()
    return [_get(n, "key").meta["val"].shape[1] for n in step.plan.graph.gm.graph.nodes
            if n.op == "call_function" and n.target in ops]


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_heads_are_read_unrepeated_and_the_step_is_eager_bitwise(kv_heads):
    step = _run(lambda: llama(kv_heads))
    assert "2 grouped-query attention call(s) read K/V heads unrepeated" in _summary(step)
    assert _key_heads(step) == [kv_heads] * 4  # forward and backward of both layers
    nodes = step.plan.graph.gm.graph.nodes
    assert not any(n.target is torch.ops.aten.expand.default and len(n.meta["val"].shape) == 5 for n in nodes)
    report = assert_step_equivalent(hf_step, lambda: llama(kv_heads), adamw, token_batches(3), exact=True,
                                    config={"gradient_clipping": 0})
    assert report.bitwise


@pytest.mark.parametrize("kv_heads, bf16", [(1, True), (2, True), (2, False)], ids=["1-bf16", "2-bf16", "2-fp32"])
def test_with_a_padding_mask_the_backward_reads_repeats_made_just_before_it_and_is_eager_bitwise(kv_heads, bf16):
    # with a padding mask eager repeats K/V and sums the copies' K/V gradients after the kernel: in bf16 it rounds
    # each copy's to bf16 first, where the kernel would sum them in fp32 and round once (k_proj/v_proj drifted by
    # ~1e-4 after one AdamW step); in fp32 it adds them in another order than the kernel (the last bits of the K/V
    # projections after the first step). The forward reads the heads unrepeated, the backward the repeats, made
    # again from them right before it, not kept from the forward. (A batch without padding: transformers drops its
    # mask in eager and passes grouped heads; the captured step folds the causal mask it built and does the same)
    from stepfx.graph.step_graph import META_PHASE, Phase
    from stepfx.testing.equivalence import mixed_precision_reference
    from tests.steps import padded_batch, padded_step

    config = {"bf16": {"enabled": True}, "gradient_clipping": 0} if bf16 else {"gradient_clipping": 0}
    g = torch.Generator().manual_seed(3)
    batches = [(padded_batch(lengths, generator=g),) for lengths in ([5, 9], [12, 4], [3, 8])]
    step = _run(lambda: llama(kv_heads), padded_step, batches[:1], config)
    assert "with a padding mask (2 of them) the backward reads the repeats, made again" in _summary(step)
    assert _key_heads(step) == [kv_heads] * 2 + [4] * 2  # the forwards unrepeated, the backwards repeated
    nodes = list(step.plan.graph.gm.graph.nodes)
    ops = attention_ops()
    calls = [n for n in nodes if n.op == "call_function" and n.target in ops]
    for forward, backward in zip(calls[:2], calls[2:][::-1]):
        repeat = _get(backward, "key")
        expand = repeat
        while expand.target is not torch.ops.aten.expand.default:
            expand = expand.args[0]
        for node in (repeat, expand):
            assert nodes.index(forward) < nodes.index(node) < nodes.index(backward)
            assert node.meta[META_PHASE] is Phase.BACKWARD
    reference = mixed_precision_reference(padded_step, torch.bfloat16) if bf16 else None
    report = assert_step_equivalent(padded_step, lambda: llama(kv_heads), adamw, batches, exact=True, config=config,
                                    reference_fn=reference)
    assert report.bitwise


def test_in_bf16_without_a_mask_the_kernel_sums_the_heads_as_eager_does():
    # no mask: eager passes grouped heads itself (enable_gqa), so the kernel's fp32 sum is eager's
    from stepfx.testing.equivalence import mixed_precision_reference

    config = {"bf16": {"enabled": True}, "gradient_clipping": 0}
    step = _run(lambda: llama(1), config=config)
    assert "padding mask" not in _summary(step) and _key_heads(step) == [1] * 4
    report = assert_step_equivalent(hf_step, lambda: llama(1), adamw, token_batches(3), exact=True, config=config,
                                    reference_fn=mixed_precision_reference(hf_step, torch.bfloat16))
    assert report.bitwise


def test_without_a_kernel_that_takes_grouped_heads_nothing_changes(monkeypatch):
    from stepfx import compat

    monkeypatch.setattr(compat, "attention_ops_taking_grouped_kv", lambda device: frozenset())
    step = _run(llama)
    assert _summary(step) == "" and _key_heads(step) == [4] * 4
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    assert_step_equivalent(hf_step, llama, sgd, token_batches(2), rtol=1e-6, atol=1e-7, config={"gradient_clipping": 0},
                           resync=True)


class ReadsItsRepeats(torch.nn.Module):
    """Grouped-query attention whose repeated keys are also read by the loss."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), torch.nn.Linear(8, 3)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 2).transpose(1, 2)
        kv = self.kv(x).view(b, n, 2, 2).transpose(1, 2)
        rep = kv[:, :, None].expand(b, 2, 2, n, 2).reshape(b, 4, n, 2)
        y = F.scaled_dot_product_attention(q, rep, rep, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, 8)), rep.square().mean()


def repeats_step(model, optimizer, x, y):
    logits, extra = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + extra
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_repeats_read_elsewhere_are_kept():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 5, 8, generator=g), torch.randint(0, 3, (2, 5), generator=g)) for _ in range(2)]
    step = _run(ReadsItsRepeats, repeats_step, batches)
    assert "1 kept their repeated K/V" in _summary(step) and set(_key_heads(step)) == {4}
    assert_step_equivalent(repeats_step, ReadsItsRepeats, adamw, batches, rtol=1e-6, atol=1e-7,
                           config={"gradient_clipping": 0})


def test_symbolic_lengths():

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (2, n), generator=g),) for n in (5, 9, 12)]
    config = {"gradient_clipping": 0, "stepfx": {"dynamic": True}}
    step = _run(llama, batches=batches, config=config)
    assert len(step.plans) == 1 and "read K/V heads unrepeated" in _summary(step)
    report = assert_step_equivalent(hf_step, llama, adamw, batches, exact=True, config=config)
    assert report.bitwise


def test_the_mask_is_read_under_each_kernel_s_argument_name():
    """CPU's flash kernel takes ``attn_mask``, CUDA's cuDNN and memory-efficient kernels ``attn_bias``, CUDA's
    flash kernel none (found on the H100: a bf16 Llama with padding failed with KeyError 'attn_mask')."""
    import torch.fx as fx

    from stepfx.passes.cleanup.unrepeat_kv_heads import _mask

    aten = torch.ops.aten
    g = fx.Graph()
    q, k, v, m = (g.placeholder(n) for n in "qkvm")
    cpu = g.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, True),
                          {"attn_mask": m})
    cudnn = g.call_function(aten._scaled_dot_product_cudnn_attention.default, (q, k, v, m, True, 0.0, False, False))
    efficient = g.call_function(aten._scaled_dot_product_efficient_attention.default, (q, k, v, m, True))
    flash = g.call_function(aten._scaled_dot_product_flash_attention.default, (q, k, v, 0.0, True))
    assert [_mask(n) for n in (cpu, cudnn, efficient, flash)] == [m, m, m, None]
