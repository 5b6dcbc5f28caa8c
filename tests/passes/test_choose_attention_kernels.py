"""choose_attention_kernels: cuDNN attention with symbolic lengths runs as
flash attention (forward and backward), static lengths and calls flash
cannot take stay on cuDNN. The graphs are traced over fake CUDA tensors
(no GPU needed); the numerics are tests/gpu's."""
from __future__ import annotations

import operator

import pytest
import torch

from stepfx import compat
from stepfx.graph import StepGraph
from stepfx.graph.signature import Role, Slot, StepSignature
from stepfx.passes import PassOptions
from stepfx.passes.cleanup.choose_attention_kernels import (
    FLASH_CHECK_KEY,
    choose_attention_kernels,
)
from stepfx.passes.cleanup.unrepeat_kv_heads import GQA_OPS_KEY

aten = torch.ops.aten
CUDNN, CUDNN_BWD = aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_cudnn_attention_backward.default
FLASH, FLASH_BWD = aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default


def _attention_graph(symbolic=True, kv_heads=4, bias=False, lse_read=False) -> StepGraph:
    """q/k/v/dy -> cuDNN forward and backward, as a captured step holds them
    (getitems of the forward feed the backward; the output and gradients are outputs)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = compat.make_fake_mode()
    shapes = {"q": (2, 4, 24, 16), "k": (2, kv_heads, 24, 16), "v": (2, kv_heads, 24, 16), "dy": (2, 4, 24, 16)}
    fakes = []
    for name, shape in shapes.items():
        real = torch.empty(shape, dtype=torch.bfloat16)
        fake = compat.fake_with_symbolic_dims(mode, real, (2,) if symbolic else (), name) if symbolic else mode.from_tensor(real)
        with mode:
            fakes.append(torch.empty(fake.shape, dtype=fake.dtype, device="cuda"))  # fake CUDA: no GPU needed

    def step(q, k, v, dy):
        mask = torch.zeros(q.shape[2], k.shape[2], device=q.device, dtype=q.dtype) if bias else None
        o, lse, cq, ck, mq, mk, seed, offset, _ = CUDNN(q, k, v, mask, True, 0.0, not bias, False, scale=0.25)
        dq, dk, dv = CUDNN_BWD(dy, q, k, v, o, lse, seed, offset, mask, cq, ck, mq, mk, 0.0, not bias, scale=0.25)
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


def _opts(takes=lambda *a: True, grouped=()):
    return PassOptions(world_size=1, rank=0, device_type="cuda", extra={FLASH_CHECK_KEY: takes, GQA_OPS_KEY: frozenset(grouped)})


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
