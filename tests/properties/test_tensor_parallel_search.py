"""Property: over generated transformer shapes (head counts, head sizes,
vocabulary sizes, some not divisible by the TP degree, with and without
biases), the Megatron search finds the pairs it should and only those:
attention's fused q/k/v (3 parts) -> output projection when the heads
divide by the degree, else attention stays replicated; the MLP's up -> down
pair always (its width divides); the tied embedding and LM head split
over the vocabulary when the vocabulary divides, else replicated; norms
and position embeddings replicated; dropout (in attention too) changes
none of it: its masks over split values are drawn whole and sliced. The first property is the search's, on the captured graph, without ranks;
the second runs generated models split over two ranks (with and without
sequence parallelism) against the single-process step."""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepfx.capture import capture_step
from stepfx.graph.tp_layout import TP_PLAN_KEY
from stepfx.passes.declared import PIPELINE
from stepfx.passes.manager import PassManager, PassOptions
from stepfx.passes.tensor_parallel.plan_tensor_parallel import plan_tensor_parallel
from stepfx.testing.models import GPT, gpt_config
from tests.steps import lm_step

_CLEAN = ("functionalize_graph", "drop_profiler_nodes", "remove_aliases", "prune_unchanged_outputs", "eliminate_dead_code")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads=st.integers(1, 5), head_dim=st.sampled_from([2, 4]), vocab=st.integers(17, 70),
       bias=st.booleans(), tp=st.sampled_from([2, 4]), dropout=st.sampled_from([0.0, 0.1]))
def test_the_search_finds_the_megatron_pairs_of_generated_shapes(heads, head_dim, vocab, bias, tp, dropout):
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", d_model=heads * head_dim, n_heads=heads, vocab_size=vocab, n_layers=1, seq_len=8,
                           bias=bias, dropout=dropout))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randint(0, vocab, (2, 7))
    graph = capture_step(lm_step, model, opt, (batch,), {})
    graph = PassManager([e for e in PIPELINE if e.name in _CLEAN]).run(graph, PassOptions())[-1].graph
    plan = plan_tensor_parallel(graph, PassOptions(tp_size=tp, tp_rank=0, tp_group_name="tp")).graph.signature.extra[TP_PLAN_KEY]
    kinds = {p.name: (p.kind, p.parts) for p in plan.placements}
    attention = heads % tp == 0
    assert kinds["blocks.0.qkv.weight"] == (("column", 3) if attention else ("replicated", 1)), kinds
    assert kinds["blocks.0.proj.weight"][0] == ("row" if attention else "replicated"), kinds
    assert kinds["blocks.0.fc.weight"][0] == "column" and kinds["blocks.0.fc_out.weight"][0] == "row", kinds
    if bias:
        assert kinds["blocks.0.fc.bias"][0] == "column" and kinds["blocks.0.fc_out.bias"][0] == "replicated", kinds
    assert kinds["tok.weight"][0] == ("vocabulary" if vocab % tp == 0 else "replicated"), kinds
    assert kinds["pos.weight"][0] == "replicated", kinds
    split = {n for n, (k, _) in kinds.items() if k != "replicated"}
    assert split <= {f"blocks.0.{m}.{w}" for m in ("qkv", "proj", "fc", "fc_out") for w in ("weight", "bias")} | {
        "tok.weight"}, split


def generated_gpt(heads, head_dim, vocab, bias, dropout=0.0):
    return GPT(gpt_config("tiny", d_model=heads * head_dim, n_heads=heads, vocab_size=vocab, n_layers=1, seq_len=8,
                          bias=bias, dropout=dropout))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.xdist_group("tensor_parallel")
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads=st.sampled_from([2, 4]), head_dim=st.sampled_from([2, 4]), vocab=st.integers(17, 70),
       bias=st.booleans(), batch=st.integers(1, 3), sequence=st.booleans(), dropout=st.sampled_from([0.0, 0.2]))
def test_generated_transformers_split_over_two_ranks_equal_the_reference(rank_pool, heads, head_dim, vocab, bias,
                                                                          batch, sequence, dropout):
    """Whatever the search splits (the vocabulary when it divides, sequence
    parallelism when the batch's tokens divide into whole rows; head counts
    the degree does not divide are a ConfigError, tested in
    tests/config/test_config_tensor_parallel.py), the split step equals the single process
    (fp32, 1e-5 relative, losses and parameters over 2 steps), with dropout
    too (each step seeded as the reference's)."""
    from tests.runtime.test_tensor_parallel import _check
    from tests.steps import lm_step, token_batches
    from tests.tp_workers import tp_run

    make = functools.partial(generated_gpt, heads, head_dim, vocab, bias, dropout)
    batches = [token_batches(2, batch=batch, vocab=vocab, seed=heads * 100 + vocab)]
    config = {"gradient_clipping": 0, "tensor_parallel": {"autotp_size": 2},
              "stepfx": {"sequence_parallel": sequence}}
    results = rank_pool(2).run(tp_run, lm_step, make, sgd, batches, config, timeout=300)
    _check(results, lm_step, make, sgd, batches, tp=2)
