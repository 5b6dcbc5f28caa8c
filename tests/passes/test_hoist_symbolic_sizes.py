"""hoist_symbolic_sizes and the codegen passes on a step captured with
symbolic batch sizes (stepfx.dynamic): the fused kernels take sizes as
arguments, so one capture serves lengths it never saw, computing what a
capture per length computes (Triton's interpreter on CPU)."""
from __future__ import annotations

import pytest
import torch

import stepfx
from stepfx.explain import kernel_calls
from stepfx.graph import Role
from tests.steps import lm_step, tiny_gpt

aten = torch.ops.aten


def _run(dynamic, seqs, config):
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (2, t + 1), generator=g) for t in seqs]
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = stepfx.parallelize({**config, "stepfx": {**config.get("stepfx", {}), "dynamic": dynamic}})(lm_step)
    losses = [step(model, opt, b) for b in batches]
    return step, losses, [p.detach().clone() for p in model.parameters()]


def test_size_reads_move_to_the_batch_inputs():
    step, _, _ = _run(True, [9], {"gradient_clipping": 0})
    before = step.graphs["eliminate_dead_code"].gm.graph
    after = step.graphs["hoist_symbolic_sizes"].gm.graph

    def reads(graph):
        return [n for n in graph.nodes if n.target is aten.sym_size.int]

    # the trace reads sizes off activations; afterwards only off the batch input, once per symbol
    assert any(n.args[0].op != "placeholder" for n in reads(before))
    assert reads(after) and all(n.args[0].op == "placeholder" and n.args[0].meta["slot"].role is Role.BATCH
                                for n in reads(after))
    assert len(reads(after)) == len({(n.args[0], n.args[1]) for n in reads(after)})
    assert "size reads of intermediate tensors" in dict((r.name, r.summary) for r in step.plan.records)["hoist_symbolic_sizes"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16"])  # fp32: the same kernels without the casts (suite time)
def test_fused_kernels_serve_unseen_lengths_as_a_capture_per_length(precision):
    config = {"gradient_clipping": 1.0, "stepfx": {"codegen": True}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    seqs = [9, 12, 7]  # captured once, at 9: a longer and a shorter length it never saw
    static, static_losses, static_params = _run(False, seqs, config)
    dynamic, losses, params = _run(True, seqs, config)
    assert len(static.plans) == len(seqs) and len(dynamic.plans) == 1 and dynamic.plan.guard is not None
    calls = kernel_calls(dynamic.plan.graph)
    assert calls == kernel_calls(static.plan.graph)
    assert calls["linear_cross_entropy"] == 1 and calls["layer_norm_backward"] >= 1 and calls["adam_step_many"] == 1
    assert all(torch.equal(a, b) for a, b in zip(losses, static_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, static_params))
