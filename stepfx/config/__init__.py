"""TEMPORARY stub until the config package lands (branch `config`)."""
from __future__ import annotations

from dataclasses import dataclass, field


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class StepfxOptions:
    codegen: bool | None = None
    disable: tuple[str, ...] = ()
    dump_dir: str | None = None
    cache_size: int = 8
    verify: bool = True


@dataclass(frozen=True)
class Config:
    stepfx: StepfxOptions = field(default_factory=StepfxOptions)
    source: str = "<defaults>"
    ignored_keys: tuple[str, ...] = ()
    not_applied: tuple[str, ...] = ()


def load_config(source=None) -> Config:
    if isinstance(source, Config):
        return source
    return Config()
