"""wall_clock_breakdown: the executor runs a marked copy of the program and
reports seconds per phase (forward, backward, optimizer, communication) to
the monitor, which writes DeepSpeed's elapsed_time_ms_* scalars."""
from __future__ import annotations

import csv
import time

import torch

import stepfx
from tests.steps import adamw, lm_step, tiny_gpt, token_batches


def _rows(path):
    with open(path) as f:
        return list(csv.reader(f))


def test_phase_seconds_reach_the_csv_monitor_and_add_up_to_the_step(tmp_path):
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = adamw(model)
    config = {"gradient_clipping": 1.0, "wall_clock_breakdown": True,
              "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}}
    step = stepfx.parallelize(config)(lm_step)
    batches = token_batches(3)
    step(model, opt, *batches[0])
    timer = step.plan.executor.timer
    # segments in program order (the optimizer's host scalars are read first), closed by the output's mark
    assert timer is not None and timer.kinds[-1] == "end"
    assert timer.kinds.index("forward") < timer.kinds.index("backward") < len(timer.kinds) - 2
    assert timer.kinds[-2] == "optimizer"
    start = time.perf_counter()
    step(model, opt, *batches[1])
    wall = time.perf_counter() - start
    seconds = step.plan.executor.phase_seconds
    assert set(seconds) == {"forward", "backward", "optimizer"} and all(s > 0 for s in seconds.values())
    assert sum(seconds.values()) <= wall
    step(model, opt, *batches[2])
    step._monitor.close()
    for name in ("forward", "backward", "step"):
        rows = _rows(tmp_path / "run" / f"Train_Samples_elapsed_time_ms_{name}.csv")
        assert rows[0][0] == "step" and len(rows) == 4 and all(float(r[1]) > 0 for r in rows[1:]), rows
    # the plan explain() shows is the unmarked program
    assert not any(n.op == "call_function" and getattr(n.target, "__name__", "") == "mark"
                   for n in step.plan.graph.gm.graph.nodes)


def test_without_the_option_the_program_runs_unmarked():
    torch.manual_seed(0)
    model = tiny_gpt()
    step = stepfx.parallelize({"gradient_clipping": 0})(lm_step)
    step(model, adamw(model), *token_batches(1)[0])
    assert step.plan.executor.timer is None and step.plan.executor.phase_seconds is None


def test_collectives_and_their_waits_are_communication():
    import torch.fx as fx

    from stepfx.runtime.phase_timer import PhaseTimer

    c10d = torch.ops._c10d_functional
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.sin.default, (x,))
    y.meta["phase"] = "backward"
    r = g.call_function(c10d.all_reduce.default, (y, "sum", "0"))
    w = g.call_function(c10d.wait_tensor.default, (r,))
    z = g.call_function(torch.ops.aten.cos.default, (w,))
    z.meta["phase"] = "optimizer"
    for n in (r, w):
        n.meta["phase"] = "backward"
    g.output((z,))
    timer = PhaseTimer(fx.GraphModule(torch.nn.Module(), g), "cpu")
    assert timer.kinds == ["backward", "communication", "optimizer", "end"]
