"""``assert_step_equivalent``: a stepfx step must equal the eager step.

The project's central property, packaged so users can point it at their own
models: run the same training step eagerly and through
``stepfx.parallelize`` from identical starting states, with the same batches
and the same RNG seeds, and compare what the step returns at every step and
the parameters, buffers and optimizer states after every step.

Tolerances are relative *and* absolute, like ``torch.allclose``:
``|a - b| <= atol + rtol * |b|``. ``exact=True`` demands bitwise equality
(what fp32 on CPU achieves).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.utils._pytree as pytree

__all__ = ["assert_step_equivalent", "EquivalenceReport", "compare_tensors"]


@dataclass
class EquivalenceReport:
    """What an equivalence run measured (all differences are maxima)."""

    steps: int = 0
    output_abs: list[float] = field(default_factory=list)  # per step
    output_rel: list[float] = field(default_factory=list)
    state_abs: list[float] = field(default_factory=list)  # per step
    state_rel: list[float] = field(default_factory=list)

    @property
    def bitwise(self) -> bool:
        return all(d == 0 for d in self.output_abs + self.state_abs)

    def __str__(self) -> str:
        if self.bitwise:
            return f"{self.steps} steps, bitwise equal"
        return (
            f"{self.steps} steps, max output diff {max(self.output_abs, default=0):.3g} abs / "
            f"{max(self.output_rel, default=0):.3g} rel, max state diff {max(self.state_abs, default=0):.3g} abs / "
            f"{max(self.state_rel, default=0):.3g} rel"
        )


def compare_tensors(what: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> tuple[float, float]:
    """Max abs and rel difference; AssertionError naming ``what`` when out of tolerance."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{what}: shape/dtype {tuple(actual.shape)}/{actual.dtype} != expected {tuple(expected.shape)}/{expected.dtype}"
        )
    a = actual.detach().to("cpu", torch.float64)
    b = expected.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return 0.0, 0.0
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)) or not torch.equal(a[~torch.isfinite(a)], b[~torch.isfinite(b)]):
        raise AssertionError(f"{what}: non-finite values differ")
    finite = torch.isfinite(b)
    a, b = a[finite], b[finite]
    diff = (a - b).abs()
    abs_max = diff.max().item() if diff.numel() else 0.0
    rel = diff / b.abs().clamp_min(torch.finfo(torch.float32).tiny)
    rel_max = rel.max().item() if rel.numel() else 0.0
    bad = diff > atol + rtol * b.abs()
    if bool(bad.any()):
        i = int(torch.argmax((diff - (atol + rtol * b.abs())).flatten()))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {b.numel()} elements differ beyond rtol={rtol:g}, atol={atol:g} "
            f"(max abs diff {abs_max:.3g}, max rel diff {rel_max:.3g}; e.g. element {i}: {a.flatten()[i].item():.9g} vs expected {b.flatten()[i].item():.9g})"
        )
    return abs_max, (0.0 if math.isnan(rel_max) else rel_max)


def _as_args(batch) -> tuple[tuple, dict]:
    if isinstance(batch, dict) and set(batch) == {"args", "kwargs"}:
        return tuple(batch["args"]), dict(batch["kwargs"])
    if isinstance(batch, tuple):
        return batch, {}
    return (batch,), {}


def _clone(tree):
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _optimizer_states(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    if optimizer is None:
        return {}
    out = {}
    for name, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer state {name}[{key}]"] = value
    return out


def _compare_states(step, model, ref_model, opt, ref_opt, rtol, atol) -> tuple[float, float]:
    actual = {f"{k}": v for k, v in model.state_dict().items()}
    expected = {f"{k}": v for k, v in ref_model.state_dict().items()}
    actual.update(_optimizer_states(model, opt))
    expected.update(_optimizer_states(ref_model, ref_opt))
    if set(actual) != set(expected):
        missing = sorted(set(expected) ^ set(actual))
        raise AssertionError(f"after step {step}: state entries differ: {missing[:5]}")
    worst_abs = worst_rel = 0.0
    for key in expected:
        da, dr = compare_tensors(f"after step {step}: {key}", actual[key], expected[key], rtol, atol)
        worst_abs, worst_rel = max(worst_abs, da), max(worst_rel, dr)
    return worst_abs, worst_rel


def assert_step_equivalent(
    step_fn: Callable,
    make_model: Callable[[], torch.nn.Module],
    make_optimizer: Callable[[torch.nn.Module], Any] | None,
    batches: Sequence[Any] | Iterable[Any],
    *,
    config: Any = None,
    rtol: float = 1e-6,
    atol: float = 1e-7,
    exact: bool = False,
    make_scheduler: Callable[[Any], Any] | None = None,
    seed: int = 0,
) -> EquivalenceReport:
    """Run ``step_fn`` eagerly and compiled with stepfx on the same batches
    and check that outputs and state match after every step.

    - ``make_model()`` builds the model once (after ``torch.manual_seed(seed)``);
      the reference is a deep copy, so both start identical.
    - ``make_optimizer(model)`` builds an optimizer for each copy (or None).
    - each batch is a tuple of positional arguments after (model, optimizer),
      a single tensor, or ``{"args": ..., "kwargs": ...}``; each run gets its
      own copy of the batch.
    - ``make_scheduler(optimizer)`` optionally builds an lr scheduler stepped
      after every step on both sides.
    - before step ``i`` both sides seed the global RNG with ``seed + 1 + i``,
      so dropout draws the same masks.

    Returns the measured differences; raises AssertionError naming the step,
    the output or state entry and the numbers when they exceed tolerance.
    """
    import stepfx

    if exact:
        rtol = atol = 0.0
    torch.manual_seed(seed)
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt = make_optimizer(model) if make_optimizer else None
    ref_opt = make_optimizer(ref_model) if make_optimizer else None
    sched = make_scheduler(opt) if make_scheduler else None
    ref_sched = make_scheduler(ref_opt) if make_scheduler else None
    compiled = stepfx.parallelize(config)(step_fn)
    report = EquivalenceReport()
    for i, batch in enumerate(batches):
        args, kwargs = _as_args(batch)
        torch.manual_seed(seed + 1 + i)
        out = compiled(model, opt, *_clone(args), **_clone(kwargs))
        torch.manual_seed(seed + 1 + i)
        ref_out = step_fn(ref_model, ref_opt, *_clone(args), **_clone(kwargs))
        leaves, spec = pytree.tree_flatten(out)
        ref_leaves, ref_spec = pytree.tree_flatten(ref_out)
        if spec != ref_spec:
            raise AssertionError(f"step {i}: the step returned {spec} but eager returned {ref_spec}")
        worst_abs = worst_rel = 0.0
        for j, (a, b) in enumerate(zip(leaves, ref_leaves)):
            if isinstance(b, torch.Tensor):
                da, dr = compare_tensors(f"step {i}: output leaf {j}", a, b, rtol, atol)
            else:
                da = abs(float(a) - float(b)) if isinstance(b, (int, float)) else float(a != b)
                dr = da / max(abs(float(b)), 1e-30) if isinstance(b, (int, float)) else da
                if da > atol + rtol * (abs(float(b)) if isinstance(b, (int, float)) else 0):
                    raise AssertionError(f"step {i}: output leaf {j}: {a!r} != expected {b!r}")
            worst_abs, worst_rel = max(worst_abs, da), max(worst_rel, dr)
        report.output_abs.append(worst_abs)
        report.output_rel.append(worst_rel)
        sa, sr = _compare_states(i, model, ref_model, opt, ref_opt, rtol, atol)
        report.state_abs.append(sa)
        report.state_rel.append(sr)
        if sched is not None:
            sched.step()
            ref_sched.step()
        report.steps += 1
    return report
