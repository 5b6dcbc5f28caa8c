"""Functions that run on each rank of the test pool for the tensor-parallel
tests (module level, so the rank processes can import them)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import stepfx
from stepfx.graph.tp_layout import TP_PLAN_KEY
from stepfx.passes.data_parallel.collectives import COLLECTIVE_OPS
from stepfx.testing.equivalence import _rank_seed


def tp_run(step_fn, make_model, make_optimizer, batches_per_dp, config) -> dict:
    """Train with ``config`` on this rank; the ranks of a tensor-parallel
    group read the batches of their data-parallel rank. Returns the losses,
    the whole model state and optimizer state after the last step, the
    placements and the collectives of the final graph by phase."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = config["tensor_parallel"]["autotp_size"]
    torch.manual_seed(0)
    model = make_model()
    opt = make_optimizer(model)
    step = stepfx.parallelize(config)(step_fn)
    losses = []
    for i, batch in enumerate(batches_per_dp[rank // tp]):
        # the reference's seed per step and data-parallel rank: a TP group draws alike (replicated dropout)
        torch.manual_seed(_rank_seed(0, i, rank // tp, world // tp))
        losses.append(step(model, opt, *batch).item())
    graph = step.plan.graph
    counts: dict[str, int] = {}
    sequence: dict[str, int] = {}  # sequence parallelism's reduce-scatters and all-gathers over the TP group
    c10d = torch.ops._c10d_functional
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and node.target is c10d.all_reduce.default:
            group = "vocab" if node.name.startswith("tp_vocab") else "tp" if node.name.startswith("tp_") else "dp"
            key = f"{group} {node.meta['phase']}"
            counts[key] = counts.get(key, 0) + 1
        elif node.op == "call_function" and node.name.startswith(("tp_reduce_scatter", "tp_all_gather")):
            kind = "reduce_scatter" if node.target is c10d.reduce_scatter_tensor.default else "all_gather"
            key = f"{kind} {node.meta['phase']}"
            sequence[key] = sequence.get(key, 0) + 1
    # each kind of collective in the final graph: (op, "tp" or "dp" group, phase, the dtype it moves)
    collectives = sorted({(node.target.__name__.split(".")[0], "tp" if node.name.startswith("tp_") else "dp",
                           str(node.meta["phase"]), str(node.args[0].meta["val"].dtype))
                          for node in graph.gm.graph.nodes if node.op == "call_function" and node.target in COLLECTIVE_OPS})
    plan = graph.signature.extra.get(TP_PLAN_KEY)
    stale = any(p.numel() == 0 for p in model.parameters())
    state = {k: v.clone() for k, v in step.model_state_dict().items()}
    opt_state = step.optimizer_state()
    step.sync_model()
    synced = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state, "optimizer": opt_state, "counts": counts, "world": world,
            "placements": plan.describe() if plan else [], "notes": list(plan.notes) if plan else [],
            "module_emptied": stale, "synced": synced, "captures": len({id(p) for p in step.plans}),
            "explain": step.explain(), "skipped": step.skipped_steps, "loss_scale": step.loss_scale,
            "collectives": collectives, "sequence": sequence,
            "shapes": {n.name: tuple(d if isinstance(d, int) else str(d) for d in n.meta["val"].shape)
                       for n in graph.gm.graph.nodes
                       if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)}}
