"""Under ZeRO-3 the user's module is empty between steps (the rank's pieces
live in the step's store). Using it outside the step — evaluation,
generation, a second decorated step over the same model — is refused with
a message naming the step and ``sync_model()``, not aten's "'weight' must
be 2-D", and so is ``module.state_dict()`` (it would save empty tensors);
after ``sync_model()`` both a plain evaluation and a forward-only
decorated step run, and training goes on as if neither had happened."""
from __future__ import annotations

import pytest
import torch

import stepfx
from stepfx.errors import CaptureError
from stepfx.runtime.emptied import EmptiedModuleError
from tests.steps import square_step

CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "gradient_clipping": 0,
          "stepfx": {"cache_dir": False, "progress": False}}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.GELU(), torch.nn.Linear(8, 1))


def _train(model, optimizer, x):
    return square_step(model, optimizer, x)


def _evaluate(model, optimizer, x):
    with torch.no_grad():
        return model(x).square().mean()


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 4, generator=g) for _ in range(n)]


def test_calling_the_emptied_module_names_the_step_and_sync_model():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step = stepfx.parallelize(CONFIG)(_train)
    train_step(model, optimizer, _batches(1)[0])
    assert all(p.numel() == 0 for p in model.parameters())
    with pytest.raises(EmptiedModuleError, match=r"held by the stepfx step '_train' between steps, as ZeRO-3 pieces.*0\.weight of size "
                                                 r"\(8, 4\).*_train\.sync_model\(\)"):
        model(torch.randn(2, 4))
    with pytest.raises(EmptiedModuleError, match=r"state_dict\(\) would hold empty tensors.*_train\.save_checkpoint"):
        model.state_dict()  # torch.save(model.state_dict()) would write empty tensors
    assert [v.shape for v in train_step.model_state_dict().values()] == [(8, 4), (8,), (1, 8), (1,)]
    eval_step = stepfx.parallelize(CONFIG)(_evaluate)  # a second step over the emptied module: refused at capture
    with pytest.raises(CaptureError, match=r"EmptiedModuleError[\s\S]*_train\.sync_model\(\)"):
        eval_step(model, None, torch.randn(2, 4))


def test_after_sync_model_evaluation_runs_and_training_goes_on_as_without_it():
    batches, val = _batches(4), torch.randn(5, 4)
    losses = {}
    for evaluate in (None, "module", "step"):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step = stepfx.parallelize(CONFIG)(_train)
        eval_step = stepfx.parallelize(CONFIG)(_evaluate)
        got = []
        for i, x in enumerate(batches):
            got.append(train_step(model, optimizer, x).item())
            if evaluate is not None and i % 2 == 1:
                train_step.sync_model()
                model.eval()
                if evaluate == "module":
                    with torch.no_grad():
                        got.append(("eval", model(val).square().mean().item()))
                else:
                    got.append(("eval", eval_step(model, None, val).item()))
                model.train()
        losses[evaluate] = got
        final = train_step.model_state_dict()
        losses[evaluate, "final"] = {k: v.clone() for k, v in final.items()}
    assert losses["module"] == losses["step"]
    assert [x for x in losses["module"] if not isinstance(x, tuple)] == losses[None]
    assert losses["module"][2][1] != losses["module"][-1][1]  # the second evaluation saw the updated parameters
    for key, value in losses[None, "final"].items():
        assert torch.equal(value, losses["module", "final"][key]) and torch.equal(value, losses["step", "final"][key])
