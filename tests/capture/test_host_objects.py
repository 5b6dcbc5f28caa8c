"""Host-side training objects driven inside the step, whose Python would
run once, at capture: a learning-rate scheduler's step() and an lr assigned
to a param group (the schedule would never move on; silently, the losses part
from eager's at the third step), and an enabled GradScaler (the host decides
whether to skip the update). Capture refuses each with the user's line and
the way that works; a scheduler stepped or an lr set outside the step, and
a disabled GradScaler, train bitwise as eager."""
from __future__ import annotations

import pytest
import torch

import stepfx
from stepfx.errors import CaptureError
from tests.steps import square_step

CONFIG = {"gradient_clipping": 0, "stepfx": {"cache_dir": False, "progress": False}}


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 / (1 + i))


def _loss(model, x):
    return model(x).square().mean()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 4, generator=g) for _ in range(4)]


@pytest.mark.parametrize("kind", ["lambda", "plateau"])
def test_a_scheduler_stepped_inside_the_step_is_refused_with_the_line(kind):
    model, optimizer, scheduler = _setup()
    if kind == "plateau":
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)

    def train_step(model, optimizer, x):
        loss = _loss(model, x)
        loss.backward()
        optimizer.step()
        scheduler.step(loss) if kind == "plateau" else scheduler.step()
        optimizer.zero_grad()
        return loss

    before = {k: v.clone() for k, v in model.state_dict().items()}
    epoch = scheduler.last_epoch
    name = "ReduceLROnPlateau" if kind == "plateau" else "LambdaLR"
    with pytest.raises(CaptureError, match=rf"calls {name}\.step\(\)[\s\S]*test_host_objects\.py:\d+ in train_step: "
                                           r"scheduler\.step[\s\S]*after the step returns"):
        stepfx.parallelize(CONFIG)(train_step)(model, optimizer, _batches()[0])
    assert scheduler.last_epoch == epoch and optimizer.param_groups[0]["lr"] == 0.1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("schedule", ["scheduler", "lr"])
def test_a_schedule_run_outside_the_step_trains_as_eager_with_one_plan(schedule):
    """A scheduler stepped after each call, or the lr set before each call:
    the lr is an input of the captured step, read at every call."""
    runs = []
    for compiled in (False, True):
        model, optimizer, scheduler = _setup()
        step = stepfx.parallelize(CONFIG)(square_step) if compiled else square_step
        losses = []
        for i, x in enumerate(_batches()):
            if schedule == "lr":
                for group in optimizer.param_groups:
                    group["lr"] = _lr(i)
            losses.append(step(model, optimizer, x).item())
            if schedule == "scheduler":
                scheduler.step()
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert len(step.plans) == 1

_STEP = 0  # a loop counter the step reads from its module, as a hand-written schedule does


def _lr(i):
    return 0.1 / (1 + i)


@pytest.mark.parametrize("source", ["global", "argument"])
def test_a_learning_rate_set_in_the_step_is_refused_with_the_line(source):
    """``for g in opt.param_groups: g['lr'] = get_lr(it)`` inside the step: from
    a global the first value was kept for every call (silently: losses part
    from eager's at the third step); from an argument the step was captured
    again at every value."""
    def train_step(model, optimizer, x, i=None):
        for group in optimizer.param_groups:
            group["lr"] = _lr(_STEP if i is None else i)
        loss = _loss(model, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    model, optimizer, _ = _setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = (3,) if source == "argument" else ()
    with pytest.raises(CaptureError, match=r"sets the learning rate of the optimizer's param group 0 in Python[\s\S]*"
                                           r"test_host_objects\.py:\d+ in train_step: group\[\"lr\"\] = _lr[\s\S]*"
                                           r"before calling the step"):
        stepfx.parallelize(CONFIG)(train_step)(model, optimizer, _batches()[0], *args)
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert type(optimizer.param_groups[0]) is dict
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("enabled", [True, False])
def test_a_grad_scaler_is_refused_with_the_fp16_block_as_the_way_and_a_disabled_one_passes(enabled):
    """An AMP loop's GradScaler decides on the host whether to skip the update;
    stepfx's fp16 block scales in the graph. A disabled scaler (nanoGPT builds
    one under bf16) scales nothing: the step trains as eager."""
    def train_step(model, optimizer, x, scaler):
        loss = _loss(model, x)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        return loss

    runs = []
    for compiled in (False, True):
        model, optimizer, _ = _setup()
        scaler = torch.amp.GradScaler("cpu", enabled=enabled)
        step = stepfx.parallelize(CONFIG)(train_step) if compiled else train_step
        if compiled and enabled:
            before = {k: v.clone() for k, v in model.state_dict().items()}
            with pytest.raises(CaptureError, match=r"uses torch\.amp\.grad_scaler\.GradScaler[\s\S]*test_host_objects\.py:"
                                                   r"\d+ in train_step: scaler\.scale\(loss\)[\s\S]*\"fp16\": "):
                step(model, optimizer, _batches()[0], scaler)
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
            return
        losses = [step(model, optimizer, x, scaler).item() for x in _batches()]
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def _gan():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"g": torch.nn.Linear(4, 4), "d": torch.nn.Linear(4, 1)})
    return (model, torch.optim.Adam(model["g"].parameters(), lr=1e-2),
            torch.optim.Adam(model["d"].parameters(), lr=1e-2))


def _d_step(model, opt_d, x):
    d_loss = model["d"](x).square().mean() - model["d"](model["g"](x).detach()).mean()
    d_loss.backward()
    opt_d.step()
    opt_d.zero_grad()
    return d_loss


def _g_step(model, opt_g, x):
    g_loss = model["d"](model["g"](x)).mean()
    g_loss.backward()
    opt_g.step()
    opt_g.zero_grad()
    for p in model["d"].parameters():
        p.grad = None
    return g_loss


def test_a_second_optimizer_stepped_in_the_step_is_refused_and_one_step_per_optimizer_trains_as_eager():
    """A GAN step with the discriminator's optimizer beside the generator's:
    the second one holds the real parameters, so its update did nothing
    (silently) or failed at capture on a real tensor. Refused with the line;
    the advised shape, one decorated step per optimizer, is bitwise eager."""
    def both(model, opt_g, x, opt_d):
        d_loss = _d_step(model, opt_d, x)
        return d_loss, _g_step(model, opt_g, x)

    model, opt_g, opt_d = _gan()
    with pytest.raises(CaptureError, match=r"steps a second optimizer \(Adam over 2 parameter\(s\)\)[\s\S]*"
                                           r"test_host_objects\.py:\d+ in _d_step: opt_d\.step\(\)[\s\S]*one decorated step "
                                           r"per optimizer"):
        stepfx.parallelize(CONFIG)(both)(model, opt_g, _batches()[0], opt_d)
    assert not opt_d.state and not opt_g.state
    runs = []
    for compiled in (False, True):
        model, opt_g, opt_d = _gan()
        d_step, g_step = (stepfx.parallelize(CONFIG)(_d_step), stepfx.parallelize(CONFIG)(_g_step)) if compiled \
            else (_d_step, _g_step)
        losses = [(d_step(model, opt_d, x).item(), g_step(model, opt_g, x).item()) for x in _batches()]
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
