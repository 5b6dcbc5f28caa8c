"""The config's ``optimizer`` and ``scheduler`` blocks, as ``deepspeed.initialize``
uses them: the step builds the optimizer (the user passes None) and advances
the scheduler once per optimizer update.

Tolerance: fp32, bitwise against eager PyTorch running the same optimizer
and scheduler classes by hand (the same ops in the same order).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import stepfx
from stepfx.config import ConfigError
from stepfx.schedules import WarmupDecayLR
from tests.steps import MLP, mlp_batches, token_batches, tiny_gpt, lm_step

ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.1}}
DECAY = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 2,
                                             "total_num_steps": 6, "warmup_type": "linear"}}


def ce_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _eager(model, batches, *, accumulate=1):
    """The step by hand: torch's AdamW with the block's arguments, DeepSpeed's
    WarmupDecayLR, one update and one scheduler step per ``accumulate`` calls."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1, foreach=False)
    sched = WarmupDecayLR(opt, total_num_steps=6, warmup_min_lr=0.0, warmup_max_lr=3e-3, warmup_num_steps=2,
                          warmup_type="linear")
    losses, lrs = [], []
    for i, (x, y) in enumerate(batches):
        loss = F.cross_entropy(model(x), y)
        (loss / accumulate).backward()  # the step returns the loss as written; its gradient is averaged
        if i % accumulate == accumulate - 1:
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            opt.zero_grad()
            sched.step()
        losses.append(loss.detach())
    return losses, lrs, sched


def test_config_builds_the_optimizer_and_steps_the_scheduler_like_eager():
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    ref = copy.deepcopy(model)
    batches = mlp_batches(6)
    ref_losses, ref_lrs, ref_sched = _eager(ref, batches)
    assert len(set(ref_lrs)) >= 4  # the schedule really moves

    step = stepfx.parallelize({"optimizer": ADAMW, "scheduler": DECAY, "gradient_clipping": 0})(ce_step)
    lrs = []
    for (x, y), ref_loss in zip(batches, ref_losses):
        lrs.append(step.lr_scheduler.get_last_lr()[0] if step.lr_scheduler else 0.0)
        assert torch.equal(step(model, None, x, y), ref_loss)
    assert lrs[1:] == ref_lrs[1:] and isinstance(step.optimizer, torch.optim.AdamW)
    assert step.lr_scheduler.last_batch_iteration == ref_sched.last_batch_iteration
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert not step.config.not_applied  # both blocks are acted on


def test_scheduler_advances_once_per_update_under_accumulation():
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    ref = copy.deepcopy(model)
    batches = mlp_batches(6)
    ref_losses, _, ref_sched = _eager(ref, batches, accumulate=2)
    config = {"optimizer": ADAMW, "scheduler": DECAY, "gradient_clipping": 0, "gradient_accumulation_steps": 2}
    step = stepfx.parallelize(config)(ce_step)
    for i, (x, y) in enumerate(batches):
        loss = step(model, None, x, y)
        torch.testing.assert_close(loss, ref_losses[i], rtol=1e-6, atol=0)
        assert step.lr_scheduler.last_batch_iteration == (i + 1) // 2 - 1  # DeepSpeed's counter starts at -1
    assert step.lr_scheduler.state_dict() == ref_sched.state_dict()
    torch.testing.assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), rtol=1e-5, atol=1e-7)


def test_a_scheduler_block_schedules_the_users_optimizer():
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    block = {"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}}
    step = stepfx.parallelize({"scheduler": block, "gradient_clipping": 0})(lm_step)
    for batch in token_batches(5):
        step(model, opt, *batch)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)  # 5 steps, halved after 2 and 4
    assert step.optimizer is opt


def scaled_step(model, optimizer, x, y, blowup):
    loss = F.cross_entropy(model(x).float(), y) * blowup
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_fp16_skipped_step_does_not_advance_the_scheduler():
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    config = {"optimizer": ADAMW, "scheduler": DECAY, "gradient_clipping": 0,
              "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8, "hysteresis": 1}}
    step = stepfx.parallelize(config)(scaled_step)
    (x, y), = mlp_batches(1)
    for blowup in (1.0, 1e30, 1.0, 1e30, 1e30, 1.0):
        step(model, None, x, y, torch.tensor(blowup))
    assert step.skipped_steps == 3
    assert step.lr_scheduler.last_batch_iteration == 3 - 1  # from -1; DeepSpeed steps it only on applied updates


def test_optimizer_passed_as_well_as_configured_is_an_error():
    model = MLP((8, 16, 4))
    step = stepfx.parallelize({"optimizer": ADAMW})(ce_step)
    (x, y), = mlp_batches(1)
    with pytest.raises(ConfigError, match=r"optimizer.*pass None"):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    before = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


def test_scheduler_without_any_optimizer_is_an_error():
    step = stepfx.parallelize({"scheduler": DECAY})(ce_step)
    (x, y), = mlp_batches(1)
    with pytest.raises(ConfigError, match="scheduler"):
        step(MLP((8, 16, 4)), None, x, y)


def test_auto_in_the_optimizer_block_names_the_key():
    config = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    step = stepfx.parallelize(config)(ce_step)
    (x, y), = mlp_batches(1)
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr"):
        step(MLP((8, 16, 4)), None, x, y)
