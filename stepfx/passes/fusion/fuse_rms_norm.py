"""fuse_rms_norm: an RMSNorm written out in Python (Hugging Face's Llama,
Mistral, Qwen2, Phi-3 ...), forward and backward, runs stepfx's RMSNorm kernels.

Why: ``LlamaRMSNorm`` computes ``w * (x.float() * rsqrt(x.float().pow(2).mean(-1)
+ eps)).to(dtype)``: captured, that is six forward ops and about fifteen
backward ops per norm, which keep the fp32 copy of ``x`` and the normalized
value for the backward. stepfx's kernels (``codegen/norm_kernels.py``, the
contract of ``aten._fused_rms_norm`` and its backward) read ``x`` once each
way and keep only ``rstd`` (one fp32 per row).

Requires: a functional graph with phases; codegen on.

Ensures: each match — found from its ``rsqrt`` by op identity:

    forward:  [x32 = _to_copy(x, f32)]; r = rsqrt(add(mean(pow(x32, 2), [-1], keepdim), eps));
              h = mul(x32, r); [h = _to_copy(h, dtype(x))]; y = mul(w, h)      (w: [N], either operand order)
              or Gemma's: y = _to_copy(mul(h, w), dtype(x)) with an fp32 w (``1 + weight``): one rounding,
              as the kernel's; the weight's gradient then in fp32
    backward: the ops that read only the backward's values, ``g`` (y's gradient, met in mul(g, w) and
              mul(g, h)), x32, r and h: the weight's gradient (a sum over the rows of mul(g, h), viewed
              as [N]) and the input's (ending in an add, cast back to x's dtype where x was cast)

— whose intermediate values nothing else reads, and whose computation equals
the kernels' on sample values (evaluated once per distinct structure, at the
captured shapes, on the step's device: fp32 within 1e-5, 16-bit within the
rounding HF's two casts differ by), becomes::

    norm = graph_ops.rms_norm(x, [N], w, eps);  y = norm[0];  rstd = norm[1]
    grads = graph_ops.rms_norm_backward(g, x, [N], rstd, w, [True, True]);  dx = grads[0];  dw = grads[1]

Differences from the written-out ops: in 16-bit, the kernel multiplies the
normalized value by the weight in fp32 and rounds once (HF rounds the
normalized value first, then the product), and sums the weight's gradient in
fp32 (HF rounds each product first); within the 16-bit error the tests hold.
Anything else — symbolic sizes, a norm whose values other ops read, a shape
the kernels do not take, recomputed copies (remat) — stays as it was (generic regions take it), with
the reason in explain()'s fusion report.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ... import compat
from ...graph import StepGraph
from ...graph.build import clone_step_graph_mapped
from ...graph.step_graph import META_PHASE, Phase
from ..data_parallel.collectives import make_node
from ..manager import PassOptions, PassResult
from .fuse_optimizer_update import FUSION_REPORT_KEY

__all__ = ["fuse_rms_norm"]

aten = torch.ops.aten
_BACKWARD_OPS = frozenset({aten.mul.Tensor, aten.mul.Scalar, aten.sum.dim_IntList, aten.pow.Tensor_Scalar,
                           aten.expand.default, aten.div.Scalar, aten.div.Tensor, aten.add.Tensor, aten.neg.default,
                           aten.sub.Tensor, aten._to_copy.default})
_SAMPLE_LIMIT = 1 << 25  # elements of x a CPU device's check evaluates (a CUDA step's is checked on the GPU)


@dataclasses.dataclass
class _Match:
    x: fx.Node
    w: fx.Node
    g: fx.Node
    eps: float
    y: fx.Node
    dx: fx.Node
    dw: fx.Node
    nodes: list  # every node replaced, in graph order
    summed: fx.Node | None = None  # fp32: the add that sums x's second contribution with another gradient
    dx2: fx.Node | None = None  # that second contribution


def _is_cast(node, dtype=None) -> bool:
    return (node.op == "call_function" and node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype", "layout", "device"}
            and (dtype is None or node.kwargs.get("dtype") == dtype))


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _static_width(node) -> bool:
    """A tensor whose last dimension (the normalized one) is static; the rows may be symbolic (stepfx.dynamic:
    the kernels take the row count as an argument)."""
    val = _val(node)
    return isinstance(val, torch.Tensor) and val.dim() > 0 and not compat.is_symbolic(val.shape[-1])


def _shape(node) -> tuple:
    """``node``'s shape, symbolic sizes as expressions (compared without guarding)."""
    return tuple(compat.size_expr(d) for d in _val(node).shape)


def _dense(val: torch.Tensor) -> bool:
    """Contiguous, judged on the sizes' hints (no guard on a symbolic size)."""
    expected = 1
    for size, stride in reversed(list(zip(val.shape, val.stride()))):
        size = compat.size_hint(size)
        if size != 1 and compat.size_hint(stride) != expected:
            return False
        expected *= size
    return True


def _is_size(node) -> bool:
    """A size read (``sym_size``, hoisted under stepfx.dynamic), which ops like ``expand`` take as arguments."""
    return isinstance(_val(node), (int, torch.SymInt))


def _concrete(value):
    """``value`` with symbolic sizes replaced by their hints (the sizes of the call being traced)."""
    if isinstance(value, torch.SymInt):
        return compat.size_hint(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_concrete(v) for v in value)
    return value


def _other(node, one):
    a, b = node.args[:2]
    return b if a is one else a if b is one else None


def _forward(r: fx.Node):
    """(x, x32, w, eps, y, h, forward nodes, out) from an rsqrt, or the reason it is not an RMSNorm: ``y``
    multiplies ``h`` by ``w``; ``out`` is the norm's result (``y``, or Gemma's cast of it)."""
    a = r.args[0]
    if a.op != "call_function" or a.target not in (aten.add.Tensor, aten.add.Scalar) or not isinstance(a.args[1], float):
        return "rsqrt of something other than mean + eps"
    mean = a.args[0]
    if mean.op != "call_function" or mean.target is not aten.mean.dim or len(mean.args) < 3 or mean.args[2] is not True:
        return "not a mean over the last dim with keepdim"
    p = mean.args[0]
    if p.op != "call_function" or p.target is not aten.pow.Tensor_Scalar or p.args[1] != 2:
        return "not a mean of squares"
    x32 = p.args[0]
    if not _static_width(x32) or list(mean.args[1]) not in ([-1], [_val(x32).dim() - 1]) or _val(x32).dtype != torch.float32:
        return "not over the last dim (of a static size) of an fp32 value"
    x = x32.args[0] if _is_cast(x32, torch.float32) else x32
    mul = [u for u in r.users if u.target is aten.mul.Tensor and _other(u, r) is x32 and u.meta.get(META_PHASE) is Phase.FORWARD]
    if len(mul) != 1:
        return "the normalized value is not x * rstd"
    h = mul[0]
    chain = [p, mean, a, r, h]
    if x is not x32:
        chain.insert(0, x32)
    late_cast = False  # Gemma: the fp32 normalized value times an fp32 weight, then cast (one rounding)
    if _val(x).dtype != torch.float32:
        casts = [u for u in h.users if _is_cast(u, _val(x).dtype)]
        if len(casts) == 1:
            h = casts[0]
            chain.append(h)
        else:
            late_cast = True
    ys = [u for u in h.users if u.target is aten.mul.Tensor and u.meta.get(META_PHASE) is Phase.FORWARD]
    if len(ys) != 1:
        return "the normalized value is not multiplied by a weight"
    y = ys[0]
    w = _other(y, h)
    n = _val(x).shape[-1]
    if not isinstance(w, fx.Node) or tuple(_val(w).shape) != (n,):
        return "the weight is not a [N] tensor"
    out = y
    if late_cast:
        casts = [u for u in y.users if _is_cast(u, _val(x).dtype)]
        if len(casts) != 1 or len(y.users) != 1 or _val(w).dtype != torch.float32:
            return "the normalized value is not cast back to the input's dtype"
        out = casts[0]
    elif _val(w).dtype != _val(x).dtype:
        return "the weight is not of the input's dtype"
    return x, x32, w, float(a.args[1]), y, h, chain + [y] + ([out] if out is not y else []), out


def _backward(x32, r, h, w, y, forward: list, order: dict):
    """(g, dx, the add of dx's second part or None, dw, backward nodes) or the reason."""
    gh = [u for u in w.users if u is not y and u.target is aten.mul.Tensor and u.meta.get(META_PHASE) is Phase.BACKWARD
          and _shape(u) == _shape(y)]
    if len(gh) != 1:
        return "the output's gradient is not multiplied by the weight once"
    g = _other(gh[0], w)
    gwp = [u for u in h.users if u is not y and u.target is aten.mul.Tensor and _other(u, h) is g]
    if len(gwp) != 1 or len(h.users) != 2:
        return "the normalized value is read elsewhere"
    sums = list(gwp[0].users)
    if len(sums) != 1 or sums[0].target is not aten.sum.dim_IntList:
        return "the weight's gradient is not a sum over the rows"
    dw = sums[0]
    if len(dw.users) == 1 and next(iter(dw.users)).target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        dw = next(iter(dw.users))
    if _shape(dw) != _shape(w):
        return "the weight's gradient is not the weight's shape"
    # the input's gradient: the ops computed from gh (and x32, r) alone, closed over the backward op set
    inside = set(forward) | {gh[0]}
    known = {x32, r, gh[0], g}
    closure = [gh[0]]
    changed = True
    while changed:
        changed = False
        for node in sorted({u for n in closure + [x32, r] for u in n.users}, key=order.__getitem__):
            if node in inside or node in closure or node.target not in _BACKWARD_OPS:
                continue
            if node.meta.get(META_PHASE) is not Phase.BACKWARD:
                continue
            if all(a in known or a in closure or _is_size(a) for a in node.all_input_nodes):
                closure.append(node)
                changed = True
    ends = sorted((n for n in closure if any(u not in closure for u in n.users)), key=order.__getitem__)
    if not ends or any(_shape(n) != _shape(x32) or n is gh[0] for n in ends):
        return "the input's gradient does not leave the norm whole"
    nodes = closure + [gwp[0], sums[0]] + ([dw] if dw is not sums[0] else [])
    if len(ends) == 1:
        return g, ends[0], None, dw, nodes
    # x itself is normalized (fp32: no cast): its two contributions (through x * rstd and through the mean of
    # squares) are summed by autograd with the gradient x gets elsewhere (the residual), each its own add
    if len(ends) != 2 or len(ends[1].users) != 1:
        return f"the input's gradient leaves the norm as {len(ends)} values"
    add = next(iter(ends[1].users))
    if add.target is not aten.add.Tensor or _other(add, ends[1]) is None or not isinstance(_other(add, ends[1]), fx.Node):
        return "the input's second contribution is not summed with an add"
    return g, ends[0], add, dw, nodes


def _structure(m: _Match) -> tuple:
    index = {m.x: "x", m.w: "w", m.g: "g"}
    index.update({n: i for i, n in enumerate(m.nodes)})
    ops = tuple((str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), lambda a: index.get(a, a.name)))) for n in m.nodes)
    return ops, _shape(m.x), str(_val(m.x).dtype), str(_val(m.w).dtype), str(_val(m.g).dtype), m.eps


def _check(m: _Match) -> str | None:
    """The region's results against the kernels' reference on sample values (the captured shapes)."""
    from ...codegen import norm_kernels as K  # triton: imported when codegen runs, as the other fusions do

    x_val = _val(m.x)
    # on the step's device (a CUDA step's norms in milliseconds); on a CPU device up to a size
    device = x_val.device if x_val.device.type == "cuda" else torch.device("cpu")
    if device.type == "cpu" and x_val.numel() > _SAMPLE_LIMIT:
        return f"not checked: {x_val.numel():,} elements are more than the CPU check evaluates"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_concrete(tuple(x_val.shape)), generator=gen).to(device=device, dtype=x_val.dtype)
    w = (1 + 0.1 * torch.randn(tuple(_val(m.w).shape), generator=gen)).to(device=device, dtype=_val(m.w).dtype)
    g = torch.randn(_concrete(tuple(_val(m.g).shape)), generator=gen).to(device=device, dtype=_val(m.g).dtype)
    env = {m.x: x, m.w: w, m.g: g}

    def value(a: fx.Node):  # a region's input, or a size read (symbolic lengths): its hint
        return env[a] if a in env else _concrete(_val(a))

    with torch.no_grad():
        for node in m.nodes:
            args = _concrete(fx.node.map_arg(node.args, value))
            kwargs = _concrete(fx.node.map_arg(node.kwargs, value))
            kwargs = {k: (device if k == "device" else v) for k, v in kwargs.items()}
            env[node] = node.target(*args, **kwargs)
    n = x_val.shape[-1]
    y, rstd = K._rms_norm_forward_reference(x, [n], w, m.eps)
    dx, dw = K._rms_norm_backward_reference(g, x, [n], rstd, w, [True, True],
                                            _val(m.w).dtype if _val(m.w).dtype != x_val.dtype else None)
    tol = 1e-5 if x_val.dtype == torch.float32 else 2e-2
    ours_dx = env[m.dx] + env[m.dx2] if m.dx2 is not None else env[m.dx]
    for name, ours, ref in (("output", env[m.y], y), ("input gradient", ours_dx, dx), ("weight gradient", env[m.dw], dw)):
        ours, ref = ours.float().reshape(ref.shape), ref.float()
        if not torch.isfinite(ours).all() or (ours - ref).norm() > tol * ref.norm().clamp_min(1e-6):
            return f"the {name} differs from the kernels' on sample values"
    return None


def _find(g: fx.Graph) -> tuple[list[_Match], list[tuple[str, str]]]:
    from ...codegen.norm_kernels import unsupported_reason

    order = {n: i for i, n in enumerate(g.nodes)}
    matches, skipped = [], []
    taken: set = set()
    for r in [n for n in g.nodes if n.op == "call_function" and n.target is aten.rsqrt.default]:
        if r.meta.get(META_PHASE) is not Phase.FORWARD:
            continue
        found = _forward(r)
        if isinstance(found, str):
            skipped.append((r.name, found))
            continue
        x, x32, w, eps, y, h, forward, out = found
        back = _backward(x32, r, h, w, y, forward, order)
        if isinstance(back, str):
            skipped.append((r.name, back))
            continue
        grad, dx, summed, dw, backward = back
        nodes = sorted(set(forward) | set(backward), key=order.__getitem__)
        region = set(nodes)
        dx2 = next((n for n in backward if summed is not None and n in summed.all_input_nodes), None)
        outputs = {out, dx, dw} | ({dx2} if dx2 is not None else set())
        leak = next((n for n in nodes if n not in outputs and any(u not in region for u in n.users)), None)
        if leak is not None:
            skipped.append((r.name, f"{leak.name} is read outside the norm"))
            continue
        if region & taken:
            continue
        why = unsupported_reason(_val(x), [_val(x).shape[-1]], _val(w))
        if why is not None:
            skipped.append((r.name, why))
            continue
        taken |= region
        matches.append(_Match(x, w, grad, eps, out, dx, dw, nodes, summed, dx2))
    return matches, skipped


def fuse_rms_norm(graph: StepGraph, options: PassOptions) -> PassResult:
    g0 = graph.gm.graph
    if not any(n.op == "call_function" and n.target is aten.rsqrt.default for n in g0.nodes):
        return PassResult(graph, False)
    matches, skipped = _find(g0)
    checked: dict = {}
    kept = []
    for m in matches:
        key = _structure(m)
        if key not in checked:
            checked[key] = _check(m)
        if checked[key] is not None:
            skipped.append((m.y.name, checked[key]))
        else:
            kept.append(m)
    report = list(graph.signature.extra.get(FUSION_REPORT_KEY, ()))
    report += [("fuse_rms_norm", name, why) for name, why in skipped]
    if not kept:
        if skipped:
            graph = graph.replace(signature=dataclasses.replace(graph.signature, extra={**graph.signature.extra,
                                                                                          FUSION_REPORT_KEY: report}))
        return PassResult(graph, bool(skipped), f"no RMSNorm matched ({len(skipped)} rsqrt(s) left: {skipped[0][1]})"
                          if skipped else "")
    from ...codegen import graph_ops

    graph, copy_of = clone_step_graph_mapped(graph)
    g = graph.gm.graph
    for m in kept:
        x, w, grad, y, dx, dw = (copy_of[n] for n in (m.x, m.w, m.g, m.y, m.dx, m.dw))
        n = _val(x).shape[-1]
        x_val = _val(x)
        with x_val.fake_mode:  # the per-row statistic, its rows symbolic where the input's are
            stat = torch.empty(tuple(x_val.shape[:-1]) + (1,), dtype=torch.float32, device=x_val.device)
        with g.inserting_before(y):
            norm = make_node(g, graph_ops.rms_norm, (x, [n], w, m.eps), val=(_val(y), stat), like=y, name="rms_norm")
            out = make_node(g, operator.getitem, (norm, 0), val=_val(y), like=y, name="rms_out")
            rstd = make_node(g, operator.getitem, (norm, 1), val=stat, like=y, name="rms_rstd")
        y.replace_all_uses_with(out)
        pos = {n: i for i, n in enumerate(g.nodes)}
        first = min((u for v in (dx, dw) for u in v.users), key=pos.__getitem__)
        with g.inserting_before(first):
            if not _dense(_val(grad)):  # the kernel reads rows densely: a transposed gradient (Qwen3's q/k norms
                # over the head dim, their gradient coming back through the attention's transpose) is copied
                with _val(grad).fake_mode:
                    val = _val(grad).clone(memory_format=torch.contiguous_format)
                grad = make_node(g, aten.clone.default, (grad,), {"memory_format": torch.contiguous_format}, val=val,
                                 like=dx, name="rms_grad_dense")
            wdtype = _val(w).dtype if _val(w).dtype != x_val.dtype else None  # Gemma's fp32 (1 + weight)
            back = make_node(g, graph_ops.rms_norm_backward, (grad, x, [n], rstd, w, [True, True], wdtype),
                             val=(_val(dx), _val(dw)), like=dx, name="rms_norm_backward")
            new_dx = make_node(g, operator.getitem, (back, 0), val=_val(dx), like=dx, name="rms_dx")
            new_dw = make_node(g, operator.getitem, (back, 1), val=_val(dw), like=dx, name="rms_dw")
        dx.replace_all_uses_with(new_dx)
        dw.replace_all_uses_with(new_dw)
        if m.summed is not None:  # dx holds both contributions: the add of the second one goes
            summed = copy_of[m.summed]
            summed.replace_all_uses_with(_other(summed, copy_of[m.dx2]))
            g.erase_node(summed)
        for node in reversed([copy_of[n] for n in m.nodes]):
            if not node.users:
                g.erase_node(node)
    graph.gm.recompile()
    graph = graph.replace(signature=dataclasses.replace(graph.signature, extra={**graph.signature.extra,
                                                                              FUSION_REPORT_KEY: report}))
    return PassResult(graph, True, f"{len(kept)} RMSNorm(s) forward and backward on stepfx's kernels "
                                   f"({len(checked)} structure(s) checked on sample values)"
                                   + (f"; {len(skipped)} left: {skipped[0][1]}" if skipped else ""))

