"""stepfx.monitor: the log line, the no-sync invariant, and the DeepSpeed monitor writers, with fake values."""
from __future__ import annotations

import csv
import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from stepfx.config import load_config
from stepfx.monitor import MAX_PENDING, Monitor, dense_flops_per_token, loss_of, monitor as monitor_module, tokens_in
from stepfx.monitor import writers as writers_module


class Clock:
    """Each call is one second after the previous one: every update after the first takes 1 s."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class Recorder:
    """A writer that keeps the event batches it is given."""

    def __init__(self):
        self.batches: list[list[tuple]] = []
        self.closed = False

    def write_events(self, events):
        self.batches.append(list(events))

    def close(self):
        self.closed = True

    @property
    def events(self) -> list[tuple]:
        return [e for batch in self.batches for e in batch]


def config(**raw):
    return load_config({"train_batch_size": 8, "gradient_clipping": 0, **raw})


def feed(monitor: Monitor, updates, **overrides):
    for i in updates:
        values = dict(loss=torch.tensor(float(i)), lr=1e-4 * i, tokens=1000, peak_memory_bytes=i * 2**30,
                      loss_scale=torch.tensor(2.0 ** 16), skipped_steps=torch.tensor(i // 3),
                      flops_per_token=6e6)
        values.update(overrides)
        monitor.after_update(i, **values)


def stepfx_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "stepfx" and r.levelno == logging.INFO
            and r.getMessage().startswith("stepfx: step ")]


# -- the log line -------------------------------------------------------------------
def test_logs_one_line_every_steps_per_print_updates(caplog):
    caplog.set_level(logging.INFO, logger="stepfx")
    monitor = Monitor(config(steps_per_print=2, fp16={"enabled": True}), peak_flops=1e10, clock=Clock())
    feed(monitor, range(1, 6))
    assert stepfx_lines(caplog) == [
        # update 1 counts no time (it would include compilation): throughput from update 2 alone
        "stepfx: step 2 | loss 1.5000 | lr 2.000e-04 | 1,000 tokens/s | 8.0 samples/s | MFU 60.0% | "
        "peak memory 2.00 GiB | loss scale 65536 | skipped 0",
        "stepfx: step 4 | loss 3.5000 | lr 4.000e-04 | 1,000 tokens/s | 8.0 samples/s | MFU 60.0% | "
        "peak memory 4.00 GiB | loss scale 65536 | skipped 1",
    ]
    assert [r.levelno for r in caplog.records if r.name == "stepfx"] == [logging.INFO] * 2


def test_line_leaves_out_what_is_unknown_and_mfu_needs_both_flops_figures(caplog):
    caplog.set_level(logging.INFO, logger="stepfx")
    monitor = Monitor(load_config({"steps_per_print": 1, "gradient_clipping": 0}), clock=Clock())
    monitor.after_update(1, loss=2.0)
    monitor.after_update(2, loss=1.0, tokens=500, flops_per_token=6e6)  # no peak_flops: no MFU
    assert stepfx_lines(caplog) == ["stepfx: step 1 | loss 2.0000", "stepfx: step 2 | loss 1.0000 | 500 tokens/s"]


def test_wall_clock_breakdown_phases_are_averaged_per_update(caplog):
    caplog.set_level(logging.INFO, logger="stepfx")
    recorder = Recorder()
    monitor = Monitor(config(steps_per_print=2, wall_clock_breakdown=True), writers=[recorder], clock=Clock())
    monitor.after_update(1, phase_seconds={"forward": 0.010, "backward": 0.030, "communication": 0.005,
                                           "optimizer": 0.002})
    monitor.after_update(2, phase_seconds={"forward": 0.020, "backward": 0.050, "communication": 0.007,
                                           "optimizer": 0.004})
    (line,) = stepfx_lines(caplog)
    assert line.endswith("ms/update: forward 15.0, backward 40.0, communication 6.0, optimizer 3.0")
    written = {(tag, step): value for tag, value, step in recorder.events}
    assert written[("Train/Samples/elapsed_time_ms_backward_allreduce", 16)] == pytest.approx(7.0)
    assert written[("Train/Samples/elapsed_time_ms_step", 8)] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="unknown phase.*'fwd'"):
        monitor.after_update(3, phase_seconds={"fwd": 0.1})


def test_phases_are_ignored_without_wall_clock_breakdown(caplog):
    caplog.set_level(logging.INFO, logger="stepfx")
    recorder = Recorder()
    monitor = Monitor(config(steps_per_print=1), writers=[recorder], clock=Clock())
    monitor.after_update(1, phase_seconds={"forward": 0.01})
    assert stepfx_lines(caplog) == ["stepfx: step 1"]
    assert not any("elapsed" in tag for tag, _, _ in recorder.events)


# -- reading device values ---------------------------------------------------------------
def test_device_values_are_read_only_at_print_steps_and_copied_when_given(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="stepfx")
    reads = []
    real = monitor_module._read_tensors
    monkeypatch.setattr(monitor_module, "_read_tensors", lambda records: (reads.append(len(records)), real(records)))
    monitor = Monitor(config(steps_per_print=4), clock=Clock())
    buffer = torch.zeros(())  # a step that reuses its output buffer (CUDA graphs do)
    for i in range(1, 9):
        buffer.fill_(float(i))
        monitor.after_update(i, loss=buffer)
        assert len(reads) == i // 4  # nothing read between print steps
    assert reads == [4, 4]
    assert [line.split(" | ")[1] for line in stepfx_lines(caplog)] == ["loss 2.5000", "loss 6.5000"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_values_do_not_synchronize_between_print_steps(caplog):
    caplog.set_level(logging.INFO, logger="stepfx")
    monitor = Monitor(config(steps_per_print=3, fp16={"enabled": True}), clock=Clock())
    loss, scale = torch.tensor(2.0, device="cuda"), torch.tensor(1024.0, device="cuda")
    skipped = torch.tensor(1, device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any host-device synchronization raises
    try:
        for i in (1, 2):
            monitor.after_update(i, loss=loss * i, loss_scale=scale, skipped_steps=skipped,
                                 peak_memory_bytes=torch.cuda.max_memory_allocated())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    monitor.after_update(3, loss=loss * 3, loss_scale=scale, skipped_steps=skipped)
    (line,) = stepfx_lines(caplog)
    assert line.startswith("stepfx: step 3 | loss 4.0000") and line.endswith("loss scale 1024 | skipped 1")


def test_without_printing_device_values_wait_at_most_max_pending_updates(tmp_path):
    recorder = Recorder()
    monitor = Monitor(config(), writers=[recorder], clock=Clock())
    feed(monitor, range(1, MAX_PENDING + 3))
    assert [len(b) for b in recorder.batches] == [len(recorder.batches[0])]
    assert {step for _, _, step in recorder.events} == {8 * i for i in range(1, MAX_PENDING + 1)}
    monitor.close()
    monitor.close()
    assert recorder.closed and len(recorder.batches) == 2
    assert not monitor.active


def test_only_rank_0_logs_or_writes(caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="stepfx")
    cfg = config(steps_per_print=1, csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"})
    monitor = Monitor(cfg, rank=1, world_size=2)
    assert not monitor.active and monitor.writers == []
    feed(monitor, range(1, 3))
    monitor.close()
    assert stepfx_lines(caplog) == []
    assert not (tmp_path / "j").exists()


def test_inactive_without_print_interval_or_writers():
    assert not Monitor(config()).active
    assert Monitor(config(steps_per_print=100)).active


# -- writers ------------------------------------------------------------------------------
def test_events_use_deepspeeds_tags_with_samples_as_step():
    recorder = Recorder()
    monitor = Monitor(config(fp16={"enabled": True}), writers=[recorder], world_size=2, peak_flops=1e9,
                      clock=Clock())
    feed(monitor, range(1, 3))
    monitor.close()
    at_16 = {tag: value for tag, value, step in recorder.events if step == 16}
    assert at_16 == {
        "Train/Samples/train_loss": 2.0, "Train/Samples/lr": pytest.approx(2e-4), "Train/Samples/loss_scale": 65536.0,
        "Train/Samples/skipped_steps": 0.0, "Train/Samples/tokens_per_second": 1000.0,
        "Train/Samples/samples_per_second": 8.0, "Train/Samples/mfu": pytest.approx(3.0),
        "Train/Samples/peak_memory_bytes": 2 * 2**30,
    }
    assert "Train/Samples/tokens_per_second" not in {tag for tag, _, step in recorder.events if step == 8}


def read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_csv_monitor_files_as_deepspeed_lays_them_out(tmp_path):
    cfg = config(csv_monitor={"enabled": "yes", "output_path": str(tmp_path), "job_name": "run1"})
    with Monitor(cfg, clock=Clock()) as monitor:
        feed(monitor, range(1, 4))
    folder = tmp_path / "run1"
    assert read_csv(folder / "Train_Samples_train_loss.csv") == [["step", "train_loss"], ["8", "1.0"], ["16", "2.0"],
                                                                 ["24", "3.0"]]
    assert read_csv(folder / "Train_Samples_lr.csv")[0] == ["step", "lr"]
    assert (folder / "Train_Samples_loss_scale.csv").exists()
    with Monitor(cfg, clock=Clock()) as monitor:  # a resumed run appends, without a second header
        feed(monitor, [4])
    rows = read_csv(folder / "Train_Samples_train_loss.csv")
    assert rows[0] == ["step", "train_loss"] and rows[-1] == ["32", "4.0"] and len(rows) == 5


def test_csv_monitor_defaults_to_deepspeeds_job_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Monitor(config(csv_monitor={"enabled": True, "job_name": "auto"}), clock=Clock()) as monitor:
        feed(monitor, [1])
    assert (tmp_path / "DeepSpeedJobName" / "Train_Samples_train_loss.csv").exists()


def test_tensorboard_event_file_reads_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config(tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "tb"})
    with Monitor(cfg, clock=Clock()) as monitor:
        feed(monitor, range(1, 4))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert "Train/Samples/train_loss" in events.Tags()["scalars"]
    assert [(e.step, e.value) for e in events.Scalars("Train/Samples/train_loss")] == [(8, 1.0), (16, 2.0), (24, 3.0)]
    assert [e.value for e in events.Scalars("Train/Samples/lr")] == pytest.approx([1e-4, 2e-4, 3e-4])


@pytest.mark.parametrize("block, package", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_missing_package_names_the_config_key_and_the_pip_package(monkeypatch, block, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(writers_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(ImportError, match=rf"{block}\.enabled is true .* pip install {package}"):
        Monitor(config(**{block: {"enabled": True}}), rank=3)  # every rank checks, so all fail together


def test_wandb_writes_an_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    with Monitor(config(wandb={"enabled": True, "project": "stepfx-test"}), clock=Clock()) as monitor:
        feed(monitor, range(1, 3))
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert any(run.glob("*.wandb"))


# -- step values ---------------------------------------------------------------------------
def test_loss_of_finds_the_scalar_loss_in_common_results():
    loss = torch.tensor(1.5)
    assert loss_of(loss) is loss
    assert loss_of((loss, torch.zeros(2, 3))) is loss
    assert loss_of({"logits": torch.zeros(2, 3), "loss": loss}) is loss
    assert loss_of(torch.zeros(2, 3)) is None and loss_of(None) is None


def test_tokens_in_counts_the_largest_integer_tensor():
    ids = torch.zeros(4, 128, dtype=torch.long)
    assert tokens_in(({"input_ids": ids, "labels": ids, "mask": ids.bool()},), {}) == 512
    assert tokens_in((torch.zeros(4, 3),), {"y": torch.zeros(4, dtype=torch.long)}) == 4
    assert tokens_in((torch.zeros(4, 3),), {}) is None


def test_dense_flops_per_token_is_six_per_parameter():
    assert dense_flops_per_token(torch.nn.Linear(10, 10)) == 6.0 * 110
