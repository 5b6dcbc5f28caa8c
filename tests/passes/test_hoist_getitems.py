"""hoist_getitems: a multi-output op's results are taken out right after it, so
its tuple does not keep every result alive until the last reader of one (the
recomputation's backward reading a fused residual-add + layer norm's rstd kept
the block's residual sum to the backward: 18 GiB at 13B, micro-batch 24,
measured on the H200 and not predicted)."""
from __future__ import annotations

import gc
import operator

import torch

import stepfx
from stepfx.graph import Role
from stepfx.graph.accounting import estimate_memory
from stepfx.testing.memory import measure_memory
from tests.steps import adamw, lm_step, tiny_gpt, token_batches


def _trained(disable=()):
    # every block recomputed (budget 0) with stepfx's kernels: the fused add + layer norm's mean and rstd are read
    # by the backward, its residual sum by the next block only
    torch.manual_seed(0)
    model = tiny_gpt(seq_len=64, d_model=64, n_layers=1)
    opt = adamw(model)
    batch = token_batches(1, batch=4, seq=64)[0]
    config = {"gradient_clipping": 1.0, "bf16": {"enabled": True},
              "stepfx": {"codegen": True, "activation_memory_budget": 0.0, "disable": list(disable)}}
    step = stepfx.parallelize(config)(lm_step)
    losses = [step(model, opt, *batch).item()]
    held = [*model.parameters(), *batch] + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    gc.collect()
    measured = measure_memory(lambda: step(model, opt, *batch), held)
    return step, losses, measured, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_each_result_lives_until_its_own_last_reader_as_the_estimate_counts():
    # (with the pass disabled the measured peak is 5.4% over the estimate here: the residual sum held to the backward)
    step, losses, measured, params = _trained()
    nodes = list(step.plan.graph.gm.graph.nodes)
    for n in nodes:
        items = [u for u in n.users if u.target is operator.getitem]
        if n.op == "call_function" and items:  # right after their op, one per index
            following = nodes[nodes.index(n) + 1:nodes.index(n) + 1 + len(items)]
            assert set(following) == set(items) and len({u.args[1] for u in items}) == len(items), n.name
    assert "taken out right after their op" in step.explain()
    est = estimate_memory(step.plan.graph)
    # the carried 16-bit copies are at rest in the estimate (runtime state); the measurement, which knows only the
    # model's and optimizer's tensors as held, sees them through the views the step takes of them
    carried = est.at_rest.get(Role.RUNTIME_STATE, 0)
    assert abs((est.peak - est.resident) - (measured.peak - carried)) <= 0.01 * measured.peak
