"""Ops without a fake (meta) kernel get their own CaptureError, naming the op
and the user's line (not "tensor-dependent control flow", which is how fake
mode reports them)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from stepfx import CaptureError
from tests.steps import adamw

THIS_FILE = __file__.rstrip("c")


def test_ctc_loss_with_tensor_lengths_names_the_op_without_a_fake_kernel():
    def ctc_step(model, optimizer, x, targets, input_lengths, target_lengths):
        log_probs = model(x).log_softmax(-1).transpose(0, 1)
        loss = F.ctc_loss(log_probs, targets, input_lengths, target_lengths)  # the offending line
        loss.backward()
        optimizer.step()
        return loss

    model = nn.Linear(8, 6)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(3, 12, 8, generator=g), torch.randint(1, 6, (3, 5), generator=g),
             torch.tensor([12, 11, 10]), torch.tensor([5, 4, 3]))
    with pytest.raises(CaptureError) as info:
        stepfx.parallelize()(ctc_step)(model, adamw(model), *batch)
    msg = str(info.value)
    assert "aten._ctc_loss.Tensor has no fake (meta) kernel" in msg and "control flow" not in msg
    assert THIS_FILE in info.value.source and "F.ctc_loss(" in info.value.source
