"""stepfx.host_update_across_steps: the host update that waits for the norm
finishes while the next step begins, which waits for each piece where it
first reads it. The same arithmetic as the update within the step: bitwise
on CPU, whatever the host's speed (the worker is slowed here so that a
reader that did not wait would read the pieces before their update)."""
from __future__ import annotations

import functools
import time

import pytest
import torch

import stepfx
from stepfx.config.errors import ConfigError
from stepfx.runtime import host_optimizer as H
from stepfx.runtime.host_optimizer import host_adam_ready, host_adam_start, host_adam_wait
from stepfx.testing.equivalence import assert_data_parallel_equivalent
from tests.steps import adamw, dp_batches, lm_step, tiny_gpt


def _config(across, *, bf16=False, accumulation=1, **stepfx_extra):
    config = {"gradient_clipping": 0.5, "gradient_accumulation_steps": accumulation,
              "stepfx": {"host_adam": "exact", "host_update_across_steps": across, **stepfx_extra},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0,
                                    "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def _slow_host(monkeypatch, seconds=0.005):
    exact = H.adam_chunked

    def slow(*args, **kwargs):
        time.sleep(seconds)  # per parameter: the next step's forward is there long before the update is done
        return exact(*args, **kwargs)

    monkeypatch.setattr(H, "adam_chunked", slow)


def _train(config, steps, batches=None):
    """A tensor learning rate that a schedule writes in place after each step: the job runs after its step
    returned, and must not see the next step's rate."""
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, dtype=torch.float64), weight_decay=0.1)
    step = stepfx.parallelize(config)(lm_step)
    losses = []
    for i, (batch,) in enumerate(batches or dp_batches(1, steps=steps)[0]):
        losses.append(step(model, opt, batch).item())
        opt.param_groups[0]["lr"].fill_(1e-2 / (i + 2))
    return step, model, opt, losses


@pytest.mark.parametrize("bf16, accumulation", [(False, 1), (True, 1), (True, 2)],
                         ids=["fp32-device-masters", "bf16-host-masters", "bf16-micro-steps"])
def test_the_update_across_steps_is_the_same_step_bitwise(monkeypatch, bf16, accumulation):
    # fp32: the device pieces are the masters, donated to the job, which writes them in place; bf16: the masters
    # live on the host and the job writes the device's bf16 copies in place. With accumulation the micro-step's
    # plan reads the pieces without waiting itself: the executor waits for the update before it runs
    _slow_host(monkeypatch)
    steps = 3 * accumulation
    step, _, _, losses = _train(_config(True, bf16=bf16, accumulation=accumulation), steps)
    in_flight = len(H._IN_FLIGHT)  # what the last step's jobs write, each waited for by its first reader
    ours = step.model_state_dict()  # read right after a step: waits for its update
    assert not H._IN_FLIGHT
    plain, _, _, plain_losses = _train(_config(False, bf16=bf16, accumulation=accumulation), steps)
    assert losses == plain_losses
    theirs = plain.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    ours, theirs = step.optimizer_state(), plain.optimizer_state()
    assert all(torch.equal(ours[n][k], theirs[n][k]) for n in theirs for k in theirs[n])
    nodes = list(step.plan.graph.gm.graph.nodes)
    starts = [n for n in nodes if n.target is host_adam_start]
    assert starts and all(n.kwargs.get("across_steps") for n in starts)
    assert not any(n.target is host_adam_wait for n in nodes)
    readies = [n for n in nodes if n.target is host_adam_ready]
    first_use = min(nodes.index(n) for n in readies)
    assert len(readies) == sum(n.args[0] for n in starts) == in_flight
    assert first_use < min(nodes.index(s) for s in starts)
    assert "finish in the next step" in step.explain()


def test_a_step_failing_while_the_last_update_runs_leaves_that_update(monkeypatch):
    # the failed step's state is the one the step before it left, its host update complete
    _slow_host(monkeypatch, 0.01)
    batches = dp_batches(1, steps=2)[0]
    step, model, opt, _ = _train(_config(True), 1, batches[:1])
    (bad,) = batches[1]
    with pytest.raises(Exception):
        step(model, opt, bad.clamp(min=0) + 10**6)  # token ids past the embedding
    assert not H._IN_FLIGHT and not H._ACROSS
    after_one, ref_model, ref_opt, _ = _train(_config(False), 1, batches[:1])
    ours, theirs = step.model_state_dict(), after_one.model_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    (batch,) = batches[1]
    assert step(model, opt, batch).item() == after_one(ref_model, ref_opt, batch).item()  # and training goes on


def test_on_two_ranks_equals_the_single_process(rank_pool):
    report = assert_data_parallel_equivalent(rank_pool(2), lm_step, functools.partial(tiny_gpt, bias=False), adamw,
                                             dp_batches(2), config=_config(True), clip_norm=0.5, rtol=1e-5,
                                             atol=1e-7)
    assert "finish in the next step" in report.explains[0]


@pytest.mark.parametrize("extra, match", [
    ({"delayed_parameter_update": True}, "delayed_parameter_update both move"),
    ({"host_update_speculation": True}, "host_update_speculation true"),
], ids=["with-the-delayed-update", "with-speculation"])
def test_conflicting_options_are_refused_by_key(extra, match):
    config = _config(True, bf16=True, **extra)
    with pytest.raises(ConfigError, match=r"stepfx\.host_update_across_steps: .*" + match):
        _train(config, 1)


def test_the_memory_estimate_holds_the_gradients_until_their_job_is_waited_for():
    # the job reads the step's gradients after the step: they stay to its end, and into the next step until
    # its first reader of the job's pieces waits for it
    from stepfx.graph.accounting import Sizes, estimate_memory, liveness, size_values

    step = _train(_config(True), 1)[0]
    graph = step.plan.graph
    nodes = list(graph.gm.graph.nodes)
    starts = [n for n in nodes if n.target is host_adam_start]
    grads = {g for s in starts for g in s.args[1 + s.args[0]:1 + 2 * s.args[0]]}
    held = sum(g.meta["val"].numel() * g.meta["val"].element_size() for g in grads)
    sizes = Sizes(size_values(graph))
    live = at_first = 0
    for n, size, freed in liveness(graph, sizes):
        if size is not None:
            live += sizes.value(size)
            if n.op != "placeholder" and not at_first:
                at_first = sizes.value(size)
        live -= sum(sizes.value(s) for _, s in freed)
    inputs = sum(sizes.value(sizes.bytes_of(n.meta["val"])) for n in nodes if n.op == "placeholder")
    assert held > 0 and at_first >= held  # the previous step's, at the first node
    assert live - inputs >= held  # this step's, at its end
    within = estimate_memory(_train(_config(False), 1)[0].plan.graph)
    assert estimate_memory(graph).peak >= within.peak


def test_below_zero_3_it_does_not_apply_and_says_so():
    config = _config(True)
    config["zero_optimization"]["stage"] = 2
    step = _train(config, 1)[0]
    assert any(r.name == "update_across_steps" and r.skipped for r in step.plan.records)
    assert any(n.target is host_adam_wait for n in step.plan.graph.gm.graph.nodes)
