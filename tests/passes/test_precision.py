"""Mixed precision, fp16 loss scaling, gradient accumulation and clipping
(capture options and the passes hold_accumulated_gradients,
unscale_clip_gradients, skip_step_on_overflow), single process.

Tolerances:
- bf16 against the eager mixed-precision step (fp32 masters, bf16 compute
  copies): bitwise — the same ops in the same order.
- bf16 against the fp32 step: losses within 2e-2 relative per step over 20
  AdamW steps (bf16 keeps 8 bits of mantissa; measured <= 7.1e-3).
- accumulation over k micro-batches against one step on the k-times batch:
  fp32, 2e-6 relative (the k-fold sum runs in a different order than the
  batch reduction; measured ~2e-7).
- clipping against torch.nn.utils.clip_grad_norm_: bitwise — on one rank
  the norm is taken in its order (per-tensor norms, then their norm).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepfx
from stepfx.testing.equivalence import assert_step_equivalent, compare_tensors, mixed_precision_reference
from tests.steps import MLP, adamw, hf_gpt2, hf_llama, hf_step, lm_step, mlp_batches, sgd, tiny_gpt, token_batches

BF16 = {"bf16": {"enabled": True}, "gradient_clipping": 0}


@pytest.mark.parametrize("make, step", [(tiny_gpt, lm_step), (hf_gpt2, hf_step), (hf_llama, hf_step)], ids=["gpt", "gpt2", "llama"])
def test_bf16_equals_the_eager_mixed_precision_step(make, step):
    report = assert_step_equivalent(step, make, adamw, token_batches(5), config=BF16, reference_fn=mixed_precision_reference(step, torch.bfloat16), exact=True)
    assert report.bitwise


def test_bf16_tracks_fp32_over_20_steps():
    report = assert_step_equivalent(lm_step, tiny_gpt, adamw, token_batches(20), config=BF16, rtol=1, atol=1, normwise=True)
    assert max(report.output_rel) < 2e-2


def test_bf16_casts_once_per_parameter_and_updates_fp32_masters():
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize(BF16)(lm_step)
    for (batch,) in token_batches(2):
        step(model, opt, batch)
    graph = step.graphs["capture"]
    casts = [n for n in graph.gm.graph.nodes if n.target is torch.ops.aten._to_copy.default and n.meta.get("param") and str(n.meta["phase"]) == "forward"]
    assert len(casts) == len(list(model.parameters())) and all(n.kwargs["dtype"] is torch.bfloat16 for n in casts)
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert all(s.dtype is torch.float32 for st in opt.state.values() for s in st.values() if s.dim())


def test_user_autocast_is_captured_faithfully():
    def autocast_step(model, optimizer, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    report = assert_step_equivalent(autocast_step, lambda: MLP((8, 32, 4)), adamw, mlp_batches(), exact=True)
    assert report.bitwise


# -- fp16 loss scaling ----------------------------------------------------------


def scaled_step(model, optimizer, x, y, blowup):
    # blowup is 1 or huge: a huge one makes the fp16 gradients overflow
    loss = F.cross_entropy(model(x).float(), y) * blowup
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


class DeepSpeedScaler:
    """DeepSpeed's DynamicLossScaler.update_scale, written from its
    documented algorithm (an independent reference)."""

    def __init__(self, init, window, hysteresis, consecutive, min_scale):
        self.scale, self.window, self.delayed = init, window, hysteresis
        self.hyst, self.consecutive, self.min = hysteresis, consecutive, min_scale
        self.it, self.last = 0, -1

    def update(self, overflow):
        if overflow:
            if self.delayed == 1 or self.hyst == 1:
                self.scale = max(self.scale / 2, self.min)
            else:
                self.hyst -= 1
            self.last = self.it
        else:
            if self.consecutive:
                self.hyst = self.delayed
            stable = self.it - self.last - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive:
                    self.hyst = self.delayed
                self.scale *= 2
        self.it += 1


def _fp16_config(**fp16):
    # auto_cast: the MLP's float inputs are cast to fp16 (DeepSpeed's option)
    return {"fp16": {"enabled": True, "auto_cast": True, **fp16}, "gradient_clipping": 0}


def test_an_overflowing_step_is_skipped_bit_for_bit_and_halves_the_scale():
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = stepfx.parallelize(_fp16_config(initial_scale_power=8, hysteresis=1))(scaled_step)
    (x, y), (x2, y2) = mlp_batches(2)
    for _ in range(2):
        step(model, opt, x, y, torch.tensor(1.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in step.optimizer_state().items()}
    scale = step.loss_scale
    step(model, opt, x2, y2, torch.tensor(1e30))  # inf in fp16
    assert step.skipped_steps == 1 and step.loss_scale == scale / 2
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    after = step.optimizer_state()
    assert all(torch.equal(state[n][k], after[n][k]) for n in state for k in state[n])  # the step counter too
    step(model, opt, x2, y2, torch.tensor(1.0))
    assert not all(torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("hysteresis, consecutive", [(1, False), (2, False), (2, True), (3, False)])
def test_scale_trajectory_equals_deepspeeds_algorithm(hysteresis, consecutive):
    pattern = [0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    cfg = _fp16_config(initial_scale_power=10, loss_scale_window=3, hysteresis=hysteresis, consecutive_hysteresis=consecutive, min_loss_scale=4)
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = stepfx.parallelize(cfg)(scaled_step)
    ref = DeepSpeedScaler(2.0**10, 3, hysteresis, consecutive, 4)
    (x, y), = mlp_batches(1)
    got, expected = [], []
    for overflow in pattern:
        step(model, opt, x, y, torch.tensor(1e30 if overflow else 1.0))
        ref.update(bool(overflow))
        got.append(step.loss_scale)
        expected.append(ref.scale)
    assert got == expected
    assert step.skipped_steps == sum(pattern)


def test_fixed_loss_scale_skips_but_never_changes():
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    step = stepfx.parallelize(_fp16_config(loss_scale=128))(scaled_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), = mlp_batches(1)
    for blow in (1.0, 1e30, 1.0):
        step(model, opt, x, y, torch.tensor(blow))
    assert step.loss_scale == 128 and step.skipped_steps == 1


def test_fp16_without_overflow_tracks_fp32():
    report = assert_step_equivalent(
        lm_step, tiny_gpt, adamw, token_batches(10), config=_fp16_config(initial_scale_power=12), rtol=1, atol=1, normwise=True
    )
    assert max(report.output_rel) < 2e-2


def test_overflow_at_the_minimum_scale_stops_like_deepspeed():
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    step = stepfx.parallelize(_fp16_config(initial_scale_power=1, hysteresis=1, min_loss_scale=1))(scaled_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), = mlp_batches(1)
    with pytest.raises(stepfx.StepfxError, match="min_loss_scale"):
        for _ in range(4):
            step(model, opt, x, y, torch.tensor(1e30))


# -- gradient accumulation ------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3])
def test_accumulation_equals_one_step_on_the_k_times_batch(k):
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    ref = MLP((8, 16, 4))
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = sgd(model), sgd(ref)
    step = stepfx.parallelize({"gradient_accumulation_steps": k, "gradient_clipping": 0})(mlp_ce_step)
    micro = mlp_batches(3 * k)
    losses = []
    for i in range(3):
        chunk = micro[i * k : (i + 1) * k]
        for x, y in chunk:
            losses.append(step(model, opt, x, y))
        x = torch.cat([c[0] for c in chunk])
        y = torch.cat([c[1] for c in chunk])
        ref_loss = mlp_ce_step(ref, ref_opt, x, y)
        compare_tensors("loss", torch.stack(losses[-k:]).mean(), ref_loss, 2e-6, 0)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            compare_tensors(n, p, q, 2e-6, 1e-8, normwise=True)
    assert len(step.plans) >= 2  # an accumulate-only variant and an update variant


def mlp_ce_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_accumulation_leaves_param_grads_alone_and_holds_the_sum():
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    opt = sgd(model)
    step = stepfx.parallelize({"gradient_accumulation_steps": 2, "gradient_clipping": 0})(mlp_ce_step)
    x, y = mlp_batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    step(model, opt, x, y)  # accumulate only
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert any(k[0].value == "grad" for k in step._store.held)
    step(model, opt, x, y)  # update
    assert not any(k[0].value == "grad" for k in step._store.held)



def test_fp16_accumulation_scales_every_micro_step_and_skips_on_any_overflow():
    # the accumulate-only micro-step scales its loss by the rank's scale too;
    # an overflow in it poisons the accumulated gradient, so the update skips
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    ref = MLP((8, 16, 4))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    config = {**_fp16_config(initial_scale_power=8, hysteresis=1), "gradient_accumulation_steps": 2}
    step = stepfx.parallelize(config)(scaled_step)
    fp32 = stepfx.parallelize({"gradient_accumulation_steps": 2, "gradient_clipping": 0})(scaled_step)
    one = torch.tensor(1.0)
    for x, y in mlp_batches(6):
        loss, ref_loss = step(model, opt, x, y, one), fp32(ref, ref_opt, x, y, one)
        assert abs(loss.item() - ref_loss.item()) <= 2e-2 * abs(ref_loss.item())
    assert step.skipped_steps == 0 and step.loss_scale == 256
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    (x, y), = mlp_batches(1, seed=5)
    step(model, opt, x, y, torch.tensor(1e30))  # accumulate only: inf in the held gradient
    step(model, opt, x, y, one)  # the update sees it and skips
    assert step.skipped_steps == 1 and step.loss_scale == 128
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    step(model, opt, x, y, one)
    step(model, opt, x, y, one)  # the skipped update dropped the inf: this one applies
    assert step.skipped_steps == 1
    assert all(torch.isfinite(p).all() and not torch.equal(before[n], p) for n, p in model.named_parameters())


# -- clipping -------------------------------------------------------------------


def clipped_reference(step_fn, max_norm, norms: list | None = None):
    """The eager step with torch's clip_grad_norm_ right before optimizer.step()
    (the total norms it returns appended to ``norms`` when given)."""

    def reference(model, optimizer, *args):
        real_step = optimizer.step

        def clipping_step(*a, **k):
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if norms is not None:
                norms.append(norm.item())
            return real_step(*a, **k)

        optimizer.step = clipping_step
        try:
            return step_fn(model, optimizer, *args)
        finally:
            del optimizer.step

    return reference


@pytest.mark.parametrize("max_norm", [0.01, 0.5, 1e6])
def test_clipping_equals_torch_clip_grad_norm(max_norm):
    # SGD: the clip factor shows in the update one-to-one
    report = assert_step_equivalent(
        lm_step, tiny_gpt, sgd, token_batches(4), config={"gradient_clipping": max_norm},
        reference_fn=clipped_reference(lm_step, max_norm), exact=True,
    )
    assert report.bitwise



@pytest.mark.parametrize("stage, world, codegen", [(0, 1, False), (0, 2, False), (2, 1, False), (2, 2, False), (0, 1, True)])
def test_norm_order_where_one_rank_can_take_it(stage, world, codegen):
    """unscale_clip_gradients: where the norm needs no collective (one rank;
    whole gradients on two) it is ``_foreach_norm`` over the gradients in
    parameter order, then the norm of their stack, as clip_grad_norm_; ZeRO
    pieces on two ranks: local sums of squares and one scalar all-reduce.
    With codegen on fp32 gradients keep torch's order (fuse_sum_squares
    takes only norms over 16-bit gradients' copies)."""
    from stepfx.config import load_config
    from stepfx.graph import META_PARAM
    from stepfx.passes import PIPELINE, PassManager, PassOptions
    from tests.steps import captured_mlp

    graph, model, _, _ = captured_mlp()
    config = load_config({"gradient_clipping": 0.5, "stepfx": {"codegen": codegen},
                          "zero_optimization": {"stage": stage, "reduce_bucket_size": 200}})
    options = PassOptions(config=config, world_size=world, rank=0, group_name="test", device_type="cpu")
    records = PassManager(PIPELINE).run(graph, options)
    summary = next(r.summary for r in records if r.name == "unscale_clip_gradients")
    nodes = list(records[-1].graph.gm.graph.nodes)
    norms = [n for n in nodes if n.target is torch.ops.aten._foreach_norm.Scalar]
    reduces = [n for n in nodes if n.target is torch.ops._c10d_functional.all_reduce.default and n.meta["val"].dim() == 0]
    if stage and world > 1:
        assert not norms and len(reduces) == 1 and "norm from sums of squares (one all-reduce over ZeRO pieces)" in summary
        return
    assert len(norms) == 1 and not reduces and "norm as torch.nn.utils.clip_grad_norm_ (per-tensor norms, then their norm)" in summary
    if codegen:  # the clip multiplies are in the fused update now
        assert not [n for n in nodes if "sum_squares" in getattr(n.target, "__name__", "")]
        return
    # each gradient's clipped copy names its parameter: the order is the model's
    clipped = [next(u.meta[META_PARAM] for u in t.users if u.target is torch.ops.aten.mul.Tensor) for t in norms[0].args[0]]
    assert clipped == [name for name, _ in model.named_parameters()]
    total = next(n for n in nodes if n.target is torch.ops.aten.linalg_vector_norm.default)
    assert total.args[0].target is torch.ops.aten.stack.default and total.args[1] == 2.0


def test_codegen_keeps_torch_norm_order_for_fp32_gradients():
    """With codegen on (fused SGD updates; Triton's interpreter on CPU) an fp32
    norm stays in clip_grad_norm_'s order, so an MLP's clipped SGD step is
    eager's bits (with fused sums of squares it differed by 1.5e-8)."""
    from tests.steps import ce_step, small_mlp

    report = assert_step_equivalent(ce_step, small_mlp, sgd, mlp_batches(4),
                                    config={"gradient_clipping": 0.05, "stepfx": {"codegen": True}},
                                    reference_fn=clipped_reference(ce_step, 0.05), exact=True)
    assert report.bitwise

class TokenEncoder(nn.Module):
    """Embedding, ``nn.TransformerEncoder`` (torch's own attention layers), head.
    No dropout: with it the captured step's first loss already differs from
    eager's (7e-3 relative, clipping off), a matter apart from clipping."""

    def __init__(self, vocab=64, width=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx):
        return self.head(self.encoder(self.embed(idx)))


def encoder_step(model, optimizer, idx):
    loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def tiny_bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=32))


@pytest.mark.parametrize("max_norm", [1.0, 0.05])
@pytest.mark.parametrize("make, step", [(TokenEncoder, encoder_step), (tiny_bert, hf_step)], ids=["TransformerEncoder", "bert"])
def test_clipped_adamw_is_bitwise_torch_clip_grad_norm(make, step, max_norm):
    # AdamW divides by sqrt(v): on ~0 gradients a last-bit difference in the
    # clip factor moves the update by O(lr). With the norm summed as one sum
    # of squares the parameters differed by up to 6.6e-4 here after 5 steps;
    # in clip_grad_norm_'s order they are the same bits
    norms = []
    report = assert_step_equivalent(step, make, adamw, token_batches(5), config={"gradient_clipping": max_norm},
                                    reference_fn=clipped_reference(step, max_norm, norms), exact=True)
    assert report.bitwise and report.steps == 5
    assert len(norms) == 5 and min(norms) > max_norm  # every step clips (norms 1.6-2.8)


def test_deepspeed_dict_without_clipping_key_clips_at_one_like_deepspeed():
    assert stepfx.load_config({}).gradient_clipping == 1.0
    assert stepfx.load_config(None).gradient_clipping == 0.0  # no config: the step as written
    assert math.isclose(stepfx.load_config({"gradient_clipping": 0.3}).gradient_clipping, 0.3)
