"""``stepfx check CONFIG``: a DeepSpeed config validated as stepfx reads it."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .status import EXIT_INVALID, EXIT_OK, EXIT_USAGE

__all__ = ["ConfigCheck", "Finding", "check_config", "positive_int"]


@dataclass(frozen=True)
class Finding:
    """One thing ``check`` says about a config.

    ``severity``: "error" (stepfx and DeepSpeed reject the config),
    "warning" (accepted, but most likely not what was meant, or the step's
    first call will fail), "note" (for information: "auto" values, keys
    stepfx accepts but does not act on yet). ``key``: the dotted key path
    ("" for the file as a whole). ``suggestion``: the key stepfx suggests
    instead, when it has one. ``line``/``column``: where a JSON syntax
    error is (1-based), else None.
    """

    severity: str
    key: str
    message: str
    suggestion: str | None = None
    line: int | None = None
    column: int | None = None


@dataclass
class ConfigCheck:
    """What ``check_config`` found. ``readable`` is False when the file could
    not be read or is not JSON (a usage error, not an invalid config)."""

    path: str
    findings: list[Finding] = field(default_factory=list)
    readable: bool = True

    @property
    def valid(self) -> bool:
        return self.readable and not any(f.severity == "error" for f in self.findings)

    def of(self, severity: str) -> list[Finding]:
        return [f for f in self.findings if f.severity == severity]

    def exit_status(self) -> int:
        return EXIT_USAGE if not self.readable else EXIT_OK if self.valid else EXIT_INVALID

    def to_json(self) -> dict:
        return {"path": self.path, "valid": self.valid, "readable": self.readable,
                **{f"{s}s": [dataclasses.asdict(f) for f in self.of(s)] for s in ("error", "warning", "note")}}


# What a ConfigWarning's message looks like: "<key path>: <text>", and maybe "Did you mean '<key>'?".
_KEY_PREFIX = re.compile(r"^([\w.\-]+(?:, [\w.\-]+)*): ")
_DID_YOU_MEAN = re.compile(r"Did you mean '([^']+)'\?")
# "auto" values stepfx itself fills at the step's first call, from the model (config.resolve_zero_auto).
_FILLED_FROM_MODEL = ("zero_optimization.reduce_bucket_size", "zero_optimization.prefetch_bucket_size",
                      "zero_optimization.param_persistence_threshold",
                      "zero_optimization.gather_16bit_weights_on_model_save")


def check_config(path: str | os.PathLike, *, world_size: int | None = None) -> ConfigCheck:
    """Read the DeepSpeed config at ``path`` exactly as ``stepfx.parallelize`` does, and say what it makes of it.

    Errors: what ``load_config`` rejects (the first error only: loading
    stops there), and with ``world_size`` (data-parallel ranks) DeepSpeed's
    batch-size arithmetic. Warnings: ``load_config``'s ConfigWarnings,
    defaults that change the math (``config.implicit``), and what the
    step's first call will reject when it builds the config's optimizer
    and scheduler. Notes: "auto" values and who fills them, keys accepted
    but not acted on (``Config.not_applied``).
    """
    result = ConfigCheck(os.fspath(path))
    config = _load(path, result)
    if config is None:
        return result
    result.findings += _implicit_findings(config)
    result.findings += _first_call_findings(config)
    if world_size is not None:
        result.findings += _batch_findings(config, world_size)
    result.findings += _auto_findings(config)
    result.findings += [Finding("note", key, f"{key}: accepted as DeepSpeed reads it, but stepfx does not act on it "
                                "yet") for key in config.not_applied]
    return result


def _load(path: str | os.PathLike, result: ConfigCheck):
    """``load_config(path)``, with what it says added to ``result``; None
    when the file is unreadable, not JSON, or rejected."""
    from ..config import ConfigError, ConfigWarning, load_config

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as error:
        result.readable = False
        result.findings.append(Finding("error", "", f"cannot read {result.path}: {error}"))
        return None
    try:
        json.loads(text)  # load_config reads the file again; this is for the line and column of a syntax error
    except json.JSONDecodeError as error:
        result.readable = False
        result.findings.append(Finding("error", "", f"{result.path} is not valid JSON: {error.msg} at line "
                                       f"{error.lineno} column {error.colno}", line=error.lineno, column=error.colno))
        return None
    config = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        try:
            config = load_config(path)
        except ConfigError as error:
            result.findings.append(Finding("error", error.path, str(error), error.suggestion))
    result.findings += [_warning_finding(str(w.message)) for w in caught if issubclass(w.category, ConfigWarning)]
    return config


def _implicit_findings(config) -> list[Finding]:
    """``config.implicit``'s sentences, which name their key somewhere in the sentence rather than first."""
    from ..config.implicit import implicit_defaults
    from ..config.load import known_top_level_keys

    findings = []
    for sentence in implicit_defaults(config):
        named = [word for word in re.findall(r"\w+", sentence) if word in known_top_level_keys()]
        key = named[0] if named else ""
        findings.append(Finding("warning", key, f"{key}: {sentence}" if key else sentence))
    return findings


def _batch_findings(config, world_size: int) -> list[Finding]:
    """DeepSpeed's batch-size arithmetic for ``world_size`` data-parallel
    ranks, as the step's first call runs it: only when the config gives a
    batch size (an "auto" one is filled by HF first)."""
    from ..config import ConfigError, resolve_batch_sizes

    if not any(isinstance(getattr(config, k), int) for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        return []
    try:
        train, micro, gas = resolve_batch_sizes(config, world_size)
    except ConfigError as error:
        return [Finding("error", error.path, str(error), error.suggestion)]
    return [Finding("note", "train_batch_size", f"train_batch_size: for {world_size} data-parallel rank(s): "
                    f"train_batch_size={train}, train_micro_batch_size_per_gpu={micro}, "
                    f"gradient_accumulation_steps={gas}")]


def _auto_findings(config) -> list[Finding]:
    """A note per value still "auto", saying who fills it."""
    findings = []
    for key in _auto_paths(config):
        if key in _FILLED_FROM_MODEL or key.startswith("zero_optimization.offload_"):
            how = "stepfx fills it at the step's first call, from the model (HF's rules)"
        elif key in ("fp16.enabled", "bf16.enabled"):
            how = "stepfx reads it as off unless stepfx.config.resolve_auto(config, mixed_precision=...) fills it"
        elif key.startswith(("optimizer.", "scheduler.")):
            how = ("HF transformers/accelerate fill it; without them, fill it with stepfx.config.resolve_auto("
                   "config, ...) before parallelize(): the step's first call raises while it is 'auto'")
        else:
            how = ("HF transformers/accelerate fill it; without them, fill it with stepfx.config.resolve_auto("
                   "config, ...) before parallelize()")
        findings.append(Finding("note", key, f"{key}: 'auto': {how}"))
    return findings


def _warning_finding(message: str) -> Finding:
    """A ConfigWarning as a Finding. ConfigWarning carries only its message,
    whose form every warning of stepfx.config follows: the key path first."""
    key = _KEY_PREFIX.match(message)
    near = _DID_YOU_MEAN.search(message)
    return Finding("warning", key.group(1) if key else "", message, near.group(1) if near else None)


def _first_call_findings(config) -> list[Finding]:
    """What the step's first call will reject when it builds the config's
    optimizer (over a stand-in parameter) and scheduler: warnings, not
    errors, since the config is valid as DeepSpeed reads it; it is stepfx's
    step that cannot run it (yet). Skipped while "auto" values are left:
    ``resolve_auto`` has to fill them first."""
    import torch

    from ..config import AUTO, ConfigError, ConfigWarning
    from ..optimizer_builder import build_optimizer
    from ..schedules import build_scheduler

    findings: list[Finding] = []
    if config.optimizer is None or any(v is AUTO for v in config.optimizer.params.values()):
        return findings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        try:
            optimizer = build_optimizer(config.optimizer, [torch.zeros(1, requires_grad=True)])
            scheduler = config.scheduler
            if scheduler is not None and not any(v is AUTO for v in scheduler.params.values()):
                build_scheduler(scheduler, optimizer)
        except ConfigError as error:
            findings.append(Finding("warning", error.path, f"{error} (parallelize() raises this at the step's "
                                    "first call, when it builds the config's optimizer and scheduler)",
                                    error.suggestion))
    findings += [_warning_finding(str(w.message)) for w in caught if issubclass(w.category, ConfigWarning)]
    return findings


def _auto_paths(config) -> list[str]:
    """Canonical key paths whose value is still AUTO, in field order."""
    from ..config import AUTO

    skip = {"raw", "source", "ignored_keys", "not_applied"}

    def walk(value: Any, path: str) -> list[str]:
        if value is AUTO:
            return [path]
        if dataclasses.is_dataclass(value):
            return [p for f in dataclasses.fields(value) if f.name not in skip
                    for p in walk(getattr(value, f.name), f"{path}.{f.name}" if path else f.name)]
        if isinstance(value, Mapping):
            return [p for k, v in value.items() for p in walk(v, f"{path}.{k}")]
        return []

    return walk(config, "")


def _print_check(result: ConfigCheck, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return
    out = sys.stdout if result.readable else sys.stderr
    for finding in result.findings:
        print(f"{finding.severity}: {finding.message}", file=out)
    counts = ", ".join(_count(len(result.of(s)), s) for s in ("error", "warning", "note") if result.of(s))
    verdict = "valid" if result.valid else "unreadable" if not result.readable else "invalid"
    print(f"{result.path}: {verdict}" + (f" ({counts})" if counts else ""), file=out)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="path to a DeepSpeed JSON config")
    parser.add_argument("--world-size", type=positive_int, default=None, metavar="N",
                        help="data-parallel ranks: also check train_batch_size = micro x accumulation x N")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _run_check(args: argparse.Namespace) -> int:
    result = check_config(args.config, world_size=args.world_size)
    _print_check(result, args.json)
    return result.exit_status()


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


