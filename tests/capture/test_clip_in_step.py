"""A step that clips its own gradients (``torch.nn.utils.clip_grad_norm_(
model.parameters(), 1.0)`` after ``backward``, the usual hand-written loop)
under bf16: while the step runs the module computes with 16-bit copies of
the fp32 masters and ``model.parameters()`` yields the copies, which hold no
gradient. The clip clipped nothing and returned 0, silently (found
2026-12-06; the tests' bf16 reference had the same defect). Now it clips the
masters' gradients, as DeepSpeed clips fp32 gradients; other reads of the
copies' ``.grad`` and a clip under fp16 loss scaling are refused, naming the
line."""
from __future__ import annotations

import pytest
import torch

import stepfx
from stepfx.errors import CaptureError
from stepfx.testing.equivalence import assert_step_equivalent, mixed_precision_reference
from tests.steps import adamw, lm_loss, tiny_gpt, token_batches

BF16 = {"bf16": {"enabled": True}, "gradient_clipping": 0, "stepfx": {"dynamic": False}}


def norm_clipped_step(model, optimizer, idx):
    loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad()
    return loss, norm


def value_clipped_step(model, optimizer, idx):
    loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def unclipped_step(model, optimizer, idx):
    loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _params(step_fn, config):
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = adamw(model)
    step = stepfx.parallelize(config)(step_fn)
    outs = [step(model, opt, *batch) for batch in token_batches(2)]
    return outs, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("step_fn", [norm_clipped_step, value_clipped_step], ids=["norm", "value"])
def test_a_step_s_own_clip_under_bf16_clips_the_masters_gradients_bitwise(step_fn):
    report = assert_step_equivalent(step_fn, tiny_gpt, adamw, token_batches(3), config=BF16, exact=True,
                                    reference_fn=mixed_precision_reference(step_fn, torch.bfloat16))
    assert report.steps == 3
    # and the clip does something: the unclipped step ends elsewhere
    _, clipped = _params(step_fn, BF16)
    _, unclipped = _params(unclipped_step, BF16)
    assert any(not torch.equal(clipped[k], unclipped[k]) for k in clipped)


def test_the_clip_returns_the_masters_gradient_norm():
    outs, _ = _params(norm_clipped_step, BF16)
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = adamw(model)
    reference = mixed_precision_reference(norm_clipped_step, torch.bfloat16)
    expected = [reference(model, opt, *batch) for batch in token_batches(2)]
    for (_, norm), (_, ref) in zip(outs, expected):
        assert float(ref) > 0.5 and torch.equal(norm, ref)


def grad_reading_step(model, optimizer, idx):
    loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    total = sum(p.grad.norm() for p in model.parameters() if p.grad is not None)  # reads the copies' .grad
    optimizer.step()
    optimizer.zero_grad()
    return loss, total


def test_other_reads_of_the_copies_gradients_are_refused_with_the_line():
    torch.manual_seed(0)
    model = tiny_gpt()
    step = stepfx.parallelize(BF16)(grad_reading_step)
    with pytest.raises(CaptureError, match="reads .grad of the model's parameters") as info:
        step(model, adamw(model), *token_batches(1)[0])
    assert "test_clip_in_step.py" in str(info.value) and "total = sum(p.grad.norm()" in str(info.value)


def test_a_clip_under_fp16_loss_scaling_is_refused_with_the_line():
    torch.manual_seed(0)
    model = tiny_gpt()
    step = stepfx.parallelize({"fp16": {"enabled": True}, "gradient_clipping": 0})(norm_clipped_step)
    with pytest.raises(CaptureError, match="under fp16 loss scaling") as info:
        step(model, adamw(model), *token_batches(1)[0])
    assert "clip_grad_norm_(model.parameters(), 0.5)" in str(info.value)
    assert '"gradient_clipping"' in str(info.value)


def test_fp32_steps_clip_as_before():
    report = assert_step_equivalent(norm_clipped_step, tiny_gpt, adamw, token_batches(2),
                                    config={"gradient_clipping": 0}, exact=True)
    assert report.bitwise


def zeroing_step(model, optimizer, idx):
    model.zero_grad(set_to_none=False)  # torch's and transformers' loops clear through the module
    loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    optimizer.step()
    model.zero_grad()
    return loss


def test_the_module_s_zero_grad_clears_the_masters_gradients():
    """``model.zero_grad()`` reads every parameter's ``.grad``: on the copies it would be refused (or, before,
    clear nothing); it clears the masters' gradients, as in eager."""
    report = assert_step_equivalent(zeroing_step, tiny_gpt, adamw, token_batches(3), config=BF16, exact=True,
                                    reference_fn=mixed_precision_reference(zeroing_step, torch.bfloat16))
    assert report.steps == 3


@pytest.mark.parametrize("stage", [0, 1])
def test_a_step_s_own_clip_on_two_ranks_clips_the_averaged_gradients(rank_pool, stage):
    """On two ranks (stages 0-1 keep whole averaged gradients; stage 2+ refuses a clip in the step) the own clip
    sees the averaged masters' gradients: the parameters equal those of the config's gradient_clipping (the same
    norm of the same gradients, its terms summed in another order: within 1e-6), and both ranks report the same
    norm, above the clip."""
    from tests import dp_workers as W

    own, config = (rank_pool(2).run(W.own_clip_run, stage, flag) for flag in (True, False))
    assert own[0]["norms"] == own[1]["norms"] and min(own[0]["norms"]) > 0.5
    for key, want in config[0]["params"].items():
        got = own[0]["params"][key]
        assert float((got - want).norm()) <= 1e-6 * float(want.norm()), key
