"""torch's RMSprop, Adagrad, Adamax and Adadelta: captured as SGD and Adam
are (the single-tensor reference update, traced), sharded by ZeRO as any
elementwise state, and equal to the reference bitwise: alone and on two
ranks at ZeRO stages 1-3 (each optimizer with every option that adds state
or math: RMSprop centered with momentum, Adagrad's lr decay, weight decay).
They have no fused kernel and no host update: offloading their update is
refused naming the key."""
from __future__ import annotations

import pytest
import torch

import stepfx
import tests.dp_workers as W
from stepfx.config import ConfigError
from stepfx.testing.equivalence import assert_data_parallel_equivalent
from tests.steps import ce_step, square_step


def rmsprop(model):
    return torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.9, centered=True, weight_decay=0.01)


def adagrad(model):
    return torch.optim.Adagrad(model.parameters(), lr=0.1, lr_decay=0.01, weight_decay=0.01)


def adamax(model):
    return torch.optim.Adamax(model.parameters(), lr=0.01, weight_decay=0.01)


def adadelta(model):
    return torch.optim.Adadelta(model.parameters(), lr=1.0, weight_decay=0.01)


OPTIMIZERS = [rmsprop, adagrad, adamax, adadelta]


@pytest.mark.parametrize("make_opt", OPTIMIZERS, ids=[f.__name__ for f in OPTIMIZERS])
def test_one_process_is_eager_bitwise(make_opt):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(3, 4, generator=g) for _ in range(4)]
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        optimizer = make_opt(model)
        step = stepfx.parallelize({"gradient_clipping": 0})(square_step) if compiled else square_step
        runs.append(([step(model, optimizer, x).item() for x in batches], [p.detach().clone() for p in model.parameters()],
                     {k: v.clone() for s in optimizer.state.values() for k, v in s.items()}))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert runs[0][2].keys() == runs[1][2].keys()


@pytest.mark.slow
@pytest.mark.parametrize("make_opt, stage", [(rmsprop, 3), (adagrad, 2), (adamax, 3), (adadelta, 1)],
                         ids=["rmsprop-3", "adagrad-2", "adamax-3", "adadelta-1"])
def test_zero_on_two_ranks_is_the_reference_bitwise(rank_pool, make_opt, stage):
    zero = {"stage": stage, "reduce_bucket_size": 7, "stage3_param_persistence_threshold": 0}
    report = assert_data_parallel_equivalent(rank_pool(2), ce_step, W.MLPFactory((3, 5, 4, 3), []), make_opt,
                                             W.mlp_rank_batches(2, 3, 3, 3, 1),
                                             config={"zero_optimization": zero, "gradient_clipping": 0}, exact=True)
    assert report.bitwise and report.steps == 3


def test_offloading_their_update_is_refused_naming_the_key():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    config = {"gradient_clipping": 0, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match=r"offload_optimizer.*implements Adam and AdamW.*RMSprop"):
        stepfx.parallelize(config)(square_step)(model, rmsprop(model), torch.randn(3, 4))


@pytest.mark.parametrize("stage", [1, 3])
def test_a_frozen_parameters_state_made_at_construction_is_kept(stage):
    """Adagrad makes its state for every parameter when built, a frozen one's
    too: ZeRO 1-3 moved it to the rank, which no step reads, and dropped it
    (found by the ZeRO property test). It stays in the user's optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    model[2].weight.requires_grad_(False)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.5)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    step = stepfx.parallelize({"gradient_clipping": 0, "zero_optimization": zero})(square_step)
    for _ in range(2):
        step(model, optimizer, torch.randn(4, 3))
    kept = optimizer.state[model[2].weight]
    assert float(kept["step"]) == 0 and torch.equal(kept["sum"], torch.full((2, 7), 0.5))
    assert set(step.optimizer_state()) == {"0.weight", "0.bias", "2.weight", "2.bias"}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_a_frozen_parameters_counter_neither_decides_nor_stands_for_the_shared_one(rank_pool, stage):
    """The frozen parameter's Adagrad counter stays at 0 while the others
    count steps. It counted among those that must agree for one shared read:
    after the first step the rank that also held a trained counter saw them
    differ and captured the step again, the other did not, and the two hung
    in different collectives (found by the ZeRO property test). lr_decay
    makes the shared count part of the arithmetic."""
    zero = {"stage": stage, "reduce_bucket_size": 1, "stage3_param_persistence_threshold": 0}
    report = assert_data_parallel_equivalent(rank_pool(2), ce_step, W.MLPFactory((5, 12, 5), [1]), adagrad,
                                             W.mlp_rank_batches(2, 3, 5, 5, 50),
                                             config={"zero_optimization": zero, "gradient_clipping": 0}, exact=True)
    assert report.bitwise and report.steps == 3
