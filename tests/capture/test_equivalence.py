"""Captured-and-executed equals eager, bitwise, on CPU fp32 over 5 steps.

fp32 on CPU reproduces eager PyTorch exactly: the graph runs the same aten
kernels in the same order with the same operand layouts, and the
optimizer's scalar arithmetic runs in Python doubles as in eager. So these
tests demand bitwise equality (exact=True); the documented tolerance for
other settings is 1e-6 relative.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from stepfx.testing.equivalence import assert_step_equivalent
from tests.steps import (
    MLP,
    SmallCNN,
    ce_step,
    hf_gpt2,
    hf_llama,
    hf_step,
    image_batches,
    lm_step,
    mlp_batches,
    tiny_gpt,
    token_batches,
)

OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "sgd_nesterov_wd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_dampening": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.8, dampening=0.3),
    "sgd_maximize": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5, maximize=True),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adam_wd_amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=0.1, amsgrad=True),
    "adam_foreach": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, foreach=True),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
    "adamw_amsgrad": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, amsgrad=True),
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_mlp_every_optimizer(opt):
    make_opt = OPTIMIZERS[opt]
    # adam_foreach: stepfx traces the single-tensor algorithm; eager's foreach
    # kernels on CPU compute the same per-element math, so bitwise still holds
    report = assert_step_equivalent(ce_step, lambda: MLP((8, 16, 4)), make_opt, mlp_batches(), exact=True)
    assert report.steps == 5 and report.bitwise


def test_mlp_with_dropout_matches_eager_masks():
    report = assert_step_equivalent(
        ce_step, lambda: MLP((8, 32, 4), dropout=0.3), OPTIMIZERS["adamw"], mlp_batches(), exact=True
    )
    assert report.bitwise


def test_gpt_transformer():
    report = assert_step_equivalent(lm_step, lambda: tiny_gpt(dropout=0.1), OPTIMIZERS["adamw"], token_batches(), exact=True)
    assert report.bitwise


def test_hf_gpt2():
    report = assert_step_equivalent(hf_step, hf_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), token_batches(), exact=True)
    assert report.bitwise


def test_hf_llama():
    report = assert_step_equivalent(hf_step, hf_llama, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), token_batches(), exact=True)
    assert report.bitwise


def test_cnn_batchnorm_running_stats():
    report = assert_step_equivalent(ce_step, SmallCNN, OPTIMIZERS["sgd_momentum"], image_batches(), exact=True)
    assert report.bitwise


def test_param_groups_with_own_lr_and_weight_decay():
    def make_opt(m):
        return torch.optim.AdamW(
            [
                {"params": m.net[0].parameters(), "lr": 0.1, "weight_decay": 0.0},
                {"params": m.net[2].parameters(), "lr": 0.003, "weight_decay": 0.2},
            ],
            lr=0.01,
        )

    report = assert_step_equivalent(ce_step, lambda: MLP((8, 16, 4)), make_opt, mlp_batches(), exact=True)
    assert report.bitwise


def test_frozen_parameters_stay_and_are_not_written():
    def make_model():
        m = MLP((8, 16, 16, 4))
        m.net[0].weight.requires_grad_(False)
        return m

    report = assert_step_equivalent(
        ce_step, make_model, lambda m: torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=0.01), mlp_batches(), exact=True
    )
    assert report.bitwise


def test_frozen_parameter_inside_optimizer():
    def make_model():
        m = MLP((8, 16, 4))
        m.net[2].bias.requires_grad_(False)
        return m

    report = assert_step_equivalent(ce_step, make_model, OPTIMIZERS["sgd_momentum"], mlp_batches(), exact=True)
    assert report.bitwise


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


def test_tied_weights_are_one_parameter():
    report = assert_step_equivalent(lm_step, TiedLM, OPTIMIZERS["adamw"], token_batches(), exact=True)
    assert report.bitwise


@pytest.mark.parametrize(
    "sched",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    ],
    ids=["steplr", "onecycle", "lambda"],
)
def test_lr_scheduler_changes_lr_between_calls_without_recapture(sched):
    report = assert_step_equivalent(
        ce_step, lambda: MLP((8, 16, 4)), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), mlp_batches(), make_scheduler=sched, exact=True
    )
    assert report.bitwise


def test_step_without_zero_grad_accumulates_like_eager():
    def step(model, optimizer, x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    report = assert_step_equivalent(step, lambda: MLP((8, 16, 4)), OPTIMIZERS["sgd_momentum"], mlp_batches(), exact=True)
    assert report.bitwise


def test_gradient_accumulation_in_user_code():
    def step(model, optimizer, xs, ys):
        optimizer.zero_grad()
        total = 0.0
        for i in range(xs.shape[0]):
            loss = torch.nn.functional.cross_entropy(model(xs[i]), ys[i]) / xs.shape[0]
            loss.backward()
            total = total + loss.detach()
        optimizer.step()
        return total

    batches = [(torch.randn(3, 4, 8), torch.randint(0, 4, (3, 4))) for _ in range(5)]
    report = assert_step_equivalent(step, lambda: MLP((8, 16, 4)), OPTIMIZERS["adam"], batches, exact=True)
    assert report.bitwise


def test_returns_pytree_with_constants_and_scalars():
    def step(model, optimizer, x, y):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return {"loss": loss, "acc": acc, "loss_value": loss.item(), "tag": "train", "n": [1, 2]}

    report = assert_step_equivalent(step, lambda: MLP((8, 16, 4)), OPTIMIZERS["adam"], mlp_batches(), exact=True)
    assert report.bitwise
