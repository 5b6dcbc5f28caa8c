"""A training script moved to stepfx often keeps the wrappers it had:
DistributedDataParallel (with torch.compile inside). stepfx reduces the
gradients itself, so it steps the model inside; with a batch norm, DDP's
own forward (buffer broadcast, its logging's ``random`` sample) was refused
at capture as "the step draws random numbers on the host" (found
2026-12-06 trying a DDP script as a new user). A model FSDP already
sharded is refused with what to do."""
from __future__ import annotations

import pytest
import torch

from tests import dp_workers as W


@pytest.mark.parametrize("stage", [0, 3])
def test_a_ddp_wrapped_model_trains_as_the_model_itself_under_its_own_names(rank_pool, stage):
    pool = rank_pool(2)
    plain = pool.run(W.wrapped_model_run, "none", stage)
    for wrap in ("ddp", "ddp-compiled"):
        wrapped = pool.run(W.wrapped_model_run, wrap, stage)
        for rank in range(2):
            assert wrapped[rank]["losses"] == plain[rank]["losses"]
            assert list(wrapped[rank]["state"]) == list(plain[rank]["state"])  # no module./_orig_mod. prefix
            for key, value in plain[rank]["state"].items():
                assert torch.equal(wrapped[rank]["state"][key], value), (wrap, key)


def test_a_model_fsdp_sharded_is_refused_naming_what_to_do(rank_pool):
    messages = rank_pool(2).run(W.fsdp_sharded_refusal)
    assert all("FSDP already sharded its parameters" in m and "pass the model before fully_shard" in m
               for m in messages), messages
