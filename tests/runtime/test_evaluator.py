"""``step.evaluator(fn)``: a forward-only step that runs where the training
step keeps the parameters. Under ZeRO-3 it gathers the training step's
pieces bucket by bucket for its forward (DeepSpeed's engine in ``eval()``
mode), instead of ``sync_model()`` making every parameter whole on every
rank. Checked on 2 ranks: its values equal the same evaluation at stage 0
bitwise (fp32 and bf16; the MLP and Hugging Face GPT-2 on padded batches of
a new length at every step, with some small parameters kept whole), equal
eager evaluation of the synced module, and training around it is bitwise
the run without it. Misuse is refused on every rank."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import stepfx
from stepfx.testing.errors import RankError
from tests import dp_workers as W
from tests.steps import ce_step, hf_gpt2, padded_rank_batches, padded_step


def mlp_eval(model, optimizer, x, y):
    with torch.no_grad():
        return F.cross_entropy(model(x), y)


def padded_eval(model, optimizer, batch):
    with torch.no_grad():
        return model(**batch).loss


def mlp_model():
    return W.MLPFactory((4, 6, 5, 3))()


def _run(make_model, train_fn, eval_fn, config, batches, evaluate):
    """Train on this rank's batches, evaluating the batch after each step
    (or not); then the synced module's eager evaluation of the last batch."""
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = make_model()
    opt = None if "optimizer" in config else torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize(config)(train_fn)
    ev = step.evaluator(eval_fn)
    losses, evals = [], []
    for batch in batches[rank]:
        losses.append(step(model, opt, *batch).item())
        if evaluate:
            model.eval()  # (GPT-2's dropout)
            evals.append(ev(model, None, *batch).item())
            model.train()
    state = {k: v.clone() for k, v in step.model_state_dict().items()}
    step.sync_model()
    model.eval()
    synced = eval_fn(model, None, *batches[rank][-1]).item()
    return losses, evals, state, synced


def _zero(stage, persist=0, bf16=False, built=False):
    config = {"gradient_clipping": 0,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": persist}}
    if bf16:
        config["bf16"] = {"enabled": True}
    if built:  # the config's optimizer block builds the training step's AdamW (none for the evaluator)
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    return config


@pytest.mark.parametrize("bf16, built", [(False, False), (True, True)], ids=["fp32", "bf16-config-optimizer"])
def test_evaluation_under_zero3_equals_stage0_and_leaves_training_as_it_was(rank_pool, bf16, built):
    batches = W.mlp_rank_batches(2, 3, 4, 3, 5)
    pool = rank_pool(2)
    runs = {stage: pool.run(_run, mlp_model, ce_step, mlp_eval, _zero(stage, bf16=bf16, built=built), batches, True)
            for stage in (0, 3)}
    quiet = pool.run(_run, mlp_model, ce_step, mlp_eval, _zero(3, bf16=bf16, built=built), batches, False)
    for rank in range(2):
        (l0, e0, s0, _), (l3, e3, s3, synced3), (lq, _, sq, _) = runs[0][rank], runs[3][rank], quiet[rank]
        assert l3 == l0 == lq  # training with evaluations between steps is the run without them
        assert e3 == e0 and len(e3) == 3
        assert all(torch.equal(s3[k], sq[k]) and torch.equal(s3[k], s0[k]) for k in s0)
        if not bf16:  # the module computes in fp32 after sync_model: eager's value
            assert e3[-1] == synced3


@pytest.mark.slow
def test_hugging_face_gpt2_padded_batches_with_whole_small_parameters(rank_pool):
    batches = padded_rank_batches(2, 3, seed=3)  # a new length at every step, different on the two ranks
    pool = rank_pool(2)
    at0 = pool.run(_run, hf_gpt2, padded_step, padded_eval, _zero(0), batches, True)
    at3 = pool.run(_run, hf_gpt2, padded_step, padded_eval, _zero(3, persist=40), batches, True)
    for rank in range(2):
        assert at3[rank][0] == at0[rank][0]
        assert at3[rank][1] == at0[rank][1]
        assert at3[rank][1][-1] == at3[rank][3]


def _freezing_run(stage, batches):
    """Evaluations around a parameter frozen mid-run (the training step then
    cuts its pieces anew): one before the next training step, under the old
    pieces, and one after each step; then the synced module's eager one."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = mlp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize(_zero(stage))(ce_step)
    ev = step.evaluator(mlp_eval)
    evals = []
    for i, (x, y) in enumerate(batches[dist.get_rank()]):
        if i == 2:
            model.net[0].weight.requires_grad_(False)
            evals.append(ev(model, None, x, y).item())
        step(model, opt, x, y)
        evals.append(ev(model, None, x, y).item())
    step.sync_model()
    return evals, mlp_eval(model, None, x, y).item(), len(ev.plans)


def test_evaluation_follows_the_pieces_cut_anew_when_a_parameter_is_frozen(rank_pool):
    # the evaluator used to re-cut the pieces itself from its own old layout after the training step had (a
    # KeyError on one rank, the other in a gather), and a plan made for the old layout could serve the new one
    batches = W.mlp_rank_batches(2, 4, 4, 3, 5)
    pool = rank_pool(2)
    at0, at3 = (pool.run(_freezing_run, stage, batches) for stage in (0, 3))
    for rank in range(2):
        (e0, _, _), (e3, synced3, plans3) = at0[rank], at3[rank]
        assert e3 == e0 and len(e3) == 5 and e3[-1] == synced3
        assert plans3 == 3  # the first layout, the new flags under the old pieces, then the new pieces


def _misuse(kind):
    torch.manual_seed(0)
    model = mlp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize(_zero(3))(ce_step)
    x, y = torch.randn(3, 4), torch.randint(0, 3, (3,))
    if kind == "before":
        return step.evaluator(mlp_eval)(model, None, x, y)
    step(model, opt, x, y)
    if kind == "optimizer":
        return step.evaluator(mlp_eval)(model, opt, x, y)
    if kind == "trains":
        return step.evaluator(_trains)(model, None, x, y)
    raise AssertionError(kind)


def _trains(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


@pytest.mark.parametrize("kind, error, match", [
    ("before", "RuntimeError", "has not been called yet: before its first call the module is whole"),
    ("optimizer", "TypeError", r"trains nothing, call it as mlp_eval\(model, None, \*batch\)"),
    ("trains", "CaptureError", "is an evaluator of ce_step but runs a backward pass"),
])
def test_misuse_is_refused_on_every_rank(rank_pool, kind, error, match):
    with pytest.raises(RankError) as caught:
        rank_pool(2).run(_misuse, kind)
    failures = caught.value.failures
    assert sorted(f.rank for f in failures) == [0, 1]
    for f in failures:
        assert f.kind == "raised" and f.exc_type.endswith(error), f
        assert re.search(match, f.message), f.message
