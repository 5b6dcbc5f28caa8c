"""Property: for generated sequences of batch shapes per rank (each rank its
own batch size and length at every step) x ZeRO stage x precision, stepfx
with stepfx.dynamic "auto" on 2 real ranks equals the averaged-gradient
reference bitwise, capturing at most 3 times per rank (once at the first
call, once when the length changes, once more when the batch size changes
as well) — also with each rank's token count passed as a Python int, which
becomes an input with the first change (capture/number_arguments.py) and
makes the ranks capture at calls of their own."""
from __future__ import annotations

import re

import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from stepfx.testing.equivalence import assert_data_parallel_equivalent
from tests import dp_workers as W
from tests.steps import lm_step, lm_step_bf16_reference, one_block_gpt, token_lm_step, token_lm_step_bf16_reference


def _batches(shapes, seed, counts=False):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, 64, (b, t + 1), generator=g),) + ((b * t,) if counts else ()) for b, t in rank]
            for rank in shapes]


shape = st.tuples(st.integers(2, 3), st.integers(3, 12))  # (batch, length); 1 would be a specialized size


@settings(max_examples=4, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    shapes=st.integers(2, 4).flatmap(lambda n: st.lists(st.lists(shape, min_size=n, max_size=n), min_size=2, max_size=2)),
    stage=st.sampled_from([0, 1, 2, 3]),
    precision=st.sampled_from(["fp32", "bf16"]),
    optimizer=st.sampled_from(["sgd", "adamw"]),
    seed=st.integers(0, 1000),
    counts=st.booleans(),
)
@example(shapes=[[(2, 5), (2, 7), (3, 4)], [(3, 6), (2, 6), (2, 9)]], stage=3, precision="bf16", optimizer="adamw",
         seed=1, counts=True)  # token counts as ints: each rank's changes at calls of its own
def test_rank_varying_shapes_equal_the_reference(rank_pool, shapes, stage, precision, optimizer, seed, counts):
    config = {"gradient_clipping": 0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                                           "stage3_param_persistence_threshold": 0}}
    kwargs = {}
    step = token_lm_step if counts else lm_step
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
        kwargs["reference_fn"] = token_lm_step_bf16_reference if counts else lm_step_bf16_reference
    # one block: the sizes are the batch's, whatever the depth (and a capture costs half)
    report = assert_data_parallel_equivalent(rank_pool(2), step, one_block_gpt, W.OptimizerFactory(optimizer),
                                             _batches(shapes, seed, counts), config=config, exact=True, seed=seed,
                                             **kwargs)
    assert report.bitwise and report.steps == len(shapes[0])
    for text in report.explains:
        assert int(re.search(r"(\d+) captured variant", text).group(1)) <= 3
