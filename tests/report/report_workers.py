"""Rank functions for the report tests (module level: rank processes import them)."""
from __future__ import annotations

import torch

import stepfx
from tests.steps import lm_step, tiny_gpt, token_batches


def zero3_gpt_report(path: str) -> str | None:
    """The demo's set-up in small: a GPT under ZeRO-3 on the pool's ranks, two steps (the second
    measured by step.profile), then the page of every rank written collectively by rank 0."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                               "gradient_clipping": 1.0})(lm_step)
    rank = dist.get_rank()
    batches = [b[rank * 2:(rank + 1) * 2] for (b,) in token_batches(2, batch=4, seed=11)]
    step(model, opt, batches[0])
    step.profile(steps=1)
    step(model, opt, batches[1])
    return step.report(path, all_ranks=True)


def bisect_data_parallel(stage: int, perturb_after: str | None, fraction: float, clip: float) -> dict:
    """bisect_divergence on this rank's batch of a ZeRO ``stage`` plan, every rank calling it; with
    ``perturb_after``, a test-only pass that perturbs one forward node runs right after that pass."""
    import torch.distributed as dist

    import stepfx.api
    from stepfx.passes import PIPELINE, PipelineEntry
    from stepfx.testing import bisect_divergence
    from tests.report.test_bisect import perturb_one_node
    from tests.steps import ce_step, mlp_batches, small_mlp

    pipeline, chosen = list(PIPELINE), {}
    if perturb_after is not None:
        fn, chosen = perturb_one_node(fraction)
        at = next(i for i, e in enumerate(pipeline) if e.name == perturb_after) + 1
        pipeline.insert(at, PipelineEntry("perturb_one_node", fn, "test: a wrong rewrite"))
    saved, stepfx.api.PIPELINE = stepfx.api.PIPELINE, tuple(pipeline)
    try:
        x, y = mlp_batches(dist.get_world_size(), seed=21)[dist.get_rank()]
        found = bisect_divergence(ce_step, small_mlp, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), (x, y),
                                  config={"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                                          "gradient_clipping": clip})
    finally:
        stepfx.api.PIPELINE = saved
    return {"pass": found.pass_name, "node": found.node, "op": found.op, "rank": found.rank, "text": str(found),
            "chosen": dict(chosen), "per_pass": found.per_pass}
