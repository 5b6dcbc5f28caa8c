"""The public face: parallelize, re-capture, cache, explain, graphs, dumps, state."""
from __future__ import annotations

import copy
import logging
import os

import pytest
import torch

import stepfx
from stepfx.config import Config, StepfxOptions
from stepfx.explain import format_bytes
from stepfx.passes import pass_names
from tests.steps import MLP, ce_step, mlp_batches


def _setup(dropout=0.0):
    torch.manual_seed(0)
    model = MLP((8, 16, 4), dropout=dropout)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def test_later_calls_reuse_the_plan():
    model, opt = _setup()
    step = stepfx.parallelize()(ce_step)
    for x, y in mlp_batches(5):
        step(model, opt, x, y)
    # Adam's state is created before the first capture (capture/initial_state.py): one plan for the run
    assert len(step.plans) == 1
    assert step.plan.runs == 5


def test_new_shapes_recapture_and_are_logged(caplog):
    model, opt = _setup()
    ref_model, ref_opt = copy.deepcopy(model), torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=0.01)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.01)
    step = stepfx.parallelize()(ce_step)
    g = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.INFO, logger="stepfx"):
        for batch in (6, 6, 3, 6, 3):
            x, y = torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)
            assert torch.equal(step(model, opt, x, y), ce_step(ref_model, ref_opt, x, y))
    assert len(step.plans) == 2  # a variant at batch 6, and one more once batch 3 appears
    assert any("re-capturing" in r.message and "argument [0][0]" in r.message and "(6, 8)" in r.message for r in caplog.records)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_cache_is_bounded_and_eviction_is_logged(caplog):
    model, opt = _setup()
    # static batch sizes: each of the four is a variant of its own
    step = stepfx.parallelize(Config(stepfx=StepfxOptions(cache_size=2, dynamic=False)))(ce_step)
    with caplog.at_level(logging.WARNING, logger="stepfx"):
        for batch in (2, 3, 4, 5):
            step(model, opt, torch.randn(batch, 8), torch.randint(0, 4, (batch,)))
    assert len(step.plans) == 2
    assert any("at most 2 captured variants" in r.message for r in caplog.records)


def test_captured_plans_are_kept_out_of_full_collections():
    """stepfx.freeze_gc: after a capture the process's objects (the plan's
    graphs among them) sit in the collector's permanent generation; the
    next capture unfreezes first, so an evicted plan is collected again;
    off, nothing is frozen."""
    import gc
    import weakref

    gc.unfreeze()
    try:
        model, opt = _setup()
        step = stepfx.parallelize(Config(stepfx=StepfxOptions(cache_size=1)))(ce_step)
        step(model, opt, torch.randn(2, 8), torch.randint(0, 4, (2,)))
        nodes = len(step.plan.graph.gm.graph.nodes)
        assert gc.get_freeze_count() > nodes
        evicted = weakref.ref(step.plan.graph.gm)
        step(model, opt, torch.randn(3, 8), torch.randint(0, 4, (3,)))  # a new variant evicts the first
        gc.unfreeze()
        gc.collect()
        assert evicted() is None, "the evicted plan's graph was kept alive"

        model, opt = _setup()
        step = stepfx.parallelize(Config(stepfx=StepfxOptions(freeze_gc=False)))(ce_step)
        step(model, opt, torch.randn(2, 8), torch.randint(0, 4, (2,)))
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_eval_mode_and_no_grad_changes_are_new_variants():
    model, opt = _setup(dropout=0.5)
    ref, ref_opt = copy.deepcopy(model), None
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    step = stepfx.parallelize()(ce_step)
    x, y = mlp_batches(1)[0]
    for mode in ("train", "eval", "train"):
        getattr(model, mode)()
        getattr(ref, mode)()
        torch.manual_seed(7)
        out = step(model, opt, x, y)
        torch.manual_seed(7)
        assert torch.equal(out, ce_step(ref, ref_opt, x, y))


def test_hyperparameter_change_other_than_lr_recaptures():
    model, _ = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = stepfx.parallelize()(ce_step)
    (x, y), (x2, y2) = mlp_batches(2)
    step(model, opt, x, y)
    step(model, opt, x, y)
    n = len(step.plans)
    opt.param_groups[0]["lr"] = 0.05  # an input: no re-capture
    step(model, opt, x2, y2)
    assert len(step.plans) == n
    opt.param_groups[0]["momentum"] = 0.5  # baked in: re-capture
    step(model, opt, x2, y2)
    assert len(step.plans) == n + 1


def test_graphs_are_ordered_by_pass():
    model, opt = _setup()
    step = stepfx.parallelize()(ce_step)
    step(model, opt, *mlp_batches(1)[0])
    assert list(step.graphs) == ["capture", *pass_names()]
    assert not step.graphs["capture"].functional and step.graphs["eliminate_dead_code"].functional


def test_explain_shows_passes_roles_bytes_and_the_graph():
    model, opt = _setup()
    step = stepfx.parallelize()(ce_step)
    for x, y in mlp_batches(2):
        step(model, opt, x, y)
    text = step.explain()
    for name in ("00_capture", *[f"{i + 1:02d}_{n}" for i, n in enumerate(pass_names())]):
        assert name in text
    assert "inputs by role:" in text
    n_params = sum(p.numel() for p in model.parameters())
    assert f"parameters: {n_params:,} ({n_params:,} trainable, 0 frozen)" in text
    param_line = next(line for line in text.splitlines() if line.strip().startswith("param "))
    assert f"{n_params:,}" in param_line and format_bytes(n_params * 4) in param_line
    assert "optimizer_state" in text and "hyperparam" in text and "batch" in text
    assert "def step(\n    self,\n    p_net_0_weight," in text and "# param net.0.weight" in text
    assert "# forward" in text and "# backward" in text and "# optimizer" in text


def test_explain_before_any_call_is_a_clear_error():
    step = stepfx.parallelize()(ce_step)
    with pytest.raises(RuntimeError, match="has not been called yet"):
        step.explain()


def test_a_step_called_without_its_model_and_optimizer_says_how_to_call_it():
    """A step written as a closure over its model and optimizer (as with
    torch.compile) and called with the batch only: the error names the call's
    shape and the objects the step reads from its scope, before anything runs."""
    model, opt = _setup()

    @stepfx.parallelize()
    def train_step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    x, y = next(iter(mlp_batches(1)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=r"called as train_step\(model, optimizer, \*batch\).*first argument must be "
                                        r"the nn.Module being trained, got Tensor; train_step reads model 'model' and "
                                        r"optimizer 'opt' from its enclosing scope.*train_step\(model, opt, \.\.\.\)"):
        train_step(x, y)
    with pytest.raises(TypeError, match="second argument must be the optimizer \\(or None\\), got Tensor"):
        stepfx.parallelize()(ce_step)(model, x, y)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_dump_writes_every_pass(tmp_path):
    model, opt = _setup()
    step = stepfx.parallelize()(ce_step)
    step(model, opt, *mlp_batches(1)[0])
    paths = step.dump(str(tmp_path))
    assert [os.path.basename(p) for p in paths] == [f"{i:02d}_{n}.py" for i, n in enumerate(["capture", *pass_names()])] + [
        "report.json"]  # the HTML report's data (stepfx report-html)


def test_dump_env_var_is_read_when_decorating(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPFX_DUMP_DIR", str(tmp_path))
    step = stepfx.parallelize()(ce_step)
    monkeypatch.delenv("STEPFX_DUMP_DIR")
    model, opt = _setup()
    step(model, opt, *mlp_batches(1)[0])
    (variant,) = os.listdir(tmp_path)
    assert "00_capture.py" in os.listdir(tmp_path / variant)


def test_model_state_and_torch_save_roundtrip(tmp_path):
    model, opt = _setup()
    step = stepfx.parallelize()(ce_step)
    for x, y in mlp_batches(3):
        step(model, opt, x, y)
    state = step.model_state_dict()
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    torch.save(model.state_dict(), tmp_path / "m.pt")
    fresh = MLP((8, 16, 4))
    fresh.load_state_dict(torch.load(tmp_path / "m.pt"))
    x = torch.randn(2, 8)
    assert torch.equal(fresh(x), model(x))


def test_disabled_pass_still_runs_correctly():
    report = stepfx.testing.assert_step_equivalent(
        ce_step,
        lambda: MLP((8, 16, 4)),
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
        mlp_batches(3),
        config=Config(stepfx=StepfxOptions(disable=("remove_aliases", "eliminate_dead_code"))),
        exact=True,
    )
    assert report.bitwise


def test_zero_auto_values_come_from_the_model(caplog):
    from stepfx.testing.models import GPT, gpt_config

    model = GPT(gpt_config("tiny"))  # d_model 32: HF's rules give 32**2, 0.9*32**2, 10*32
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"gradient_clipping": 0, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"}}
    step = stepfx.parallelize(cfg)(lm_step_for_api)
    with caplog.at_level(logging.INFO, logger="stepfx"):
        step(model, opt, torch.randint(0, 64, (2, 9)))
    zero = step.config.zero_optimization
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == (1024, 921, 320)
    assert any("resolved ZeRO 'auto' values" in r.message for r in caplog.records)


def test_zero_stage_auto_is_an_error_naming_the_key():
    model = MLP((8, 16, 4))
    step = stepfx.parallelize({"gradient_clipping": 0, "zero_optimization": {"stage": "auto"}})(ce_step)
    with pytest.raises(stepfx.ConfigError, match="zero_optimization.stage"):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), *mlp_batches(1)[0])


def lm_step_for_api(model, optimizer, idx):
    from stepfx.testing.models import lm_loss

    loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _weighted_ce_step(model, optimizer, x, y, weight, *, shift=0.0):
    loss = torch.nn.functional.cross_entropy(model(x), y) * weight + shift
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _twins(make_opt):
    """An MLP and its optimizer, and the same again as eager's reference."""
    import copy

    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    return model, make_opt(model.parameters()), reference, make_opt(reference.parameters())


def test_a_python_number_that_changes_between_calls_becomes_an_input_after_one_more_capture():
    """Numbers among the arguments (a weight, a keyword shift) that change
    value are inputs of the graph from then on: two plans for any number of
    values, bitwise eager (capture/number_arguments.py). Under
    stepfx.dynamic false each value is a plan of its own, and the warning
    names the argument once and the way (a tensor)."""
    import warnings

    model, opt, reference, ref_opt = _twins(lambda ps: torch.optim.SGD(ps, lr=0.1))
    step = stepfx.parallelize({"gradient_clipping": 0})(_weighted_ce_step)
    (x, y), = mlp_batches(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(4):
            got = step(model, opt, x, y, 1.0 + i, shift=0.5 * i)
            assert torch.equal(got, _weighted_ce_step(reference, ref_opt, x, y, 1.0 + i, shift=0.5 * i))
    assert len(step.plans) == 2
    assert not [w for w in seen if issubclass(w.category, stepfx.errors.CaptureWarning)]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert "args[2]" in step.explain() and "kwargs['shift']" in step.explain()  # (the inputs, named)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        static = stepfx.parallelize({"gradient_clipping": 0, "stepfx": {"dynamic": False}})(_weighted_ce_step)
        for i in range(3):
            static(model, opt, x, y, 1.0 + i, shift=0.5 * i)
    messages = [str(w.message) for w in seen if issubclass(w.category, stepfx.errors.CaptureWarning)]
    assert len(static.plans) == 3
    assert len(messages) == 2 and all("Pass it as a tensor (torch.tensor(value))" in m for m in messages)
    assert "the step's argument #5 (after the model and optimizer) is a Python number (1.0, now 2.0)" in messages[0]
    assert "the step's keyword argument 'shift' is a Python number (0.0, now 0.5)" in messages[1]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tensor_step = stepfx.parallelize({"gradient_clipping": 0})(_weighted_ce_step)
        for i in range(3):
            tensor_step(model, opt, x, y, torch.tensor(1.0 + i))
    assert len(tensor_step.plans) == 1
    assert not [w for w in seen if issubclass(w.category, stepfx.errors.CaptureWarning)]


def _count_step(model, optimizer, x, y, n):
    """A number the step's Python decides on (a range): it cannot be an input."""
    loss = sum(torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]) for i in range(n)) / n
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_a_number_the_steps_python_decides_on_stays_a_constant_named_in_the_warning():
    import warnings

    model, opt, reference, ref_opt = _twins(lambda ps: torch.optim.AdamW(ps, lr=0.01))
    step = stepfx.parallelize({"gradient_clipping": 0})(_count_step)
    (x, y), = mlp_batches(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for n in (1, 2, 3, 2):
            assert torch.equal(step(model, opt, x, y, n), _count_step(reference, ref_opt, x, y, n))
    assert len(step.plans) == 3  # one per value: 1, 2, 3
    messages = [str(w.message) for w in seen if issubclass(w.category, stepfx.errors.CaptureWarning)]
    assert len(messages) == 1 and "decides on its value (a branch, a range, a size)" in messages[0], messages
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def _dict_batch_step(model, optimizer, batch):
    loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _logging_step(model, optimizer, batch):
    loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    if batch["tag"].startswith("weighted"):
        loss = loss * 2
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _calls_warnings(step, model, opt, batches):
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        losses = [step(model, opt, b) for b in batches]
    return losses, [str(w.message) for w in seen if issubclass(w.category, stepfx.errors.CaptureWarning)]


def test_what_the_step_never_fetches_from_a_batch_dict_does_not_capture_again():
    """A batch dict that carries each example's id and text (kept for logging) captured the step at every call
    (found trying a padded HF batch with an 'id' list as a new user). Entries the traced step never fetches are
    left out of the fingerprint: one capture, and the same losses and parameters as eager."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    step = stepfx.parallelize({"gradient_clipping": 0})(_dict_batch_step)
    batches = [{"x": x, "y": y, "ids": [f"ex{i}a", f"ex{i}b"], "meta": {"text": f"example {i}", "n": i}}
               for i, (x, y) in enumerate(mlp_batches(4))]
    losses, messages = _calls_warnings(step, model, opt, batches)
    assert len(step.plans) == 1 and not messages
    assert [float(v) for v in losses] == [float(_dict_batch_step(reference, ref_opt, b)) for b in batches]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert "batch entries the step never reads (no tensors; a new value or length runs this plan): " \
           "args[0]['ids'], args[0]['meta']" in step.explain()


def test_a_list_of_ids_as_long_as_a_varying_batch_does_not_capture_again():
    """Batches of 3 to 6 examples, each with its list of ids: the list's length is structure, and it is left out
    with its values, so the symbolic capture serves every size (2 captures: the first call's, then symbolic)."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    step = stepfx.parallelize({"gradient_clipping": 0})(_dict_batch_step)
    batches = [{"x": x[:n], "y": y[:n], "ids": [f"ex{i}.{j}" for j in range(n)]}
               for i, ((x, y), n) in enumerate(zip(mlp_batches(5), [3, 4, 6, 5, 3]))]
    losses, messages = _calls_warnings(step, model, opt, batches)
    assert len(step.plans) == 2 and not messages
    assert [float(v) for v in losses] == [float(_dict_batch_step(reference, ref_opt, b)) for b in batches]


def test_text_the_step_reads_is_named_once_as_the_reason_to_capture_again():
    """A string the step fetches may steer the graph: each new value captures again, named once per field
    (long texts cut), and the branch it takes is the one eager takes."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    step = stepfx.parallelize({"gradient_clipping": 0})(_logging_step)
    tags = ["plain " + "word " * 20, "weighted", "plain"]
    batches = [{"x": x, "y": y, "tag": t, "ids": [f"ex{i}"]} for i, ((x, y), t) in enumerate(zip(mlp_batches(3), tags))]
    losses, messages = _calls_warnings(step, model, opt, batches)
    assert len(step.plans) == 3
    assert len(messages) == 1, messages
    assert "argument #3 (after the model and optimizer) at ['tag'] is a Python str ('plain word word word word word word word...', now 'weighted')" in messages[0]
    assert "The step reads it" in messages[0]
    assert [float(v) for v in losses] == [float(_logging_step(reference, ref_opt, b)) for b in batches]


def _token_sum_run(config, counts):
    from tests.steps import token_sum_step

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize(config)(token_sum_step)
    losses = [step(model, opt, x, y, n).item() for (x, y), n in zip(mlp_batches(len(counts)), counts)]
    return losses, len(step.plans), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("config", [
    {"gradient_clipping": 1.0, "stepfx": {"codegen": True}},
    {"gradient_clipping": 0, "fp16": {"enabled": True, "auto_cast": True}},
    {"gradient_clipping": 0, "gradient_accumulation_steps": 2},
], ids=["codegen", "fp16-auto-cast", "accumulation"])
def test_a_number_input_computes_the_constants_bits(config):
    """The token count as an input (fused kernels taking it as an argument,
    fp16's cast of floating inputs leaving it alone, accumulation's two
    plans) gives the bits of the step that holds it as a constant."""
    counts = [3, 5, 2, 7, 4, 6]
    inputs = _token_sum_run(config, counts)
    constants = _token_sum_run({**config, "stepfx": {**config.get("stepfx", {}), "dynamic": False}}, counts)
    assert inputs[0] == constants[0] and all(torch.equal(p, q) for p, q in zip(inputs[2], constants[2]))
    assert constants[1] == 6 and inputs[1] == (3 if "gradient_accumulation_steps" in config else 2)
