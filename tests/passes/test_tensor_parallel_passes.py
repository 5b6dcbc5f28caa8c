"""plan_tensor_parallel and shard_tensor_parallel on a captured graph (no
ranks: the rewrite is checked structurally; numerics are in
tests/runtime/test_tensor_parallel.py)."""
from __future__ import annotations

import torch

from stepfx.graph import Phase, Role, Storage
from stepfx.graph.tp_layout import TP_PLAN_KEY, TensorSplit
from stepfx.passes.declared import PIPELINE
from stepfx.passes.manager import PassManager, PassOptions
from stepfx.passes.tensor_parallel.plan_tensor_parallel import plan_tensor_parallel
from stepfx.passes.tensor_parallel.shard_tensor_parallel import shard_tensor_parallel
from tests.steps import captured_mlp

OPTIONS = PassOptions(tp_size=2, tp_rank=1, tp_group_name="tp")


def _clean(graph):
    names = ("functionalize_graph", "drop_profiler_nodes", "remove_aliases", "prune_unchanged_outputs",
             "eliminate_dead_code")
    manager = PassManager([e for e in PIPELINE if e.name in names])
    return manager.run(graph, PassOptions())[-1].graph


def test_mlp_pair_is_found_and_split():
    graph, model, opt, batch = captured_mlp()
    planned = plan_tensor_parallel(_clean(graph), OPTIONS).graph
    plan = planned.signature.extra[TP_PLAN_KEY]
    kinds = {p.name: (p.kind, p.split_dim) for p in plan.placements}
    assert kinds == {"net.0.weight": ("column", 0), "net.0.bias": ("column", 0), "net.2.weight": ("row", 1),
                     "net.2.bias": ("replicated", None)}

    result = shard_tensor_parallel(planned, OPTIONS)
    g = result.graph.gm.graph
    reduces = [n for n in g.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
    # the row-parallel product is all-reduced once in the forward; the input takes no gradient
    assert [n.meta["phase"] for n in reduces] == [Phase.FORWARD]
    assert reduces[0].args[1:] == ("sum", "tp")
    slots = {(s.role, s.name, s.key): s for s in result.graph.signature.inputs}
    w = slots[(Role.PARAM, "net.0.weight", None)]
    assert w.storage is Storage.RANK and w.split == TensorSplit(0, 1, 1, 2)
    assert slots[(Role.OPTIMIZER_STATE, "net.0.weight", "exp_avg")].split == w.split
    assert slots[(Role.OPTIMIZER_STATE, "net.0.weight", "step")].storage is Storage.RANK  # held whole
    assert slots[(Role.OPTIMIZER_STATE, "net.0.weight", "step")].split is None
    assert slots[(Role.PARAM, "net.2.bias", None)].storage is Storage.USER
    placeholder = next(n for n in g.nodes if n.op == "placeholder" and n.meta["slot"].name == "net.0.weight")
    assert tuple(placeholder.meta["val"].shape) == (8, 8)  # [16, 8] split in two


def test_a_split_of_unequal_fused_parts_takes_each_part_s_share():
    # Phi-3's q/k/v: 4 rows of q, 2 of k, 2 of v; rank 1 of 2 holds the second half of each
    whole = torch.arange(8.0)[:, None]
    split = TensorSplit(0, 3, 1, 2, sizes=(4, 2, 2))
    assert split.take(whole)[:, 0].tolist() == [2.0, 3.0, 5.0, 7.0]
    shards = [TensorSplit(0, 3, r, 2, sizes=(4, 2, 2)).take(whole) for r in range(2)]
    assert torch.equal(split.join(shards), whole)


def test_a_split_takes_and_joins_shards():
    whole = torch.arange(32.0).reshape(16, 2)
    shards = [TensorSplit(0, 1, r, 2).take(whole) for r in range(2)]
    assert torch.equal(shards[1], whole[8:])
    assert torch.equal(TensorSplit(0, 1, 0, 2).join(shards), whole)
    fused = torch.arange(12.0).reshape(6, 2)  # three fused parts (q, k, v) of two rows each
    parts = [TensorSplit(0, 3, r, 2).take(fused) for r in range(2)]
    assert parts[0][:, 0].tolist() == [0.0, 4.0, 8.0]  # the first half of each part
    assert torch.equal(TensorSplit(0, 3, 0, 2).join(parts), fused)


def test_nothing_to_split_is_noted():
    from stepfx.capture import capture_step
    from tests.steps import MLP, ce_step, mlp_batches

    model = MLP((8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    graph = capture_step(ce_step, model, opt, mlp_batches(1)[0], {})
    planned = plan_tensor_parallel(_clean(graph), OPTIONS)
    assert "nothing to split" in planned.summary
    assert not shard_tensor_parallel(planned.graph, OPTIONS).changed


def test_under_bf16_the_pair_is_found_through_the_parameters_casts():
    """The matmuls read bf16 copies of the fp32 masters (``_to_copy``): the
    search looks through the cast, and the copy splits with its parameter."""
    from stepfx.capture import capture_step
    from stepfx.capture.trace import CaptureOptions
    from tests.steps import MLP, ce_step, mlp_batches

    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = CaptureOptions(compute_dtype=torch.bfloat16, cast_inputs=True)
    graph = capture_step(ce_step, model, opt, mlp_batches(1)[0], {}, options=options)
    planned = plan_tensor_parallel(_clean(graph), OPTIONS).graph
    kinds = {p.name: (p.kind, p.split_dim) for p in planned.signature.extra[TP_PLAN_KEY].placements}
    assert kinds == {"net.0.weight": ("column", 0), "net.0.bias": ("column", 0), "net.2.weight": ("row", 1),
                     "net.2.bias": ("replicated", None)}
    g = shard_tensor_parallel(planned, OPTIONS).graph.gm.graph
    reduces = [n for n in g.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
    assert [n.meta["val"].dtype for n in reduces] == [torch.bfloat16]  # the row-parallel partial product


def _clipped_graph(tp_rank):
    from stepfx.config import load_config

    graph, *_ = captured_mlp()
    config = load_config({"gradient_clipping": 1.0, "stepfx": {"codegen": False}})
    options = PassOptions(config=config, tp_size=2, tp_rank=tp_rank, tp_group_name="tp")
    return PassManager(PIPELINE).run(graph, options)[-1].graph.gm.graph


def test_clipping_sums_shards_over_the_tp_group_and_counts_replicas_once():
    """The norm's sum of squares is all-reduced over the TP group once; the
    replicated net.2.bias's squares count on TP rank 0, times 0 elsewhere."""
    for tp_rank in (0, 1):
        g = _clipped_graph(tp_rank)
        reduces = [n for n in g.nodes if n.target is torch.ops._c10d_functional.all_reduce.default
                   and n.meta["phase"] is Phase.OPTIMIZER]
        assert len(reduces) == 1 and reduces[0].args[1:] == ("sum", "tp")
        norm = next(n for n in g.nodes if n.target is torch.ops.aten.sqrt.default)
        assert norm.args[0].args[0] is reduces[0]  # sqrt(wait(all_reduce(sum of squares)))
        zeroed = [n for n in g.nodes if n.target is torch.ops.aten.mul.Tensor and n.args[1] == 0.0]
        assert len(zeroed) == (0 if tp_rank == 0 else 1)


def _with_specs(*specs, default=False):
    from stepfx.config import load_config

    config = load_config({"tensor_parallel": {"autotp_size": 2, "partition_config": {
        "use_default_specs": default, "layer_specs": list(specs)}}})
    return PassOptions(config=config, tp_size=2, tp_rank=1, tp_group_name="tp")


def test_partition_config_that_cannot_propagate_is_refused_by_key():
    # the first weight split by its input features reads replicated features: the key and the op are named
    import pytest

    from stepfx.config import ConfigError

    graph, *_ = captured_mlp()
    with pytest.raises(ConfigError, match=r"tensor_parallel\.partition_config\.layer_specs: .*net\.0\.weight: entry 0"
                                          r".*do not propagate"):
        plan_tensor_parallel(_clean(graph), _with_specs({"patterns": [r"^net\.0\.weight$"], "partition_type": "row"}))
    with pytest.raises(ConfigError, match=r"layer_specs\[0\]\.patterns: matches 'net\.0\.bias', which is not a matmul"):
        plan_tensor_parallel(_clean(graph), _with_specs({"patterns": [r"net\.0"], "partition_type": "column"}))


def test_partition_config_with_default_specs_lets_the_search_split_the_rest():
    # the user names the MLP's pair (by other means than the search would: fc_out by partition_dim);
    # use_default_specs: the search finds attention's pair itself
    from stepfx.capture import capture_step
    from tests.steps import lm_step, one_block_gpt, token_batches

    torch.manual_seed(0)
    model = one_block_gpt()
    graph = capture_step(lm_step, model, torch.optim.SGD(model.parameters(), lr=0.1), token_batches(1)[0], {})
    planned = plan_tensor_parallel(_clean(graph), _with_specs(
        {"patterns": [r".*\.fc\.weight$"], "partition_type": "column"},
        {"patterns": [r".*fc_out\.weight$"], "partition_type": "row", "partition_dim": 1}, default=True)).graph
    placements = {p.name: p for p in planned.signature.extra[TP_PLAN_KEY].placements}
    assert placements["blocks.0.fc.weight"].why == "tensor_parallel.partition_config.layer_specs[0]"
    assert placements["blocks.0.fc_out.weight"].why.startswith("tensor_parallel.partition_config.layer_specs[1]")
    assert (placements["blocks.0.qkv.weight"].kind, placements["blocks.0.qkv.weight"].parts) == ("column", 3)
    assert placements["blocks.0.qkv.weight"].why.startswith("product reaches blocks.0.proj.weight")
    assert placements["blocks.0.proj.weight"].kind == "row"


def _llama_graph(kv_heads):
    from transformers import LlamaConfig, LlamaForCausalLM

    from stepfx.api import _hf_tp_plan
    from stepfx.capture import capture_step
    from tests.steps import hf_step, token_batches

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=kv_heads,
                                         max_position_embeddings=16, bos_token_id=0, eos_token_id=0))
    graph = capture_step(hf_step, model, torch.optim.SGD(model.parameters(), lr=0.1), token_batches(1)[0], {})
    return _clean(graph), _hf_tp_plan(model)


def test_a_hugging_face_model_s_own_tp_plan_is_honoured():
    from stepfx.passes.tensor_parallel.plan_tensor_parallel import HF_TP_PLAN_KEY

    graph, hf_plan = _llama_graph(kv_heads=2)
    assert ("model.layers.*.self_attn.k_proj", "colwise") in hf_plan
    options = PassOptions(tp_size=2, tp_rank=0, tp_group_name="tp", extra={HF_TP_PLAN_KEY: hf_plan})
    result = plan_tensor_parallel(graph, options)
    plan = result.graph.signature.extra[TP_PLAN_KEY]
    placements = {p.name: p for p in plan.placements}
    k = placements["model.layers.0.self_attn.k_proj.weight"]
    assert k.kind == "column" and k.why == "the model's base_model_tp_plan: 'model.layers.*.self_attn.k_proj': colwise"
    assert placements["model.layers.0.mlp.down_proj.weight"].kind == "row"
    # HF's vocabulary-parallel head and embedding: the vocabulary search's split, without HF's gather of the logits
    assert placements["lm_head.weight"].kind == "vocabulary" == placements["model.embed_tokens.weight"].kind
    assert any("'lm_head': 'colwise_gather_output': left to the vocabulary search" in n for n in plan.notes)
    assert "named by the model's base_model_tp_plan" in result.summary


def test_a_hugging_face_plan_that_cannot_apply_leaves_it_to_the_search():
    # one key/value head cannot be split over 2 ranks: HF's plan fails here, the search replicates k and v
    from stepfx.passes.tensor_parallel.plan_tensor_parallel import HF_TP_PLAN_KEY

    graph, hf_plan = _llama_graph(kv_heads=1)
    options = PassOptions(tp_size=2, tp_rank=0, tp_group_name="tp", extra={HF_TP_PLAN_KEY: hf_plan})
    plan = plan_tensor_parallel(graph, options).graph.signature.extra[TP_PLAN_KEY]
    placements = {p.name: p for p in plan.placements}
    assert placements["model.layers.0.self_attn.k_proj.weight"].kind == "replicated"
    assert placements["model.layers.0.self_attn.q_proj.weight"].kind == "column"
    assert any("base_model_tp_plan does not apply here" in n for n in plan.notes)


# -- the vocabulary-parallel embedding, LM head and cross-entropy ------------------------------------------


def lm_step_returning_logits(model, optimizer, idx):
    from tests.steps import lm_loss

    logits = model(idx[:, :-1])
    loss = lm_loss(logits, idx[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss, logits


def _gpt_graph(step=None):
    from stepfx.capture import capture_step
    from tests.steps import lm_step, tiny_gpt, token_batches

    torch.manual_seed(0)
    model = tiny_gpt(n_layers=1, vocab_size=80)  # a width no other value of the step has
    batch = token_batches(1, vocab=80)[0]
    graph = capture_step(step or lm_step, model, torch.optim.SGD(model.parameters(), lr=0.1), batch, {})
    return _clean(graph)


def _vocab_options(value, tp_rank=1):
    from stepfx.config import load_config

    block = {"autotp_size": 2} if value is None else {"autotp_size": 2, "vocab_parallel_lm_head": value}
    return PassOptions(config=load_config({"tensor_parallel": block}), tp_size=2, tp_rank=tp_rank, tp_group_name="tp")


def test_the_cross_entropy_runs_on_each_rank_s_slice_of_the_logits():
    """The tied embedding / LM head splits by rows over the vocabulary: no
    value of the step is as wide as the vocabulary (the logits are never
    gathered), the log-softmax all-reduces a max and a sum per row, the
    negative log-likelihood picks this rank's targets (rank 1 holds tokens
    40..79) and ignores the rest locally."""
    planned = plan_tensor_parallel(_gpt_graph(), _vocab_options(None)).graph
    tok = next(p for p in planned.signature.extra[TP_PLAN_KEY].placements if p.name == "tok.weight")
    assert (tok.kind, tok.split_dim) == ("vocabulary", 0)
    g = shard_tensor_parallel(planned, _vocab_options(None)).graph.gm.graph
    widths = {n.meta["val"].shape[-1] for n in g.nodes if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim()}
    assert 80 not in widths and 40 in widths
    vocab = [n.args[1] for n in g.nodes if n.target is torch.ops._c10d_functional.all_reduce.default
             and n.name.startswith("tp_vocab")]
    assert vocab == ["max", "sum", "sum"]  # log-softmax forward (max, sum of exponentials), backward (row sums)
    assert not [n for n in g.nodes if "all_gather" in str(n.target)]
    offset = next(n for n in g.nodes if n.name.startswith("vocab_local_index"))
    assert offset.args[1] == 40
    nll = next(n for n in g.nodes if n.target is torch.ops.aten.nll_loss_forward.default)
    assert nll.args[3:] == (2, -1)  # this rank's sum; targets held elsewhere ignored locally


def test_vocab_parallel_lm_head_false_keeps_the_head_replicated():
    plan = plan_tensor_parallel(_gpt_graph(), _vocab_options(False)).graph.signature.extra[TP_PLAN_KEY]
    tok = next(p for p in plan.placements if p.name == "tok.weight")
    assert tok.kind == "replicated" and "vocab_parallel_lm_head is false" in tok.why


def test_vocab_parallel_lm_head_true_refuses_a_step_that_returns_the_logits():
    import pytest

    from stepfx.config import ConfigError

    graph = _gpt_graph(lm_step_returning_logits)
    plan = plan_tensor_parallel(graph, _vocab_options(None)).graph.signature.extra[TP_PLAN_KEY]
    tok = next(p for p in plan.placements if p.name == "tok.weight")
    assert tok.kind == "replicated" and "a split value is returned" in tok.why  # the search keeps it whole
    with pytest.raises(ConfigError, match=r"tensor_parallel\.vocab_parallel_lm_head: is true but no LM head splits "
                                          r"over the vocabulary: tok\.weight: a split value is returned"):
        plan_tensor_parallel(graph, _vocab_options(True))


def test_sequence_parallel_runs_norms_and_residuals_on_each_rank_s_tokens():
    """With stepfx.sequence_parallel the layer norms and the residual adds
    read [1, 8, 32] of the [2, 8, 32] activations (the batch's first half on
    rank 0); the matmuls of the pairs read the gathered [16, 32] rows."""
    from stepfx.config import load_config

    options = PassOptions(config=load_config({"tensor_parallel": {"autotp_size": 2},
                                              "stepfx": {"sequence_parallel": True}}),
                          tp_size=2, tp_rank=0, tp_group_name="tp")
    planned = plan_tensor_parallel(_gpt_graph(), options)
    assert planned.graph.signature.extra[TP_PLAN_KEY].tokens == 16
    g = shard_tensor_parallel(planned.graph, options).graph.gm.graph
    norms = [n for n in g.nodes if n.target is torch.ops.aten.native_layer_norm.default]
    assert len(norms) == 3 and all(tuple(n.args[0].meta["val"].shape) == (1, 8, 32) for n in norms)
    gathers = [n for n in g.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    assert all(tuple(n.meta["val"].shape) == (16, 32) for n in gathers)
    scatters = [n for n in g.nodes if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default]
    assert len(gathers) == len(scatters) == 6  # 3 forward, 3 backward each
    # explain()'s traffic: over the TP group of 2 (not the world of 4 the job may have)
    from stepfx.graph.accounting import communication

    sharded = shard_tensor_parallel(planned.graph, options).graph
    items = [c for c in communication(sharded, 4) if c.group == "tensor"]
    assert {c.op for c in items} == {"all_reduce", "reduce_scatter", "all_gather"}
    for c in items:
        assert c.sent_bytes == {"all_reduce": c.payload_bytes, "reduce_scatter": c.payload_bytes / 2,
                                "all_gather": c.payload_bytes}[c.op], c


def _family_graph(family):
    from stepfx.capture import capture_step
    from tests.passes.test_hf_codegen import make
    from tests.steps import hf_step, token_batches

    torch.manual_seed(0)
    model = make(family)
    graph = capture_step(hf_step, model, torch.optim.SGD(model.parameters(), lr=0.1), token_batches(1, vocab=61)[0], {})
    return _clean(graph), model.config.model_type


def _tp_options(block, model_type):
    from stepfx.config import load_config
    from stepfx.passes.tensor_parallel.plan_tensor_parallel import MODEL_TYPE_KEY

    config = load_config({"tensor_parallel": {"autotp_size": 2, **block}})
    return PassOptions(config=config, tp_size=2, tp_rank=1, tp_group_name="tp", extra={MODEL_TYPE_KEY: model_type})


def test_deepspeed_presets_split_what_they_name():
    """preset_model "qwen2" (DeepSpeed AutoTP's built-in specs) splits q/k/v
    and gate/up by columns, o_proj and down_proj by rows, each placement
    naming the preset's entry; the search still splits the vocabulary."""
    graph, model_type = _family_graph("qwen2")
    plan = plan_tensor_parallel(graph, _tp_options({"preset_model": "Qwen2"}, model_type)).graph.signature.extra[TP_PLAN_KEY]
    placements = {p.name: p for p in plan.placements}
    q, o = placements["model.layers.1.self_attn.q_proj.weight"], placements["model.layers.1.self_attn.o_proj.weight"]
    assert (q.kind, q.why) == ("column", "tensor_parallel.preset_model 'Qwen2' entry 1")
    assert (o.kind, o.why) == ("row", "tensor_parallel.preset_model 'Qwen2' entry 0; its output is all-reduced")
    assert placements["model.layers.1.mlp.gate_proj.weight"].why == "tensor_parallel.preset_model 'Qwen2' entry 3"
    assert placements["model.layers.1.self_attn.q_proj.bias"].kind == "column"


def test_a_preset_that_does_not_fit_the_model_is_refused_by_key_and_a_shape_of_unequal_parts_fixes_it():
    """DeepSpeed's "phi3" preset cuts the fused q/k/v in equal thirds; this
    Phi-3 has 4 query and 2 key/value heads ([16, 8, 8] rows), so the preset
    is a ConfigError naming preset_model (DeepSpeed would split it wrongly
    and say nothing). A layer spec of the user's, merged before the preset
    as DeepSpeed merges them, with DeepSpeed's shape of unequal parts
    ([[16, 8, 8], -1]) splits it per part; "skip" keeps a weight whole."""
    import pytest

    from stepfx.config import ConfigError

    graph, model_type = _family_graph("phi3")
    with pytest.raises(ConfigError, match=r"^tensor_parallel\.preset_model: the preset 'phi3' does not fit this model"):
        plan_tensor_parallel(graph, _tp_options({"preset_model": "phi3"}, model_type))
    block = {"preset_model": "phi3", "partition_config": {"layer_specs": [
        {"patterns": [r".*\.self_attn\.qkv_proj\.weight$"], "shape": [[16, 8, 8], -1], "partition_dim": 0},
        {"patterns": [r".*layers\.0\.mlp\.(gate_up|down)_proj\.weight$"], "partition_type": "skip"},
        {"patterns": [r".*layers\.1\.mlp\.gate_up_proj\.weight$"], "partition_type": "column",
         "model_types": ["llama"]}]}}  # (not this model's type: the preset's entry decides)
    plan = plan_tensor_parallel(graph, _tp_options(block, model_type)).graph.signature.extra[TP_PLAN_KEY]
    placements = {p.name: p for p in plan.placements}
    qkv = placements["model.layers.1.self_attn.qkv_proj.weight"]
    assert (qkv.kind, qkv.parts, qkv.sizes) == ("column", 3, (16, 8, 8))
    assert qkv.why.startswith("tensor_parallel.partition_config.layer_specs[0]")
    assert placements["model.layers.0.mlp.gate_up_proj.weight"].kind == "replicated"
    assert placements["model.layers.0.mlp.gate_up_proj.weight"].why.endswith("partition_type skip")
    up = placements["model.layers.1.mlp.gate_up_proj.weight"]
    assert (up.kind, up.parts, up.why) == ("column", 2, "tensor_parallel.preset_model 'phi3' entry 3 (2 fused parts)")


def test_tensor_parallel_waits_move_to_their_first_reader_unless_tp_overlap_comm_is_false():
    """schedule_collectives on a split GPT block (TP 2): each TP all-reduce's
    wait moves to just before its first reader, so in the backward the
    weight gradient's matmul runs while the input gradient is all-reduced
    (Megatron's overlap); with tensor_parallel.tp_overlap_comm false every
    TP wait stays right after its collective. On CUDA the pass applies with
    TP alone (no data parallelism)."""
    from stepfx.capture import capture_step
    from stepfx.config import load_config
    from stepfx.passes.data_parallel.schedule_collectives import schedule_collectives
    from tests.steps import lm_step, one_block_gpt, token_batches

    torch.manual_seed(0)
    model = one_block_gpt()
    graph = capture_step(lm_step, model, torch.optim.SGD(model.parameters(), lr=0.1), token_batches(1)[0], {})
    options = PassOptions(config=load_config({"tensor_parallel": {"autotp_size": 2}}), tp_size=2, tp_rank=0,
                          tp_group_name="tp")
    sharded = shard_tensor_parallel(plan_tensor_parallel(_clean(graph), options).graph, options).graph
    c10d = torch.ops._c10d_functional

    def gaps(g):
        """Per TP all-reduce: (its phase, the matmuls between it and its wait)."""
        nodes = list(g.nodes)
        out = []
        for i, n in enumerate(nodes):
            if n.op == "call_function" and n.target is c10d.all_reduce.default:
                (wait,) = n.users
                between = nodes[i + 1:nodes.index(wait)]
                out.append((n.meta["phase"], sum(b.target is torch.ops.aten.mm.default for b in between)))
        return out

    before = gaps(sharded.gm.graph)
    assert before and all(mms == 0 for _, mms in before)
    overlapped = gaps(schedule_collectives(sharded, options).graph.gm.graph)
    assert any(phase is Phase.BACKWARD and mms >= 1 for phase, mms in overlapped), overlapped
    off = PassOptions(config=load_config({"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": False}}),
                      tp_size=2, tp_rank=0, tp_group_name="tp")
    assert gaps(schedule_collectives(sharded, off).graph.gm.graph) == before
    entry = next(e for e in PIPELINE if e.name == "schedule_collectives")
    assert entry.applies(PassOptions(config=options.config, tp_size=2, device_type="cuda"))
    assert not entry.applies(PassOptions(config=off.config, tp_size=2, device_type="cuda"))
