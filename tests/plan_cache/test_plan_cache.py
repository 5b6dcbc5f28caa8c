"""The on-disk plan cache (stepfx/plan_cache) and the progress lines of a first call.

A warm start runs in a fresh process (the point of the cache); the misses,
damaged entries and unsafe folders are checked in this process with new
step objects over fresh models, which find the plan only on disk.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stepfx
from stepfx.plan_cache import key as key_module
from tests.steps import ce_step, mlp_batches

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> str:
    """A plan cache folder of the test's own. The compiler cache variables
    the cache would set are set (to folders under it) and restored after
    the test, so they do not leak into other tests of this process."""
    root = tmp_path / "stepfx-cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(root / "triton"))
    return str(root)


MODEL_SOURCE = '''
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))
'''


def _net_module(folder: Path, monkeypatch, source: str = MODEL_SOURCE):
    """A model class in a module file of the test's (imported as a user's
    module is: in sys.modules, which is how the key finds its file)."""
    path = folder / "cached_net.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("cached_net", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "cached_net", module)
    spec.loader.exec_module(module)
    return module


def _run(cache_dir: str, module, *, batch: int = 6, config: dict | None = None, steps: int = 1):
    """A fresh model, optimizer and step object; ``steps`` calls. The step."""
    torch.manual_seed(0)
    model = module.Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize({"gradient_clipping": 0, **(config or {}),
                               "stepfx": {"cache_dir": cache_dir, **(config or {}).get("stepfx", {})}})(ce_step)
    for x, y in mlp_batches(steps, batch=batch):
        step(model, optimizer, x, y)
    return step


def _plans(cache_dir: str) -> list[str]:
    return sorted(os.listdir(os.path.join(cache_dir, "plans")))


def test_warm_start_in_a_fresh_process_loads_the_plan_and_is_bitwise(tmp_path):
    """Cold run, then a second process on the same folder whose capture and
    passes raise: it loads the plan, and its losses and parameters equal
    the cold run's bit for bit. The cold run prints its progress on stderr;
    the warm one, with stepfx.progress false (not part of the key), none."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("TRITON_CACHE_DIR", None)
    runs = {}
    for mode in ("cold", "warm"):
        done = subprocess.run([sys.executable, "-m", "tests.plan_cache.runs", str(tmp_path / "cache"), mode],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[mode] = (json.loads(done.stdout.splitlines()[-1]), done.stderr)
    (cold, cold_err), (warm, warm_err) = runs["cold"], runs["warm"]
    assert not cold["from_cache"] and cold["note"].startswith("saved")
    assert warm["from_cache"] and warm["note"].startswith("loaded from"), warm["note"]
    assert warm["losses"] == cold["losses"]
    assert warm["params"] == cold["params"]
    lines = [line for line in cold_err.splitlines() if line.startswith("stepfx: lm_step:")]
    assert any("capturing the step" in line for line in lines), cold_err
    assert any(line.startswith("stepfx: lm_step: captured in ") and "running" in line for line in lines), cold_err
    assert any("first call done in" in line for line in lines), cold_err
    assert len(lines) <= 6, lines
    assert not [line for line in warm_err.splitlines() if line.startswith("stepfx: lm_step:")], warm_err
    # the compilers' caches went under the plan cache (neither variable was set)
    assert (tmp_path / "cache" / "plans").is_dir()


def test_misses_on_config_batch_shape_model_source_and_versions(tmp_path, cache_dir, monkeypatch):
    net = _net_module(tmp_path, monkeypatch)
    first = _run(cache_dir, net)
    assert not first.plan.from_cache and first.plan.cache_note.startswith("saved")
    assert _run(cache_dir, net).plan.from_cache  # the same run again: loaded
    assert not _run(cache_dir, net, config={"gradient_clipping": 0.5}).plan.from_cache
    assert not _run(cache_dir, net, batch=5).plan.from_cache
    with monkeypatch.context() as patch:
        patch.setattr(key_module, "_versions", lambda: (("torch", "9.9.9"),))
        assert not _run(cache_dir, net).plan.from_cache
    with monkeypatch.context() as patch:  # an edited stepfx (a checkout's passes, say)
        patch.setattr(key_module, "_stepfx_source_digest", lambda: "edited")
        assert not _run(cache_dir, net).plan.from_cache
    # a symbolic plan serves the sizes its guards admit, also from the cache
    dynamic = {"stepfx": {"dynamic": True}}
    assert not _run(cache_dir, net, config=dynamic).plan.from_cache
    step = _run(cache_dir, net, config=dynamic, batch=5)
    assert step.plan.from_cache and step.plan.guard is not None
    assert len(_plans(cache_dir)) == 6
    edited = _net_module(tmp_path, monkeypatch, MODEL_SOURCE.replace("torch.tanh", "torch.sigmoid"))
    step = _run(cache_dir, edited)
    assert not step.plan.from_cache  # an edited model file is another key
    assert len(_plans(cache_dir)) == 7
    assert "plan cache: saved" in step.explain()


def test_a_damaged_entry_is_ignored_and_rewritten(tmp_path, cache_dir, caplog, monkeypatch):
    net = _net_module(tmp_path, monkeypatch)
    _run(cache_dir, net)
    (name,) = _plans(cache_dir)
    path = os.path.join(cache_dir, "plans", name)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])  # a write cut short
    with caplog.at_level(logging.WARNING, logger="stepfx"):
        step = _run(cache_dir, net)
    assert not step.plan.from_cache
    assert any("ignoring the cached plan" in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records)
    assert Path(path).read_bytes() != data[: len(data) // 2]
    assert _run(cache_dir, net).plan.from_cache  # rewritten whole
    Path(path).write_bytes(data[:-100] + b"\0" * 100)  # damaged inside, length kept
    assert not _run(cache_dir, net).plan.from_cache


def test_a_folder_others_can_write_is_refused(tmp_path, cache_dir, caplog, monkeypatch):
    os.makedirs(os.path.join(cache_dir, "plans"))
    os.chmod(cache_dir, 0o777)
    with caplog.at_level(logging.WARNING, logger="stepfx"):
        step = _run(cache_dir, _net_module(tmp_path, monkeypatch))
    messages = [r.getMessage() for r in caplog.records if "plan cache" in r.getMessage()]
    assert messages and "can be written by its group or by anyone" in messages[0] and "chmod go-w" in messages[0]
    assert "plan cache: refused:" in step.explain()
    assert _plans(cache_dir) == []


def test_off_by_config_and_progress_through_logging(tmp_path, cache_dir, caplog, monkeypatch):
    """stepfx.cache_dir false: no cache, and explain() says so. With the
    application's logging set up (pytest's), progress lines are records of
    the stepfx.progress logger, not stderr prints; progress false: none."""
    net = _net_module(tmp_path, monkeypatch)
    with caplog.at_level(logging.INFO, logger="stepfx.progress"):
        step = _run(cache_dir, net, config={"stepfx": {"cache_dir": False}})
    assert "plan cache: off (stepfx.cache_dir is false)" in step.explain()
    progress = [r.getMessage() for r in caplog.records if r.name == "stepfx.progress"]
    assert progress and progress[0].startswith("stepfx: ce_step: capturing the step (plan cache: off")
    assert not logging.getLogger("stepfx.progress").handlers  # logging was configured: no handler of stepfx's
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stepfx.progress"):
        _run(cache_dir, net, config={"stepfx": {"cache_dir": False, "progress": False}})
    assert not [r for r in caplog.records if r.name == "stepfx.progress"]


def test_each_zero_rank_saves_and_loads_its_own_plan(rank_pool, tmp_path):
    from tests.plan_cache.runs import zero_cold_then_warm

    cache = str(tmp_path / "cache")
    results = rank_pool(2).run(zero_cold_then_warm, cache)
    for r in results:
        assert not r["cold_from_cache"] and r["warm_from_cache"], r["note"]
        assert r["bitwise"]
    assert len(os.listdir(os.path.join(cache, "plans"))) == 2  # one plan per rank (the rank is in the key)
