"""A rank may capture the step at a call where the others do not: a Python
value of its own among the arguments (a token count per rank, as Hugging
Face passes ``num_items_in_batch``), its own batch sizes, state of its own.
Every call starts with a flag exchange on a gloo group (who captures); a
rank that captures alone runs on without a pre-flight when its collectives
are ones the ranks agreed on, and otherwise every rank joins one — the ones
that did not capture with the program they hold — and all raise, naming
what differs. Before, the capturing rank started the pre-flight alone and
both ranks waited forever (the ZeRO property test's Adagrad draw in CI)."""
from __future__ import annotations

import pytest
import torch

from stepfx.testing.equivalence import assert_data_parallel_equivalent
from stepfx.testing.errors import RankError
from tests import dp_workers as W
from tests.steps import maybe_update_step, token_sum_step


def _with(batches, extra):
    return [[(*b, e) for b, e in zip(rank, more)] for rank, more in zip(batches, extra)]


@pytest.mark.parametrize("stage", [0, 3])
def test_ranks_capturing_at_different_calls_train_as_the_reference(rank_pool, stage):
    # rank 0 meets a new count at calls 1, 3, 4; rank 1 at calls 1, 2, 4
    batches = _with(W.mlp_rank_batches(2, 4, 4, 3, 7), [[3, 3, 5, 2], [3, 4, 4, 6]])
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    report = assert_data_parallel_equivalent(rank_pool(2), token_sum_step, W.MLPFactory((4, 6, 3)),
                                             W.OptimizerFactory("adamw"), batches,
                                             config={"zero_optimization": zero, "gradient_clipping": 0}, exact=True)
    assert report.bitwise and report.steps == 4


def test_a_rank_alone_with_other_collectives_fails_on_every_rank_naming_both(rank_pool):
    # at call 2 rank 1 skips the update (no gradient all-reduce): its program differs; rank 0 runs its plan
    batches = _with(W.mlp_rank_batches(2, 2, 4, 3, 7), [[True, True], [True, False]])
    with pytest.raises(RankError) as caught:
        assert_data_parallel_equivalent(rank_pool(2), maybe_update_step, W.MLPFactory((4, 6, 3)),
                                        W.OptimizerFactory("sgd_plain"), batches, config={"gradient_clipping": 0})
    failures = caught.value.failures
    assert sorted(f.rank for f in failures) == [0, 1] and all(f.kind == "raised" for f in failures)
    for f in failures:
        assert f.exc_type.endswith("RankMismatchError"), f
        assert "rank 1: captured the step at call 2" in f.message, f.message
        assert "rank 0: runs the step captured at call 1 (no capture at call 2)" in f.message, f.message
