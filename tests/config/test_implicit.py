"""A DeepSpeed config that leaves gradient_clipping out clips at 1.0: said
once, at the first call, naming the key."""
from __future__ import annotations

import logging

import pytest
import torch

import stepfx
from tests.steps import MLP, ce_step, mlp_batches


def _warnings(config, caplog, calls=2):
    model = MLP((8, 16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = stepfx.parallelize(config)(ce_step)
    with caplog.at_level(logging.WARNING, logger="stepfx"):
        for x, y in mlp_batches(calls):
            step(model, opt, x, y)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "gradient_clipping" in r.getMessage()]


def test_a_config_without_gradient_clipping_is_told_once(caplog):
    (message,) = _warnings({"train_micro_batch_size_per_gpu": 6}, caplog)
    assert "does not set gradient_clipping" in message and "global norm 1" in message and '"gradient_clipping": 0' in message
    assert "ce_step" in message


@pytest.mark.parametrize("config", [{"gradient_clipping": 1.0}, {"gradient_clipping": 0}, None],
                         ids=["set-to-the-default", "off", "no-config"])
def test_no_warning_when_set_or_when_there_is_no_config(config, caplog):
    assert _warnings(config, caplog) == []


def test_auto_clipping_outside_the_trainer_clips_at_its_default_and_says_so(caplog):
    """Left "auto", clipping would read no number and silently not clip."""
    import logging

    import torch

    import stepfx
    from tests.steps import lm_step, tiny_gpt, token_batches

    model = tiny_gpt()
    step = stepfx.parallelize({"gradient_clipping": "auto"})(lm_step)
    with caplog.at_level(logging.WARNING, logger="stepfx"):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), token_batches(1)[0][0])
    assert step.config.gradient_clipping == 1.0
    assert any('gradient_clipping is "auto"' in r.getMessage() for r in caplog.records)
    assert "unscale_clip_gradients" in step.explain() and "clipped to norm 1" in step.explain()

