"""choose_attention_kernels: cuDNN attention with symbolic lengths runs as
flash attention (forward and backward; the default) or, with
``attention_pad_multiple``, on cuDNN over the length padded to a bucket
(causal self-attention);
static lengths and calls neither can take stay on cuDNN. The graphs are
traced over fake CUDA tensors (no GPU needed); the numerics are tests/gpu's."""
from __future__ import annotations

import operator

import pytest
import torch

from stepfx import compat
from stepfx.config import load_config
from stepfx.graph import StepGraph
from stepfx.graph.signature import Role, Slot, StepSignature
from stepfx.passes import PassOptions
from stepfx.passes.cleanup.choose_attention_kernels import (
    FLASH_CHECK_KEY,
    choose_attention_kernels,
    pad_multiple,
)
from stepfx.passes.cleanup.unrepeat_kv_heads import GQA_OPS_KEY

aten = torch.ops.aten
CUDNN, CUDNN_BWD = aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_cudnn_attention_backward.default
FLASH, FLASH_BWD = aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default


def _attention_graph(symbolic=True, kv_heads=4, bias=False, lse_read=False, causal=True, length=24,
                     bshd=False) -> StepGraph:
    """q/k/v/dy -> cuDNN forward and backward, as a captured step holds them
    (getitems of the forward feed the backward; the output and gradients are outputs)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = compat.make_fake_mode()
    shapes = {"q": (2, 4, length, 16), "k": (2, kv_heads, length, 16), "v": (2, kv_heads, length, 16),
              "dy": (2, 4, length, 16)}
    if bshd:  # the inputs laid out [batch, length, heads, head_dim], seen through a transpose (as a model's q/k/v)
        shapes = {n: (b, t, h, d) for n, (b, h, t, d) in shapes.items()}
    fakes = []
    for name, shape in shapes.items():
        real = torch.empty(shape, dtype=torch.bfloat16)
        dim = 1 if bshd else 2
        fake = compat.fake_with_symbolic_dims(mode, real, (dim,), name) if symbolic else mode.from_tensor(real)
        with mode:
            fakes.append(torch.empty(fake.shape, dtype=fake.dtype, device="cuda"))  # fake CUDA: no GPU needed

    def step(q, k, v, dy):
        if bshd:
            q, k, v, dy = (x.transpose(1, 2) for x in (q, k, v, dy))
        mask = torch.zeros(q.shape[2], k.shape[2], device=q.device, dtype=q.dtype) if bias else None
        causal_ = causal and not bias
        o, lse, cq, ck, mq, mk, seed, offset, _ = CUDNN(q, k, v, mask, True, 0.0, causal_, False, scale=0.25)
        dq, dk, dv = CUDNN_BWD(dy, q, k, v, o, lse, seed, offset, mask, cq, ck, mq, mk, 0.0, causal_, scale=0.25)
        return (o, dq, dk, dv, lse.sum()) if lse_read else (o, dq, dk, dv)

    with mode:
        gm = make_fx(step, tracing_mode="fake")(*fakes)
    names = iter(shapes)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta["slot"] = Slot(Role.BATCH, next(names))
        elif n.op == "call_function":
            n.meta["phase"] = "backward" if n.target is CUDNN_BWD else "forward"
    outs = tuple(Slot(Role.USER_OUTPUT, f"out{i}") for i in range(5 if lse_read else 4))
    return StepGraph(gm, StepSignature(inputs=tuple(Slot(Role.BATCH, n) for n in shapes), outputs=outs), functional=True)


def _opts(takes=lambda *a: True, grouped=(), pad=0):
    """pad: ``stepfx.attention_pad_multiple`` (0: flash attention where it takes the call)."""
    return PassOptions(config=load_config({"stepfx": {"attention_pad_multiple": pad}}), world_size=1, rank=0,
                       device_type="cuda", extra={FLASH_CHECK_KEY: takes, GQA_OPS_KEY: frozenset(grouped)})


def _targets(graph: StepGraph) -> list:
    return [n.target for n in graph.gm.graph.nodes if n.target in (CUDNN, CUDNN_BWD, FLASH, FLASH_BWD)]


def test_symbolic_lengths_run_flash_attention_forward_and_backward():
    calls = []
    graph = _attention_graph()
    result = choose_attention_kernels(graph, _opts(lambda *a: calls.append(a) or True))
    assert result.changed and "1 attention call(s) with symbolic lengths run flash attention" in result.summary
    assert _targets(result.graph) == [FLASH, FLASH_BWD]
    assert calls == [(torch.bfloat16, 16, 4, 4, True)]
    fwd, bwd = (n for n in result.graph.gm.graph.nodes if n.target in (FLASH, FLASH_BWD))
    assert fwd.args[:4] == (*(bwd.args[1:4]), 0.0) and fwd.args[4] is True and fwd.kwargs == {"scale": 0.25}
    # the backward reads flash's own output, log-sum-exp and random state, causal and scaled as the forward
    items = {u.args[1]: u for u in fwd.users}
    assert bwd.args[4] is items[0] and bwd.args[5] is items[1] and bwd.args[12:14] == (items[6], items[7])
    assert bwd.args[11] is True and bwd.kwargs == {"scale": 0.25}
    lse = items[1].meta["val"]
    assert lse.dim() == 3 and lse.dtype == torch.float32 and compat.is_symbolic(lse.shape[2])  # flash's [B, H, S]
    # the gradients and output keep their shapes (symbolic length included) and phases
    out = result.graph.gm.graph.output_node().args[0]
    before = graph.gm.graph.output_node().args[0]
    for a, b in zip(out, before):
        assert tuple(map(compat.size_expr, a.meta["val"].shape)) == tuple(map(compat.size_expr, b.meta["val"].shape))
    assert fwd.meta["phase"] == "forward" and bwd.meta["phase"] == "backward"
    # and it can be executed over fake tensors to the same shapes (the graph is well formed)
    result.graph.gm.graph.lint()


@pytest.mark.parametrize("case", ["static", "bias", "lse_read", "flash_cannot", "grouped_without_flash_gqa"])
def test_calls_flash_cannot_replace_stay_on_cudnn(case):
    graph = _attention_graph(symbolic=case != "static", bias=case == "bias", lse_read=case == "lse_read",
                             kv_heads=2 if case.startswith("grouped") else 4)
    result = choose_attention_kernels(graph, _opts(takes=lambda *a: case != "flash_cannot", pad="auto"))
    if case in ("flash_cannot", "grouped_without_flash_gqa"):  # causal self-attention: padded on cuDNN instead
        assert result.changed and _targets(result.graph) == [CUDNN, CUDNN_BWD]
        result = choose_attention_kernels(graph, _opts(takes=lambda *a: case != "flash_cannot"))
    assert not result.changed and _targets(result.graph) == [CUDNN, CUDNN_BWD]
    if case != "static":
        assert "1 kept on cuDNN" in result.summary


def test_grouped_heads_where_flash_takes_them():
    graph = _attention_graph(kv_heads=2)
    result = choose_attention_kernels(graph, _opts(grouped=(FLASH, FLASH_BWD)))
    assert result.changed and _targets(result.graph) == [FLASH, FLASH_BWD]
    grads = [n for n in result.graph.gm.graph.nodes if n.op == "call_function" and n.target is operator.getitem
             and n.args[0].target is FLASH_BWD]
    assert sorted(g.meta["val"].shape[1] for g in grads) == [2, 2, 4]  # dk, dv grouped; dq per query head


def test_without_a_flash_check_nothing_changes():
    graph = _attention_graph()
    result = choose_attention_kernels(graph, PassOptions(world_size=1, rank=0, device_type="cuda"))
    assert not result.changed and result.graph is graph


def _shapes(graph: StepGraph, target) -> list:
    return [tuple(map(compat.size_expr, n.meta["val"][0].shape)) for n in graph.gm.graph.nodes if n.target is target]


@pytest.mark.parametrize("kv_heads,bshd", [(4, False), (2, False), (4, True)])
def test_causal_symbolic_attention_runs_cudnn_on_a_padded_length(kv_heads, bshd):
    """Causal self-attention with a symbolic length stays on cuDNN, on q/k/v (and the output gradient) padded
    with zeros up to a multiple; the output and the three gradients are cut back to the length, so every value
    the rest of the step reads keeps its shape and its strides (a later view may merge the batch with the
    length); the backward reads the padded forward's own output and statistics. Grouped K/V heads stay
    grouped (cuDNN took them before)."""
    graph = _attention_graph(kv_heads=kv_heads, bshd=bshd)
    before = graph.gm.graph.output_node().args[0]
    result = choose_attention_kernels(graph, _opts(pad=32))
    assert result.changed and "padded to a multiple of 32" in result.summary
    assert _targets(result.graph) == [CUDNN, CUDNN_BWD]
    g = result.graph.gm.graph
    fwd, bwd = (n for n in g.nodes if n.target in (CUDNN, CUDNN_BWD))
    length = compat.size_expr(before[0].meta["val"].shape[2])
    padded = compat.size_expr(fwd.meta["val"][0].shape[2])
    assert padded != length and {int(padded.subs(length, t)) for t in (1, 31, 32)} == {32}
    assert int(padded.subs(length, 33)) == 64
    cats = [n for n in g.nodes if n.target is torch.ops.aten.cat.default]
    inputs = ["call_function" if bshd else "placeholder"] * 4
    assert [c.args[0][0].op for c in cats] == inputs  # q, k, v, then the output gradient
    assert all(compat.size_expr(c.meta["val"].shape[2]) == padded for c in cats)
    items = {u.args[1]: u for u in fwd.users}
    assert bwd.args[0] is cats[3] and bwd.args[1:4] == tuple(cats[:3]) and bwd.args[4] is items[0]
    assert bwd.args[5] is items[1] and compat.size_expr(bwd.args[11].meta["val"]) == padded
    # the outputs (attention output, dq, dk, dv) are cut back: the same shapes and strides as before
    after = g.output_node().args[0]
    expr = lambda sizes: tuple(map(compat.size_expr, sizes))  # noqa: E731
    for a, b in zip(after, before):
        assert a.args[0].target is torch.ops.aten.clone.default
        assert a.args[0].args[0].args[0].target is torch.ops.aten.narrow.default
        assert expr(a.meta["val"].shape) == expr(b.meta["val"].shape)
        assert expr(a.meta["val"].stride()) == expr(b.meta["val"].stride())
    if bshd:  # the layout is the inputs' (length outside heads), as cuDNN allocates it
        assert compat.size_hint(before[1].meta["val"].stride(2)) == 4 * 16
    assert fwd.meta["phase"] == "forward" and bwd.meta["phase"] == "backward"
    assert cats[0].meta["phase"] == "forward" and cats[3].meta["phase"] == "backward"
    g.lint()


@pytest.mark.parametrize("case", ["not_causal", "static", "bias", "lse_read"])
def test_padding_only_where_it_is_exact(case):
    """Padding keys is exact only under a causal mask (a non-causal query would read the zero keys) and only
    where cuDNN's statistics are read by its own backward: other calls are not padded (non-causal goes to
    flash attention where flash takes it, the others stay as they were)."""
    graph = _attention_graph(symbolic=case != "static", bias=case == "bias", lse_read=case == "lse_read",
                             causal=case != "not_causal")
    result = choose_attention_kernels(graph, _opts(pad="auto"))
    assert not any(n.target is torch.ops.aten.cat.default for n in result.graph.gm.graph.nodes)
    assert _targets(result.graph) == ([FLASH, FLASH_BWD] if case == "not_causal" else [CUDNN, CUDNN_BWD])


def test_auto_pad_multiple_from_the_traced_length():
    """"auto": the next power of two at or above an eighth of the traced length, within [64, 512]."""
    graph = _attention_graph(length=1581)
    q = next(n for n in graph.gm.graph.nodes if n.op == "placeholder")
    assert pad_multiple(q.meta["val"].shape[2], "auto") == 256
    assert [pad_multiple(t, "auto") for t in (9, 512, 513, 1024, 2048, 2049, 8192)] == [64, 64, 128, 128, 256, 512, 512]
    assert pad_multiple(q.meta["val"].shape[2], 96) == 96
    result = choose_attention_kernels(graph, _opts(pad="auto"))
    assert "multiple of 256" in result.summary


def test_flash_attention_by_default():
    """Without ``attention_pad_multiple`` (the default 0) symbolic causal attention runs flash attention:
    measured faster than padded cuDNN on the H200 (the pass's docstring)."""
    options = PassOptions(config=load_config({}), world_size=1, rank=0, device_type="cuda",
                          extra={FLASH_CHECK_KEY: lambda *a: True, GQA_OPS_KEY: frozenset()})
    result = choose_attention_kernels(_attention_graph(), options)
    assert _targets(result.graph) == [FLASH, FLASH_BWD]
