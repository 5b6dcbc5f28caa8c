"""DeepSpeed's learning-rate schedules on any torch optimizer, and ``build_scheduler`` for the ``scheduler`` block.

Reference: DeepSpeed v0.19.5 (commit edaa722), ``deepspeed/runtime/lr_schedules.py``
and ``engine._scheduler_from_config``. The classes are
``torch.optim.lr_scheduler.LRScheduler`` subclasses that keep DeepSpeed's
behaviour, which differs from torch's schedulers in these ways:

- The counter is ``last_batch_iteration`` (the same value as torch's
  ``last_epoch``). It is -1 right after construction and 0 after the first
  ``step()``. The lr at iteration t depends on t alone (``lr_at(t)``).
- Construction with ``last_batch_iteration=-1`` writes the lrs of iteration
  -1: warmup_min_lr (WarmupLR, WarmupDecayLR), 0 (WarmupCosineLR),
  cycle_min_lr and betas ``(cycle_min_mom, 0.99)`` (OneCycle),
  lr_range_test_min_lr (LRRangeTest). Resuming with any other value writes
  nothing until the first ``step()``.
- ``step(batch_iteration=None)`` sets the counter to ``batch_iteration``
  (or adds 1 to it) and writes the lrs of that iteration.
- ``state_dict()`` is ``{"last_batch_iteration": n}``, which is what DeepSpeed
  checkpoints hold. ``load_state_dict`` sets the counter and writes nothing:
  the lrs come back with the optimizer's own state dict.
- OneCycle's ``cycle_momentum`` (on by default) moves ``betas[0]`` and sets
  ``betas[1]`` to 0.99. It only does this for optimizers whose defaults have
  ``betas``. For the others (SGD) DeepSpeed turns cycle_momentum off with a
  warning, so stepfx does too. Both cases give a ConfigWarning.
- An unknown ``warmup_type`` falls back to "log" and warns, as in DeepSpeed.

Values that DeepSpeed would reject, or that would fail later in its
arithmetic, raise ConfigError naming ``scheduler.params.<name>``.
"""
from __future__ import annotations

import inspect
import math
import numbers
import warnings
from types import MappingProxyType
from typing import Any, Sequence

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from stepfx.config import AUTO, ConfigError, ConfigWarning, SchedulerConfig
from stepfx.config.errors import bad_value, closest, join, unknown_key
from stepfx.config.values import thaw

__all__ = ["DeepSpeedLRScheduler", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
           "DEEPSPEED_SCHEDULES", "build_scheduler"]

_PATH = "scheduler.params"
_WARMUP_TYPES = ("log", "linear")
# OneCycle with cycle_momentum always sets betas[1] to this (DeepSpeed's _initialize_momentum).
_ONECYCLE_BETA2 = 0.99


# --- value checks: each returns the value or raises ConfigError at scheduler.params.<name> ---------------------

def _real(name: str, value: Any, *, ge: float | None = None, gt: float | None = None) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and ((ge is not None and value < ge) or (gt is not None and value <= gt)):
        ok = False
    if not ok:
        bound = f" >= {ge}" if ge is not None else f" > {gt}" if gt is not None else ""
        raise bad_value(join(_PATH, name), value, f"a finite number{bound}")
    return value


def _int(name: str, value: Any, *, ge: int) -> int:
    # DeepSpeed checks isinstance(value, int) for its step counts: 1000.0 is rejected there too.
    if isinstance(value, bool) or not isinstance(value, int) or value < ge:
        raise bad_value(join(_PATH, name), value, f"an integer >= {ge}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_value(join(_PATH, name), value, "true or false")
    return value


def _per_group(optimizer: Optimizer, name: str, value: Any, **bounds: float) -> list[float]:
    """A number for every param group, or one number per group (DeepSpeed's ``_format_param``)."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise bad_value(join(_PATH, name), value, f"a number or a list of {n} numbers (one per param group)",
                            f"the optimizer has {n} param groups, the list has {len(value)}")
        return [_real(name, v, **bounds) for v in value]
    return [_real(name, value, **bounds)] * n


def _warmup_type(value: Any) -> str:
    if value in _WARMUP_TYPES:
        return value
    near = closest(value, _WARMUP_TYPES) if isinstance(value, str) else None
    hint = f" Did you mean {near!r}?" if near else ""
    warnings.warn(f"{_PATH}.warmup_type: unknown value {value!r}; DeepSpeed falls back to 'log' and so does "
                  f"stepfx.{hint}", ConfigWarning, stacklevel=3)
    return "log"


def _warmup_fraction(kind: str, t: int, num_steps: int) -> float:
    """How far warmup has gone at iteration ``0 <= t < num_steps``, in [0, 1)."""
    if kind == "log":
        return 1.0 / math.log(num_steps) * math.log(t + 1)
    return t / num_steps


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _set(group: dict, key: str, value: Any) -> None:
    # A tensor lr (capturable / compiled optimizers) is filled in place so that graphs holding it see the change.
    if isinstance(group[key], torch.Tensor):
        group[key].fill_(value.squeeze() if isinstance(value, torch.Tensor) else value)
    else:
        group[key] = value


def _check_optimizer(optimizer: Any) -> Optimizer:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer")
    return optimizer


class DeepSpeedLRScheduler(LRScheduler):
    """Base of the DeepSpeed schedules: DeepSpeed's counter, initial write and state dict on torch's LRScheduler.

    A subclass sets its attributes, then calls ``super().__init__``, and
    defines ``lr_at(t)``: the lr of every param group at iteration t >= -1.
    """

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int = -1):
        _int("last_batch_iteration", last_batch_iteration, ge=-1)
        super().__init__(optimizer)  # torch's first step() is skipped: see _initial_step
        self.last_epoch = last_batch_iteration
        if last_batch_iteration == -1:
            self._write()
        else:
            self._last_lr = [_copy(group["lr"]) for group in self.optimizer.param_groups]

    def _initial_step(self) -> None:
        # torch's constructor calls step() once, which moves the counter to 0 and writes lr(0). DeepSpeed's
        # schedules stay at -1 after construction, so stepfx skips that step.
        self._step_count = 1

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's name for the counter: the index of the last batch (-1 before the first step())."""
        return self.last_epoch

    @last_batch_iteration.setter
    def last_batch_iteration(self, value: int) -> None:
        self.last_epoch = value

    def lr_at(self, t: int) -> list[float]:
        """The lr of every param group at iteration ``t`` (-1 = before the first step)."""
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lr_at(self.last_epoch)

    def step(self, batch_iteration: int | None = None) -> None:
        """Go to iteration ``batch_iteration`` (default: the next one) and write its lrs into the optimizer."""
        self._step_count += 1
        self.last_epoch = self.last_epoch + 1 if batch_iteration is None else batch_iteration
        self._write()

    def _write(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.lr_at(self.last_epoch), strict=True):
            _set(group, "lr", lr)
        self._last_lr = [_copy(group["lr"]) for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """``{"last_batch_iteration": n}``: DeepSpeed's format. The schedule's parameters come from the config."""
        return {"last_batch_iteration": self.last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the counter. As in DeepSpeed, the lrs are not written here; the optimizer's state dict holds them."""
        self.last_epoch = state_dict["last_batch_iteration"]


class WarmupLR(DeepSpeedLRScheduler):
    """lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps iterations, then stays there.

    lr(t) = min + (max - min) * g(t), where W = max(2, warmup_num_steps) and
    g(t) = ln(t + 1) / ln(W) ("log") or t / W ("linear") for t < W, and 1 after.
    lr(-1) = min. warmup_max_lr=None means each group's current lr.
    """

    def __init__(self, optimizer: Optimizer, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        _check_optimizer(optimizer)
        _int("warmup_num_steps", warmup_num_steps, ge=1)
        self.min_lrs = _per_group(optimizer, "warmup_min_lr", warmup_min_lr, ge=0.0)
        if warmup_max_lr is None:
            self.max_lrs = [_copy(group["lr"]) for group in optimizer.param_groups]
        else:
            self.max_lrs = _per_group(optimizer, "warmup_max_lr", warmup_max_lr, ge=0.0)
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        # At least 2 steps, so that the log warmup's ln(W) is not 0.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, t, self.warmup_num_steps)
        return 1.0

    def lr_at(self, t: int) -> list[float]:
        if t < 0:
            return list(self.min_lrs)
        gamma = self._gamma(t)
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps.

    After warmup, g(t) = max(0, (T - t) / max(1, T - W)) with T = total_num_steps.
    Unlike WarmupLR, warmup_max_lr defaults to 0.001 (DeepSpeed's default).
    """

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        self.total_num_steps = _real("total_num_steps", total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"{_PATH}.total_num_steps {total_num_steps} is less than warmup_num_steps "
                          f"{self.warmup_num_steps}: the lr drops from its peak straight into the decay (DeepSpeed "
                          "warns too)", ConfigWarning, stacklevel=2)

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, t, self.warmup_num_steps)
        return max(0.0, float(self.total_num_steps - t) / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(DeepSpeedLRScheduler):
    """Each group's lr times a ratio: warmup from warmup_min_ratio to 1, then a cosine down to cos_min_ratio.

    With W = max(2, warmup_num_steps), T = total_num_steps and the warmup
    fraction g(t) of WarmupLR: ratio(t) = wmin + (1 - wmin) * g(t) for t < W;
    after it, p = min(1, (t - W + 1) / max(1, T - W)) and
    ratio = max(0, cmin + (1 - cmin) * (1 + cos(pi * p)) / 2). ratio(-1) = 0.
    The peak lrs are the groups' lrs at construction.
    """

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        _check_optimizer(optimizer)
        _int("warmup_num_steps", warmup_num_steps, ge=1)
        self.total_num_steps = _real("total_num_steps", total_num_steps)
        self.warmup_min_ratio = _real("warmup_min_ratio", warmup_min_ratio)
        self.cos_min_ratio = _real("cos_min_ratio", cos_min_ratio)
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_num_steps = max(2, warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"{_PATH}.total_num_steps {total_num_steps} is less than warmup_num_steps "
                          f"{self.warmup_num_steps}: the lr goes straight to cos_min_ratio after warmup (DeepSpeed "
                          "warns too)", ConfigWarning, stacklevel=2)
        self.org_lrs = [_copy(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio_at(self, t: int) -> float:
        """The factor applied to every group's peak lr at iteration ``t``."""
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            gamma = _warmup_fraction(self.warmup_type, t, self.warmup_num_steps)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        # Clamped at 1, so that past total_num_steps the ratio stays at cos_min_ratio.
        progress = min(1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, t: int) -> list[float]:
        if t < 0:
            return [0.0] * len(self.org_lrs)
        ratio = self.ratio_at(t)
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(DeepSpeedLRScheduler):
    """lr grows from lr_range_test_min_lr: lr(t) = min_lr * (1 + step_rate * k(t)).

    k(t) = (t + 1) / step_size, or floor((t + 1) / step_size) with
    lr_range_test_staircase. lr(-1) = min_lr.
    """

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        _check_optimizer(optimizer)
        self.min_lrs = _per_group(optimizer, "lr_range_test_min_lr", lr_range_test_min_lr, ge=0.0)
        self.step_size = _int("lr_range_test_step_size", lr_range_test_step_size, ge=1)
        self.step_rate = _real("lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = _bool("lr_range_test_staircase", lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def lr_at(self, t: int) -> list[float]:
        interval = float(t + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [lr * increase for lr in self.min_lrs]


class OneCycle(DeepSpeedLRScheduler):
    """One triangle cycle of the lr (and, inversely, of betas[0]), then a decay.

    With T1 = cycle_first_step_size, T2 = cycle_second_step_size (default T1),
    C = T1 + T2 and i = t + 1: for t < C, the cycle's height is s = i / T1
    while i <= T1, else s = (C - i) / T2. A stair count n > 0 for that half
    rounds s down to a multiple of 1/n. lr = min_lr + (max_lr - min_lr) * s
    and betas[0] = max_mom - (max_mom - min_mom) * s.
    After the cycle, with d = t - C + 1: lr = min_lr / (1 + decay_lr_rate * d / decay_step_size)
    and betas[0] = max_mom * (1 + decay_mom_rate * d / decay_step_size). A rate
    or decay_step_size of 0 turns that decay off: lr stays min_lr, betas[0] max_mom.
    The decay is continuous in d: decay_step_size scales it and does not make stairs.
    """

    def __init__(self, optimizer: Optimizer, cycle_min_lr: float | Sequence[float],
                 cycle_max_lr: float | Sequence[float], decay_lr_rate: float = 0.0,
                 cycle_first_step_size: float = 2000, cycle_second_step_size: float | None = None,
                 cycle_first_stair_count: float = 0, cycle_second_stair_count: float | None = None,
                 decay_step_size: float = 0, cycle_momentum: bool = True,
                 cycle_min_mom: float | Sequence[float] = 0.8, cycle_max_mom: float | Sequence[float] = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        _check_optimizer(optimizer)
        # DeepSpeed takes the step sizes as floats; the first must be > 0 because the height divides by it.
        self.first_step_size = float(_real("cycle_first_step_size", cycle_first_step_size, gt=0.0))
        self.second_step_size = (self.first_step_size if cycle_second_step_size is None else
                                 float(_real("cycle_second_step_size", cycle_second_step_size, ge=0.0)))
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = _real("cycle_first_stair_count", cycle_first_stair_count)
        self.second_stair_count = (self.first_stair_count if cycle_second_stair_count is None else
                                   _real("cycle_second_stair_count", cycle_second_stair_count))
        self.decay_step_size = _real("decay_step_size", decay_step_size)
        self.min_lrs = _per_group(optimizer, "cycle_min_lr", cycle_min_lr, ge=0.0)
        self.max_lrs = _per_group(optimizer, "cycle_max_lr", cycle_max_lr, ge=0.0)
        self.decay_lr_rate = _real("decay_lr_rate", decay_lr_rate)
        self.min_moms = _per_group(optimizer, "cycle_min_mom", cycle_min_mom)
        self.max_moms = _per_group(optimizer, "cycle_max_mom", cycle_max_mom)
        self.decay_mom_rate = _real("decay_mom_rate", decay_mom_rate)
        no_decay = math.isclose(self.decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        self.cycle_momentum = _bool("cycle_momentum", cycle_momentum) and self._can_cycle_momentum(optimizer)
        super().__init__(optimizer, last_batch_iteration)
        if last_batch_iteration == -1 and self.cycle_momentum:
            # DeepSpeed starts betas at the cycle's *minimum* momentum, though step() then computes the
            # maximum for the cycle's first iterations.
            for group, mom in zip(self.optimizer.param_groups, self.min_moms):
                group["betas"] = (mom, _ONECYCLE_BETA2)

    @staticmethod
    def _can_cycle_momentum(optimizer: Optimizer) -> bool:
        name = type(optimizer).__name__
        if "betas" not in optimizer.defaults:
            warnings.warn(f"{_PATH}.cycle_momentum: {name} has no betas, so OneCycle leaves its momentum alone; "
                          "DeepSpeed turns cycle_momentum off for such optimizers, and so does stepfx",
                          ConfigWarning, stacklevel=3)
            return False
        beta2 = {group["betas"][1] for group in optimizer.param_groups}
        if beta2 != {_ONECYCLE_BETA2}:
            warnings.warn(f"{_PATH}.cycle_momentum: OneCycle sets {name}'s betas[1] to {_ONECYCLE_BETA2} (was "
                          f"{sorted(beta2)}), as DeepSpeed does; set cycle_momentum to false to keep it",
                          ConfigWarning, stacklevel=3)
        return True

    def height_at(self, t: int) -> float:
        """How far up the cycle iteration ``t < C`` is: 0 at min_lr, 1 at max_lr."""
        i = t + 1
        x = 1.0 + i / self.total_size - math.floor(1 + i / self.total_size)  # position in the cycle, in [0, 1)
        if x <= self.step_ratio:
            height, stairs = x / self.step_ratio, self.first_stair_count
        else:
            height, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # From the integer offset, not from `height`: at a half's end the float height can be 1e-16
            # below a stair and flooring it would drop a whole stair.
            offset = i % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            height = math.floor(position) / stairs
        return height

    def lr_at(self, t: int) -> list[float]:
        if t < self.total_size:
            height = self.height_at(t)
            return [lo + (hi - lo) * height for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((t - self.total_size + 1) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def momentum_at(self, t: int) -> list[float]:
        """betas[0] of every param group at iteration ``t`` (betas[1] is always 0.99)."""
        if t < self.total_size:
            height = self.height_at(t)
            return [hi - (hi - lo) * height for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((t - self.total_size + 1) / self.decay_step_size)
        return [hi * factor for hi in self.max_moms]

    def _write(self) -> None:
        super()._write()
        if self.cycle_momentum:
            for group, mom in zip(self.optimizer.param_groups, self.momentum_at(self.last_epoch)):
                group["betas"] = (mom, _ONECYCLE_BETA2)


DEEPSPEED_SCHEDULES: MappingProxyType[str, type[DeepSpeedLRScheduler]] = MappingProxyType(
    {cls.__name__: cls for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)})

# torch schedulers whose arguments are Python objects (functions, other schedulers), which JSON cannot hold.
_NEEDS_PYTHON_OBJECTS = ("LambdaLR", "MultiplicativeLR", "ChainedScheduler", "SequentialLR")
# Where resolve_auto takes each "auto" scheduler value from.
_AUTO_SOURCES = MappingProxyType({"warmup_min_lr": "0, always", "warmup_max_lr": "learning_rate=",
                                  "warmup_num_steps": "warmup_steps=", "total_num_steps": "total_num_steps="})


def build_scheduler(config: SchedulerConfig, optimizer: Optimizer) -> LRScheduler:
    """The scheduler DeepSpeed's engine builds from the ``scheduler`` block: ``type(optimizer, **params)``.

    ``type`` is one of DEEPSPEED_SCHEDULES or a ``torch.optim.lr_scheduler``
    class. A param still AUTO, a name the constructor does not take, a
    missing required param or a bad value raises ConfigError naming
    ``scheduler.params.<name>``.
    """
    for name, value in config.params.items():
        if value is AUTO:
            source = _AUTO_SOURCES.get(name, "the matching argument")
            raise ConfigError(join(_PATH, name), f"is still 'auto'; fill it with stepfx.config.resolve_auto(config, "
                              f"...) first (it takes this one from {source})", value=AUTO, expected="a value")
    if config.type in DEEPSPEED_SCHEDULES:
        cls = DEEPSPEED_SCHEDULES[config.type]
    elif config.type in _NEEDS_PYTHON_OBJECTS:
        raise ConfigError("scheduler.type", f"torch's {config.type} takes Python objects (functions or schedulers) "
                          "that a JSON config cannot hold; build it in Python instead", value=config.type,
                          expected=f"a scheduler other than {', '.join(_NEEDS_PYTHON_OBJECTS)}")
    else:
        cls = getattr(torch.optim.lr_scheduler, config.type, None)
        if not (isinstance(cls, type) and issubclass(cls, LRScheduler)):
            raise ConfigError("scheduler.type", f"torch {torch.__version__} has no LR scheduler {config.type!r}",
                              value=config.type, expected="a class of torch.optim.lr_scheduler")
    kwargs = _constructor_kwargs(cls, config.type, {name: thaw(value) for name, value in config.params.items()})
    if cls in DEEPSPEED_SCHEDULES.values():
        return cls(optimizer, **kwargs)  # checks its own values, naming the param
    try:
        return cls(optimizer, **kwargs)
    except (TypeError, ValueError) as error:
        raise ConfigError(_PATH, f"torch.optim.lr_scheduler.{config.type}({kwargs}) failed: {error}", value=kwargs,
                          expected=f"arguments {config.type} accepts") from error


def _constructor_kwargs(cls: type, type_name: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` checked against the names ``cls(optimizer, ...)`` takes, as Python's call would check them."""
    signature = inspect.signature(cls)
    arguments = [p for p in list(signature.parameters.values())[1:]
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    valid = [p.name for p in arguments]
    for name, value in params.items():
        if name not in valid:
            raise unknown_key(join(_PATH, name), value, valid,
                              f"{type_name} takes no such argument (DeepSpeed passes params to its constructor)")
    for p in arguments:
        if p.default is p.empty and p.name not in params:
            raise ConfigError(join(_PATH, p.name), f"missing: {type_name} needs it and has no default",
                              value=None, expected="a value")
    return params
