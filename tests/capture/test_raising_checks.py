"""A check that reads a tensor and only raises (``if labels.max() >= vocab:
raise ValueError(...)``) is captured as a run-time assertion: good batches
train exactly as eager, a bad batch raises with the check's message and
leaves the model and optimizer as they were.

PYTEST_DONT_REWRITE: pytest's assertion rewriting would change the bytecode
of the ``assert`` statement the steps here use as a check."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from stepfx import CaptureError
from stepfx.errors import ExecutionError
from tests.steps import MLP, ce_step, mlp_batches

THIS_FILE = __file__.rstrip("c")


class CheckedClassifier(nn.Module):
    """Validates its labels the way Hugging Face heads do."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.classes = classes
        self.body = MLP((8, 16, classes))

    def forward(self, x, labels):
        if labels.max() >= self.classes:
            raise ValueError(f"Label values must be < num_labels: {self.classes}")
        return F.cross_entropy(self.body(x), labels)


def checked_step(model, optimizer, x, labels):
    assert not (x.isnan().any()), "the batch has NaNs"
    loss = model(x, labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _state(model, optimizer):
    params = [p.detach().clone() for p in model.parameters()]
    states = [v.clone() for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return params + states


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_checks_train_like_eager_and_a_bad_batch_raises_leaving_state_unchanged():
    torch.manual_seed(0)
    model = CheckedClassifier()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = stepfx.parallelize()(checked_step)
    batches = mlp_batches(4)
    for x, y in batches[:3]:
        assert torch.equal(step(model, opt, x, y), checked_step(ref, ref_opt, x, y))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    ops = [n.target for n in step.plan.graph.gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.aten._assert_async.msg) == 2  # both checks survived the pass pipeline

    x, y = batches[3]
    bad_labels = y.clone()
    bad_labels[2] = 9
    before = _state(model, opt)
    with pytest.raises(ExecutionError) as info:
        step(model, opt, x, bad_labels)
    assert "ValueError: Label values must be < num_labels: 4" in str(info.value)
    assert "if labels.max() >= self.classes" in str(info.value)
    assert _same(before, _state(model, opt))

    bad_x = x.clone()
    bad_x[0, 0] = float("nan")
    with pytest.raises(ExecutionError, match="AssertionError: the batch has NaNs"):
        step(model, opt, bad_x, y)
    assert _same(before, _state(model, opt))

    # the failed calls changed nothing: training goes on exactly as eager
    assert torch.equal(step(model, opt, x, y), checked_step(ref, ref_opt, x, y))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_a_negated_check_takes_the_other_side():
    def step(model, optimizer, x, y):
        if not (y >= 0).all():
            raise ValueError("negative label")
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    model = MLP((8, 16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = stepfx.parallelize()(step)
    x, y = mlp_batches(1)[0]
    compiled(model, opt, x, y)
    with pytest.raises(ExecutionError, match="ValueError: negative label"):
        compiled(model, opt, x, -y - 1)


def test_a_raise_that_depends_on_more_than_the_tensor_is_still_refused():
    strict = False

    def step(model, optimizer, x, y):
        if (y < 0).any() and strict:  # whether it raises also depends on `strict`
            raise ValueError("negative label")
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    model = MLP((8, 16, 4))
    x, y = mlp_batches(1)[0]
    with pytest.raises(CaptureError, match="reads a tensor's value") as info:
        stepfx.parallelize()(step)(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    assert THIS_FILE in info.value.source and "and strict" in info.value.source


def test_a_branch_that_does_more_than_raise_is_still_refused():
    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x), y)
        if loss > 10:
            print("diverged")
            raise ValueError("diverged")
        loss.backward()
        optimizer.step()
        return loss

    model = MLP((8, 16, 4))
    x, y = mlp_batches(1)[0]
    with pytest.raises(CaptureError, match="reads a tensor's value"):
        stepfx.parallelize()(step)(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)


class OverflowClamped(nn.Module):
    """Guards overflow on the values the way transformers' BART-family encoder layers do in fp16."""

    def __init__(self):
        super().__init__()
        self.body = MLP((8, 16, 4))

    def forward(self, x):
        hidden = x * 2.0
        if hidden.dtype == torch.float32 and not torch.isfinite(hidden).all():
            clamp_value = torch.finfo(hidden.dtype).max / 4
            hidden = torch.clamp(hidden, min=-clamp_value, max=clamp_value)
        return self.body(torch.tanh(hidden * 1e-38))


clamped_step = ce_step


def test_a_branch_whose_body_only_clamps_is_selected_on_the_device_as_eager_takes_it():
    # one capture serves batches with and without non-finite values, each as eager computes it
    from stepfx.testing.equivalence import assert_step_equivalent

    batches = mlp_batches(4)
    batches[1][0][0, 0] = float("inf")  # eager clamps this batch
    batches[3][0][1, 2] = -float("inf")
    report = assert_step_equivalent(clamped_step, OverflowClamped,
                                    lambda m: torch.optim.SGD(m.parameters(), lr=0.1), batches, exact=True,
                                    config={"gradient_clipping": 0})
    assert report.bitwise
    torch.manual_seed(0)
    model = OverflowClamped()
    step = stepfx.parallelize({"gradient_clipping": 0})(clamped_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches:
        step(model, opt, *batch)
    assert len(step.plans) == 1
    code = step.plan.graph.gm.code
    assert "aten.clamp" in code and "aten.where" in code


def test_bart_trains_in_fp16_through_its_overflow_clamp():
    transformers = pytest.importorskip("transformers")
    from stepfx.testing.equivalence import assert_step_equivalent, mixed_precision_reference
    from tests.steps import padded_batch, padded_step

    def bart():
        return transformers.BartForConditionalGeneration(transformers.BartConfig(
            vocab_size=64, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=32, pad_token_id=0,
            bos_token_id=0, eos_token_id=0, decoder_start_token_id=0))

    g = torch.Generator().manual_seed(3)
    batches = [(padded_batch(lengths, generator=g),) for lengths in ([5, 9], [12, 4], [3, 8])]
    # fp16 loss scaling (2^4 here) rounds the gradients otherwise than the unscaled reference: a tolerance
    # (SGD: Adam's first steps would turn rounding noise into whole-lr updates)
    report = assert_step_equivalent(padded_step, bart, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                                    batches, rtol=1e-2, atol=1e-4, normwise=True,
                                    config={"fp16": {"enabled": True, "initial_scale_power": 4}, "gradient_clipping": 0},
                                    reference_fn=mixed_precision_reference(padded_step, torch.float16))
    assert report.steps == 3


def test_a_branch_that_clamps_into_another_name_or_computes_on_tensors_is_refused():
    # where(the body runs, clamp(x), x) is eager's value only for the name that is clamped in place; a body
    # that computes on tensors otherwise cannot be selected op by op
    class IntoAnother(OverflowClamped):
        def forward(self, x):
            hidden, other = x * 2.0, x
            if not torch.isfinite(hidden).all():
                other = torch.clamp(hidden, min=-1.0, max=1.0)
            return self.body(other)

    class Scales(OverflowClamped):
        def forward(self, x):
            hidden = x * 2.0
            if not torch.isfinite(hidden).all():
                hidden = torch.clamp(hidden * 0.5, min=-1.0, max=1.0)
            return self.body(hidden)

    for make in (IntoAnother, Scales):
        torch.manual_seed(0)
        model = make()
        step = stepfx.parallelize({"gradient_clipping": 0})(clamped_step)
        with pytest.raises(CaptureError, match="reads a tensor's value"):
            step(model, torch.optim.SGD(model.parameters(), lr=0.1), *mlp_batches(1)[0])
