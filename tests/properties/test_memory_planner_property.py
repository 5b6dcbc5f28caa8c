"""Property (issue 18): the memory planner meets generated budgets.

For generated GPT shapes, ZeRO stages and budgets anywhere between the
smallest reachable peak and the peak with nothing recomputed or offloaded,
the planner's choice is predicted to fit the budget, every candidate it
names before its choice was over it (it keeps the first that fits, in its
order), and where the choice offloads nothing, the predicted transient
peak is within 10% of what the step really allocates on CPU. A budget
below the smallest reachable peak is a ConfigError naming that peak.
"""
from __future__ import annotations

import gc
import re

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import stepfx
from stepfx.graph.accounting import estimate_memory
from stepfx.testing.memory import measure_memory
from tests.steps import adamw, lm_step, tiny_gpt, token_batches

GIB = 2**30


def _run(shape, zero, stepfx_options):
    d_model, n_layers, seq, batch = shape
    torch.manual_seed(0)
    model = tiny_gpt(d_model=d_model, n_layers=n_layers, seq_len=seq)
    opt = adamw(model)
    config = {"gradient_clipping": 0, "zero_optimization": zero, "stepfx": {"host_adam": "exact", **stepfx_options}}
    step = stepfx.parallelize(config)(lm_step)
    batch_tokens = token_batches(1, batch=batch, seq=seq)[0]
    step(model, opt, *batch_tokens)
    return step, model, opt, batch_tokens


@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@example(shape=(48, 2, 64, 4), stage=2, where=0.4)  # recomputation and the offload both in reach
@given(
    shape=st.tuples(st.sampled_from([32, 48]), st.integers(1, 2), st.just(64), st.sampled_from([2, 4])),
    stage=st.sampled_from([0, 2, 3]),
    where=st.floats(0.0, 1.0),
)
def test_the_planner_meets_generated_budgets(shape, stage, where):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    most = estimate_memory(_run(shape, zero, {})[0].plan.graph).peak
    smallest_zero = dict(zero, offload_optimizer={"device": "cpu"}) if stage else zero
    least = estimate_memory(_run(shape, smallest_zero, {"activation_memory_budget": 0.0})[0].plan.graph).peak
    assert least <= most
    budget = int(least + where * (most - least))
    step, model, opt, batch = _run(shape, zero, {"memory_budget_gib": budget / GIB})
    est = estimate_memory(step.plan.graph)
    assert est.peak <= budget
    summary = next(r.summary for r in step.plan.records if r.name == "plan_memory")
    chosen, tried = summary.split("; tried ", 1)
    before = tried.split("; ")[:-1]  # the last one tried is the choice
    assert all(line.endswith("(over the budget)") for line in before), summary
    if "offload" not in chosen:  # what the step really allocates on CPU (host jobs allocate on the host)
        held = [*model.parameters(), *batch] + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        held += list(step._store.tensors.values())
        gc.collect()
        measured = measure_memory(lambda: step(model, opt, *batch), held)
        assert abs((est.peak - est.resident) - measured.peak) <= 0.1 * measured.peak, (est, measured.peak)
    with pytest.raises(stepfx.ConfigError, match=re.escape("stepfx.memory_budget_gib: ") + r".* cannot be met"):
        _run(shape, zero, {"memory_budget_gib": least / 2 / GIB})
