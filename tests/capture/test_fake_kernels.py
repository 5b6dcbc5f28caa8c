"""Ops torch has no fake (meta) kernel for. ``F.ctc_loss`` with length
tensors (Hugging Face's CTC heads: Wav2Vec2, HuBERT) gets one from stepfx
(its ``log_alpha`` is sized by the longest target, a data-dependent size) and
trains as eager does; any other such op gets its own CaptureError naming the
op and the user's line (not "tensor-dependent control flow", which is how
fake mode reports them)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from stepfx import CaptureError
from stepfx.testing.equivalence import assert_data_parallel_equivalent
from tests.steps import adamw

THIS_FILE = __file__.rstrip("c")
CLASSES = 7   # class 0 is the CTC blank


def ctc_step(model, optimizer, x, targets, input_lengths, target_lengths):
    log_probs = model(x).log_softmax(-1).transpose(0, 1)   # (time, batch, classes)
    loss = F.ctc_loss(log_probs, targets, input_lengths, target_lengths)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def ctc_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, CLASSES))


def ctc_batch(g: torch.Generator, *, batch: int, concatenated: bool):
    """Frames padded to the longest input (lengths vary per sequence and
    per batch), labels padded to the longest label (or concatenated, the
    other layout ctc_loss takes)."""
    frames = torch.randint(6, 15, (batch,), generator=g)
    labels = torch.randint(1, 5, (batch,), generator=g)
    x = torch.randn(batch, int(frames.max()), 8, generator=g)
    padded = torch.randint(1, CLASSES, (batch, int(labels.max())), generator=g)
    targets = torch.cat([padded[i, :n] for i, n in enumerate(labels.tolist())]) if concatenated else padded
    return x, targets, frames, labels


@pytest.mark.parametrize("concatenated", [False, True], ids=["padded-targets", "concatenated-targets"])
def test_ctc_loss_with_length_tensors_trains_as_eager(concatenated):
    torch.manual_seed(0)
    model, ref = ctc_model(), ctc_model()
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = adamw(model), adamw(ref)
    step = stepfx.parallelize({"gradient_clipping": 0})(ctc_step)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        batch = ctc_batch(g, batch=3, concatenated=concatenated)
        loss = step(model, opt, *batch)
        ref_loss = ctc_step(ref, ref_opt, *batch)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    text = step.explain()
    # new frame counts: the batch's time dimension became symbolic once
    assert int(re.search(r"(\d+) captured variant\(s\)", text).group(1)) <= 2
    # log_alpha's width (the longest label) is named with the user's line
    assert re.search(r"u\d+: data-dependent, a size of aten._ctc_loss.Tensor's output at .*F\.ctc_loss\(", text), text[:1500]


def test_ctc_loss_two_ranks_zero3_with_their_own_lengths(rank_pool):
    g = torch.Generator().manual_seed(2)
    batches = [[ctc_batch(g, batch=2, concatenated=False) for _ in range(4)] for _ in range(2)]
    config = {"gradient_clipping": 0, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    report = assert_data_parallel_equivalent(rank_pool(2), ctc_step, ctc_model, adamw, batches, config=config,
                                             rtol=1e-6, atol=1e-7)
    assert report.steps == 4


def test_an_op_without_a_fake_kernel_is_named_with_the_users_line():
    lib = torch.library.Library("stepfx_test_no_fake", "DEF")
    lib.define("double(Tensor x) -> Tensor")
    lib.impl("double", lambda x: x * 2, "CPU")

    def step_fn(model, optimizer, x):
        loss = torch.ops.stepfx_test_no_fake.double(model(x)).sum()  # the offending line
        loss.backward()
        optimizer.step()
        return loss

    model = nn.Linear(4, 4)
    with pytest.raises(CaptureError) as info:
        stepfx.parallelize()(step_fn)(model, adamw(model), torch.randn(2, 4))
    msg = str(info.value)
    assert "stepfx_test_no_fake.double.default has no fake (meta) kernel" in msg and "register_fake" in msg
    assert THIS_FILE in info.value.source and "stepfx_test_no_fake.double(" in info.value.source
