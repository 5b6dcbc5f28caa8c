"""stepfx.planning.predict: the per-rank memory and communication of a step,
predicted on the meta device, equal what the running step's graph says on
every rank; and ``stepfx plan`` prints it."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import stepfx
from stepfx.cli import main
from stepfx.graph.accounting import communication, estimate_memory
from stepfx.planning import next_token_step, predict
from tests.steps import tiny_gpt, token_batches

CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 4000},
          "bf16": {"enabled": True}, "gradient_clipping": 1.0}


def _measured(config):
    """On each rank: what the running step's final graph costs."""
    torch.manual_seed(0)
    model = tiny_gpt()
    step = stepfx.parallelize(config)(next_token_step)
    (batch,) = token_batches(1, batch=2)[0]
    step(model, torch.optim.AdamW(model.parameters()), batch)
    mem = estimate_memory(step.plan.graph)
    comms = [(c.op, c.payload_bytes) for c in communication(step.plan.graph, dist.get_world_size())]
    return dict(mem.at_rest), mem.peak, comms


def test_prediction_equals_the_running_step_on_every_rank(rank_pool):
    measured = rank_pool(2).run(_measured, CONFIG)
    batch = torch.empty(2, 9, dtype=torch.long, device="meta")
    for rank, (at_rest, peak, comms) in enumerate(measured):
        p = predict(next_token_step, CONFIG, tiny_gpt, batch, world_size=2, rank=rank, device="cpu")
        assert dict(p.memory.at_rest) == at_rest and p.memory.peak == peak
        assert [(c.op, c.payload_bytes) for c in p.collectives] == comms
        assert any(op == "all_gather" for op, _ in comms) and any(op == "reduce_scatter" for op, _ in comms)


def test_stepfx_plan_on_the_command_line(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(CONFIG))
    assert main(["plan", "tests.steps:tiny_gpt", str(cfg), "--world-size", "4", "--batch", "2x9", "--device", "cpu",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 4 and out["parameters"] == sum(p.numel() for p in tiny_gpt().parameters())
    whole = 4 * out["parameters"]
    assert out["at_rest_bytes"]["param"] <= whole / 4 + 64 * 4 * 20  # a quarter, plus each bucket's alignment padding
    assert main(["plan", "tests.steps:nope", str(cfg), "--world-size", "4", "--batch", "2x9"]) == 2
    assert main(["plan", "tests.steps:tiny_gpt", str(cfg), "--world-size", "4", "--batch", "2y9"]) == 2


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="rank 4"):
        predict(next_token_step, CONFIG, tiny_gpt, torch.empty(2, 9, dtype=torch.long, device="meta"), world_size=4, rank=4)
