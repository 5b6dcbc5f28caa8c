"""skip_step_on_overflow: fp16 loss scaling's skipped step and scale update,
on the device.

Requires: ``unscale_clip_gradients`` marked the overflow flag; the
loss-scale runtime input exists (capture scaled the loss by it).

Ensures:

- every updated parameter and optimizer state is ``where(found_inf, old,
  new)``: a step whose gradients overflowed leaves parameters, optimizer
  state and the step count bit-identical (state the step would create for
  the first time is created regardless);
- the loss scale follows DeepSpeed's DynamicLossScaler exactly (loss_scale
  0 in the config): on overflow, once hysteresis is used up, halve the
  scale (not below ``min_loss_scale``), else use up one hysteresis;
  without overflow, after ``loss_scale_window`` clean iterations since the
  last overflow double it (refilling hysteresis; every clean step refills
  it with ``consecutive_hysteresis``). A fixed ``loss_scale`` only skips.
- runtime state held by the rank, on the device: ``loss_scale``,
  ``scale_hysteresis``, ``scale_iter``, ``scale_last_overflow``,
  ``skipped_steps`` and ``overflows_at_min_scale`` (DeepSpeed raises when the
  scale is already at its minimum and still overflows; stepfx counts it and
  raises on the next call, without a host sync here).

Before / after::

    return (addcdiv, ...)        ->   param = aten.where.self(found_inf, p_w, addcdiv)
                                      return (param, ..., new_scale, ...)
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ...graph import META_OVERFLOW, Phase, Role, Slot, StepGraph, Storage, output_node
from ...graph.build import bind_placeholders, clone_step_graph
from ...graph.signature import RUNTIME_INIT_KEY
from ..data_parallel.collectives import fake_like, make_node
from ..manager import PassOptions, PassResult

__all__ = ["skip_step_on_overflow", "loss_scale_settings", "SCALE_STATE"]

aten = torch.ops.aten

# runtime state of the loss scaler: name -> dtype
SCALE_STATE = {
    "loss_scale": torch.float32,
    "scale_hysteresis": torch.int64,
    "scale_iter": torch.int64,
    "scale_last_overflow": torch.int64,
    "skipped_steps": torch.int64,
    "overflows_at_min_scale": torch.int64,
}


@dataclasses.dataclass(frozen=True)
class LossScaleSettings:
    dynamic: bool
    initial: float
    window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float


def loss_scale_settings(config) -> LossScaleSettings:
    fp16 = config.fp16
    dynamic = not fp16.loss_scale
    initial = float(2 ** fp16.initial_scale_power) if dynamic else float(fp16.loss_scale)
    return LossScaleSettings(
        dynamic, initial, int(fp16.loss_scale_window), int(fp16.hysteresis), bool(fp16.consecutive_hysteresis), float(fp16.min_loss_scale)
    )


def _hold_scale_only(graph: StepGraph, options: PassOptions) -> PassResult:
    """A micro-step that only accumulates scales its loss too, by the scale
    the rank holds (shared with the updating variant), and changes nothing else."""
    sig = graph.signature
    if not any(s.role is Role.RUNTIME_STATE and s.name == "loss_scale" and s.storage is Storage.USER for s in sig.inputs):
        return PassResult(graph, False)
    graph = clone_step_graph(graph)

    def held(slot):
        if slot.role is Role.RUNTIME_STATE and slot.name == "loss_scale":
            return dataclasses.replace(slot, storage=Storage.RANK)
        return slot

    for node in graph.gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["slot"] = held(node.meta["slot"])
    init = {**sig.extra.get(RUNTIME_INIT_KEY, {}), "loss_scale": (loss_scale_settings(options.config).initial, torch.float32)}
    new_sig = dataclasses.replace(sig.with_inputs(tuple(held(s) for s in sig.inputs)), extra={**sig.extra, RUNTIME_INIT_KEY: init})
    return PassResult(graph.replace(signature=new_sig), True, "accumulation micro-step: the loss is scaled by the rank's loss scale")


def skip_step_on_overflow(graph: StepGraph, options: PassOptions) -> PassResult:
    flag = next((n for n in graph.gm.graph.nodes if n.meta.get(META_OVERFLOW)), None)
    if flag is None:
        return _hold_scale_only(graph, options)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    flag = next(n for n in g.nodes if n.meta.get(META_OVERFLOW))
    settings = loss_scale_settings(options.config)
    sig = graph.signature
    out = output_node(graph.gm)
    values = list(out.args[0])
    slots = list(sig.outputs)
    by_ident = {n.meta["slot"].ident: n for n in g.nodes if n.op == "placeholder"}
    meta = dict(like=flag, phase=Phase.OPTIMIZER)

    guarded = 0
    with g.inserting_before(out):
        for i, slot in enumerate(slots):
            old = by_ident.get(slot.ident)
            if slot.role not in (Role.PARAM, Role.OPTIMIZER_STATE) or old is None or values[i] is old:
                continue
            val = values[i].meta["val"]
            # a 0-d host counter (the optimizer's step) selected by the device
            # flag lands on the device, as where() does at run time: it stays
            # there, so reading it never waits for the step that decides it
            dev = flag.meta["val"].device if val.dim() == 0 and val.device.type == "cpu" else val.device
            with val.fake_mode:
                kept = torch.empty((), dtype=val.dtype, device=dev) if dev != val.device else fake_like(val, val.shape)
            values[i] = make_node(
                g, aten.where.self, (flag, old, values[i]), val=kept, name="kept_if_overflow",
                param=slot.name, **meta,  # part of the parameter's update (a fused kernel folds it in)
            )
            guarded += 1

    # the loss scaler's state: inputs (held by the rank), updates, outputs
    state: dict[str, fx.Node] = {}
    inputs = list(sig.inputs)
    existing = {
        n.meta["slot"].name: (i, n)
        for i, n in enumerate(x for x in g.nodes if x.op == "placeholder")
        if n.meta["slot"].role is Role.RUNTIME_STATE
    }
    added = []
    for name, dtype in SCALE_STATE.items():
        slot = Slot(Role.RUNTIME_STATE, name, storage=Storage.RANK)
        if name in existing:
            i, node = existing[name]
            node.meta["slot"] = inputs[i] = slot
            state[name] = node
            continue
        with g.inserting_before(next(iter(g.nodes))):
            node = g.placeholder(name)
        node.meta.update(slot=slot, val=fake_like(flag.meta["val"], (), dtype))
        inputs.append(slot)
        added.append(node)
        state[name] = node
    _order_last(g, added)

    with g.inserting_before(out):
        new = _scaler_update(g, flag, state, settings, meta)
    for name, node in new.items():
        slots.append(Slot(Role.RUNTIME_STATE, name, storage=Storage.RANK))
        values.append(node)
    out.args = (tuple(values),)
    bind_placeholders(graph.gm, inputs)
    init = dict(sig.extra.get(RUNTIME_INIT_KEY, {}))
    init.update(
        loss_scale=(settings.initial, torch.float32),
        scale_hysteresis=(settings.hysteresis, torch.int64),
        scale_iter=(0, torch.int64),
        scale_last_overflow=(-1, torch.int64),
        skipped_steps=(0, torch.int64),
        overflows_at_min_scale=(0, torch.int64),
    )
    new_sig = dataclasses.replace(sig, inputs=tuple(inputs), outputs=tuple(slots), extra={**sig.extra, RUNTIME_INIT_KEY: init})
    graph = graph.replace(signature=new_sig)
    graph.gm.recompile()
    kind = "dynamic" if settings.dynamic else f"fixed at {settings.initial:g}"
    return PassResult(graph, True, f"{guarded} state updates kept on overflow; loss scale {kind} (initial {settings.initial:g})")


def _order_last(g: fx.Graph, new_placeholders: list[fx.Node]) -> None:
    """New placeholders go after the existing ones (slot order = placeholder order)."""
    placeholders = [n for n in g.nodes if n.op == "placeholder" and n not in new_placeholders]
    anchor = placeholders[-1] if placeholders else None
    for node in new_placeholders:
        if anchor is None:
            next(iter(g.nodes)).prepend(node)
        else:
            anchor.append(node)
        anchor = node


def _scaler_update(g: fx.Graph, flag: fx.Node, s: dict[str, fx.Node], cfg, meta) -> dict[str, fx.Node]:
    """DeepSpeed's DynamicLossScaler.update_scale, as tensor ops."""

    def op(target, *args, name, dtype=None, kwargs=None):
        ref = args[0].meta["val"]
        return make_node(g, target, args, kwargs, val=fake_like(ref, (), dtype or ref.dtype), name=name, **meta)

    def count(boolean, name):
        return op(aten._to_copy.default, boolean, name=name, dtype=torch.int64, kwargs={"dtype": torch.int64})

    skipped = op(aten.add.Tensor, s["skipped_steps"], count(flag, "flag_count"), name="skipped_steps")
    new = {"skipped_steps": skipped}
    if not cfg.dynamic:
        new["loss_scale"] = s["loss_scale"]
        return new
    scale, hyst, it, last = s["loss_scale"], s["scale_hysteresis"], s["scale_iter"], s["scale_last_overflow"]
    hyst_used = op(aten.eq.Scalar, hyst, 1, name="hysteresis_used", dtype=torch.bool) if cfg.hysteresis != 1 else None
    shrink = flag if hyst_used is None else op(aten.logical_and.default, flag, hyst_used, name="shrink", dtype=torch.bool)
    halved = op(aten.clamp.default, op(aten.div.Tensor, scale, 2.0, name="halved"), cfg.min_scale, None, name="halved")
    at_min = op(aten.logical_and.default, shrink, op(aten.eq.Scalar, scale, cfg.min_scale, name="at_min", dtype=torch.bool), name="overflow_at_min", dtype=torch.bool)
    stable = op(aten.sub.Tensor, op(aten.sub.Tensor, it, last, name="since_overflow"), 1, name="stable_interval")
    window_hit = op(
        aten.logical_and.default,
        op(aten.gt.Scalar, stable, 0, name="stable_positive", dtype=torch.bool),
        op(aten.eq.Scalar, op(aten.remainder.Scalar, stable, cfg.window, name="stable_mod"), 0, name="window_end", dtype=torch.bool),
        name="window_hit", dtype=torch.bool,
    )
    grow = op(aten.logical_and.default, op(aten.logical_not.default, flag, name="clean", dtype=torch.bool), window_hit, name="grow", dtype=torch.bool)
    new_scale = op(aten.where.self, shrink, halved, scale, name="scale_after_overflow")
    new_scale = op(aten.where.self, grow, op(aten.mul.Tensor, scale, 2.0, name="doubled"), new_scale, name="new_loss_scale")
    # hysteresis: on overflow use one up (the last one stays: that overflow
    # shrank the scale instead); when clean, refill as DeepSpeed does
    full = op(aten.full_like.default, hyst, cfg.hysteresis, name="hysteresis_full")
    minus = op(aten.sub.Tensor, hyst, 1, name="hysteresis_minus_one")
    on_overflow = hyst if hyst_used is None else op(aten.where.self, hyst_used, hyst, minus, name="hysteresis_on_overflow")
    on_clean = full if cfg.consecutive_hysteresis else op(aten.where.self, grow, full, hyst, name="hysteresis_on_clean")
    new["scale_hysteresis"] = op(aten.where.self, flag, on_overflow, on_clean, name="new_hysteresis")
    new["scale_last_overflow"] = op(aten.where.self, flag, it, last, name="new_last_overflow")
    new["scale_iter"] = op(aten.add.Tensor, it, 1, name="new_scale_iter")
    new["loss_scale"] = new_scale
    new["overflows_at_min_scale"] = op(aten.add.Tensor, s["overflows_at_min_scale"], count(at_min, "at_min_count"), name="overflows_at_min_scale")
    return new
