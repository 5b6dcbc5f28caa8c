"""``explain()``: what stepfx did to a step, for people.

Sections: the passes run (with times and what each changed), the step's
state by role with bytes, the parameter count, config keys that were
accepted but not applied or ignored, and the final graph as readable Python
with phases as trailing comments.
"""
from __future__ import annotations

import collections

import torch

from . import compat
from .graph import CARRIED_COPIES_KEY, HOST_STATE_KEY, MASTER_COPIES_KEY, META_DONATED, META_PHASE, Role, format_graph
from .graph.accounting import HOST_ADAM_RATE, Sizes, communication, estimate_memory, host_traffic, size_values
from .graph.layout import LAYOUT_KEY
from .graph.tp_layout import TP_PLAN_KEY
from .capture.tracing_checks import TRACING_CHECKS_KEY
from .capture.trace import BUFFERS_CAST_KEY, FP32_PARAMS_KEY, UNREAD_ARGUMENTS_KEY
from .passes.fusion.fuse_optimizer_update import FUSION_REPORT_KEY

__all__ = ["explain_plan", "format_bytes"]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _value_size(val, sizes: Sizes) -> tuple[int, int]:
    if isinstance(val, torch.Tensor):
        nbytes = sizes.value(sizes.bytes_of(val))
        return nbytes // val.element_size(), nbytes
    return 1, 8


def _expr(expr) -> str:
    """A byte count's expression, for a trailing note (empty when static)."""
    return f"  = {expr} bytes" if expr is not None else ""


def _host_traffic_lines(graph, device_type: str) -> list[str]:
    """Offload's traffic and host work a step, as times at the cost model's rates against the device's compute."""
    from .report.timeline import DEVICE_MODELS

    t = host_traffic(graph)
    if not t.host_elements and not t.to_host and not t.to_device:
        return []
    model = DEVICE_MODELS.get(device_type, DEVICE_MODELS["cuda"])
    link = (t.to_host + t.to_device) / model.host_bandwidth
    host = sum(n / HOST_ADAM_RATE.get(k, HOST_ADAM_RATE["fused"]) for k, n in t.host_elements.items())
    compute = t.flops / model.flops
    bound = max(("host-device copies", link), ("the host update", host), ("device compute", compute), key=lambda x: x[1])
    elements = sum(t.host_elements.values())
    return [
        "offload per step on this rank (predicted at the cost model's rates: "
        f"{model.host_bandwidth / 1e9:g} GB/s host link, host Adam {HOST_ADAM_RATE['fused'] / 1e9:g}e9 "
        f"elements/s fused, {HOST_ADAM_RATE['exact'] / 1e9:g}e9 exact, {model.flops / 1e12:g} TFLOP/s):",
        f"  {'host <-> device':<24} {format_bytes(t.to_host):>12} down, {format_bytes(t.to_device)} up: "
        f"{1e3 * link:.1f} ms",
        f"  {'host update':<24} {elements:>12,} elements: {1e3 * host:.1f} ms",
        f"  {'device compute':<24} {t.flops / 1e12:>10.3g} TFLOP: {1e3 * compute:.1f} ms",
        f"  bound by {bound[0]} where they do not overlap (the update overlaps the backward under "
        "host_update_speculation, the next step's forward under host_update_across_steps, the next step under "
        "delayed_parameter_update)",
    ]


def _zero_section(graph, world: int, values: dict, device_type: str = "cuda") -> list[str]:
    layout = graph.signature.extra.get(LAYOUT_KEY)
    lines: list[str] = []
    mem = estimate_memory(graph, values)
    if layout is not None:
        kinds = collections.Counter(str(b.sharding) for b in layout.buckets)
        lines.append(
            f"ZeRO stage {layout.stage} over {layout.world_size} ranks: {len(layout.buckets)} buckets ("
            + ", ".join(f"{n} sharding {k}" for k, n in sorted(kinds.items()))
            + ")"
        )
        for b in layout.buckets[:8]:
            lines.append(
                f"  bucket {b.index}: {len(b.params)} params, {b.numel:,} elements (padded {b.padded:,}), "
                f"{b.shard:,} per rank, sharding {b.sharding}" + (" (frozen: gathered only)" if b.frozen else "")
            )
        if len(layout.buckets) > 8:
            lines.append(f"  ... {len(layout.buckets) - 8} more buckets")
    lines.append("memory on this rank (predicted" + (", at the last call's sizes" if mem.peak_expr is not None else "") + "):")
    for role in (Role.PARAM, Role.GRAD, Role.OPTIMIZER_STATE, Role.BUFFER):
        lines.append(f"  {role.value + ' at rest':<24} {format_bytes(mem.at_rest.get(role, 0)):>12}")
    if Role.BATCH in mem.at_rest_expr:
        lines.append(f"  {'batch':<24} {format_bytes(mem.at_rest[Role.BATCH]):>12}{_expr(mem.at_rest_expr[Role.BATCH])}")
    masters = graph.signature.extra.get(MASTER_COPIES_KEY, {})
    if masters:  # host_master_weights: the device keeps the pieces' 16-bit copies
        size = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in graph.gm.graph.nodes
                   if n.op == "placeholder" and n.meta["slot"].ident in masters)
        lines.append(f"  {'piece copies at rest':<24} {format_bytes(size):>12}  (bf16 copies of the host-held "
                     "fp32 master pieces)")
    carried = graph.signature.extra.get(CARRIED_COPIES_KEY, {})
    if carried:  # kept by the rank between steps, beside the parameters
        size = sum(c.total * c.dtype.itemsize for c in carried.values())
        lines.append(f"  {'carried copies at rest':<24} {format_bytes(size):>12}  (16-bit parameter copies)")
    lines.append(f"  {'peak during the step':<24} {format_bytes(mem.peak):>12}  (at {mem.peak_node}){_expr(mem.peak_expr)}")
    if mem.host:
        held = set(graph.signature.extra.get(HOST_STATE_KEY, ()))
        roles = {n.meta["slot"].role for n in graph.gm.graph.nodes if n.op == "placeholder" and n.meta["slot"].ident in held}
        masters = graph.signature.extra.get(MASTER_COPIES_KEY, {})
        pieces = ("host_master_weights: the fp32 master pieces" if masters
                  else "offload_param: the parameters' pieces")
        what = "; ".join(w for role, w in ((Role.OPTIMIZER_STATE, "offload_optimizer: Adam's moments"),
                                           (Role.PARAM, pieces)) if role in roles)
        lines.append(f"  {'host memory at rest':<24} {format_bytes(mem.host):>12}  ({what}; not in the figures above)")
    if mem.host_transient:
        lines.append(f"  {'host, during the update':<24} {format_bytes(mem.host_transient):>12}  (at most: copies of "
                     "what speculated updates overwrite, until the gradient norm is known; host_update_speculation)")
    lines.extend(_host_traffic_lines(graph, device_type))
    comm = communication(graph, world, values)
    if comm:
        lines.append("communication per step on this rank:")
        by_op: dict[str, list] = collections.defaultdict(lambda: [0, 0, 0.0])
        for item in comm:
            acc = by_op[item.op if item.group == "data" else f"{item.op} (TP)"]
            acc[0] += 1
            acc[1] += item.payload_bytes
            acc[2] += item.sent_bytes
        for op, (count, payload, sent) in sorted(by_op.items()):
            lines.append(f"  {op:<21} x{count:<4} buffers {format_bytes(payload):>12}   sent (ring) {format_bytes(sent):>12}")
    lines.append("")
    return lines


def _tensor_parallel_section(graph) -> list[str]:
    """Each parameter's tensor-parallel placement and why (plan_tensor_parallel)."""
    plan = graph.signature.extra.get(TP_PLAN_KEY)
    if plan is None:
        return []
    lines = [f"tensor parallelism: degree {plan.degree}, this rank {plan.rank} of its group; "
             f"{len(plan.sharded)} parameters split"]
    lines += [f"  note: {note}" for note in plan.notes]
    lines += [f"  {line}" for line in plan.describe()]
    lines.append("")
    return lines


def _pipeline_section(plan) -> list[str]:
    """The stages, this rank's programs, the schedule as a timeline and its predicted bubble."""
    executor = plan.executor
    programs = getattr(executor, "programs", None)
    if programs is None:
        return []
    from .runtime.pipeline_schedule import StageCosts, predicted_bubble, timeline

    stage_plan, schedule = programs.plan, executor.schedule
    lines = [f"pipeline parallelism: schedule {schedule.name}, {schedule.ranks} ranks, {schedule.stages} stages, "
             f"{executor.micro_batches} micro-batch(es) per step; this rank runs stage(s) "
             f"{', '.join(map(str, executor.my_stages))}"]
    lines += [f"  {line}" for line in stage_plan.describe()]
    for (kind, stage), prog in sorted(programs.programs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if stage in executor.my_stages or stage < 0:
            lines.append(f"  program {prog.describe()}")
    sends = [f"{s}->{s + 1}: {', '.join(v)}" for s, v in enumerate(programs.send_forward) if v]
    sends += [f"{s}->{s - 1}: {', '.join(v)}" for s, v in enumerate(programs.send_backward) if v]
    lines.append("  sent per micro-batch: " + ("; ".join(sends) or "nothing"))
    if programs.step_sends or programs.param_sends:
        lines.append(f"  shared parameters: {len(programs.step_sends)} gradient part(s) to the owner, "
                     f"{len(programs.param_sends)} updated value(s) back, once a step")
    if getattr(executor, "partitioned", None):
        from .runtime.pipeline_params import describe as describe_zero3

        lines += [f"  {line}" for line in describe_zero3(executor)]
    half = tuple(b / 2 for b in stage_plan.backward_costs)
    costs = StageCosts(forward=tuple(stage_plan.forward_costs), backward_input=half, backward_weight=half)
    lines.append(f"  predicted bubble (cost model; a backward's input and weight parts taken as equal): "
                 f"{100 * predicted_bubble(schedule, costs):.1f}% of rank time")
    lines += [f"  {line}" for line in timeline(schedule, costs, width=96).splitlines()]
    lines.append("")
    return lines


def _dynamic_section(plan, values: dict) -> list[str]:
    """Symbolic batch sizes: what is symbolic, what the graph assumed of it
    (guards), and the sizes the numbers below are evaluated at."""
    guard = getattr(plan, "guard", None)
    if guard is None and not values:
        return []
    lines = ["symbolic sizes (stepfx.dynamic): this variant runs every batch size its guards admit"
             if guard is not None else
             "symbolic sizes (data-dependent, as nonzero's length: counted at the largest size torch knows for each):"]
    if guard is not None:
        lines.extend(guard.describe())
    for node in plan.graph.gm.graph.nodes:
        for sym in sorted(compat.unbacked_symbols_bound(node) & set(values), key=str):
            where = node.meta.get("source")
            lines.append(f"  {sym}: data-dependent, a size of {node.target}'s output"
                         + (f" at {where}" if where else ""))
    if values:
        lines.append("  evaluated below at: " + ", ".join(f"{s} = {'?' if v is None else v}"
                                                        for s, v in sorted(values.items(), key=lambda kv: str(kv[0]))))
    lines.append("")
    return lines


def _unread_section(plan) -> list[str]:
    """Batch dict entries the step never fetched (capture/batch_reads.py): their values are no part of the plan."""
    unread = plan.graph.signature.extra.get(UNREAD_ARGUMENTS_KEY)
    if not unread:
        return []
    return ["batch entries the step never reads (no tensors; a new value or length runs this plan): "
            + ", ".join(_argument_path(e) for e in sorted(unread)), ""]


def _argument_path(entry: str) -> str:
    """``[0][0]['id']`` as the user spells it: ``args[0]['id']`` (after the model and optimizer)."""
    if entry.startswith("[0]["):
        index, _, rest = entry[len("[0]["):].partition("]")
        return f"args[{index}]{rest}"
    return f"kwargs{entry[len('[1]'):]}" if entry.startswith("[1]") else entry


def _tracing_checks_section(plan) -> list[str]:
    """Where the model's library took its tracing path (capture/tracing_checks.py)."""
    checks = plan.graph.signature.extra.get(TRACING_CHECKS_KEY, ())
    if not checks:
        return []
    lines = ["equality with eager: the model's library saw tracing and took the path that needs no tensor values "
             "(as under torch.compile), e.g. an explicit attention mask where eager calls SDPA with is_causal; "
             "results may differ from eager in the last bits:"]
    lines.extend(f"  {check.describe()}" for check in checks)
    folded = [r.summary for r in plan.records if r.name == "fold_causal_masks" and r.changed]
    if folded:
        lines.append(f"  undone where it built SDPA's causal mask: {folded[0]}, as eager calls it")
    lines.append("")
    return lines


def _training_section(step) -> list[str]:
    """Precision, loss scale, accumulation, clipping, optimizer and schedule."""
    cfg = step.config
    fp16, bf16 = cfg.fp16.enabled is True, cfg.bf16.enabled is True
    comm = getattr(cfg, "communication_data_type", None) or "fp32 (the gradients' dtype)"
    precision = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    lines = [f"precision: {precision} compute" + (", fp32 master parameters and optimizer state" if fp16 or bf16 else "")
             + f"; gradients communicated in {comm}"]
    if fp16:
        # reading the device: explain() is not on the training path
        lines.append(f"fp16 loss scale: {step.loss_scale:g} now; {step.skipped_steps} step(s) skipped on overflow so far")
    k = cfg.gradient_accumulation_steps if isinstance(cfg.gradient_accumulation_steps, int) else 1
    clip = cfg.gradient_clipping
    lines.append(f"gradient accumulation: {k} micro-step(s) per update; clipping: "
                 + (f"global L2 norm <= {clip:g}" if isinstance(clip, (int, float)) and clip > 0 else "off"))
    optimizer, scheduler = step.optimizer, step.lr_scheduler  # (settles a pending fp16 schedule step)
    if optimizer is not None:
        origin = "from the config's optimizer block" if cfg.optimizer is not None else "passed in"
        lr = ", ".join(f"{g['lr']:.3g}" for g in optimizer.param_groups)
        line = f"optimizer: {type(optimizer).__name__} ({origin}); lr now {lr}"
        if scheduler is not None:
            line += f"; scheduled by {type(scheduler).__name__} (config's scheduler block)"
        lines.append(line)
    lines.append("")
    return lines


def explain_plan(step, plan) -> str:
    cfg = step.config
    graph = plan.graph
    lines: list[str] = []
    lines.append(
        f"stepfx plan for {step.__name__}: {len(step.plans)} captured variant(s); "
        f"this one captured at call {plan.created_at_call}, run {plan.runs} time(s)"
    )
    dp = getattr(step, "_dp", None)
    world = dp.world_size if dp is not None else 1
    rank = dp.rank if dp is not None else 0
    lines.append(f"config: {getattr(cfg, 'source', '<config>')}    device: {plan.device_type}    world size: {world}    rank: {rank}")
    lines.append(f"replay: {plan.executor.graphs_note}")
    lines.append(f"plan cache: {plan.cache_note or 'not consulted'}")
    notes = plan.executor.binding.carried_notes()
    for note in dict.fromkeys(notes):  # one line per distinct note (a 13B model has hundreds of pieces)
        count = notes.count(note)
        lines.append(f"carried compute copies: {note}" + (f" (x{count})" if count > 1 else ""))
    lines.append("")

    total = sum(r.seconds for r in plan.records)
    lines.append(f"passes ({total:.2f} s in all" + (", when the cached plan was made" if plan.from_cache else "") + "):")
    for r in plan.records:
        if r.skipped:
            lines.append(f"  {r.label:<32} {'':>10}  skipped ({r.skipped})")
        else:
            what = r.summary or ("changed" if r.changed else "no change")
            lines.append(f"  {r.label:<32} {r.seconds * 1e3:>7.1f} ms  {what}")
    lines.append("")

    values = size_values(graph, getattr(plan, "last_batch_shapes", None))
    sizes = Sizes(values)
    lines.append("inputs by role:")
    lines.append(f"  {'role':<16} {'tensors':>8} {'elements':>14} {'bytes':>12}")
    by_role: dict[Role, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for node in graph.gm.graph.nodes:
        if node.op != "placeholder":
            continue
        slot = node.meta["slot"]
        numel, nbytes = _value_size(node.meta.get("val"), sizes)
        acc = by_role[slot.role]
        acc[0] += 1
        acc[1] += numel
        acc[2] += nbytes
    for role in Role:
        if role in by_role:
            n, numel, nbytes = by_role[role]
            lines.append(f"  {role.value:<16} {n:>8} {numel:>14,} {format_bytes(nbytes):>12}")
    outs = collections.Counter(s.role.value for s in graph.signature.outputs)
    lines.append("  outputs: " + ", ".join(f"{n} {role}" for role, n in outs.items()))
    lines.append("")

    lines.extend(_dynamic_section(plan, values))
    lines.extend(_unread_section(plan))
    lines.extend(_tracing_checks_section(plan))
    lines.extend(_tensor_parallel_section(graph))
    lines.extend(_pipeline_section(plan))
    lines.extend(_zero_section(graph, world, values, plan.device_type))
    lines.extend(_training_section(step))
    kept = graph.signature.extra.get(FP32_PARAMS_KEY, ())
    if kept:
        lines[-1:-1] = [f"batch norms compute with fp32 weights and running statistics ({len(kept)} parameters, "
                        f"e.g. {kept[0]}): torch's batch norm takes a 16-bit input so; DeepSpeed would round the "
                        "statistics to 16 bits each step"]
    cast = graph.signature.extra.get(BUFFERS_CAST_KEY, ())
    if cast:
        lines[-1:-1] = [f"buffers read in {'fp16' if step.config.fp16.enabled is True else 'bf16'}, as DeepSpeed holds "
                        f"them (module.bfloat16()): {', '.join(cast)} (fp32, they met the 16-bit weights in a matrix "
                        "product or convolution; stepfx.cast_buffers)"]
    lines.extend(_kernels_section(step, graph))

    model = step._model
    if model is not None:
        # shapes as captured: under ZeRO-3 the module's own tensors are empty between steps
        shapes = plan.param_numels
        trainable = sum(shapes.get(n, 0) for n, p in model.named_parameters() if p.requires_grad)
        frozen = sum(shapes.get(n, 0) for n, p in model.named_parameters() if not p.requires_grad)
        lines.append(f"parameters: {trainable + frozen:,} ({trainable:,} trainable, {frozen:,} frozen) in {len(shapes)} tensors")
        lines.append("")

    not_applied = tuple(getattr(cfg, "not_applied", ()))
    ignored = tuple(getattr(cfg, "ignored_keys", ()))
    if not_applied:
        lines.append("config keys accepted, not applied: " + ", ".join(not_applied))
    if ignored:
        lines.append("unknown top-level config keys, ignored: " + ", ".join(ignored))
    if not_applied or ignored:
        lines.append("")

    phases = collections.Counter(
        str(n.meta.get(META_PHASE)) for n in graph.gm.graph.nodes if n.op == "call_function"
    )
    lines.append(
        "final step graph ("
        + ", ".join(f"{phase} {n}" for phase, n in phases.items())
        + " ops):"
    )
    lines.append(format_graph(graph, header=plan.records[-1].provenance()))
    _append_sources(lines, "Triton source of the kernels this graph launches:", kernel_sources(graph), prefix="kernel ")
    _append_sources(lines, "generic regions handed to inductor (the fx code it compiles):",
                    {key: text.strip() for key, text in _region_sources(graph).items()})
    return "\n".join(lines)


def _append_sources(lines: list[str], title: str, sources: dict[str, str], prefix: str = "") -> None:
    """A titled section of source texts, each under a ``# -- name ---`` rule."""
    if not sources:
        return
    lines.append("")
    lines.append(title)
    for name, text in sources.items():
        lines.append(f"# -- {prefix}{name} " + "-" * max(0, 60 - len(name)))
        lines.append(text)


def _region_keys(graph) -> list[str]:
    from .codegen.graph_ops import run_region

    keys = []
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and node.target is run_region and node.args[0] not in keys:
            keys.append(node.args[0])
    return keys


def _region_sources(graph) -> dict[str, str]:
    from .codegen.regions import REGIONS

    return {key: REGIONS[key].source() for key in _region_keys(graph) if key in REGIONS}


def kernel_calls(graph) -> collections.Counter:
    """graph_ops function name -> how many nodes call it (0 kernels when codegen is off)."""
    from .codegen.graph_ops import KERNELS_OF

    return collections.Counter(n.target.__name__ for n in graph.gm.graph.nodes if n.op == "call_function" and n.target in KERNELS_OF)


def kernel_sources(graph) -> dict[str, str]:
    """Registered kernel name -> its Triton source, for every kernel ``graph`` launches."""
    from .codegen import kernel_source
    from .codegen.graph_ops import KERNELS_OF, kernels_of

    names = []
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and node.target in KERNELS_OF:
            names.extend(n for n in kernels_of(node.target) if n not in names)
    return {name: kernel_source(name) for name in names}


def _kernels_section(step, graph) -> list[str]:
    codegen = getattr(step.config.stepfx, "codegen", None)
    lines = [f"codegen: {'on' if codegen else 'off'}" + ("" if codegen else " (stepfx.codegen; on by default on CUDA)")]
    calls = kernel_calls(graph)
    # updates written in place (a multi-tensor call counts its tensors: its first argument)
    donated = sum(n.args[0] if getattr(n.target, "__name__", "") == "adam_step_many" else 1
                  for n in graph.gm.graph.nodes if n.meta.get(META_DONATED))
    for name, count in sorted(calls.items()):
        lines.append(f"  {name:<24} x{count}")
    if donated:
        lines.append(f"  ({donated} updates write in place into the state they update)")
    regions = graph.signature.extra.get("generic_regions", ())
    if regions:
        distinct = len({key for key, _ in regions})
        lines.append(f"  {len(regions)} generic regions ({sum(n for _, n in regions)} ops) handed to inductor, "
                     f"{distinct} distinct (compiled once each; their code is at the end)")
    report = graph.signature.extra.get(FUSION_REPORT_KEY, ())
    if report:
        lines.append("  not fused:")
        for fusion, what, why in report[:12]:
            lines.append(f"    {fusion}: {what}: {why}")
        if len(report) > 12:
            lines.append(f"    ... {len(report) - 12} more")
    lines.append("")
    return lines
