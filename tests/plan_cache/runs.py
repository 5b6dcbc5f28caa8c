"""One run of a one-block GPT step in a fresh process, for
tests/plan_cache/test_plan_cache.py: ``python -m tests.plan_cache.runs CACHE_DIR MODE``
with MODE "cold" (progress lines on) or "warm" (capture and the passes
refuse to run, progress off). Prints one JSON line: the losses and final
parameters exactly (float.hex), and the plan's cache note."""
from __future__ import annotations

import json
import sys


def main() -> None:
    cache_dir, mode = sys.argv[1], sys.argv[2]
    import torch

    import stepfx
    import stepfx.api
    import stepfx.plan_cache.key
    from tests.steps import lm_step, one_block_gpt, token_batches

    # a developer's tree may be edited between the two processes, which changes stepfx's source
    # digest (a miss: right, but not what this run is about; test_plan_cache checks that it misses)
    stepfx.plan_cache.key._stepfx_source_digest = lambda: "the tree of this test"
    if mode == "warm":  # a warm start must neither capture nor run passes
        def refuse(*args, **kwargs):
            raise AssertionError("a warm start captured or ran passes")

        stepfx.api.capture_step = refuse
        stepfx.api.PassManager.run = refuse
    torch.manual_seed(0)
    model = one_block_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"gradient_clipping": 1.0, "stepfx": {"cache_dir": cache_dir, "progress": mode == "cold"}}
    step = stepfx.parallelize(config)(lm_step)
    losses = [float(step(model, optimizer, batch)).hex() for (batch,) in token_batches(3)]
    params = {n: [float(v).hex() for v in p.detach().flatten().tolist()] for n, p in model.named_parameters()}
    print(json.dumps({"losses": losses, "params": params, "from_cache": step.plan.from_cache,
                      "note": step.plan.cache_note}))


if __name__ == "__main__":
    main()


def zero_cold_then_warm(cache_dir: str) -> dict:
    """On each rank of a pool: a ZeRO-3 step run twice by two step objects
    on equal fresh models, the second with capture refused (it must load
    this rank's plan from ``cache_dir``). Whether the warm run loaded and
    matched the cold one bitwise (losses and whole parameters)."""
    import os

    import torch
    import torch.distributed as dist

    import stepfx
    import stepfx.api
    from tests.steps import lm_step, one_block_gpt, token_batches

    def refuse(*args, **kwargs):
        raise AssertionError("a warm start captured")

    moved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    real = stepfx.api.capture_step
    runs = []
    try:
        for warm in (False, True):
            stepfx.api.capture_step = refuse if warm else real
            torch.manual_seed(0)
            model = one_block_gpt()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            config = {"gradient_clipping": 0, "stepfx": {"cache_dir": cache_dir},
                      "zero_optimization": {"stage": 3, "reduce_bucket_size": 500,
                                            "stage3_param_persistence_threshold": 0}}
            step = stepfx.parallelize(config)(lm_step)
            losses = [step(model, optimizer, batch) for (batch,) in token_batches(2, seed=dist.get_rank())]
            runs.append((torch.stack(losses), step.model_state_dict(), step.plan.from_cache, step.plan.cache_note))
    finally:
        stepfx.api.capture_step = real
        for key, value in moved.items():  # the pool's processes serve other tests
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    (cold_losses, cold_state, cold_cached, _), (warm_losses, warm_state, warm_cached, note) = runs
    return {"cold_from_cache": cold_cached, "warm_from_cache": warm_cached, "note": note,
            "bitwise": torch.equal(cold_losses, warm_losses) and all(torch.equal(cold_state[k], warm_state[k]) for k in cold_state)}
