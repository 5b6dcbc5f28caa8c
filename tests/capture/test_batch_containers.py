"""Batches in containers torch's pytree does not open (capture/batch_types.py):
Hugging Face's BatchEncoding (what DataCollatorWithPadding returns) and a
loop's own dataclass. Their tensors were no inputs of the step: capture
refused with "a tensor that is not ... an argument of the step" (found
2026-12-06 passing DataCollatorWithPadding's batches as a new user)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import stepfx
from stepfx.testing.models import MLP
from tests.steps import mlp_batches

transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _collated(n=4, seed=0):
    """Right-padded batches of a new length each, as DataCollatorWithPadding returns them (a BatchEncoding)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 14, (), generator=g))
        ids = torch.randint(1, 96, (2, length), generator=g)
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, length - 3:] = 0
        out.append(transformers.BatchEncoding(
            {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}))
    return out


def encoding_step(model, optimizer, batch):
    assert isinstance(batch, transformers.BatchEncoding)
    batch = batch.to(model.device)  # what training loops do with it
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_a_batch_encoding_trains_bitwise_eager_with_symbolic_lengths():
    model = _gpt2()
    reference = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(reference.parameters(), lr=1e-3)
    step = stepfx.parallelize({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0})(encoding_step)
    for batch in _collated():
        assert torch.equal(step(model, opt, batch), encoding_step(reference, ref_opt, batch))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert len(step.plans) == 2  # the first length, then symbolic for every other


@dataclasses.dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    weight: float = 1.0


def dataclass_step(model, optimizer, batch: Batch):
    loss = F.cross_entropy(model(batch.x), batch.y) * batch.weight
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _model_and_reference():
    """An MLP and an SGD over it, and the same again as eager's reference."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), reference, torch.optim.SGD(reference.parameters(), lr=0.1)


def test_a_dataclass_batch_trains_bitwise_eager():
    model, opt, reference, ref_opt = _model_and_reference()
    step = stepfx.parallelize({"gradient_clipping": 0})(dataclass_step)
    batches = [Batch(x, y, 0.5) for x, y in mlp_batches(3)]
    for batch in batches:
        assert torch.equal(step(model, opt, batch), dataclass_step(reference, ref_opt, batch))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert len(step.plans) == 1
    assert any(slot.name == "args[0].x" for slot in step.plan.graph.signature.inputs)


@dataclasses.dataclass
class Settings:
    scale: float

    def __post_init__(self):
        self.doubled = 2 * self.scale  # not a field: a rebuilt instance would lack it


def settings_step(model, optimizer, x, y, settings: Settings):
    loss = F.cross_entropy(model(x), y) * settings.doubled
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_a_dataclass_without_tensors_stays_one_constant():
    model, opt, reference, ref_opt = _model_and_reference()
    step = stepfx.parallelize({"gradient_clipping": 0})(settings_step)
    for x, y in mlp_batches(2):
        assert torch.equal(step(model, opt, x, y, Settings(0.5)), settings_step(reference, ref_opt, x, y, Settings(0.5)))
    assert Settings not in torch.utils._pytree.SUPPORTED_NODES
