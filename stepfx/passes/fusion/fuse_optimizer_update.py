"""fuse_optimizer_update: each parameter's optimizer update becomes one kernel call.

Requires: a functional graph after the ZeRO, unscale/clip and overflow
passes (the ops on a parameter's gradient, state and update carry its name);
capture's update rules (``signature.extra["update_rules"]``).

Ensures: for every parameter or ZeRO piece whose update ops compute the
rule of its param group (Adam/AdamW or SGD), those ops are replaced by one
call of the fused kernel (:mod:`stepfx.codegen.graph_ops`), which reads the
gradient once and folds in the unscale/clip factor and the fp16 overflow
skip. Whether the ops compute the rule is *checked*, not assumed: they run,
and the kernel's eager reference runs, on the same small random values
(twice: with and without an overflow); only an exact role-by-role match is
replaced. The kernel writes into the parameter and state it updates (they
are donated: ``meta["donated"]``) when nothing reads them later and no
collective follows (so a failing collective still leaves the step's state
untouched); otherwise it returns new tensors. Step counters stay as they are
(host scalars). Parameters left alone are recorded with the reason
(``signature.extra["fusion_report"]``).

Before / after (AdamW, one parameter)::

    grad = aten.mul.Tensor(g_w, grad_factor)            update = stepfx.codegen.graph_ops.adam_step(
    mul = aten.mul.Tensor(p_w, sub)                          p_w, g_w, s_w_exp_avg, s_w_exp_avg_sq, h_lr_0,
    lerp = aten.lerp.Scalar(s_w_exp_avg, grad, sub_1)  ->    h_beta1_0, h_beta2_0, s_w_step, grad_factor,
    ... (12 more)                                             step_is_new=False, eps=1e-08, ..., inplace=True)
    addcdiv = aten.addcdiv(mul, lerp, add_1, value=neg)  addcdiv = update[0]
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ...graph import META_DONATED, META_PARAM, META_PHASE, Phase, Role, StepGraph
from ...graph.build import clone_step_graph
from ...graph.ops import has_side_effect, is_collective, is_view
from ...graph.update_rule import UPDATE_RULES_KEY, UpdateRule
from ..data_parallel.collectives import fake_like, make_node
from ..data_parallel.shard_optimizer_update import META_PIECE_OF
from ..manager import PassOptions, PassResult

__all__ = ["fuse_optimizer_update", "FUSION_REPORT_KEY", "UpdateRegion", "tagged_updates", "find_update_region",
           "check_update_region", "region_structure", "region_roles", "unsupported_rule"]

aten = torch.ops.aten
FUSION_REPORT_KEY = "fusion_report"  # signature.extra: list of (pass, what, reason) records
_SAMPLE = 13  # elements of the random values the check runs on


@dataclasses.dataclass
class _Region:
    param: str
    nodes: set  # the update's nodes
    leaves: dict  # role -> node (or host value)
    roots: list  # tensor nodes of the region read outside it
    order: dict  # node -> position in the graph (of the nodes that existed before this pass)


def fuse_optimizer_update(graph: StepGraph, options: PassOptions) -> PassResult:
    rules: dict[str, UpdateRule] = graph.signature.extra.get(UPDATE_RULES_KEY) or {}
    if not rules:
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    report = list(graph.signature.extra.get(FUSION_REPORT_KEY, ()))
    fused = inplace = 0
    checked: dict[tuple, str | None] = {}  # region structure -> None (computes the rule) or why not
    tagged: dict[str, list[fx.Node]] = {}
    order = {n: i for i, n in enumerate(g.nodes)}
    for node in g.nodes:
        if node.op == "call_function" and node.meta.get(META_PHASE) is Phase.OPTIMIZER and node.meta.get(META_PARAM) in rules:
            tagged.setdefault(node.meta[META_PARAM], []).append(node)
    for name, nodes in tagged.items():
        if any(_runtime_effect(n) for n in nodes):
            continue  # its update is already a host job (offload_optimizer): nothing here to fuse, nor to run
        rule = rules[name]
        why = _unsupported(rule)
        region = None
        if why is None:
            region, why = _region(g, name, nodes, rule, order)
        if why is None:
            key = _structure(region, rule)
            if key not in checked:
                checked[key] = _check(region, rule)
            why = checked[key]
        if why is not None:
            report.append(("fuse_optimizer_update", name, why))
            continue
        done, why = _replace(graph, region, rule)
        if why is not None:
            report.append(("fuse_optimizer_update", name, why))
            continue
        fused += 1
        inplace += done
    if not fused:
        graph = graph.replace(signature=dataclasses.replace(graph.signature, extra={**graph.signature.extra, FUSION_REPORT_KEY: report}))
        return PassResult(graph, bool(report), f"no update fused ({len(report)} not fused; see explain())")
    g.eliminate_dead_code(is_impure_node=has_side_effect)
    graph.gm.recompile()
    graph = graph.replace(signature=dataclasses.replace(graph.signature, extra={**graph.signature.extra, FUSION_REPORT_KEY: report}))
    left = len(tagged) - fused
    return PassResult(graph, True, f"{fused} updates fused into one kernel each ({inplace} in place); {left} left as ops")


def _unsupported(rule: UpdateRule | None) -> str | None:
    if rule is None:
        return "no update rule recorded for this optimizer"
    if rule.kind == "adam" and rule.amsgrad:
        return "amsgrad has no fused kernel"
    return None


# -- the region -------------------------------------------------------------------


def _is_tensor(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def _host_scalar(node) -> bool:
    """A node computing a Python number on the host (bias corrections, lr read with .item())."""
    return isinstance(node, fx.Node) and node.op == "call_function" and not _is_tensor(node) and node.meta.get(META_PARAM) is None


def _region(g: fx.Graph, name: str, tagged: list[fx.Node], rule: UpdateRule, order: dict):
    nodes = set(tagged)
    stack = list(tagged)
    while stack:  # the host arithmetic the tagged ops read (shared with other parameters, so never erased)
        for arg in stack.pop().all_input_nodes:
            if arg not in nodes and _host_scalar(arg):
                nodes.add(arg)
                stack.append(arg)
    changed = True
    while changed:  # views of values outside the region are read as they are, not fused
        changed = False
        for node in list(nodes):
            if is_view(node) and all(a not in nodes for a in node.all_input_nodes):
                nodes.discard(node)
                changed = True
    # ops that also read values of another shape (the whole parameter a ZeRO
    # all-gather rebuilds) stay ops: drop them and what depends on them
    while True:
        leaves, bad = _classify(nodes, name)
        if not bad:
            break
        drop = set()
        stack = [u for b in bad for u in b.users if u in nodes]
        while stack:
            node = stack.pop()
            if node not in drop:
                drop.add(node)
                stack.extend(u for u in node.users if u in nodes)
        if not drop:
            return None, f"reads {', '.join(b.name for b in bad)}, which is none of parameter, gradient, state, lr or flags"
        nodes -= drop
    needed = {"adam": ("param", "grad", "exp_avg", "exp_avg_sq"), "sgd": ("param", "grad")}[rule.kind]
    if rule.kind == "sgd" and rule.momentum:
        needed += ("momentum_buffer",)
    missing = [r for r in needed if r not in leaves]
    if missing:
        what = "its optimizer state is created in this step (the first step runs once, unfused)" if "param" in leaves and "grad" in leaves else f"no {', '.join(missing)} found"
        return None, what
    shape = leaves["param"].meta["val"].shape
    roots = [n for n in sorted(nodes, key=order.__getitem__) if _is_tensor(n) and tuple(n.meta["val"].shape) == tuple(shape) and any(u not in nodes for u in n.users)]
    if not roots:
        return None, "its update is not read"
    return _Region(name, nodes, leaves, roots, order), None


def _classify(nodes: set, name: str):
    """Role of every value the region reads; the values with no role."""
    leaves: dict[str, fx.Node] = {}
    bad = []
    param_shape = None
    inputs = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in nodes and arg not in inputs:
                inputs.append(arg)
    for arg in inputs:
        slot = arg.meta.get("slot") if arg.op == "placeholder" else None
        if (slot is not None and slot.role is Role.PARAM and slot.name == name) or arg.meta.get(META_PIECE_OF) == name:
            leaves["param"] = arg
            param_shape = arg.meta["val"].shape
    for arg in inputs:
        slot = arg.meta.get("slot") if arg.op == "placeholder" else None
        val = arg.meta.get("val")
        role = None
        if arg is leaves.get("param"):
            continue
        if slot is not None and slot.role is Role.OPTIMIZER_STATE and slot.name == name:
            role = "step_old" if slot.key == "step" else slot.key
        elif slot is not None and slot.role is Role.HYPERPARAM and slot.name in ("lr", "beta1", "beta2"):
            role = slot.name
        elif not isinstance(val, torch.Tensor):
            if _is_new_step(arg):
                role = "step_new"
        elif param_shape is not None and tuple(val.shape) == tuple(param_shape) and val.is_floating_point():
            role = "grad"
        elif val.dim() == 0 and val.dtype == torch.bool:
            role = "found_inf"
        elif val.dim() == 0 and val.is_floating_point() and arg.op != "placeholder":
            role = "grad_factor"  # the unscale x clip factor, on the device
        if role is None or role in leaves:
            bad.append(arg)
        else:
            leaves[role] = arg
    return leaves, bad


def _is_new_step(node: fx.Node) -> bool:
    """``_local_scalar_dense(add(<a step counter>, 1))``: the step after this step's increment, as a host number."""
    if node.op != "call_function" or node.target is not aten._local_scalar_dense.default:
        return False
    (inner,) = node.args
    if not (isinstance(inner, fx.Node) and inner.target is aten.add.Tensor and inner.args[1] == 1):
        return False
    base = inner.args[0]
    slot = base.meta.get("slot") if isinstance(base, fx.Node) and base.op == "placeholder" else None
    return slot is not None and slot.role is Role.OPTIMIZER_STATE and slot.key == "step"


def _structure(region: _Region, rule: UpdateRule) -> tuple:
    """What the check depends on: the ops, their constants and the roles read."""
    order = sorted(region.nodes, key=region.order.__getitem__)
    names = {n: i for i, n in enumerate(order)}
    roles = {node: role for role, node in region.leaves.items()}

    def ref(a):
        if isinstance(a, fx.Node):
            return ("n", names[a]) if a in names else ("leaf", roles.get(a))
        return a

    ops = tuple((n.target, tuple(fx.node.map_aggregate(n.args, ref)), tuple(sorted(fx.node.map_aggregate(n.kwargs, ref).items())))
                for n in order)
    dtypes = tuple(sorted((role, str(node.meta["val"].dtype)) for role, node in region.leaves.items() if _is_tensor(node)))
    return (rule, ops, dtypes, tuple(sorted(names[r] for r in region.roots)))


# -- the check -------------------------------------------------------------------------


def _sample(region: _Region, overflow: bool) -> dict:
    """Small random values for the region's inputs, in their dtypes, on the CPU."""
    gen = torch.Generator().manual_seed(1234)
    values = {}
    for role, node in region.leaves.items():
        val = node.meta.get("val")
        if role == "step_new":
            values[node] = 4.0
            continue
        dtype = val.dtype
        if role == "param":
            t = torch.randn(_SAMPLE, generator=gen)
        elif role == "grad":
            t = torch.randn(_SAMPLE, generator=gen)
        elif role in ("exp_avg", "momentum_buffer"):
            t = torch.randn(_SAMPLE, generator=gen) * 0.1
        elif role == "exp_avg_sq":
            t = torch.rand(_SAMPLE, generator=gen) * 0.01
        elif role == "step_old":
            t = torch.tensor(3.0)
        elif role == "lr":
            t = torch.tensor(0.0123)
        elif role == "beta1":
            t = torch.tensor(0.85)
        elif role == "beta2":
            t = torch.tensor(0.97)
        elif role == "grad_factor":
            t = torch.tensor(0.75)
        elif role == "found_inf":
            t = torch.tensor(overflow)
        else:  # pragma: no cover - roles come from _classify
            raise AssertionError(role)
        values[node] = t.to(dtype)
    return values


def _runtime_effect(node: fx.Node) -> bool:
    """A runtime op marked as acting beyond its value (a host job's start:
    ``stepfx_side_effect``): never an op of an update to fuse, and never to
    be run by the check (it would start a real job on the samples)."""
    return node.op == "call_function" and getattr(node.target, "stepfx_side_effect", False)


def _run(nodes: set, values: dict, order: dict) -> dict:
    env = dict(values)
    for node in sorted(nodes, key=order.__getitem__):
        if _runtime_effect(node) or is_collective(node):
            raise ValueError(f"{node.name} ({getattr(node.target, '__name__', node.target)}) has effects beyond "
                             "its value")
        args = fx.node.map_arg(node.args, lambda a: env[a])
        kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a])
        env[node] = node.target(*args, **kwargs)
    return env


def _kernel_call(region: _Region, rule: UpdateRule, reference: bool):
    """The graph_ops function, its args (role names for the region's values) and kwargs."""
    from ...codegen import graph_ops

    leaves = region.leaves
    step_role = "step_new" if "step_new" in leaves else "step_old"
    if rule.kind == "adam":
        fn = graph_ops.adam_step_reference if reference else graph_ops.adam_step
        args = ["param", "grad", "exp_avg", "exp_avg_sq", "lr", "beta1", "beta2", step_role, "grad_factor", "found_inf"]
        kwargs = dict(step_is_new=step_role == "step_new", eps=rule.eps, weight_decay=rule.weight_decay,
                      decoupled=rule.decoupled, maximize=rule.maximize)
        outputs = ("param", "exp_avg", "exp_avg_sq")
    else:
        fn = graph_ops.sgd_step_reference if reference else graph_ops.sgd_step
        args = ["param", "grad", "momentum_buffer", "lr", "grad_factor", "found_inf"]
        kwargs = dict(momentum=rule.momentum, dampening=rule.dampening, weight_decay=rule.weight_decay,
                      nesterov=rule.nesterov, maximize=rule.maximize)
        outputs = ("param", "momentum_buffer")
    return fn, args, kwargs, outputs


def _constant(role: str, rule: UpdateRule):
    """A value the graph bakes in instead of reading it (lr and betas normally are graph inputs)."""
    return {"lr": rule.lr, "beta1": rule.betas[0], "beta2": rule.betas[1]}.get(role)


def _check(region: _Region, rule: UpdateRule, *, overflow_too: bool = True) -> str | None:
    """None when the region's ops compute what the kernel computes, else why
    not; with ``overflow_too`` also when the overflow flag is set (a caller
    that skips the whole update on overflow itself passes False)."""
    fn, args, kwargs, outputs = _kernel_call(region, rule, reference=True)
    if rule.kind == "sgd" and not rule.momentum:
        outputs = ("param",)
    for overflow in ((False, True) if "found_inf" in region.leaves and overflow_too else (False,)):
        values = _sample(region, overflow)
        try:
            env = _run(region.nodes, values, region.order)
        except Exception as exc:  # an op the CPU cannot run at this size: leave the region alone
            return f"its ops could not be checked ({type(exc).__name__}: {exc})"
        call = [values[region.leaves[r]] if r in region.leaves else _constant(r, rule) for r in args]
        try:
            expected = fn(*call, inplace=False, **kwargs)
        except ValueError as exc:  # outside the kernel's contract (a 16-bit parameter, say): torch's ops stay
            return f"the kernel does not take it: {exc}"
        expected = dict(zip(outputs, expected if isinstance(expected, tuple) else (expected,)))
        roles = _match(region, env, expected)
        if isinstance(roles, str):
            return roles
    return None


def _match(region: _Region, env: dict, expected: dict):
    """Root -> kernel output role, or why the roots are not the kernel's outputs."""
    roles = {}
    for root in region.roots:
        got = env[root]
        hits = [role for role, want in expected.items() if want is not None and got.dtype == want.dtype
                and torch.allclose(got, want, rtol=1e-5, atol=1e-7, equal_nan=True)]
        if len(hits) != 1:
            return f"its ops do not compute {'the rule' if not hits else 'one output'} of the fused kernel ({root.name})"
        roles[root] = hits[0]
    return roles


# -- the rewrite --------------------------------------------------------------------


def _replace(graph: StepGraph, region: _Region, rule: UpdateRule):
    """Insert the kernel call, rewire the roots; (1 if in place else 0, why not)."""
    g = graph.gm.graph
    fn, args, kwargs, outputs = _kernel_call(region, rule, reference=False)
    roles = region_roles(region, rule)
    order = {n: i for i, n in enumerate(g.nodes)}
    external = [u for r in region.roots for u in r.users if u not in region.nodes]
    at = min(external, key=order.__getitem__)
    leaf_nodes = [n for n in region.leaves.values() if isinstance(n, fx.Node)]
    if any(order[n] >= order[at] for n in leaf_nodes):
        return 0, "its inputs are made after its results are read"
    donate = _donatable(graph, region, roles, at, order)
    graph_args = tuple(region.leaves[r] if r in region.leaves else _constant(r, rule) for r in args)
    on_device = _device_step(region) if rule.kind == "adam" else None
    if on_device is not None:
        # the step count is a device tensor: the kernels read the step size and
        # bias correction from one node computed there, not from a host read
        step_node, is_new = on_device
        at_step = next(i for i, r in enumerate(args) if r in ("step_new", "step_old"))
        lr_beta = tuple(graph_args[args.index(r)] for r in ("lr", "beta1", "beta2"))
        scalars = _scalars_node(g, step_node, lr_beta, is_new, region)
        graph_args = graph_args[:at_step] + (scalars,) + graph_args[at_step + 1:]
        kwargs = {**kwargs, "step_on_device": True}
    vals = tuple(expected_val for expected_val in _fake_outputs(region, outputs))
    anchor = region.roots[0]
    with g.inserting_before(at):
        kernel = make_node(g, fn, graph_args, {**kwargs, "inplace": donate}, val=vals, like=anchor,
                           phase=Phase.OPTIMIZER, param=region.param, name="fused_update")
        if donate:
            kernel.meta[META_DONATED] = tuple(args.index(r) for r in outputs if r in region.leaves)
        results = {}
        for i, role in enumerate(outputs):
            results[role] = make_node(g, operator.getitem, (kernel, i), val=vals[i], like=anchor,
                                      phase=Phase.OPTIMIZER, param=region.param, name=f"new_{role}")
    for root, role in roles.items():
        root.replace_all_uses_with(results[role], delete_user_cb=lambda user: user not in region.nodes)
    return int(donate), None


def region_roles(region: _Region, rule: UpdateRule) -> dict:
    """Root -> the kernel output it computes ("param", "exp_avg", ...), for a
    region :func:`check_update_region` passed."""
    _, args, kwargs, outputs = _kernel_call(region, rule, reference=True)
    ref_fn = _kernel_call(region, rule, reference=True)[0]
    values = _sample(region, False)
    env = _run(region.nodes, values, region.order)
    call = [values[region.leaves[r]] if r in region.leaves else _constant(r, rule) for r in args]
    expected = ref_fn(*call, inplace=False, **kwargs)
    expected = dict(zip(outputs, expected if isinstance(expected, tuple) else (expected,)))
    return _match(region, env, expected)


def tagged_updates(g: fx.Graph, rules: dict) -> dict[str, list[fx.Node]]:
    """Parameter name -> the optimizer-phase ops tagged with it, for parameters with a recorded rule."""
    tagged: dict[str, list[fx.Node]] = {}
    for node in g.nodes:
        if node.op == "call_function" and node.meta.get(META_PHASE) is Phase.OPTIMIZER and node.meta.get(META_PARAM) in rules:
            tagged.setdefault(node.meta[META_PARAM], []).append(node)
    return tagged


# the region machinery, for other passes that replace an update (offload_optimizer)
UpdateRegion = _Region
find_update_region = _region
check_update_region = _check
region_structure = _structure
unsupported_rule = _unsupported


def _device_step(region: _Region):
    """(the step counter's input node, False: not yet incremented) when the
    step count lives on the device, else None. Every region names the same
    node, so one ``adam_scalars`` serves all parameters."""
    leaf = region.leaves.get("step_new")
    if leaf is not None:
        inner = leaf.args[0]  # _local_scalar_dense(add(step, 1)): the counter itself, not yet incremented
        return None if _on_host(inner.meta["val"]) else (inner.args[0], False)
    leaf = region.leaves.get("step_old")
    if isinstance(leaf, fx.Node) and isinstance(leaf.meta.get("val"), torch.Tensor) and not _on_host(leaf.meta["val"]):
        return leaf, False
    return None


def _on_host(val: torch.Tensor) -> bool:
    return val.device.type == "cpu"


def _scalars_node(g: fx.Graph, step: fx.Node, lr_beta: tuple, is_new: bool, region: _Region) -> fx.Node:
    """The one ``adam_scalars`` node for this step counter and lr/betas (made on first use, right after its inputs)."""
    from ...codegen import graph_ops

    for user in step.users:
        if user.target is graph_ops.adam_scalars and user.args[1:] == lr_beta and user.kwargs["step_is_new"] == is_new:
            return user
    order = {n: i for i, n in enumerate(g.nodes)}
    last = max((a for a in (step, *lr_beta) if isinstance(a, fx.Node)), key=order.__getitem__)
    with g.inserting_after(last):
        return make_node(g, graph_ops.adam_scalars, (step, *lr_beta), {"step_is_new": is_new},
                         val=fake_like(step.meta["val"], (2,), torch.float32), like=step, phase=Phase.OPTIMIZER,
                         name="adam_scalars")


def _fake_outputs(region: _Region, outputs):
    return tuple(region.leaves[r].meta["val"] if r in region.leaves else None for r in outputs)


def _donatable(graph: StepGraph, region: _Region, roles: dict, at: fx.Node, order: dict) -> bool:
    """The kernel may write into the parameter and state it replaces: each is
    a graph input whose new value goes to its own output slot, nothing else
    reads it after the kernel, and no collective runs after the kernel."""
    g = graph.gm.graph
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    returned = list(out.args[0])
    slots = graph.signature.outputs
    if any(is_collective(n) for n in g.nodes if order[n] > order[at]):
        return False
    for root, role in roles.items():
        leaf = region.leaves.get(role)
        if leaf is None or leaf.op != "placeholder":
            return False
        ident = leaf.meta["slot"].ident
        if not any(v is root and slots[i].ident == ident for i, v in enumerate(returned)):
            return False
        if any(v is leaf for v in returned):
            return False
        if any(u not in region.nodes and order[u] >= order[at] for u in leaf.users):
            return False
    return True
