"""DeepSpeed's ``activation_checkpointing.cpu_checkpointing``: the values the
backward reads from the forward wait on the host in between
(passes/memory/offload_activations.py). On CPU the host is the device and
the ops are identities, so these tests check the program (stores after the
last forward reader, fetches ahead of the backward's, every backward reader
rewired), the accounting, and that the step is the same bits; on a GPU
tests/gpu/test_offload_cuda.py compares it and its peak."""
from __future__ import annotations

import operator

import pytest
import torch

import stepfx
from stepfx.graph import Phase
from stepfx.graph.accounting import Sizes, estimate_memory, host_traffic, liveness, size_values
from stepfx.graph.ops import allocates_nothing
from stepfx.graph.step_graph import META_PHASE
from stepfx.runtime.host_params import activation_fetch_start, activation_store, host_fetch_wait
from tests.steps import adamw, dp_batches, lm_step, tiny_gpt


def _live_at_the_backward(graph) -> int:
    """The estimate's live bytes right before the first backward op."""
    sizes = Sizes(size_values(graph))
    live = 0
    for n, size, freed in liveness(graph, sizes):
        if n.op == "call_function" and n.meta.get(META_PHASE) is Phase.BACKWARD:
            return live
        live += sizes.value(size) if size is not None else 0
        live -= sum(sizes.value(s) for _, s in freed)
    raise AssertionError("no backward")


def _views_of(x) -> set:
    """The nodes that see ``x``'s storage (views of views included; the accounting's rule, and reshape)."""
    out, stack = set(), [x]
    while stack:
        for u in stack.pop().users:
            if u not in out and u.target is not operator.getitem and u.args and u.args[0] in (x, *out) and (
                    allocates_nothing(u) or u.target is torch.ops.aten.reshape.default):
                out.add(u)
                stack.append(u)
    return out


def _train(config, steps=3):
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = adamw(model)
    step = stepfx.parallelize(config)(lm_step)
    losses = [step(model, opt, batch).item() for (batch,) in dp_batches(1, steps=steps)[0]]
    return step, losses


@pytest.mark.parametrize("stage, bf16, budget", [(2, False, 1.0), (3, True, None)],
                         ids=["zero2-fp32-nothing-recomputed", "zero3-bf16-checkpointed"])
def test_saved_activations_on_the_host_are_the_same_step(stage, bf16, budget):
    # budget 1.0: every activation the backward reads is kept (no recomputation) and goes to the host; None:
    # the block alone means recompute all that can be, and what remains saved goes
    def config(cpu):
        out = {"gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
               "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": cpu}}
        if bf16:
            out["bf16"] = {"enabled": True}
        if budget is not None:
            out["stepfx"] = {"activation_memory_budget": budget}
        return out

    ours, losses = _train(config(True))
    theirs, plain_losses = _train(config(False))
    assert losses == plain_losses
    a, b = ours.model_state_dict(), theirs.model_state_dict()
    assert all(torch.equal(a[n], b[n]) for n in b)
    nodes = list(ours.plan.graph.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    stores = [n for n in nodes if n.target is activation_store]
    assert stores and "kept on the host between the forward" in ours.explain()
    stored = 0
    backward = min(pos[n] for n in nodes if n.op == "call_function" and n.meta.get(META_PHASE) is Phase.BACKWARD)
    for store in stores:
        assert pos[store] < backward  # (a view the recomputed backward takes of x once kept x to it)
        x = store.args[0]
        fetch = next(u for u in store.users if u.target is activation_fetch_start)
        (back,) = [u for u in fetch.users if u.target is host_fetch_wait]
        # the forward reads x and its views, the store follows their last forward reader; the backward reads only
        # the copy (a view of x read by the backward would keep x's memory on the device beside the copy)
        views = _views_of(x)
        readers = {u for v in (x, *views) for u in v.users if u is not store and u not in views}
        assert all(pos[u] < pos[store] and u.meta[META_PHASE] is Phase.FORWARD for u in readers)
        assert back.users and all(u.meta[META_PHASE] is not Phase.FORWARD for u in back.users)
        assert pos[store] < pos[fetch] < pos[back]
        stored += x.meta["val"].numel() * x.meta["val"].element_size()
    traffic = host_traffic(ours.plan.graph)
    assert traffic.to_host == traffic.to_device == stored
    assert estimate_memory(ours.plan.graph).peak <= estimate_memory(theirs.plan.graph).peak
    # between the forward and the backward the device holds the stored values no more
    assert _live_at_the_backward(ours.plan.graph) <= _live_at_the_backward(theirs.plan.graph) - stored
    assert "activation_checkpointing.cpu_checkpointing" not in ours.explain().split("not applied:")[-1]


@pytest.mark.xdist_group("tensor_parallel")
def test_partitioned_over_the_tensor_parallel_group_are_the_same_bits(rank_pool):
    # partition_activations (with cpu_checkpointing): each TP rank keeps its half of the replicated saved values
    # (the residual stream) and the backward all-gathers them; against the same TP run keeping them whole
    from tests.steps import one_block_gpt, sgd_momentum, token_batches
    from tests.tp_workers import tp_run

    batches = [token_batches(2, seed=0)]
    config = {"gradient_clipping": 0, "tensor_parallel": {"autotp_size": 2}}
    parted = rank_pool(2).run(tp_run, lm_step, one_block_gpt, sgd_momentum, batches,
                              {**config, "activation_checkpointing": {"partition_activations": True,
                                                                      "cpu_checkpointing": True}}, timeout=300)
    whole = rank_pool(2).run(tp_run, lm_step, one_block_gpt, sgd_momentum, batches,
                             {**config, "activation_checkpointing": {}}, timeout=300)
    for ours, theirs in zip(parted, whole):
        assert ours["losses"] == theirs["losses"]
        assert all(torch.equal(ours["state"][n], theirs["state"][n]) for n in theirs["state"])
        said = ours["explain"]
        assert "kept as each rank's 1/2 (partition_activations)" in said and "kept on the host" in said
        assert not said.split("saved activations replicated")[0].endswith(" 0 ")
        assert ours["shapes"] != theirs["shapes"]


def test_symbolic_lengths_are_stored_and_fetched_by_one_plan():
    def trained(cpu):
        torch.manual_seed(0)
        model = tiny_gpt()
        opt = adamw(model)
        config = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
                  "stepfx": {"dynamic": True, "activation_memory_budget": 1.0},
                  "activation_checkpointing": {"cpu_checkpointing": cpu}}
        step = stepfx.parallelize(config)(lm_step)
        g = torch.Generator().manual_seed(3)
        return step, [step(model, opt, torch.randint(0, 64, (2, n), generator=g)).item() for n in (9, 13, 7)]

    (ours, losses), (_, plain) = trained(True), trained(False)
    assert losses == plain and len(ours.plans) == 1
    assert "of symbolic size) kept on the host" in ours.explain()
