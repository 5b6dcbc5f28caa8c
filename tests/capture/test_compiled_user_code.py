"""Users who already run ``torch.compile`` keep it when they move to stepfx:
``torch.compile(model)`` passed as the model, or a compiled function (a loss,
a library's compiled helper) called inside the step. Capture failed on both
("Detected that you are using FX to symbolically trace a dynamo-optimized
function", found 2026-12-06 trying a compiled GPT-2 as a new user). stepfx
compiles the whole step itself: the compiled code is traced as its Python,
and a compiled model's parameters keep their own names (no ``_orig_mod.``)."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from stepfx.graph import Role
from tests.steps import token_batches

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0}


class Net(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h + self.mlp(h))


def _loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


compiled_loss = torch.compile(_loss, backend="eager")


def _step_with(loss_fn):
    def step(model, optimizer, ids):
        loss = loss_fn(model(ids), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


step = _step_with(_loss)
step_with_compiled_loss = _step_with(compiled_loss)


def _train(fn, model, ref_fn=step):
    torch.manual_seed(0)
    plain = Net()
    ref = copy.deepcopy(plain)
    target = model(plain)
    opt, ref_opt = torch.optim.AdamW(target.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    s = stepfx.parallelize(CONFIG)(fn)
    for (ids,) in token_batches(3):
        assert torch.equal(s(target, opt, ids), ref_fn(ref, ref_opt, ids))
    for p, q in zip(plain.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    return s


def test_a_compiled_model_trains_bitwise_eager_under_its_own_names():
    s = _train(step, lambda m: torch.compile(m, backend="eager"))
    names = [slot.name for slot in s.plan.graph.signature.inputs if slot.role is Role.PARAM]
    assert names and not any(n.startswith("_orig_mod") for n in names)
    assert "emb.weight" in names


def test_a_compiled_function_in_the_step_is_traced_as_its_python():
    _train(step_with_compiled_loss, lambda m: m)
