"""recompute_activations: the backward recomputes forward values under a
memory budget (a minimum cut per level), the step stays bitwise what it was,
and what the model checkpoints itself is captured as it is."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from stepfx.graph.ops import ATTENTION_OPS
from stepfx.graph.accounting import estimate_memory
from stepfx.graph.ops import is_random
from stepfx.graph.step_graph import META_PHASE, Phase
from stepfx.passes.memory.recompute_activations import META_RECOMPUTED
from stepfx.testing.equivalence import assert_step_equivalent
from tests.steps import adamw, ce_step, lm_step, tiny_gpt, token_batches


def _gpt():
    return tiny_gpt(seq_len=64, d_model=32)


def _four_block_gpt():
    # per-block recomputation ("all") holds one whole block's recomputed values in its backward: with two
    # blocks that working set outweighs what it saves over "matmuls"; from four blocks on it does not
    return tiny_gpt(seq_len=64, d_model=32, n_layers=4)


def _batches(n=2):
    return token_batches(n, batch=4, seq=64)


def _run(config, make=_gpt, step_fn=lm_step, batches=None):
    torch.manual_seed(0)
    model = make()
    opt = adamw(model)
    step = stepfx.parallelize(config)(step_fn)
    for batch in batches or _batches(1):
        step(model, opt, *batch)
    return step


def _summary(step) -> str:
    return next(r.summary for r in step.plan.records if r.name == "recompute_activations")


def _copies(step) -> list:
    return [n for n in step.plan.graph.gm.graph.nodes if META_RECOMPUTED in n.meta]


def test_budgets_pick_a_level_lower_the_peak_and_keep_the_step_bitwise():
    # bitwise the step without recomputation (which equals the eager step: the capture tests)
    batches = _batches()
    base = _run({"gradient_clipping": 0}, make=_four_block_gpt, batches=batches)
    peak0 = estimate_memory(base.plan.graph).peak
    assert not _copies(base)
    peaks = {}
    for budget, level in ((0.7, "cheap"), (0.4, "matmuls"), (0.0, "all")):
        config = {"gradient_clipping": 0, "stepfx": {"activation_memory_budget": budget}}
        step = _run(config, make=_four_block_gpt, batches=batches)
        summary = _summary(step)
        assert f"level '{level}'" in summary and "cheap: saves" in summary and "all: saves" in summary
        copies = _copies(step)
        assert copies and all(n.meta[META_PHASE] == Phase.BACKWARD for n in copies)
        targets = {n.target for n in copies}
        assert (torch.ops.aten.mm.default in targets) == (level != "cheap")
        assert bool(targets & ATTENTION_OPS) == (level == "all")  # attention (no dropout) only at "all"
        # every copy reads what is alive in the backward: inputs, saved values, or other copies
        for n in copies:
            first_reader = min((u for u in n.users), key=list(step.plan.graph.gm.graph.nodes).index)
            assert first_reader.meta.get(META_PHASE) != Phase.FORWARD
        peaks[budget] = estimate_memory(step.plan.graph).peak
        ours, theirs = step.model_state_dict(), base.model_state_dict()
        assert all(torch.equal(ours[n], theirs[n]) for n in theirs), level
    assert peaks[0.0] < peaks[0.4] < peaks[0.7] < peak0, (peaks, peak0)


def test_all_level_recomputes_every_block_from_its_input():
    # the residual stream's values are every other shared value; multi-output ops (attention, LayerNorm)
    # are read by several getitems but are not on the stream: counted among them, they shifted which values
    # were kept from block to block (half the blocks kept their attention, a quarter of the norms were saved)
    step = _run({"gradient_clipping": 0, "stepfx": {"activation_memory_budget": 0.0}}, make=_four_block_gpt)
    assert "level 'all'" in _summary(step)
    targets = [n.target for n in _copies(step)]
    assert sum(t in ATTENTION_OPS for t in targets) == 4  # each block's attention, once
    assert targets.count(torch.ops.aten.native_layer_norm.default) == 2 * 4 + 1  # both norms of each, and ln_f
    saved_adds = {n.name for n in step.plan.graph.gm.graph.nodes
                  if n.target is torch.ops.aten.add.Tensor and n.meta.get(META_PHASE) == Phase.FORWARD
                  and any(u.meta.get(META_PHASE) == Phase.BACKWARD and META_RECOMPUTED in u.meta for u in n.users)}
    assert len(saved_adds) == 4, saved_adds  # the embedding's sum and the three later block inputs


def test_no_budget_or_budget_one_recomputes_nothing():
    assert _summary(_run({"gradient_clipping": 0})) == ""
    step = _run({"gradient_clipping": 0, "stepfx": {"activation_memory_budget": 1.0}})
    assert not _copies(step) and "nothing recomputed" in _summary(step)


def test_deepspeed_activation_checkpointing_block_means_budget_zero():
    step = _run({"gradient_clipping": 0, "activation_checkpointing": {"partition_activations": False,
                                                                     "number_checkpoints": 2}})
    assert _summary(step).startswith("budget 0 x") and _copies(step)


def test_budget_out_of_range_is_a_config_error():
    with pytest.raises(stepfx.ConfigError, match="stepfx.activation_memory_budget"):
        stepfx.parallelize({"stepfx": {"activation_memory_budget": 1.5}})(lm_step)


class _DropoutMLP(nn.Module):
    def __init__(self, checkpointed=False):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.checkpointed = checkpointed

    def block(self, x):
        return F.dropout(F.gelu(self.b(x)), 0.3, self.training)

    def forward(self, x):
        x = F.gelu(self.a(x))
        x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return self.c(x)


def _xy(n=2):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_random_ops_are_never_recomputed_and_user_checkpoints_are_honoured(checkpointed):
    config = {"gradient_clipping": 0, "stepfx": {"activation_memory_budget": 0.0}}
    make = lambda: _DropoutMLP(checkpointed)
    step = _run(config, make=make, step_fn=ce_step, batches=_xy(1))
    assert _copies(step) and not any(is_random(n) for n in _copies(step))
    report = assert_step_equivalent(ce_step, make, adamw, _xy(), exact=True, config=config)
    assert report.bitwise


def test_bf16_recomputed_step_is_bitwise_the_saved_one():
    losses = {}
    for budget in (None, 0.0):
        torch.manual_seed(0)
        model = _gpt()
        opt = adamw(model)
        step = stepfx.parallelize({"bf16": {"enabled": True}, "gradient_clipping": 1.0,
                                   "stepfx": {"activation_memory_budget": budget}})(lm_step)
        losses[budget] = ([step(model, opt, *b).item() for b in _batches()], [p.detach().clone() for p in model.parameters()])
    assert losses[None][0] == losses[0.0][0]
    assert all(torch.equal(a, b) for a, b in zip(losses[None][1], losses[0.0][1]))


def _checkpointed_gpt2():
    from tests.steps import hf_gpt2

    model = hf_gpt2()  # dropout 0.1 on embeddings, attention and residuals
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def test_hugging_face_gradient_checkpointing_with_dropout_equals_eager():
    """Hugging Face's gradient_checkpointing_enable() recomputes each block in
    the backward with the forward's RNG state: captured, the recomputed dropout
    reuses the forward's mask (replay_checkpoint_randomness), bitwise eager."""
    pytest.importorskip("transformers")
    from tests.steps import hf_step

    step = _run({"gradient_clipping": 0}, make=_checkpointed_gpt2, step_fn=hf_step, batches=token_batches(1))
    summary = next(r.summary for r in step.plan.records if r.name == "replay_checkpoint_randomness")
    assert "reuse the forward's draw" in summary
    report = assert_step_equivalent(hf_step, _checkpointed_gpt2, adamw, token_batches(2), exact=True,
                                    config={"gradient_clipping": 0})
    assert report.bitwise


def test_measured_peak_falls_as_predicted():
    """What the step really allocates (stepfx.testing.memory: every op's
    result tracked until its last reference is gone), without and with
    recomputation, against the liveness prediction (graph/accounting.py):
    within 10% (the prediction also counts the inputs held all step), and the
    recomputing step's measured peak well below the saving one's."""
    import gc

    from stepfx.testing.memory import measure_memory

    make = lambda: tiny_gpt(seq_len=128, d_model=64, n_layers=3)
    batch = token_batches(1, batch=8, seq=128)[0]
    measured = {}
    for budget in (None, 0.0):
        torch.manual_seed(0)
        model = make()
        opt = adamw(model)
        step = stepfx.parallelize({"gradient_clipping": 1.0, "stepfx": {"activation_memory_budget": budget}})(lm_step)
        step(model, opt, *batch)
        held = [*model.parameters(), *batch] + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        gc.collect()
        memory = measure_memory(lambda s=step, m=model, o=opt: s(m, o, *batch), held)
        est = estimate_memory(step.plan.graph)
        predicted = est.peak - est.resident
        assert abs(predicted - memory.peak) <= 0.1 * memory.peak, (budget, predicted, memory.peak)
        measured[budget] = memory.peak
    assert measured[0.0] < 0.6 * measured[None], measured


def test_hugging_face_llama_and_symbolic_lengths_recompute_bitwise():
    """Grouped-query attention, rotary embeddings and RMSNorm (a tiny HF Llama),
    and a plan with symbolic lengths (stepfx.dynamic: sizes are graph values the
    copies read) recompute at budget 0 and stay bitwise eager."""
    pytest.importorskip("transformers")
    from tests.steps import hf_llama, hf_step

    config = {"gradient_clipping": 0, "stepfx": {"activation_memory_budget": 0.0}}
    assert assert_step_equivalent(hf_step, hf_llama, adamw, token_batches(2), exact=True, config=config).bitwise
    g = torch.Generator().manual_seed(0)
    varying = [(torch.randint(0, 64, (2, t), generator=g),) for t in (9, 12, 7)]
    dynamic = {"gradient_clipping": 0, "stepfx": {"activation_memory_budget": 0.0, "dynamic": True}}
    step = _run(dynamic, make=tiny_gpt, batches=varying)
    assert len(step.plans) == 1 and _copies(step)
    assert assert_step_equivalent(lm_step, tiny_gpt, adamw, varying, exact=True, config=dynamic).bitwise


@pytest.mark.parametrize("stage", [3])  # stage 0 left out (suite time): the pass runs before any ZeRO pass
def test_the_loss_head_stays_for_the_fused_cross_entropy(stage):
    # with codegen, fuse_linear_cross_entropy stores no logits, and matches the head only where backward reads
    # the forward's own values: recomputing the head (or the targets) kept the logits in fp32 ([tokens, vocab];
    # the 13B run's plan at micro-batch 16: 6 GiB and their log-softmax) and no fused kernel. Bitwise the codegen
    # step without recomputation
    from stepfx.codegen import graph_ops

    base = {"gradient_clipping": 0, "stepfx": {"codegen": True},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    batches = token_batches(2, batch=2, seq=32)  # codegen on the CPU: Triton's interpreter runs a program a row
    plain = _run(base, batches=batches)
    config = {**base, "stepfx": {"codegen": True, "activation_memory_budget": 0.0}}
    step = _run(config, batches=batches)
    assert _copies(step)
    assert [n for n in step.plan.graph.gm.graph.nodes if n.target is graph_ops.linear_cross_entropy]
    assert not [r for r in step.plan.graph.signature.extra.get("fusion_report", ()) if r[0] == "fuse_linear_cross_entropy"]
    ours, theirs = step.model_state_dict(), plain.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
