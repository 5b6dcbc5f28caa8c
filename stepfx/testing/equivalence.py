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

__all__ = [
    "mixed_precision_reference",
    "assert_step_equivalent",
    "assert_data_parallel_equivalent",
    "data_parallel_reference",
    "data_parallel_update",
    "EquivalenceReport",
    "compare_tensors",
]


@dataclass
class EquivalenceReport:
    """What an equivalence run measured (all differences are maxima)."""

    steps: int = 0
    output_abs: list[float] = field(default_factory=list)  # per step
    output_rel: list[float] = field(default_factory=list)
    state_abs: list[float] = field(default_factory=list)  # per step
    state_rel: list[float] = field(default_factory=list)
    explains: list[str] = field(default_factory=list)  # per rank, data-parallel runs

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


def compare_tensors(
    what: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, *, normwise: bool = False
) -> tuple[float, float]:
    """Max abs and rel difference; AssertionError naming ``what`` when out of
    tolerance. Elementwise: ``|a - b| <= atol + rtol * |b|`` for every
    element. ``normwise``: ``max|a - b| <= atol + rtol * max|b|`` — the
    relative error of the tensor as a whole, which elements near zero do not
    dominate."""
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
    if normwise:
        scale = b.abs().max().item() if b.numel() else 0.0
        rel_max = abs_max / scale if scale > 0 else (0.0 if abs_max == 0 else math.inf)
        if abs_max > atol + rtol * scale:
            raise AssertionError(
                f"{what}: max abs diff {abs_max:.3g} exceeds atol={atol:g} + rtol={rtol:g} x max|expected| {scale:.3g} "
                f"(normwise rel diff {rel_max:.3g})"
            )
        return abs_max, rel_max
    # the relative difference reported: over elements above atol (below it the
    # absolute bound is the one that applies, and 0 vs 3e-8 would read as 1e26)
    big = b.abs() > atol
    rel = diff[big] / b.abs()[big]
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


def _clone(tree, device=None):
    return pytree.tree_map(lambda x: x.to(device or x.device, copy=True) if isinstance(x, torch.Tensor) else x, tree)


def _device_of(model: torch.nn.Module):
    for t in model.parameters():
        return t.device
    return None


def _optimizer_states(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    if optimizer is None:
        return {}
    out = {}
    for name, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer state {name}[{key}]"] = value
    return out


def _compare_states(step, compiled, ref_model, ref_opt, rtol, atol, normwise=False) -> tuple[float, float]:
    # through the step's accessors: under ZeRO the ranks hold the state
    actual = dict(compiled.model_state_dict())
    for name, state in compiled.optimizer_state().items():
        for key, value in state.items():
            actual[f"optimizer state {name}[{key}]"] = value
    expected = {f"{k}": v for k, v in ref_model.state_dict().items()}
    expected.update(_optimizer_states(ref_model, ref_opt))
    if set(actual) != set(expected):
        missing = sorted(set(expected) ^ set(actual))
        raise AssertionError(f"after step {step}: state entries differ: {missing[:5]}")
    worst_abs = worst_rel = 0.0
    for key in expected:
        da, dr = compare_tensors(f"after step {step}: {key}", actual[key], expected[key], rtol, atol, normwise=normwise)
        worst_abs, worst_rel = max(worst_abs, da), max(worst_rel, dr)
    return worst_abs, worst_rel


def mixed_precision_reference(step_fn: Callable, dtype: torch.dtype, *, cast_inputs: bool = False,
                              buffers: tuple[str, ...] = ()) -> Callable:
    """The eager step DeepSpeed-style mixed precision stands for: the module
    computes with ``dtype`` copies of its fp32 parameters (differentiable
    casts, so gradients reach the fp32 parameters as fp32), and the
    optimizer updates the fp32 parameters. Use it as the reference of a
    ``bf16`` step (and of an fp16 step whose loss scale changes nothing).
    ``cast_inputs``: floating-point batch tensors are cast to ``dtype``
    first, as ``stepfx.cast_inputs`` (on by default) does. ``buffers``:
    these buffers are read as ``dtype`` copies, as ``stepfx.cast_buffers``
    reads those that meet 16-bit weights. Batch norms with fp32 running
    statistics keep fp32 weights, as stepfx keeps them."""
    from stepfx import compat

    def reference(model, optimizer, *args, **kwargs):
        if cast_inputs:
            args, kwargs = pytree.tree_map(
                lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, (args, kwargs)
            )
        from stepfx.capture.trace import batch_norm_fp32_params, gradients_on_masters

        fp32 = batch_norm_fp32_params(model)  # as stepfx keeps them: torch's mixed-type batch norm
        casts = {n: (p.to(dtype) if p.is_floating_point() and n not in fp32 else p) for n, p in model.named_parameters()}
        casts.update({n: b.to(dtype) for n, b in model.named_buffers() if n in buffers})
        masters = {id(casts[n]): p for n, p in model.named_parameters()}
        with compat.reparametrize_module(model, casts), gradients_on_masters(masters):
            return step_fn(model, optimizer, *args, **kwargs)

    reference.__name__ = f"{getattr(step_fn, '__name__', 'step')}_{str(dtype).replace('torch.', '')}_reference"
    return reference


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
    reference_fn: Callable | None = None,
    normwise: bool = False,
    resync: bool = False,
) -> EquivalenceReport:
    """Run ``step_fn`` eagerly and compiled with stepfx on the same batches
    and check that outputs and state match after every step.

    ``resync``: before every step the reference takes stepfx's parameters,
    buffers and optimizer state, so each step is compared from identical
    states (the per-step property). Without it differences accumulate over
    the trajectory; that is right for bitwise comparisons, but for kernels
    that round differently it lets Adam amplify last-bit differences on
    elements whose gradient is ~0 (its update there is ~ g / eps).

    ``reference_fn`` (default ``step_fn``) is what runs eagerly, for
    features the config adds to the step (clipping, mixed precision):
    e.g. ``mixed_precision_reference(step_fn, torch.bfloat16)``.

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
        device = _device_of(model)
        if resync and i > 0:
            _take_state(compiled, ref_model, ref_opt)
        torch.manual_seed(seed + 1 + i)
        out = compiled(model, opt, *_clone(args, device), **_clone(kwargs, device))
        torch.manual_seed(seed + 1 + i)
        ref_out = (reference_fn or step_fn)(ref_model, ref_opt, *_clone(args, device), **_clone(kwargs, device))
        leaves, spec = pytree.tree_flatten(out)
        ref_leaves, ref_spec = pytree.tree_flatten(ref_out)
        if spec != ref_spec:
            raise AssertionError(f"step {i}: the step returned {spec} but eager returned {ref_spec}")
        worst_abs = worst_rel = 0.0
        for j, (a, b) in enumerate(zip(leaves, ref_leaves)):
            if isinstance(b, torch.Tensor):
                da, dr = compare_tensors(f"step {i}: output leaf {j}", a, b, rtol, atol, normwise=normwise)
            else:
                da = abs(float(a) - float(b)) if isinstance(b, (int, float)) else float(a != b)
                dr = da / max(abs(float(b)), 1e-30) if isinstance(b, (int, float)) else da
                if da > atol + rtol * (abs(float(b)) if isinstance(b, (int, float)) else 0):
                    raise AssertionError(f"step {i}: output leaf {j}: {a!r} != expected {b!r}")
            worst_abs, worst_rel = max(worst_abs, da), max(worst_rel, dr)
        report.output_abs.append(worst_abs)
        report.output_rel.append(worst_rel)
        sa, sr = _compare_states(i, compiled, ref_model, ref_opt, rtol, atol, normwise)
        report.state_abs.append(sa)
        report.state_rel.append(sr)
        if sched is not None:
            sched.step()
            ref_sched.step()
        report.steps += 1
    return report


def _take_state(compiled, ref_model, ref_opt) -> None:
    """Copy stepfx's current model and optimizer state into the reference."""
    with torch.no_grad():
        state = compiled.model_state_dict()
        for key, value in ref_model.state_dict(keep_vars=True).items():
            value.copy_(state[key])
        if ref_opt is not None:
            names = {id(p): n for n, p in ref_model.named_parameters()}
            opt_state = compiled.optimizer_state()
            for p, st in ref_opt.state.items():
                for key, value in st.items():
                    if isinstance(value, torch.Tensor):
                        value.copy_(opt_state[names[id(p)]][key])


# -- data parallelism ------------------------------------------------------------


def _rank_seed(seed: int, step: int, rank: int, world: int) -> int:
    return seed + 1 + step * world + rank


class _GradientStash:
    """Stands in for the optimizer while the reference replays one rank's
    step: ``step()`` records the gradients instead of updating."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.grads: list = []

    def step(self, closure=None):
        self.grads = [[None if p.grad is None else p.grad.detach().clone() for p in g["params"]] for g in self.param_groups]

    def zero_grad(self, set_to_none: bool = True):
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None


def data_parallel_update(step_fn, model, optimizer, rank_batches: list, seeds: list[int], *,
                         clip_norm: float | None = None) -> list:
    """One data-parallel step on one process, in place: each rank's batch through ``step_fn``
    (under its seed; gradients kept, no update), the gradients averaged over the ranks (summed in
    rank order, divided by N), clipped to ``clip_norm`` when given, one real update. Returns each
    rank's output."""
    world = len(rank_batches)
    stash = _GradientStash(optimizer)
    per_rank, grads = [], []
    device = _device_of(model)
    for r in range(world):
        args, kwargs = _as_args(rank_batches[r])
        torch.manual_seed(seeds[r])
        per_rank.append(step_fn(model, stash, *_clone(args, device), **_clone(kwargs, device)))
        grads.append(stash.grads)
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            got = [g[gi][pi] for g in grads if g and g[gi][pi] is not None]
            if got:
                total = got[0].clone()
                for more in got[1:]:
                    total += more
                p.grad = total / world
    if clip_norm:
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"] if p.grad is not None],
                                       clip_norm)
    optimizer.step()
    optimizer.zero_grad()
    return per_rank


def data_parallel_reference(
    step_fn, make_model, make_optimizer, batches_per_rank, *, seed: int = 0, make_scheduler=None, clip_norm: float | None = None
):
    """The single-process step that data parallelism must equal: every step,
    each rank's batch runs through ``step_fn`` (gradients kept, no update),
    the gradients are averaged over ranks (summed in rank order, divided by
    N), clipped to ``clip_norm`` with ``torch.nn.utils.clip_grad_norm_``
    when given, and the real optimizer updates once. Returns (per-step
    per-rank outputs, model, optimizer)."""
    world = len(batches_per_rank)
    torch.manual_seed(seed)
    model = make_model()
    opt = make_optimizer(model)
    sched = make_scheduler(opt) if make_scheduler else None
    outputs = []
    for i in range(len(batches_per_rank[0])):
        seeds = [_rank_seed(seed, i, r, world) for r in range(world)]
        outputs.append(data_parallel_update(step_fn, model, opt, [b[i] for b in batches_per_rank], seeds,
                                            clip_norm=clip_norm))
        if sched is not None:
            sched.step()
    return outputs, model, opt


def _dp_worker(step_fn, make_model, make_optimizer, batches_per_rank, config, seed, make_scheduler, config_builds):
    import torch.distributed as dist

    import stepfx

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = make_model()
    # config_builds: the config's optimizer/scheduler blocks build them inside the step
    opt = None if config_builds else make_optimizer(model)
    sched = make_scheduler(opt) if make_scheduler and not config_builds else None
    compiled = stepfx.parallelize(config)(step_fn)
    outs = []
    device = _device_of(model)
    for i, batch in enumerate(batches_per_rank[rank]):
        args, kwargs = _as_args(batch)
        torch.manual_seed(_rank_seed(seed, i, rank, world))
        out = compiled(model, opt, *_clone(args, device), **_clone(kwargs, device))
        outs.append(pytree.tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, out))
        if sched is not None:
            sched.step()
    state = {k: v.detach().cpu() for k, v in compiled.model_state_dict().items()}
    opt_state = {n: {k: v.detach().cpu() for k, v in s.items()} for n, s in compiled.optimizer_state().items()}
    explain = compiled.explain()
    return outs, state, opt_state, explain


def assert_data_parallel_equivalent(
    pool,
    step_fn: Callable,
    make_model: Callable[[], torch.nn.Module],
    make_optimizer: Callable,
    batches_per_rank: Sequence[Sequence[Any]],
    *,
    config: Any = None,
    rtol: float = 1e-6,
    atol: float = 1e-7,
    exact: bool = False,
    seed: int = 0,
    make_scheduler: Callable | None = None,
    timeout: float | None = None,
    normwise: bool = True,
    reference_fn: Callable | None = None,
    clip_norm: float | None = None,
    config_builds: bool = False,
) -> EquivalenceReport:
    """Run ``step_fn`` with stepfx on every rank of ``pool`` (a RankPool;
    rank r gets ``batches_per_rank[r]``) and check it against
    :func:`data_parallel_reference`: each rank's outputs at every step, and
    the final model and optimizer state each rank reports (gathered from
    pieces under ZeRO). ``step_fn``, ``make_model``, ``make_optimizer`` and
    ``make_scheduler`` must be picklable (module-level functions).
    Comparisons are normwise by default (see :func:`compare_tensors`):
    with more than two ranks the all-reduce sums in another order than the
    reference, and elements near zero would otherwise dominate.
    ``reference_fn`` replaces ``step_fn`` in the reference (mixed precision:
    :func:`mixed_precision_reference`); ``clip_norm`` clips the reference's
    averaged gradients as ``gradient_clipping`` does. ``config_builds``:
    stepfx gets None for the optimizer and builds it (and the scheduler) from
    the config's blocks; ``make_optimizer``/``make_scheduler`` then build
    only the reference's.

    Returns the measured differences; the per-rank ``explain()`` texts are in
    ``report.explains``."""
    if exact:
        rtol = atol = 0.0
    results = pool.run(
        _dp_worker, step_fn, make_model, make_optimizer, batches_per_rank, config, seed, make_scheduler, config_builds,
        timeout=timeout,
    )
    # the pool's ranks compute with one intra-op thread (CPU); so does the
    # reference, so that matmuls block and round alike
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref_outputs, ref_model, ref_opt = data_parallel_reference(
            reference_fn or step_fn, make_model, make_optimizer, batches_per_rank, seed=seed, make_scheduler=make_scheduler,
            clip_norm=clip_norm,
        )
    finally:
        torch.set_num_threads(threads)
    report = EquivalenceReport()
    report.explains = [r[3] for r in results]
    for i, per_rank in enumerate(ref_outputs):
        worst_abs = worst_rel = 0.0
        for rank, expected in enumerate(per_rank):
            got = results[rank][0][i]
            for j, (a, b) in enumerate(zip(pytree.tree_leaves(got), pytree.tree_leaves(expected))):
                if isinstance(b, torch.Tensor):
                    da, dr = compare_tensors(f"step {i}, rank {rank}: output leaf {j}", a, b, rtol, atol, normwise=normwise)
                    worst_abs, worst_rel = max(worst_abs, da), max(worst_rel, dr)
        report.output_abs.append(worst_abs)
        report.output_rel.append(worst_rel)
        report.steps += 1
    expected = {k: v for k, v in ref_model.state_dict().items()}
    names = {id(p): n for n, p in ref_model.named_parameters()}
    expected_opt = {names[id(p)]: {k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for p, s in ref_opt.state.items()}
    worst_abs = worst_rel = 0.0
    for rank, (_, state, opt_state, _) in enumerate(results):
        if set(state) != set(expected):
            raise AssertionError(f"rank {rank}: model state keys differ: {sorted(set(state) ^ set(expected))[:5]}")
        for key, value in expected.items():
            da, dr = compare_tensors(f"final, rank {rank}: {key}", state[key], value, rtol, atol, normwise=normwise)
            worst_abs, worst_rel = max(worst_abs, da), max(worst_rel, dr)
        if set(opt_state) != set(expected_opt):
            raise AssertionError(f"rank {rank}: optimizer state entries differ: {sorted(set(opt_state) ^ set(expected_opt))[:5]}")
        for name, keys in expected_opt.items():
            for key, value in keys.items():
                da, dr = compare_tensors(
                    f"final, rank {rank}: optimizer state {name}[{key}]", opt_state[name][key], value, rtol, atol, normwise=normwise
                )
                worst_abs, worst_rel = max(worst_abs, da), max(worst_rel, dr)
    report.state_abs.append(worst_abs)
    report.state_rel.append(worst_rel)
    return report
