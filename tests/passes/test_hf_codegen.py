"""Codegen on Hugging Face decoders: tiny configs of each family in the
installed transformers, the whole step with codegen on against eager, per
step within 1e-5 (fp32, SGD with momentum, each step from the same state).

What each family must come out with: the LM head and the model's own
causal-LM loss (fp32 logits, shifted labels, ignore_index) as one chunked
linear + cross-entropy call; the causal mask transformers builds under
tracing (``use_cache=False``) folded into ``is_causal``; and the hand-written
pieces around the matmuls — RMSNorm with its residual add, rotary
embeddings (slices, neg, cat), SwiGLU / GeGLU, their backward — in generic
regions, each region one phase. Inductor is swapped for the regions' own fx
code here (what is tested is which ops go together and how they are
wired); the CPU kernels are Triton's interpreter.
"""
from __future__ import annotations

import pytest
import torch

import stepfx
from stepfx.passes.cleanup.fold_causal_masks import _get, attention_ops
from stepfx.testing.equivalence import assert_step_equivalent
from tests.rotation import rotating
from tests.steps import hf_step, token_batches

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=61, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
             use_cache=False, attn_implementation="sdpa")
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=24, num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(intermediate_size=24, num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=24, num_key_value_heads=2)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(intermediate_size=24, num_key_value_heads=2, pad_token_id=0)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(intermediate_size=24, num_key_value_heads=1, head_dim=4)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=16, n_layer=2, n_head=4, n_positions=32, attn_pdrop=0.0,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(intermediate_size=24, rotary_pct=0.5, hidden_dropout=0.0,
                                                             attention_dropout=0.0)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=24, word_embed_proj_dim=16, dropout=0.0)),
}
HAS_ROTARY = {"llama", "mistral", "qwen2", "phi3", "gemma", "gpt_neox"}
HAS_RMS_NORM = {"llama", "mistral", "qwen2", "phi3", "gemma"}
CONFIG = {"stepfx": {"codegen": True}, "gradient_clipping": 0}


def make(family):
    config_cls, model_cls, shape = FAMILIES[family]
    if not hasattr(transformers, config_cls):
        pytest.skip(f"{config_cls} is not in transformers {transformers.__version__}")
    kwargs = dict(SMALL) if family not in ("gpt2",) else {k: v for k, v in SMALL.items()
                                                         if k in ("vocab_size", "use_cache", "attn_implementation")}
    config = getattr(transformers, config_cls)(**kwargs, **shape)
    return getattr(transformers, model_cls)(config)


@pytest.fixture
def regions_as_their_ops(monkeypatch):
    from stepfx import compat
    from stepfx.passes.fusion import fuse_generic_regions

    monkeypatch.setattr(fuse_generic_regions, "ON_CPU", True)
    monkeypatch.setattr(compat, "compile_region", lambda gm, dynamic=False: gm)


@pytest.mark.parametrize("family", rotating(sorted(FAMILIES), 4, salt="hf-codegen"))
def test_hugging_face_family_with_codegen_equals_eager(regions_as_their_ops, family):
    torch.manual_seed(0)
    model = make(family)
    step = stepfx.parallelize(CONFIG)(hf_step)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    batches = token_batches(2, batch=3, seq=11, vocab=61)
    opt = sgd(model)
    for batch in batches:
        step(model, opt, *batch)
    nodes = list(step.plan.graph.gm.graph.nodes)
    names = [getattr(n.target, "__name__", "") for n in nodes if n.op == "call_function"]
    assert names.count("linear_cross_entropy") == 1, "the LM head + HF loss is not one chunked kernel"
    aten = torch.ops.aten
    assert not {aten._log_softmax.default, aten.nll_loss_forward.default} & {n.target for n in nodes}
    ops = attention_ops()
    calls = [n for n in nodes if n.op == "call_function" and n.target in ops]
    assert calls and all(_get(n, ops[n.target][0]) is None and _get(n, "is_causal") is True for n in calls)
    regions = [n for n in nodes if getattr(n.target, "__name__", "") == "run_region"]
    assert regions
    # a region is one phase: nothing computed in forward for the backward's sake (a full-size fp32 tensor kept)
    for r in regions:  # each output keeps the phase of the op it was
        assert {g.meta.get("phase") for g in r.users} == {r.meta.get("phase")}, r.name
    if family in HAS_RMS_NORM:  # every RMSNorm, forward and backward, on stepfx's kernels
        assert names.count("rms_norm") == names.count("rms_norm_backward") == model.config.num_hidden_layers * 2 + 1
        assert not any(n.target is aten.rsqrt.default for n in nodes)
    if family in HAS_ROTARY:
        from stepfx.codegen.regions import REGIONS

        keys = {n.args[0] for n in regions}
        assert any("aten.cat.default" in REGIONS[k].ops for k in keys), "rotary embedding left out of the regions"
    report = assert_step_equivalent(hf_step, lambda: make(family), sgd, batches, config=CONFIG, rtol=1e-5, atol=1e-7,
                                    resync=True)
    assert report.steps == 2


def test_bf16_llama_with_codegen_is_no_further_from_fp32_than_unfused_bf16(regions_as_their_ops):
    """bf16 over 8 AdamW steps of the tiny Llama: the fused step's worst
    relative loss error against the fp32 step is at most twice the unfused
    bf16 step's own (both round to bf16 elsewhere; steps amplify it)."""
    torch.manual_seed(0)
    models = [make("llama") for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    bf16 = {"bf16": {"enabled": True}}
    steps = [stepfx.parallelize({**CONFIG, **bf16})(hf_step),
             stepfx.parallelize({**CONFIG, **bf16, "stepfx": {"codegen": False}})(hf_step),
             stepfx.parallelize({**CONFIG, "stepfx": {"codegen": False}})(hf_step)]
    errs = [[], []]
    for (batch,) in token_batches(8, batch=3, seq=11, vocab=61):
        fused, plain, fp32 = (s(m, o, batch).item() for s, m, o in zip(steps, models, opts))
        errs[0].append(abs(fused - fp32) / abs(fp32))
        errs[1].append(abs(plain - fp32) / abs(fp32))
    names = [getattr(n.target, "__name__", "") for n in steps[0].plan.graph.gm.graph.nodes]
    assert "linear_cross_entropy" in names and "run_region" in names
    assert max(errs[0]) <= 2 * max(errs[1]), (errs[0], errs[1])
