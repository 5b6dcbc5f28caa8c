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
