"""Every unsupported construct fails loudly: a CaptureError naming the
construct, the user's source line and what to do instead."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from stepfx import CaptureError
from tests.steps import MLP, ce_step

THIS_FILE = __file__.rstrip("c")


def _run(step, model=None, optimizer=None, batch=None):
    model = model or MLP((8, 16, 4))
    optimizer = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch or (torch.randn(6, 8), torch.randint(0, 4, (6,)))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CaptureError) as info:
        stepfx.parallelize()(step)(model, optimizer, x, y)
    # nothing the user had is lost
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return str(info.value), info.value


def test_tensor_dependent_control_flow_names_the_line():
    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x), y)
        if loss > 1.0:  # the offending line
            loss = loss * 2
        loss.backward()
        optimizer.step()
        return loss

    msg, err = _run(step)
    assert "reads a tensor's value" in msg
    assert err.source is not None and THIS_FILE in err.source and "if loss > 1.0" in err.source
    assert "torch.where" in msg


def test_tensor_dependent_control_flow_inside_the_model():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            h = self.fc(x)
            if h.sum() > 0:  # data-dependent branch in the model
                h = -h
            return h

    msg, err = _run(ce_step, model=Branchy())
    assert "if h.sum() > 0" in err.source and "in forward" in err.source


@pytest.mark.parametrize("make", [lambda ps: torch.optim.NAdam(ps), lambda ps: torch.optim.RAdam(ps)], ids=["nadam", "radam"])
def test_unsupported_optimizer(make):
    model = MLP((8, 16, 4))
    msg, err = _run(ce_step, model=model, optimizer=make(model.parameters()))
    assert "unsupported optimizer" in msg and "torch.optim.SGD" in msg


@pytest.mark.parametrize("value", ["item", "tensor"])
def test_a_value_formatted_as_text_in_the_step_names_the_line_and_the_way(value):
    """print(f"{loss.item():.4f}") in the step: Python's TypeError from a
    traced value's __format__ became 'the step raised TypeError'; now it says
    what happened (the step's Python runs once, at capture) and what to do."""
    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        print(f"loss {loss.item() if value == 'item' else loss:.4f}")
        return loss

    msg, err = _run(step)
    assert "formats a tensor's value as text" in msg and "format it after the call" in msg
    assert 'print(f"loss' in err.source


def test_write_into_a_global_tensor():
    counter = torch.zeros(())

    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x), y)
        counter.add_(1)  # a global that is no parameter/buffer/state
        loss.backward()
        optimizer.step()
        return loss

    msg, err = _run(step)
    assert "not a parameter, buffer, optimizer state or argument" in msg
    assert "counter.add_(1)" in err.source
    assert "register_buffer" in msg
    assert counter.item() == 0  # capture did not touch the user's tensor


def test_read_of_a_global_tensor():
    weights = torch.ones(4)

    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x), y, weight=weights)
        loss.backward()
        optimizer.step()
        return loss

    msg, err = _run(step)
    assert "(a global, a closure variable" in msg and "weight=weights" in err.source


def test_write_into_an_unregistered_module_attribute():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)
            self.seen = torch.zeros(())  # not a buffer

        def forward(self, x):
            self.seen += 1
            return self.fc(x)

    msg, err = _run(ce_step, model=Holder())
    assert "not a parameter, buffer, optimizer state or argument" in msg and "self.seen += 1" in err.source


def test_write_into_the_batch():
    def step(model, optimizer, x, y):
        x.mul_(2)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    msg, err = _run(step)
    assert "input batch args[0]" in msg and "x.mul_(2)" in err.source and "clone" in msg


def test_optimizer_parameter_outside_the_model():
    model = MLP((8, 16, 4))
    stray = nn.Parameter(torch.zeros(3))
    msg, _ = _run(ce_step, model=model, optimizer=torch.optim.SGD([*model.parameters(), stray], lr=0.1))
    assert "is not a parameter of the model" in msg and "nn.Parameter" in msg


def test_tensor_hyperparameter_other_than_lr():
    model = MLP((8, 16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.param_groups[0]["momentum"] = torch.tensor(0.9)
    msg, _ = _run(ce_step, model=model, optimizer=opt)
    assert "'momentum' is a tensor" in msg


def test_user_exception_is_reported_with_its_line():
    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x).t(), y)  # wrong shapes
        loss.backward()
        optimizer.step()
        return loss

    msg, err = _run(step)
    assert "raised" in msg and "model(x).t()" in err.source


def test_model_must_be_a_module():
    step = stepfx.parallelize()(ce_step)
    with pytest.raises(TypeError, match="nn.Module"):
        step(lambda x: x, None, torch.randn(2, 8), torch.zeros(2, dtype=torch.long))


def test_bare_decorator_is_rejected_with_a_hint():
    with pytest.raises(TypeError, match=r"parallelize\(\)"):
        stepfx.parallelize(ce_step)


def test_item_used_only_in_python_warns():
    seen = []

    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x), y)
        seen.append(loss.item())  # runs once, at capture
        loss.backward()
        optimizer.step()
        return loss

    model = MLP((8, 16, 4))
    with pytest.warns(stepfx.CaptureWarning, match=r"\.item\(\).*seen.append"):
        stepfx.parallelize()(step)(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(6, 8), torch.randint(0, 4, (6,)))


def _deberta_classifier(**config):
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    return DebertaV2ForSequenceClassification(DebertaV2Config(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=64, pad_token_id=0, num_labels=3, **config))


def _classifier_step(model, optimizer, batch):
    out = model(**batch)  # the user's line that reaches the library's branch
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return out.loss


def test_a_data_dependent_branch_in_a_library_names_the_package_the_users_line_and_a_way_around():
    # DeBERTa-v2's classification loss: `if label_index.size(0) > 0` on labels.nonzero()
    from stepfx.testing.equivalence import assert_step_equivalent

    g = torch.Generator().manual_seed(0)
    batches = [({"input_ids": torch.randint(1, 64, (3, n), generator=g),
                 "labels": torch.randint(0, 3, (3,), generator=g)},) for n in (7, 9)]
    model = _deberta_classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CaptureError) as info:
        stepfx.parallelize({"gradient_clipping": 0})(_classifier_step)(model, optimizer, *batches[0])
    text = str(info.value)
    assert "modeling_deberta_v2.py" in text and "label_index.size(0) > 0" in text
    assert "installed package 'transformers'" in text and "config.problem_type" in text
    assert f"{THIS_FILE}:" in text and "out = model(**batch)" in text  # the user's own line
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # the way around it: the loss without the branch
    report = assert_step_equivalent(_classifier_step, lambda: _deberta_classifier(
        problem_type="single_label_classification"), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), batches,
                                    config={"gradient_clipping": 0}, exact=True)
    assert report.bitwise


def test_an_fp16_only_branch_on_the_values_says_bf16_skips_it():
    # a branch on the activations that only fp16 takes (and that is not a clamp, which is selected on the device)
    class Rescaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = MLP()

        def forward(self, x):
            h = self.body(x)
            if h.dtype == torch.float16 and h.abs().max() > 1e3:
                h = h / 2
            return h

    torch.manual_seed(0)
    model = Rescaled()
    step = stepfx.parallelize({"fp16": {"enabled": True}, "gradient_clipping": 0})(ce_step)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    with pytest.raises(CaptureError, match=r"(?s)h.abs\(\).max\(\) > 1e3.*taken only under fp16.*with bf16"):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)


class _Outputs:  # an object torch's pytree does not open
    def __init__(self, loss, parts):
        self.loss, self.parts = loss, parts


@dataclasses.dataclass(slots=True)
class _SlotOutputs:  # no __dict__
    note: str
    parts: list


@pytest.mark.parametrize("wrap, where", [
    (lambda loss, x: _Outputs(loss, [x.sum()]), "_Outputs at ['out'] that holds tensors (['out'].loss)"),
    (lambda loss, x: _SlotOutputs("mean", [1, x.sum()]), "_SlotOutputs at ['out'] that holds tensors (['out'].parts[1])"),
], ids=["object", "slots-dataclass"])
def test_an_object_holding_tensors_in_what_the_step_returns_is_refused_not_returned_with_stand_ins(wrap, where):
    # it used to come back as a constant of the capture: its tensors fake, the same object at every call
    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return {"out": wrap(loss.detach(), x)}

    msg, err = _run(step)
    assert where in msg
    assert err.source is not None and THIS_FILE in err.source and "in step" in err.source
    assert "use_cache=False" in err.hint


def test_an_object_without_tensors_in_what_the_step_returns_comes_back_as_it_is():
    settings = _Outputs("mean", [1, 2.5])

    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss, settings, model

    model = MLP((8, 16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = stepfx.parallelize()(step)
    for _ in range(2):
        loss, back, module = compiled(model, optimizer, torch.randn(6, 8), torch.randint(0, 4, (6,)))
        assert back is settings and module is model and not loss.requires_grad
