"""fuse_attention: flash attention calls (those choose_attention_kernels makes of symbolic-length cuDNN calls on
CUDA, flash-for-CPU here) and their backwards by stepfx's Triton attention, a swap by identity; calls the
kernels cannot take stay, named with the reason. Graph checks trace over fake CUDA tensors (no GPU); the step
runs in Triton's interpreter in fp16 (its bf16 products are wrong: bf16 is refused on the CPU and run on the
GPU, tests/gpu)."""
from __future__ import annotations

import pytest
import torch

import stepfx
from stepfx.codegen import available, graph_ops
from stepfx.passes.cleanup.choose_attention_kernels import choose_attention_kernels
from stepfx.passes.fusion.fuse_attention import fuse_attention, memory_order
from tests.passes.test_choose_attention_kernels import FLASH, FLASH_BWD, _attention_graph, _opts
from tests.steps import gpt_config, lm_step
from stepfx.testing.models import GPT

pytestmark = pytest.mark.skipif(not available("cpu")[0], reason=available("cpu")[1])


def _flash_graph(**kw):
    graph = choose_attention_kernels(_attention_graph(**kw), _opts()).graph
    assert {n.target for n in graph.gm.graph.nodes} >= {FLASH, FLASH_BWD}
    return graph


@pytest.mark.parametrize("bshd", [False, True])
def test_flash_pairs_become_the_kernels_calls_with_the_recorded_layouts(bshd):
    graph = _flash_graph(bshd=bshd)
    result = fuse_attention(graph, _opts())
    assert result.changed and "1 attention call(s)" in result.summary
    nodes = list(result.graph.gm.graph.nodes)
    assert not [n for n in nodes if n.target in (FLASH, FLASH_BWD)]
    (fwd,) = [n for n in nodes if n.target is graph_ops.attention]
    (bwd,) = [n for n in nodes if n.target is graph_ops.attention_backward]
    out = next(u for u in fwd.users if u.args[1] == 0)
    assert fwd.kwargs["out_order"] == memory_order(out.meta["val"])
    for index, order in enumerate(bwd.kwargs["grad_orders"]):
        grad = next(u for u in bwd.users if u.args[1] == index)
        assert order == memory_order(grad.meta["val"])
    assert fwd.meta["val"][0].shape == out.meta["val"].shape  # the metadata kept (a swap by identity)


def test_statistics_read_elsewhere_keep_flash_and_say_why():
    graph = _flash_graph()
    g = graph.gm.graph
    fwd = next(n for n in g.nodes if n.target is FLASH)
    lse = next(u for u in fwd.users if u.args[1] == 1)
    out = next(n for n in g.nodes if n.op == "output")
    with g.inserting_before(out):
        read = g.call_function(torch.ops.aten.sum.default, (lse,))
        read.meta["val"] = lse.meta["val"].sum()
    out.args = ((*out.args[0], read),)
    graph.gm.recompile()
    result = fuse_attention(graph, _opts())
    assert not result.changed and "is read by sum" in result.summary


def test_memory_order_of_dense_and_strided_values():
    x = torch.empty(2, 5, 3, 4).transpose(1, 2)
    assert memory_order(x) == (0, 2, 1, 3)
    assert memory_order(torch.empty(2, 3, 4)) == (0, 1, 2)
    assert memory_order(torch.empty(2, 5, 3, 4)[:, :, :2]) is None  # a slice: not dense


def test_fp16_step_with_triton_attention_over_varying_lengths_is_no_further_from_fp32_than_flash():
    """fp16 mixed precision, a new length at every step (one symbolic capture): the step with the Triton
    attention's worst relative loss error against the eager fp32 step is at most twice that of the same step with
    flash attention (``disable: fuse_attention``) plus one fp16 ulp; the Triton calls are in the graph."""
    torch.manual_seed(0)
    cfg = gpt_config("tiny", n_heads=2)  # head_dim 16: the kernels' smallest
    models = [GPT(cfg) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    base = {"gradient_clipping": 0, "stepfx": {"codegen": True, "dynamic": True}}
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}
    steps = [stepfx.parallelize({**base, **fp16})(lm_step),
             stepfx.parallelize({**base, **fp16, "stepfx": {**base["stepfx"], "disable": ["fuse_attention"]}})(lm_step),
             lm_step]  # the fp32 reference: eager
    g = torch.Generator().manual_seed(5)
    errs = [[], []]
    for length in (16, 11, 13):
        batch = torch.randint(0, cfg.vocab_size, (2, length), generator=g)
        fused, plain, fp32 = (s(m, o, batch).item() for s, m, o in zip(steps, models, opts))
        errs[0].append(abs(fused - fp32) / abs(fp32))
        errs[1].append(abs(plain - fp32) / abs(fp32))
    targets = [n.target for n in steps[0].plan.graph.gm.graph.nodes]
    assert targets.count(graph_ops.attention_cpu) == cfg.n_layers and graph_ops.attention_cpu_backward in targets
    assert graph_ops.attention_cpu not in [n.target for n in steps[1].plan.graph.gm.graph.nodes]
    assert len({id(p) for p in steps[0].plans}) <= 2
    assert max(errs[0]) <= 2 * max(errs[1]) + torch.finfo(torch.float16).eps, (errs[0], errs[1])


def test_recomputed_attention_is_taken_too_and_changes_nothing():
    """Under recompute_activations' level "all" the backward reads the recomputed q/k/v with the forward's own
    statistics: every call is taken (none kept on flash), and the losses equal the step without recomputation
    bitwise (the same kernels on the same values)."""
    torch.manual_seed(0)
    cfg = gpt_config("tiny", n_heads=2)
    first = GPT(cfg)
    losses, notes = [], []
    for extra in ({"activation_memory_budget": 0.0}, {}):
        model = GPT(cfg)
        model.load_state_dict(first.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = stepfx.parallelize({"gradient_clipping": 0, "fp16": {"enabled": True, "initial_scale_power": 8},
                                   "stepfx": {"codegen": True, "dynamic": True, **extra}})(lm_step)
        g = torch.Generator().manual_seed(1)
        losses.append([step(model, opt, torch.randint(0, cfg.vocab_size, (2, n), generator=g)).item() for n in (16, 11, 13)])
        text = step.explain()
        notes.append(next(line for line in text.splitlines() if "fuse_attention" in line))
        assert ("level 'all'" in text) == bool(extra)  # attention recomputed in the first
        left = [n for n in step.plan.graph.gm.graph.nodes if "flash_attention" in str(n.target)]
        assert not left and "kept on flash" not in notes[-1], notes[-1]
    assert losses[0] == losses[1]


def test_grouped_query_attention_is_taken_over_varying_lengths():
    """A Hugging Face Llama with 4 query heads over 2 key/value heads (``unrepeat_kv_heads`` leaves the flash
    calls grouped), fp16, a new length every step: every attention call runs the Triton kernels with the key/value
    heads unrepeated, and the losses are no further from the fp32 eager step than with flash attention (the
    bound of the test above)."""
    transformers = pytest.importorskip("transformers")
    from tests.steps import hf_step

    def llama():
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
            attn_implementation="sdpa", use_cache=False))

    torch.manual_seed(0)
    models = [llama() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    base = {"gradient_clipping": 0, "fp16": {"enabled": True, "initial_scale_power": 8}}
    steps = [stepfx.parallelize({**base, "stepfx": {"codegen": True, "dynamic": True}})(hf_step),
             stepfx.parallelize({**base, "stepfx": {"codegen": True, "dynamic": True, "disable": ["fuse_attention"]}})(
                 hf_step),
             hf_step]
    g = torch.Generator().manual_seed(6)
    errs = [[], []]
    for length in (16, 11, 13):
        batch = torch.randint(0, 64, (2, length), generator=g)
        fused, plain, fp32 = (s(m, o, batch).item() for s, m, o in zip(steps, models, opts))
        errs[0].append(abs(fused - fp32) / abs(fp32))
        errs[1].append(abs(plain - fp32) / abs(fp32))
    nodes = [n for n in steps[0].plan.graph.gm.graph.nodes if n.op == "call_function"]
    calls = [n for n in nodes if n.target in (graph_ops.attention_cpu, graph_ops.attention_cpu_backward)]
    key_heads = [n.args[1 if n.target is graph_ops.attention_cpu else 2].meta["val"].shape[1] for n in calls]
    assert key_heads == [2, 2]  # forward and backward, K/V heads unrepeated
    assert not any("flash_attention" in str(n.target) for n in nodes)
    assert "kept on flash" not in steps[0].explain()
    assert max(errs[0]) <= 2 * max(errs[1]) + torch.finfo(torch.float16).eps, (errs[0], errs[1])
