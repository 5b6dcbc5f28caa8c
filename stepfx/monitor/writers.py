"""Writers for DeepSpeed's monitor blocks: ``tensorboard``, ``csv_monitor``, ``wandb``.

Reference: DeepSpeed v0.19.5 ``deepspeed/monitor/`` (config.py, tensorboard.py,
csv_monitor.py, wandb.py). As there:

- a block is read with DeepSpeed's defaults (``enabled`` false,
  ``output_path`` "", ``job_name`` "DeepSpeedJobName", wandb ``project``
  "deepspeed"); an "auto" value is DeepSpeed's default (pydantic drops it);
- files go to ``os.path.join(output_path, job_name)`` (relative to the
  working directory when output_path is "");
- every writer takes DeepSpeed's event list ``[(tag, value, step), ...]``;
  the step is the number of samples trained so far (DeepSpeed's
  ``global_samples``, hence the tags' "Samples");
- only rank 0 writes: ``writers_from_config`` is called on rank 0 alone,
  but ``check_writers_available`` runs on every rank so that a missing
  package fails every rank at once rather than leaving the others waiting
  in a collective.

Differences: the CSV writer writes a file's header row only when the file
is new or empty (DeepSpeed writes it again whenever a process first
touches the file, so a resumed run appends a second header); wandb runs
offline (``wandb sync`` uploads the run later).
"""
from __future__ import annotations

import csv
import importlib.util
import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol, Sequence

from ..config import Config
from ..config.rules import is_auto
from ..config.schema import BLOCKS

__all__ = ["CSVWriter", "TensorBoardWriter", "WandbWriter", "Writer", "check_writers_available", "writers_from_config"]

log = logging.getLogger("stepfx")

Event = tuple[str, float, int]  # (tag, value, step): DeepSpeed's monitor event

# DeepSpeed's defaults for the blocks' keys (monitor/config.py).
_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "tensorboard": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "csv_monitor": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "wandb": {"enabled": False, "group": None, "team": None, "project": "deepspeed"},
}
# the package each block needs, and what to install
_PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard"), "wandb": ("wandb", "pip install wandb")}


class Writer(Protocol):
    """Where monitor events go: DeepSpeed's ``write_events`` and a ``close``."""

    def write_events(self, events: Sequence[Event]) -> None: ...

    def close(self) -> None: ...


def block_settings(config: Config, name: str) -> dict[str, Any]:
    """One monitor block's settings with DeepSpeed's defaults filled in and
    values coerced as ``load_config`` checked them (``"enabled": "yes"`` is true)."""
    given = config.raw.get(name) or {}
    checks = BLOCKS[name].keys
    settings = dict(_DEFAULTS[name])
    for key, value in given.items():
        if key in settings and not is_auto(value):
            settings[key] = checks[key](value, f"{name}.{key}")
    return settings


def check_writers_available(config: Config) -> None:
    """Raise ImportError, naming the config key and the pip package, when an
    enabled block needs a package that is not installed."""
    for name, (package, install) in _PACKAGES.items():
        if block_settings(config, name)["enabled"] and importlib.util.find_spec(package) is None:
            raise ImportError(f"{name}.enabled is true in the config, but the {package!r} package is not "
                              f"installed: {install} (or set {name}.enabled to false)", name=package)


def writers_from_config(config: Config) -> list[Writer]:
    """The writers the config's enabled blocks ask for (call on rank 0 only)."""
    check_writers_available(config)
    writers: list[Writer] = []
    tensorboard, csv_monitor, wandb = (block_settings(config, n) for n in ("tensorboard", "csv_monitor", "wandb"))
    if tensorboard["enabled"]:
        writers.append(TensorBoardWriter(os.path.join(tensorboard["output_path"], tensorboard["job_name"])))
    if csv_monitor["enabled"]:
        writers.append(CSVWriter(os.path.join(csv_monitor["output_path"], csv_monitor["job_name"])))
    if wandb["enabled"]:
        writers.append(WandbWriter(project=wandb["project"], group=wandb["group"], team=wandb["team"]))
    return writers


class CSVWriter:
    """DeepSpeed's ``csv_monitor``: one CSV file per tag in ``log_dir``, named
    after the tag with "/" and " " made "_" (``Train_Samples_train_loss.csv``),
    with the rows ``step,<last part of the tag>`` then ``<step>,<value>``."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        log.info("stepfx: csv_monitor writes to %s", os.path.abspath(log_dir))

    def path(self, tag: str) -> str:
        return os.path.join(self.log_dir, tag.replace("/", "_").replace(" ", "_") + ".csv")

    def write_events(self, events: Sequence[Event]) -> None:
        by_tag: dict[str, list[Event]] = {}
        for event in events:
            by_tag.setdefault(event[0], []).append(event)
        for tag, rows in by_tag.items():
            path = self.path(tag)
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            with open(path, "a", newline="") as f:
                out = csv.writer(f)
                if new:
                    out.writerow(["step", tag.rsplit("/", 1)[-1]])
                out.writerows([step, value] for _, value, step in rows)

    def close(self) -> None:
        pass


class TensorBoardWriter:
    """DeepSpeed's ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter``
    scalars in ``log_dir``, flushed after every batch of events."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.summary = SummaryWriter(log_dir=log_dir)
        log.info("stepfx: tensorboard writes to %s", os.path.abspath(log_dir))

    def write_events(self, events: Sequence[Event]) -> None:
        for tag, value, step in events:
            self.summary.add_scalar(tag, value, step)
        self.summary.flush()

    def close(self) -> None:
        self.summary.close()


class WandbWriter:
    """DeepSpeed's ``wandb`` (project, group, team as ``entity``), run
    offline: stepfx never reaches the network; ``wandb sync`` uploads later.
    Events of one step go in one ``log`` call (wandb wants steps in order)."""

    def __init__(self, *, project: str, group: str | None, team: str | None):
        import wandb

        self.run = wandb.init(project=project, group=group, entity=team, mode="offline")
        log.info("stepfx: wandb writes an offline run to %s", getattr(self.run, "dir", "./wandb"))

    def write_events(self, events: Sequence[Event]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for tag, value, step in events:
            by_step.setdefault(step, {})[tag] = value
        for step in sorted(by_step):
            self.run.log(by_step[step], step=step)

    def close(self) -> None:
        self.run.finish()
