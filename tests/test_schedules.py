"""stepfx.schedules against an independent reference of DeepSpeed's documented formulas.

The reference functions below are written from DeepSpeed's docstrings and
config docs (deepspeed.ai/docs/config-json, "Scheduler Parameters") in
closed form, one iteration at a time. They share nothing with the code under test.
t is DeepSpeed's last_batch_iteration: -1 right after construction.
"""
from __future__ import annotations

import math
import warnings
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepfx.config import ConfigError, ConfigWarning, SchedulerConfig, load_config, resolve_auto
from stepfx.config.blocks import DEEPSPEED_SCHEDULERS
from stepfx.schedules import (DEEPSPEED_SCHEDULES, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR,
                              build_scheduler)

# --- reference ------------------------------------------------------------------------------------------------


def ref_warmup_fraction(t, num_steps, kind):
    w = max(2, num_steps)
    if t >= w:
        return None  # past warmup
    return math.log(t + 1) / math.log(w) if kind == "log" else t / w


def ref_warmup(t, lo, hi, num_steps=1000, kind="log"):
    if t < 0:
        return lo
    g = ref_warmup_fraction(t, num_steps, kind)
    return lo + (hi - lo) * (1.0 if g is None else g)


def ref_warmup_decay(t, lo, hi, total, num_steps=1000, kind="log"):
    if t < 0:
        return lo
    g = ref_warmup_fraction(t, num_steps, kind)
    if g is None:
        w = max(2, num_steps)
        g = max(0.0, (total - t) / max(1, total - w))
    return lo + (hi - lo) * g


def ref_cosine(t, peak, total, wmin=0.0, num_steps=1000, cmin=1e-4, kind="log"):
    if t < 0:
        return 0.0
    g = ref_warmup_fraction(t, num_steps, kind)
    if g is not None:
        return peak * (wmin + (1 - wmin) * g)
    w = max(2, num_steps)
    p = min(1.0, (t + 1 - w) / max(1, total - w))
    return peak * max(0.0, cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * p)))


def ref_range_test(t, lo=1e-3, size=2000, rate=1.0, staircase=False):
    k = (t + 1) / size
    return lo * (1 + rate * (math.floor(k) if staircase else k))


def ref_one_cycle(t, lo, hi, decay_lr_rate=0.0, first=2000, second=None, first_stairs=0, second_stairs=None,
                  decay_step_size=0, min_mom=0.8, max_mom=0.9, decay_mom_rate=0.0):
    """(lr, betas[0]) at iteration t: a triangle over first + second iterations, then decay."""
    second = first if second is None else second
    second_stairs = first_stairs if second_stairs is None else second_stairs
    cycle = first + second
    if t < cycle:
        # The cycle is periodic: iteration t + 1 == cycle is position 0 again, so with second == 0 the
        # peak is never reached (the step that would reach it wraps to the bottom).
        i = (t + 1) % cycle
        if i <= first:
            h, n = Fraction(i, first), first_stairs  # exact, so that stairs are floored exactly
        else:
            h, n = Fraction(cycle - i, second), second_stairs
        if n > 0:
            h = Fraction(math.floor(h * n), n)
        return lo + (hi - lo) * float(h), max_mom - (max_mom - min_mom) * float(h)
    d = t - cycle + 1
    no_lr_decay = decay_step_size == 0 or decay_lr_rate == 0
    no_mom_decay = decay_step_size == 0 or decay_mom_rate == 0
    lr = lo if no_lr_decay else lo / (1 + decay_lr_rate * d / decay_step_size)
    mom = max_mom if no_mom_decay else max_mom * (1 + decay_mom_rate * d / decay_step_size)
    return lr, mom


# --- helpers --------------------------------------------------------------------------------------------------


def make_optimizer(kind="adam", lrs=(0.05, ), betas=(0.9, 0.999)):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "sgd":
        return torch.optim.SGD(groups, momentum=0.9)
    return torch.optim.Adam(groups, betas=betas)


def trajectory(scheduler, steps):
    """[(lrs, betas or momenta)] right after construction, then after each of `steps` step() calls."""
    opt = scheduler.optimizer

    def snap():
        return ([g["lr"] for g in opt.param_groups], [g.get("betas", g.get("momentum")) for g in opt.param_groups])
    out = [snap()]
    for _ in range(steps):
        scheduler.step()
        out.append(snap())
    return out


def assert_lrs(traj, ref):
    """traj[k] is iteration k - 1; ref(t) gives the single group's expected lr."""
    got = [lrs[0] for lrs, _ in traj]
    want = [ref(t) for t in range(-1, len(traj) - 1)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def quiet(factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return factory()


# --- every schedule against the reference ---------------------------------------------------------------------

# (scheduler factory, reference of t, steps). The optimizer's lr is 0.05 (WarmupLR's and WarmupCosineLR's peak).
CASES = {
    "warmup_defaults": (lambda o: WarmupLR(o), lambda t: ref_warmup(t, 0.0, 0.05), 1100),
    "warmup_linear": (lambda o: WarmupLR(o, 1e-4, 0.02, 40, "linear"),
                      lambda t: ref_warmup(t, 1e-4, 0.02, 40, "linear"), 300),
    "warmup_one_step": (lambda o: WarmupLR(o, 0.01, 0.02, 1), lambda t: ref_warmup(t, 0.01, 0.02, 1), 20),
    "decay_defaults": (lambda o: WarmupDecayLR(o, 1500), lambda t: ref_warmup_decay(t, 0.0, 0.001, 1500), 1600),
    "decay_linear": (lambda o: WarmupDecayLR(o, 200, 1e-5, 3e-3, 30, "linear"),
                     lambda t: ref_warmup_decay(t, 1e-5, 3e-3, 200, 30, "linear"), 300),
    "decay_short_total": (lambda o: WarmupDecayLR(o, 10, 0.0, 0.01, 30),
                          lambda t: ref_warmup_decay(t, 0.0, 0.01, 10, 30), 60),
    "cosine_defaults": (lambda o: WarmupCosineLR(o, 1500), lambda t: ref_cosine(t, 0.05, 1500), 1600),
    "cosine_linear": (lambda o: WarmupCosineLR(o, 250, 0.1, 50, 0.05, "linear"),
                      lambda t: ref_cosine(t, 0.05, 250, 0.1, 50, 0.05, "linear"), 300),
    "range_defaults": (lambda o: LRRangeTest(o), lambda t: ref_range_test(t), 300),
    "range_staircase": (lambda o: LRRangeTest(o, 2e-4, 25, 0.5, True), lambda t: ref_range_test(t, 2e-4, 25, 0.5, True),
                        300),
    "onecycle_defaults": (lambda o: OneCycle(o, 0.01, 0.1), lambda t: ref_one_cycle(t, 0.01, 0.1)[0], 4100),
    "onecycle_asymmetric_decay": (
        lambda o: OneCycle(o, 1e-3, 1e-2, decay_lr_rate=0.5, cycle_first_step_size=70, cycle_second_step_size=30,
                           decay_step_size=20),
        lambda t: ref_one_cycle(t, 1e-3, 1e-2, 0.5, 70, 30, decay_step_size=20)[0], 300),
    "onecycle_stairs": (
        lambda o: OneCycle(o, 1e-3, 1e-2, cycle_first_step_size=100, cycle_second_step_size=60,
                           cycle_first_stair_count=10, cycle_second_stair_count=4, decay_step_size=10,
                           decay_lr_rate=0.1),
        lambda t: ref_one_cycle(t, 1e-3, 1e-2, 0.1, 100, 60, 10, 4, 10)[0], 300),
    "onecycle_no_second_half": (
        lambda o: OneCycle(o, 1e-3, 1e-2, cycle_first_step_size=20, cycle_second_step_size=0),
        lambda t: ref_one_cycle(t, 1e-3, 1e-2, first=20, second=0)[0], 60),
    "onecycle_one_stair": (  # a single stair: min_lr for the whole first half, max_lr at its end only
        lambda o: OneCycle(o, 1e-3, 1e-2, cycle_first_step_size=30, cycle_first_stair_count=1),
        lambda t: ref_one_cycle(t, 1e-3, 1e-2, first=30, first_stairs=1)[0], 100),
}


@pytest.mark.parametrize("case", CASES)
def test_schedule_matches_reference(case):
    factory, ref, steps = CASES[case]
    scheduler = quiet(lambda: factory(make_optimizer()))
    assert scheduler.last_batch_iteration == -1  # DeepSpeed's counter right after construction
    assert_lrs(trajectory(scheduler, steps), ref)
    assert scheduler.last_batch_iteration == steps - 1


def test_registry_is_the_config_layers_list():
    assert set(DEEPSPEED_SCHEDULES) == set(DEEPSPEED_SCHEDULERS)


# hypothesis: random parameters, 150 iterations each.
_steps = st.integers(1, 80)
_lr = st.floats(0.0, 0.1, allow_nan=False)
_kind = st.sampled_from(["log", "linear"])
PROPERTY_CASES = {
    "WarmupLR": st.tuples(_lr, _lr, _steps, _kind).map(
        lambda a: (lambda o: WarmupLR(o, *a), lambda t: ref_warmup(t, *a))),
    "WarmupDecayLR": st.tuples(st.integers(1, 200), _lr, _lr, _steps, _kind).map(
        lambda a: (lambda o: WarmupDecayLR(o, *a), lambda t: ref_warmup_decay(t, a[1], a[2], a[0], *a[3:]))),
    "WarmupCosineLR": st.tuples(st.integers(1, 200), st.floats(0, 1), _steps, st.floats(0, 1), _kind).map(
        lambda a: (lambda o: WarmupCosineLR(o, *a), lambda t: ref_cosine(t, 0.05, *a))),
    "LRRangeTest": st.tuples(_lr, _steps, st.floats(0, 10), st.booleans()).map(
        lambda a: (lambda o: LRRangeTest(o, *a), lambda t: ref_range_test(t, *a))),
    "OneCycle": st.tuples(_lr, _lr, st.sampled_from([0.0, 0.3]), _steps, st.one_of(st.none(), st.integers(0, 60)),
                          st.integers(0, 8), st.one_of(st.none(), st.integers(0, 8)), st.sampled_from([0, 7])).map(
        lambda a: (lambda o: OneCycle(o, *a), lambda t: ref_one_cycle(t, *a)[0])),
}


@pytest.mark.parametrize("name", PROPERTY_CASES)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_schedule_property(name, data):
    factory, ref = data.draw(PROPERTY_CASES[name])
    assert_lrs(trajectory(quiet(lambda: factory(make_optimizer())), 150), ref)


# --- per-group lrs, OneCycle momentum -------------------------------------------------------------------------


def test_per_group_lists():
    opt = make_optimizer(lrs=(0.1, 0.2, 0.3))
    warm = trajectory(WarmupLR(opt, [0.0, 1e-3, 2e-3], [0.01, 0.02, 0.03], 20, "linear"), 40)
    for g, (lo, hi) in enumerate([(0.0, 0.01), (1e-3, 0.02), (2e-3, 0.03)]):
        want = [ref_warmup(t, lo, hi, 20, "linear") for t in range(-1, 40)]
        assert [lrs[g] for lrs, _ in warm] == pytest.approx(want)
    # Without warmup_max_lr, WarmupLR warms each group up to its own lr; WarmupCosineLR scales each group's lr.
    peaks = trajectory(WarmupLR(make_optimizer(lrs=(0.1, 0.2)), warmup_num_steps=5), 10)[-1][0]
    assert peaks == pytest.approx([0.1, 0.2])
    cos = trajectory(WarmupCosineLR(make_optimizer(lrs=(0.1, 0.2)), 100, warmup_num_steps=10), 50)
    assert [lrs[1] for lrs, _ in cos] == pytest.approx([ref_cosine(t, 0.2, 100, num_steps=10) for t in range(-1, 50)])
    cyc = trajectory(quiet(lambda: OneCycle(make_optimizer(lrs=(0.1, 0.2)), [1e-3, 2e-3], [1e-2, 4e-2],
                                            cycle_first_step_size=10)), 30)
    assert [lrs[1] for lrs, _ in cyc] == pytest.approx(
        [ref_one_cycle(t, 2e-3, 4e-2, first=10)[0] for t in range(-1, 30)])
    rng = trajectory(LRRangeTest(make_optimizer(lrs=(0.1, 0.2)), [1e-3, 5e-3], 10), 30)
    assert [lrs[1] for lrs, _ in rng] == pytest.approx([ref_range_test(t, 5e-3, 10) for t in range(-1, 30)])


def test_per_group_list_of_wrong_length_names_the_param():
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_max_lr.*2 param groups.*has 3") as info:
        WarmupLR(make_optimizer(lrs=(0.1, 0.2)), warmup_max_lr=[0.1, 0.2, 0.3])
    assert info.value.path == "scheduler.params.warmup_max_lr"


def test_one_cycle_cycles_adam_betas_and_forces_beta2():
    opt = make_optimizer("adam", lrs=(0.1, 0.1))
    with pytest.warns(ConfigWarning, match=r"betas\[1\] to 0\.99 \(was \[0\.999\]\)"):
        sched = OneCycle(opt, 1e-3, 1e-2, cycle_first_step_size=15, cycle_second_step_size=5, decay_step_size=4,
                         decay_mom_rate=0.01, cycle_min_mom=[0.8, 0.85], cycle_max_mom=[0.9, 0.95])
    traj = trajectory(sched, 60)
    # Right after construction DeepSpeed writes the *minimum* momentum, whatever the reference says for t = -1.
    assert traj[0][1] == [(0.8, 0.99), (0.85, 0.99)]
    for g, (lo, hi) in enumerate([(0.8, 0.9), (0.85, 0.95)]):
        want = [ref_one_cycle(t, 1e-3, 1e-2, 0.0, 15, 5, decay_step_size=4, min_mom=lo, max_mom=hi,
                              decay_mom_rate=0.01)[1] for t in range(0, 60)]
        assert [b[g][0] for _, b in traj[1:]] == pytest.approx(want, rel=1e-12)
        assert {b[g][1] for _, b in traj} == {0.99}
    assert traj[1][1][0][0] == pytest.approx(0.9 - 0.1 / 15)  # first step: near the max momentum, lr near its min


def test_one_cycle_leaves_sgd_momentum_alone_as_deepspeed_does():
    opt = make_optimizer("sgd")
    with pytest.warns(ConfigWarning, match="SGD has no betas"):
        sched = OneCycle(opt, 1e-3, 1e-2, cycle_first_step_size=10)
    traj = trajectory(sched, 30)
    assert {m[0] for _, m in traj} == {0.9} and "betas" not in opt.param_groups[0]
    assert [lrs[0] for lrs, _ in traj] == pytest.approx([ref_one_cycle(t, 1e-3, 1e-2, first=10)[0]
                                                         for t in range(-1, 30)])


def test_one_cycle_without_cycle_momentum_keeps_betas():
    opt = make_optimizer("adam")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        traj = trajectory(OneCycle(opt, 1e-3, 1e-2, cycle_first_step_size=10, cycle_momentum=False), 25)
    assert {b[0] for _, b in traj} == {(0.9, 0.999)}


# --- state: initial values, resume, state_dict ----------------------------------------------------------------

FACTORIES = {
    "WarmupLR": lambda o, **k: WarmupLR(o, 0.0, 0.01, 50, **k),
    "WarmupDecayLR": lambda o, **k: WarmupDecayLR(o, 120, 0.0, 0.01, 50, **k),
    "WarmupCosineLR": lambda o, **k: WarmupCosineLR(o, 120, warmup_num_steps=50, **k),
    "LRRangeTest": lambda o, **k: LRRangeTest(o, 1e-3, 10, **k),
    "OneCycle": lambda o, **k: OneCycle(o, 1e-3, 1e-2, cycle_first_step_size=40, decay_step_size=5,
                                        decay_lr_rate=0.2, decay_mom_rate=0.01, **k),
}


@pytest.mark.parametrize("name", FACTORIES)
def test_state_dict_round_trip_mid_schedule(name):
    factory = FACTORIES[name]
    opt_a = make_optimizer()
    a = quiet(lambda: factory(opt_a))
    trajectory(a, 37)
    state = a.state_dict()
    assert state == {"last_batch_iteration": 36}  # DeepSpeed's checkpoint format
    opt_b = make_optimizer()
    b = quiet(lambda: factory(opt_b))
    opt_b.load_state_dict(opt_a.state_dict())  # the lrs (and betas) come back with the optimizer, as in DeepSpeed
    before = [g["lr"] for g in opt_b.param_groups]
    b.load_state_dict(state)
    assert [g["lr"] for g in opt_b.param_groups] == before  # load_state_dict writes nothing
    assert trajectory(b, 80) == trajectory(a, 80)


@pytest.mark.parametrize("name", FACTORIES)
def test_resume_from_last_batch_iteration_writes_nothing_until_step(name):
    factory = FACTORIES[name]
    reference = quiet(lambda: factory(make_optimizer()))
    traj = trajectory(reference, 30)
    opt = make_optimizer()  # lr 0.05, which none of these schedules writes at iteration -1
    resumed = quiet(lambda: factory(opt, last_batch_iteration=19))
    assert opt.param_groups[0]["lr"] == 0.05 and resumed.get_last_lr() == [0.05]
    resumed.step()
    assert opt.param_groups[0]["lr"] == traj[21][0][0]  # iteration 20


def test_step_with_batch_iteration_jumps_and_tensor_lr_is_filled_in_place():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.05))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupDecayLR(opt, 100, 0.0, 0.01, 10)
    assert opt.param_groups[0]["lr"] is lr_tensor and lr_tensor.item() == 0.0
    sched.step(60)
    assert sched.last_batch_iteration == 60
    assert lr_tensor.item() == pytest.approx(ref_warmup_decay(60, 0.0, 0.01, 100, 10))
    assert sched.get_last_lr()[0] is not lr_tensor  # a copy, as torch's schedulers return


# --- build_scheduler ------------------------------------------------------------------------------------------


def build(type_, **params):
    return build_scheduler(SchedulerConfig(type=type_, params=params), make_optimizer())


def test_build_deepspeed_and_torch_schedulers():
    sched = build("WarmupCosineLR", total_num_steps=100, warmup_num_steps=10, warmup_type="linear")
    assert isinstance(sched, WarmupCosineLR) and sched.warmup_type == "linear"
    step_lr = build("StepLR", step_size=3, gamma=0.5)
    assert isinstance(step_lr, torch.optim.lr_scheduler.StepLR) and step_lr.last_epoch == 0  # torch's own start
    multi = build("MultiStepLR", milestones=[2, 4])
    assert list(multi.milestones) == [2, 4]


@pytest.mark.parametrize("type_, params, path, fragment", [
    ("WarmupLR", {"warmup_max": 0.1}, "scheduler.params.warmup_max", "Did you mean 'warmup_max_lr'"),
    ("WarmupLR", {"warmup_steps": 10}, "scheduler.params.warmup_steps", "Did you mean 'warmup_num_steps'"),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_momentun": False},
     "scheduler.params.cycle_momentun", "Did you mean 'cycle_momentum'"),
    ("StepLR", {"step_size": 2, "gama": 0.5}, "scheduler.params.gama", "Did you mean 'gamma'"),
    ("OneCycle", {"cycle_max_lr": 0.2}, "scheduler.params.cycle_min_lr", "missing"),
    ("WarmupDecayLR", {"warmup_num_steps": 10}, "scheduler.params.total_num_steps", "missing"),
    ("WarmupLR", {"warmup_max_lr": "auto"}, "scheduler.params.warmup_max_lr", "learning_rate="),
    ("WarmupLR", {"warmup_num_steps": 0}, "scheduler.params.warmup_num_steps", "integer >= 1"),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 10.5}, "scheduler.params.warmup_num_steps",
     "integer"),
    ("WarmupCosineLR", {"total_num_steps": 10, "cos_min_ratio": "low"}, "scheduler.params.cos_min_ratio",
     "finite number"),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_first_step_size": 0},
     "scheduler.params.cycle_first_step_size", "> 0.0"),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_momentum": "yes"}, "scheduler.params.cycle_momentum",
     "true or false"),
    ("LRRangeTest", {"lr_range_test_staircase": 1}, "scheduler.params.lr_range_test_staircase", "true or false"),
    ("LRRangeTest", {"lr_range_test_step_size": 0}, "scheduler.params.lr_range_test_step_size", "integer >= 1"),
    ("LinearLR", {"start_factor": 2.0}, "scheduler.params", "LinearLR"),
    ("LambdaLR", {}, "scheduler.type", "JSON config cannot hold"),
])
def test_build_scheduler_errors_name_the_key(type_, params, path, fragment):
    with pytest.raises(ConfigError) as info:
        build(type_, **params)
    assert info.value.path == path and fragment in str(info.value), str(info.value)


def test_unknown_warmup_type_falls_back_to_log_with_a_warning():
    with pytest.warns(ConfigWarning, match="Did you mean 'linear'"):
        sched = build("WarmupLR", warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="liner")
    assert_lrs(trajectory(sched, 20), lambda t: ref_warmup(t, 0.0, 0.01, 10, "log"))


# --- the scheduler blocks of real configs ---------------------------------------------------------------------

CONFIG_DIR = Path(__file__).parent / "config" / "ds_configs"
REJECTED = {"18", "35"}  # DeepSpeed itself rejects these two files
# file -> the ConfigError path (a leftover "auto"), or (steps, reference of t) for the lr it must produce.
REAL_SCHEDULERS = {
    "01": "scheduler.params.warmup_min_lr", "02": "scheduler.params.warmup_min_lr",
    "03": "scheduler.params.warmup_min_lr", "04": "scheduler.params.warmup_min_lr",
    "14": "scheduler.params.total_num_steps", "15": "scheduler.params.warmup_min_lr",
    "28": "scheduler.params.total_num_steps",
    "12": (300, lambda t: ref_one_cycle(t, 1e-5, 3e-5, first=120)[0]),
    "23": (1300, lambda t: ref_one_cycle(t, 0.004, 0.015, 0.01, 1000, 100, 100, 100, 1000)[0]),
    "31": (1100, lambda t: ref_warmup(t, 0.0, 0.001, 1000)),
    "37": (300, lambda t: ref_warmup(t, 0.0, 0.00015, 5000)),
}
# What resolve_auto fills the HF files with below, and the lr those files must then produce.
RESOLVED = dict(hidden_size=64, micro_batch_size=2, learning_rate=3e-4, betas=(0.9, 0.999), eps=1e-8,
                weight_decay=0.0, warmup_steps=10, total_num_steps=100)
RESOLVED_REFERENCE = {"WarmupLR": lambda t: ref_warmup(t, 0.0, 3e-4, 10),
                      "WarmupDecayLR": lambda t: ref_warmup_decay(t, 0.0, 3e-4, 100, 10)}


def load(number: str):
    (path, ) = CONFIG_DIR.glob(f"{number}_*.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(path)


def test_real_config_table_covers_every_scheduler_block():
    numbers = {p.name[:2] for p in CONFIG_DIR.glob("*.json")} - REJECTED
    assert {n for n in numbers if load(n).scheduler is not None} == set(REAL_SCHEDULERS)


@pytest.mark.parametrize("number", sorted(REAL_SCHEDULERS))
def test_real_config_scheduler_blocks(number):
    config, expected = load(number), REAL_SCHEDULERS[number]
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match="still 'auto'") as info:
            build_scheduler(config.scheduler, make_optimizer())
        assert info.value.path == expected
        config = resolve_auto(config, **RESOLVED)
        expected = (200, RESOLVED_REFERENCE[config.scheduler.type])
    steps, ref = expected
    scheduler = quiet(lambda: build_scheduler(config.scheduler, make_optimizer()))
    assert type(scheduler).__name__ == config.scheduler.type
    assert_lrs(trajectory(scheduler, steps), ref)
