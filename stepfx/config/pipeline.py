"""``pipeline`` (DeepSpeed's block) and ``stepfx.pipeline`` (stepfx's own), typed.

DeepSpeed's ``runtime/config.py: get_pipeline_config`` starts from
``{"stages": "auto", "partition": "best", "seed_layers": False,
"activation_checkpoint_interval": 0, "pipe_partitioned": True,
"grad_partitioned": True}`` and overwrites it with whatever the user's block
holds (a dict update: any key is accepted). ``partition_method`` is the
spelling of ``PipelineModule``'s argument, accepted here for ``partition``.

Partition methods: ``"parameters"`` (stages hold about equal parameter
counts, DeepSpeed's default for ``PipelineModule``), ``"uniform"`` (equal
numbers of blocks), ``"type:<regex>"`` (equal numbers of the blocks whose
parameter names match the regular expression, DeepSpeed's layer-class
regex), ``"best"``/``"auto"`` (stepfx's cost model: forward and backward
time per node estimated from FLOPs and bytes).

``stepfx.pipeline``: ``{"schedule": "gpipe" | "1f1b" | "interleaved_1f1b" |
"zero_bubble", "virtual_stages": k, "split_points": [names...]}``.
``split_points`` name modules (``"layers.4"``) before which a new stage
starts, instead of the partition method.

Pipeline parallelism is on when ``pipeline.stages`` is a number above 1,
or when ``stepfx.pipeline`` is given with ``stages`` "auto" (then every
rank a stage: the world size divided by the tensor-parallel degree and by
``stepfx.pipeline.data_parallel`` (default 1)). DeepSpeed's default "auto"
alone (a ``PipelineModule`` decides there; stepfx has none) leaves it off.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, bad_value
from .rules import Notes, Rule, parse_fields, spec, validate_fields
from .values import Bool, Choice, Int, OneOf, Optional, StrList

__all__ = ["PipelineConfig", "PipelineOptions", "parse_pipeline", "parse_pipeline_options", "SCHEDULES",
           "pipeline_degree", "PipelineOptionsCheck"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
_METHODS = ("parameters", "uniform", "best", "auto")


@dataclass(frozen=True)
class _PartitionMethod:
    expected: str = "'parameters', 'uniform', 'best', 'auto' or 'type:<regex>'"

    def __call__(self, value: Any, path: str) -> str:
        if isinstance(value, str):
            v = value.strip()
            if v.lower() in _METHODS:
                return v.lower()
            if v.lower().startswith("type:"):
                pattern = v[len("type:"):]
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise bad_value(path, value, self.expected, f"the regular expression does not compile: {exc}")
                if not pattern:
                    raise bad_value(path, value, self.expected, "the regular expression is empty")
                return "type:" + pattern
        raise bad_value(path, value, self.expected)


@dataclass(frozen=True)
class _Auto:
    expected: str = "'auto'"

    def __call__(self, value: Any, path: str) -> str:
        if value == "auto":
            return "auto"
        raise bad_value(path, value, self.expected)


@dataclass(frozen=True)
class PipelineConfig:
    """DeepSpeed's ``pipeline`` block with its defaults."""

    stages: int | str = spec("auto", OneOf((Int(ge=1), _Auto())), auto_value=True)
    partition: str = spec("best", _PartitionMethod(), json=("partition_method",), auto_value=True)
    seed_layers: bool = spec(False, Bool())
    activation_checkpoint_interval: int = spec(0, Int(ge=0))
    pipe_partitioned: bool = spec(True, Bool())
    grad_partitioned: bool = spec(True, Bool())

    def __post_init__(self):
        validate_fields(self, "pipeline")


@dataclass(frozen=True)
class PipelineOptions:
    """``stepfx.pipeline``: the schedule and where stages start."""

    schedule: str = spec("1f1b", Choice(SCHEDULES, lower=True))
    virtual_stages: int = spec(1, Int(ge=1))
    split_points: tuple[str, ...] = spec((), StrList())
    data_parallel: int = spec(1, Int(ge=1))

    def __post_init__(self):
        validate_fields(self, "stepfx.pipeline")
        if self.schedule == "interleaved_1f1b" and self.virtual_stages < 2:
            raise ConfigError("stepfx.pipeline.virtual_stages", "the interleaved schedule needs at least 2 virtual "
                              "stages per rank", value=self.virtual_stages, expected="2 or more")
        if self.schedule != "interleaved_1f1b" and self.virtual_stages > 1:
            raise ConfigError("stepfx.pipeline.virtual_stages", f"virtual stages are for the interleaved schedule, "
                              f"not {self.schedule!r}", value=self.virtual_stages,
                              expected="1, or schedule 'interleaved_1f1b'")


def parse_pipeline(mapping: Any, path: str, notes: Notes) -> tuple[PipelineConfig, list[str]]:
    """DeepSpeed's ``pipeline`` block (unknown keys warn: DeepSpeed keeps them and reads none)."""
    kwargs, set_paths = parse_fields(PipelineConfig, mapping, path, "pipeline", notes, Rule.LENIENT,
                                     pydantic=False, block="pipeline")
    return PipelineConfig(**kwargs), set_paths


def parse_pipeline_options(mapping: Any, path: str = "stepfx.pipeline") -> PipelineOptions:
    """``stepfx.pipeline`` (strict: every key is stepfx's own)."""
    if isinstance(mapping, PipelineOptions):
        return mapping
    kwargs, _ = parse_fields(PipelineOptions, mapping, path, path, Notes(True), Rule.STRICT, pydantic=False,
                             block=path)
    return PipelineOptions(**kwargs)


def pipeline_degree(pipeline: PipelineConfig, options: PipelineOptions | None, world_size: int,
                    tp_size: int = 1) -> int:
    """The number of pipeline ranks (1: off), checked against the world.
    Raises ConfigError naming the key and the numbers."""
    stages = pipeline.stages
    if stages == "auto":
        if options is None:
            return 1
        dp = options.data_parallel
        if world_size % (tp_size * dp):
            raise ConfigError("stepfx.pipeline.data_parallel", f"{dp} x tensor-parallel {tp_size} does not divide "
                              f"the world size {world_size}", value=dp, expected=f"a divisor of {world_size // tp_size}")
        stages = world_size // (tp_size * dp)
    if stages <= 1:
        return 1
    if world_size % (stages * tp_size):
        raise ConfigError("pipeline.stages", f"{stages} pipeline stages x tensor-parallel {tp_size} do not divide the "
                          f"world size {world_size}; the ranks left form the data-parallel groups", value=stages,
                          expected=f"a divisor of {world_size // tp_size}")
    return stages


@dataclass(frozen=True)
class PipelineOptionsCheck:
    """The checker of ``stepfx.pipeline``: a mapping becomes :class:`PipelineOptions`."""

    expected: str = "a mapping with schedule, virtual_stages, split_points, data_parallel"

    def __call__(self, value: Any, path: str) -> PipelineOptions:
        if isinstance(value, PipelineOptions):
            return value
        return parse_pipeline_options(value, path)
