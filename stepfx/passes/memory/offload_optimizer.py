"""offload_optimizer: Adam's state and update on the host (ZeRO-Offload).

``zero_optimization.offload_optimizer`` (``device: cpu | nvme``,
``nvme_path``, ``pin_memory``, ``ratio``) with ZeRO stages 1-3. With
``nvme`` the host-held moments are file-backed (mapped files under
``nvme_path``: runtime/binding.py), so the page cache holds what fits and
the drive the rest; the update reads them sequentially (the kernel's
read-ahead) and writes them back in place.

Requires: ``shard_optimizer_update`` ran (each rank updates its pieces; their
optimizer state is held by the rank), and the unscale/clip and overflow
passes (the factor and flag the update reads exist); capture's update rules.

Ensures: for the parameters chosen (in graph order until ``ratio`` of the
rank's sharded elements; all by default) whose update ops compute
Adam/AdamW — checked on sample values, as ``fuse_optimizer_update`` checks
them — the ops are replaced, per ZeRO bucket and param group, by

- ``host_adam_start``, right after the group's last input exists: the
  gradients' pieces and the parameters' pieces go down to the host on a
  copy stream, torch's fused CPU Adam updates them there with ``exp_avg``
  and ``exp_avg_sq``, which live on the host between steps (their slots are
  in ``signature.extra[HOST_STATE_KEY]``), and the updated pieces come back
  up on another stream, in a worker thread, while the device goes on;
- with clipping or fp16 loss scaling (``stepfx.host_update_speculation``
  "auto" or true), the start does not wait for the global norm and the
  overflow flag: it comes right after the group's gradients, reads the
  factor that holds when nothing is clipped (1, or ``1 / loss_scale``,
  computed where the step begins) and the step counter as the step found
  it, and ``host_adam_validate`` right after the real factor and flag hands
  those to the worker, which keeps or restores and redoes each speculated
  update (runtime/host_optimizer.py);
- ``host_adam_wait``, right before the first updated piece is read (the
  all-gather of stages 1-2, the output of stage 3).

Gradients the backward makes in 16 bits and widens to fp32 only for the
update (bf16 without clipping: no norm or overflow check reads the fp32
value) go down in 16 bits and the host widens them (``_narrow_gradients``:
the same values, half the bytes, no fp32 copy on the device). Under clipping
the norm reads the fp32 gradients anyway and they go down as they are.

What stays on the device: the parameters (and their stage-3 pieces), the
gradients; what the host holds at rest: 8 bytes per offloaded element (the
two moments), against DeepSpeed's 16 (fp32 masters, both moments and fp32
gradients): the fp32 parameter piece crosses down and back each step
instead of living twice. The arithmetic is unchanged: the gradient times the
factor in fp32, then the rule (bitwise equal on CPU; see
``runtime/host_optimizer.py``).

Before / after (AdamW, stage 2, one bucket)::

    lerp = aten.lerp(s_w_exp_avg, piece, 0.1)      host = host_adam_start(2, piece, piece_1, grad_piece, grad_piece_1,
    ... (14 more per parameter)               ->      s_w_exp_avg, s_b_exp_avg, s_w_exp_avg_sq, s_b_exp_avg_sq, h_lr_0, ...)
    sub_2 = aten.sub(piece, mul_5)                  updated = host_adam_wait(host)
                                                    new_param = updated[0]; new_exp_avg = updated[1]; ...
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ...config.errors import ConfigError, join
from ...config.values import AUTO
from ...graph import HOST_STATE_KEY, HOST_STATE_NVME_KEY, Phase, Role, StepGraph, Storage
from ...graph.step_graph import META_DONATED, META_HOST_RESULTS, META_UNCLIPPED
from ...graph.build import clone_step_graph
from ...graph.layout import LAYOUT_KEY
from ...graph.ops import RESHAPE_OPS, has_side_effect
from ...graph.update_rule import UPDATE_RULES_KEY
from ...runtime.host_optimizer import host_adam_start, host_adam_validate, host_adam_wait
from ..data_parallel.collectives import make_node
from ..fusion.fuse_optimizer_update import (check_update_region, find_update_region, region_roles, region_structure,
                                            tagged_updates, unsupported_rule)
from ..manager import PassOptions, PassResult
from .recompute_activations import format_bytes

__all__ = ["offload_optimizer", "offload_settings", "offload_block", "start_of", "HOST_STATE_KEY", "META_HOST_RESULTS"]

_PATH = "zero_optimization.offload_optimizer"
_ROLES = ("param", "exp_avg", "exp_avg_sq")


def offload_block(options: PassOptions, slot: str):
    """``zero_optimization``'s ``slot`` block (``offload_optimizer`` / ``offload_param``) when it moves
    something off the device, else None."""
    block = getattr(getattr(options.config, "zero_optimization", None), slot, None)
    return None if block is None or block.device == "none" else block


def offload_settings(options: PassOptions):
    """The ``offload_optimizer`` block when it moves the optimizer off the device, else None."""
    return offload_block(options, "offload_optimizer")


def offload_optimizer(graph: StepGraph, options: PassOptions) -> PassResult:
    block = offload_settings(options)
    rules = graph.signature.extra.get(UPDATE_RULES_KEY) or {}
    layout = graph.signature.extra.get(LAYOUT_KEY)
    if block is None:
        return PassResult(graph, False)
    _refuse_unsupported(block, options)
    if layout is None:
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    tagged = tagged_updates(g, rules)
    bucket_of = {p.name: b for b, p in layout.params() if b.shards_state}
    regions = []
    checked: dict = {}
    with_state = {s.name for s in graph.signature.inputs if s.role is Role.OPTIMIZER_STATE and s.key == "exp_avg"}
    for name, nodes in tagged.items():
        if name not in bucket_of:
            continue  # whole on every rank (0-d, or under the stage-3 persistence threshold): stays on the device
        rule = rules[name]
        if rule is not None and rule.kind == "adam" and name not in with_state:
            continue  # its piece on this rank is empty: nothing to update here
        why = unsupported_rule(rule)
        if rule is None:
            why = ("the host update implements Adam and AdamW (torch's fused CPU kernels); this parameter's optimizer "
                   "is none of them (RMSprop, Adagrad, Adamax and Adadelta update on the device only)")
        elif rule.kind == "adam" and rule.amsgrad:
            why = "amsgrad is not implemented by the host update (nor by DeepSpeed's CPU Adam)"
        elif why is None and rule.kind != "adam":
            why = (f"the host update implements Adam and AdamW (torch's fused CPU kernels); this parameter's "
                   f"optimizer is {rule.kind.upper()}")
        region = None
        if why is None:
            region, why = find_update_region(g, name, _before_gathers(nodes), rule, order)
        if why is None:
            key = region_structure(region, rule)
            if key not in checked:
                # on overflow the host job skips the whole update (the graph still guards what it returns)
                checked[key] = check_update_region(region, rule, overflow_too=False)
            why = checked[key]
        if why is not None:
            raise ConfigError(_PATH, f"cannot move the update of parameter {name!r} to the host: {why}",
                              value=block.device, expected="'none' for this model and optimizer")
        regions.append((region, rule))
    if not regions:
        return PassResult(graph, False, "no sharded parameter is updated on this rank")
    regions = _chosen(regions, block.ratio)
    groups: dict[tuple, list] = {}
    for region, rule in regions:
        leaves = region.leaves
        key = (bucket_of[region.param].index, rule, "step_new" in leaves,
               *(leaves.get(r) for r in ("lr", "beta1", "beta2", "grad_factor", "found_inf")))
        groups.setdefault(key, []).append((region, rule))
    host_idents: set = set(graph.signature.extra.get(HOST_STATE_KEY, ()))
    elements = moved = down = up = 0
    original = list(g.nodes)
    kernel = getattr(getattr(options.config, "stepfx", None), "host_adam", "fused")
    speculation = getattr(getattr(options.config, "stepfx", None), "host_update_speculation", "auto")
    from .update_across_steps import across_steps_apply  # (it imports this module)

    if across_steps_apply(options):
        speculation = False  # the update overlaps the next step instead (update_across_steps)
    speculated = 0
    # "auto": the copies alive at once at most 2 bytes per offloaded element (a quarter of the moments); the
    # backward of a step rarely leaves the host time to update more than that before the norm is known
    cap = None if speculation is True else 2 * sum(r.leaves["param"].meta["val"].numel() for r, _ in regions)
    made: dict = {}  # the unclipped factor, made once for every start that assumes it
    for members in groups.values():
        for part in _splits(members, order):
            idents, guessed = _replace(g, part, order, original, pin=bool(block.pin_memory), kernel=kernel,
                                       speculation=speculation, copy_cap=cap, made=made)
            host_idents |= idents
            speculated += guessed
            elements += sum(r.leaves["param"].meta["val"].numel() for r, _ in part)
            for r, _ in part:  # per step: gradient and parameter pieces down, the updated pieces up
                pval, gval = r.leaves["param"].meta["val"], r.leaves["grad"].meta["val"]
                down += pval.numel() * pval.element_size() + gval.numel() * gval.element_size()
                up += pval.numel() * pval.element_size()
            moved += 1
    g.eliminate_dead_code(is_impure_node=has_side_effect)
    narrowed = _narrow_gradients(g)
    if narrowed:
        down -= narrowed
        g.eliminate_dead_code(is_impure_node=has_side_effect)
    positions = {n: i for i, n in enumerate(g.nodes)}
    donated = sum(_donate_pieces(start, positions) for start in positions if start.target is host_adam_start)
    graph.gm.recompile()
    sig = graph.signature
    extra = {**sig.extra, HOST_STATE_KEY: frozenset(host_idents)}
    if block.device == "nvme":
        extra[HOST_STATE_NVME_KEY] = str(block.nvme_path)
    graph = graph.replace(signature=dataclasses.replace(sig, extra=extra))
    return PassResult(graph, True, f"{len(regions)} Adam updates ({elements:,} elements on this rank) run on the host in "
                                   f"{moved} groups ({kernel} kernel); exp_avg/exp_avg_sq held there "
                                   f"({8 * elements:,} bytes{', in files under ' + str(block.nvme_path) if block.device == 'nvme' else ''})"
                                   + f"; per step {format_bytes(down)} down, {format_bytes(up)} up"
                                   + ("" if block.pin_memory else "; staging not pinned (pin_memory false)")
                                   + (f"; {donated} groups' updated pieces go up into the pieces themselves"
                                      if donated else "")
                                   + (f"; {speculated} groups start before the gradient norm is known, on the unclipped "
                                      f"factor, validated after it (host_update_speculation {speculation!r})"
                                      if speculated else ""))


def _before_gathers(nodes: list[fx.Node]) -> list[fx.Node]:
    """The update's own ops: not those that read what other ops made of its results (stages 1-2 rebuild the whole
    parameter from the updated pieces; the fp16 skip that keeps the old whole parameter on overflow reads that, and
    the whole parameter too, which a 1-D piece would be mistaken for)."""
    tagged = set(nodes)
    results: set = set()  # the tagged ops that compute from the optimizer state (not the gradient's piece cuts)
    for node in nodes:
        for a in node.all_input_nodes:
            slot = a.meta.get("slot") if a.op == "placeholder" else None
            if a in results or (slot is not None and slot.role is Role.OPTIMIZER_STATE and slot.key != "step"):
                results.add(node)
                break
    downstream: set = set()  # untagged values computed from the update's results
    later: set = set()
    stack = [u for n in results for u in n.users if u not in tagged]
    while stack:
        node = stack.pop()
        if node not in downstream and isinstance(node.meta.get("val"), torch.Tensor):  # not the host scalars
            downstream.add(node)
            stack.extend(u for u in node.users if u not in tagged)
    for node in nodes:  # graph order
        if any(a in later or a in downstream for a in node.all_input_nodes):
            later.add(node)
    return [n for n in nodes if n not in later]


def _refuse_unsupported(block, options: PassOptions) -> None:
    from ..data_parallel.plan_zero_layout import zero_settings
    from ..pipeline.partition_stages import pipeline_settings

    if block.device == "nvme" and (not block.nvme_path or block.nvme_path is AUTO):
        raise ConfigError(join(_PATH, "nvme_path"), "device 'nvme' needs the directory the optimizer state is kept in",
                          value=block.nvme_path, expected="a directory on the NVMe drive")
    if pipeline_settings(options) > 1:
        raise ConfigError(_PATH, "is not implemented yet with pipeline parallelism (its ZeRO-1 is the runtime's, "
                          "not the graph's)", value=block.device, expected="'none' with pipeline.stages > 1")
    if zero_settings(options)[0] < 1:
        raise ConfigError(_PATH, "needs ZeRO stage 1, 2 or 3 (the host updates the rank's pieces of the optimizer "
                          "state); zero_optimization.stage is 0", value=block.device, expected="zero_optimization.stage >= 1")


def _chosen(regions: list, ratio: float) -> list:
    """The first parameters in graph order covering ``ratio`` of the elements (DeepSpeed's partial offload)."""
    if ratio >= 1.0:
        return regions
    total = sum(r.leaves["param"].meta["val"].numel() for r, _ in regions)
    out, at = [], 0
    for region, rule in regions:
        if at >= ratio * total:
            break
        out.append((region, rule))
        at += region.leaves["param"].meta["val"].numel()
    return out


def _splits(members: list, order: dict) -> list[list]:
    """``members`` as groups whose inputs all exist before any of their results is read (one group when possible)."""
    out: list[list] = []
    for member in sorted(members, key=lambda m: _first_read(m[0], order)):
        if out and _last_input(out[-1] + [member], order) < min(_first_read(r, order) for r, _ in out[-1] + [member]):
            out[-1].append(member)
        else:
            out.append([member])
    return out


def _last_input(members, order, skip=frozenset()) -> int:
    return max(order[n] for r, _ in members for n in r.leaves.values() if isinstance(n, fx.Node) and n not in skip)


def _first_read(region, order) -> int:
    return min(order[u] for root in region.roots for u in root.users if u not in region.nodes)


def _replace(g: fx.Graph, members: list, order: dict, original: list, *, pin: bool, kernel: str,
             speculation, copy_cap: int | None, made: dict) -> tuple[set, bool]:
    """One start/wait pair for ``members`` (with a validation between them
    where the start speculates); the host-held slots' idents, and whether it
    speculates."""
    first = members[0][0]
    rule = members[0][1]
    leaves = first.leaves
    count = len(members)
    regions = [r for r, _ in members]
    step_role = "step_new" if "step_new" in leaves else "step_old"

    def scalar(role):
        if role in leaves:
            return leaves[role]
        return {"lr": rule.lr, "beta1": rule.betas[0], "beta2": rule.betas[1]}.get(role)

    verdict = [leaves[r] for r in ("grad_factor", "found_inf") if isinstance(leaves.get(r), fx.Node)]
    factor = leaves.get("grad_factor")
    speculate = bool(verdict) and speculation is not False and (factor is None or META_UNCLIPPED in factor.meta)
    guess = (None, None)
    if speculate and all("step_old" in r.leaves for r in regions):
        step_role = "step_old"  # the counter as the step found it (the host adds 1): known from the start
    if speculate:
        unclipped = None
        if factor is not None and factor.meta[META_UNCLIPPED] == "1/loss_scale":  # made where the step begins
            if "1/loss_scale" not in made:
                scale = next(n for n in g.nodes if n.op == "placeholder"
                             and n.meta["slot"].role is Role.RUNTIME_STATE and n.meta["slot"].name == "loss_scale")
                with g.inserting_before(next(n for n in g.nodes if n.op != "placeholder")):
                    made["1/loss_scale"] = make_node(g, torch.ops.aten.reciprocal.default, (scale,),
                                                     val=factor.meta["val"], like=first.roots[0],
                                                     phase=Phase.OPTIMIZER, name="unclipped_factor")
            unclipped = made["1/loss_scale"]
        guess = (unclipped, None)
    args = (count, *(r.leaves["param"] for r in regions), *(r.leaves["grad"] for r in regions),
            *(r.leaves["exp_avg"] for r in regions), *(r.leaves["exp_avg_sq"] for r in regions),
            *(r.leaves[step_role] for r in regions),
            *(scalar(role) for role in ("lr", "beta1", "beta2")),
            *(guess if speculate else (scalar("grad_factor"), scalar("found_inf"))))
    kwargs = dict(step_is_new=step_role == "step_new", eps=rule.eps, weight_decay=rule.weight_decay,
                  decoupled=rule.decoupled, maximize=rule.maximize, pin_memory=pin, kernel=kernel)
    if speculate:
        kwargs.update(speculative=speculation, key=first.param, copy_cap=copy_cap)
    skip = set(verdict) if speculate else set()
    if step_role == "step_old":
        skip |= {r.leaves["step_new"] for r in regions if "step_new" in r.leaves}
    after = original[_last_input(members, order, skip)]
    before = original[min(_first_read(r, order) for r in regions)]
    vals = tuple(r.leaves[role].meta["val"] for r in regions for role in _ROLES)
    with g.inserting_after(after):
        start = make_node(g, host_adam_start, args, kwargs, val=None, like=first.roots[0], phase=Phase.OPTIMIZER,
                          name="host_update")
    job = start
    if speculate:
        known = original[_last_input(members, order)]
        with g.inserting_after(start if order[known] <= order[after] else known):
            job = make_node(g, host_adam_validate, (start, scalar("grad_factor"), scalar("found_inf")), val=None,
                            like=first.roots[0], phase=Phase.OPTIMIZER, name="host_update_validated")
    with g.inserting_before(before):
        wait = make_node(g, host_adam_wait, (job,), val=vals, like=first.roots[0], phase=Phase.OPTIMIZER,
                         name="host_updated")
        wait.meta[META_HOST_RESULTS] = tuple(i for i in range(len(vals)) if i % 3)
        results = {}
        for i, region in enumerate(regions):
            for j, role in enumerate(_ROLES):
                results[(region.param, role)] = make_node(
                    g, operator.getitem, (wait, 3 * i + j), val=vals[3 * i + j], like=region.roots[0],
                    phase=Phase.OPTIMIZER, param=region.param, name=f"new_{role}")
    idents = set()
    for region, rule_ in members:
        for root, role in region_roles(region, rule_).items():
            root.replace_all_uses_with(results[(region.param, role)], delete_user_cb=lambda user, r=region: user not in r.nodes)
        for role in ("exp_avg", "exp_avg_sq"):
            leaf = region.leaves[role]
            if leaf.op != "placeholder":
                raise ConfigError(_PATH, f"the {role} of {region.param!r} is not state the rank holds between steps")
            idents.add(leaf.meta["slot"].ident)
    return idents, speculate


def _narrow_gradients(g: fx.Graph) -> int:
    """Gradients the backward makes in 16 bits and widens to fp32 only for the host update go down in 16 bits;
    the host widens them (the same values, half the bytes down, no fp32 copy on the device). Only where nothing
    else reads the widened value: a clipping norm or overflow check reading it would keep the fp32 copy alive
    beside the 16-bit one until the update starts. The bytes a step no longer moves down."""
    saved = 0
    for start in [n for n in g.nodes if n.target is host_adam_start]:
        count = start.args[0]
        for i in range(count):
            grad = start.args[1 + count + i]
            source = _sixteen_bit_source(grad, only_reader=start)
            if source is None:
                continue
            shape = list(grad.meta["val"].shape)
            with g.inserting_before(start):
                narrow = make_node(g, torch.ops.aten.reshape.default, (source, shape),
                                   val=source.meta["val"].reshape(shape), like=grad, name="grad_16")
            start.update_arg(1 + count + i, narrow)
            saved += grad.meta["val"].numel() * (4 - source.meta["val"].element_size())
    return saved


def _sixteen_bit_source(grad: fx.Node, only_reader: fx.Node) -> fx.Node | None:
    """The bf16/fp16 value ``grad`` (fp32) is a widening of, through views (``_to_copy`` to float32 on the
    same device, nothing else changed), where ``only_reader`` is the only reader of the widened value and its
    views: one rank's gradient as bf16 training makes it, unclipped. None otherwise."""
    node, reader = grad, only_reader
    while True:
        if set(node.users) != {reader}:
            return None
        if not (node.op == "call_function" and node.target in RESHAPE_OPS):
            break
        node, reader = node.args[0], node
    if node.op != "call_function" or node.target is not torch.ops.aten._to_copy.default:
        return None
    source = node.args[0]
    wide, narrow = node.meta.get("val"), getattr(source, "meta", {}).get("val")
    if not (isinstance(wide, torch.Tensor) and isinstance(narrow, torch.Tensor)) or set(node.kwargs) - {"dtype", "layout", "device"}:
        return None
    if wide.dtype != torch.float32 or narrow.dtype not in (torch.bfloat16, torch.float16) or wide.device != narrow.device:
        return None
    return source


def _donate_pieces(start: fx.Node, order: dict) -> int:
    """Let ``start``'s job write the updated pieces into the device pieces (``donate``, ``META_DONATED``: verify
    checks that nothing reads them later) where they are rank-held pieces (ZeRO-3) that the start reads last;
    1 if it does. Else the device holds each piece twice at the end of the step, old and updated. ``order``:
    the nodes' positions."""
    count = start.args[0]
    params = start.args[1:1 + count]
    if len(set(params)) != count:
        return 0
    for p in params:
        slot = p.meta.get("slot") if isinstance(p, fx.Node) and p.op == "placeholder" else None
        if slot is None or slot.storage is not Storage.RANK or slot.role is not Role.PARAM:
            return 0
        if any(order[u] > order[start] for u in p.users):
            return 0
    start.kwargs = {**start.kwargs, "donate": True}
    start.meta[META_DONATED] = tuple(range(1, 1 + count))
    return 1


def undonate(start: fx.Node) -> None:
    """The pieces moved to the host (host_master_weights, offload_parameters): updated there in place, nothing
    donated on the device."""
    start.kwargs = {k: v for k, v in start.kwargs.items() if k != "donate"}
    start.meta.pop(META_DONATED, None)


def start_of(wait: fx.Node) -> fx.Node:
    """The ``host_adam_start`` node a ``host_adam_wait`` reads (through its validation)."""
    job = wait.args[0]
    return job.args[0] if job.target is host_adam_validate else job
