"""The ``stepfx`` command line (``python -m stepfx`` or the ``stepfx`` script).

A thin layer: each subcommand parses its arguments, calls one public
function of this module (``check_config``, ``environment_report``), prints
the result as text or ``--json``, and turns it into an exit status:

- 0: done (``check``: the config is valid; warnings and notes allowed),
- 1: ``check`` found errors in the config,
- 2: usage errors: bad arguments, a file that cannot be read, a file that
  is not JSON (argparse's own status for bad arguments is 2 as well).

Subcommands are entries of ``COMMANDS``; a new one (``export``, ``plan``)
is one more ``Command`` there, with its own ``add_arguments`` and ``run``.
Environment variables are read here, at the entry point, and nowhere
deeper (STYLE.md): ``report`` reads the cache-directory variables.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import sys
import warnings
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable, Sequence

__all__ = ["COMMANDS", "Command", "ConfigCheck", "Finding", "check_config", "environment_report", "main"]

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


# -- check -------------------------------------------------------------------
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
    from .config import ConfigError, ConfigWarning, load_config

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
    from .config.implicit import implicit_defaults
    from .config.load import known_top_level_keys

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
    from .config import ConfigError, resolve_batch_sizes

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

    from .config import AUTO, ConfigError, ConfigWarning
    from .optimizer_builder import build_optimizer
    from .schedules import build_scheduler

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
    from .config import AUTO

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
    parser.add_argument("--world-size", type=_positive_int, default=None, metavar="N",
                        help="data-parallel ranks: also check train_batch_size = micro x accumulation x N")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _run_check(args: argparse.Namespace) -> int:
    result = check_config(args.config, world_size=args.world_size)
    _print_check(result, args.json)
    return result.exit_status()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


# -- report ------------------------------------------------------------------
_PACKAGES = ("torch", "triton", "networkx", "sympy", "transformers", "tensorboard", "wandb")


def environment_report(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """What a bug report needs to know about this machine, as plain JSON-ready data (like DeepSpeed's ``ds_report``).

    Sections: versions, torch (CUDA/cuDNN/NCCL), devices, distributed
    backends, triton (and whether stepfx's kernels can run), kernel caches
    (Triton's and inductor's directories, with entry counts and sizes).
    ``environ`` defaults to ``os.environ``; it is read for TRITON_INTERPRET
    and the cache-directory variables, as Triton and inductor read them.
    """
    import torch
    import torch.distributed as dist

    from . import __version__, compat
    from .codegen import available

    env = dict(os.environ if environ is None else environ)
    versions = {"stepfx": __version__, "python": f"{platform.python_version()} ({sys.executable})"}
    versions.update({name: _installed_version(name) for name in _PACKAGES})
    cudnn = torch.backends.cudnn.is_available()
    torch_info = {
        "cuda built": torch.version.cuda,
        "cuda available": torch.cuda.is_available(),
        "cudnn": torch.backends.cudnn.version() if cudnn else None,
        "nccl": _nccl_version(),
    }
    devices = [{"index": i, "name": p.name, "memory_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}"}
               for i, p in ((i, torch.cuda.get_device_properties(i)) for i in range(torch.cuda.device_count()))]
    backends = {name: bool(dist.is_available() and getattr(dist, f"is_{name}_available")())
                for name in ("gloo", "nccl", "mpi")}
    interpret = env.get("TRITON_INTERPRET")
    triton = {
        "installed": importlib.util.find_spec("triton") is not None,
        "TRITON_INTERPRET": interpret,
        **{f"stepfx kernels on {device}": _kernel_status(available, device, interpret) for device in ("cuda", "cpu")},
    }
    inductor_dir = env.get("TORCHINDUCTOR_CACHE_DIR") or compat.inductor_default_cache_dir()
    triton_home = env.get("TRITON_HOME") or os.path.expanduser("~")
    caches = {
        "triton": _cache_entry(env.get("TRITON_CACHE_DIR") or os.path.join(triton_home, ".triton", "cache")),
        "inductor": _cache_entry(inductor_dir),
    }
    return {"versions": versions, "torch": torch_info, "devices": devices, "distributed backends": backends,
            "triton": triton, "kernel caches": caches}


def _installed_version(name: str) -> str | None:
    """The installed distribution's version (read from its metadata, without importing it), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nccl_version() -> str | None:
    """NCCL's version when this torch was built with it (CPU builds lack ``torch.cuda.nccl``'s binding)."""
    import torch

    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _kernel_status(available: Callable[[str], tuple[bool, str]], device: str, interpret: str | None) -> str:
    """``codegen.available`` reads TRITON_INTERPRET from the process; this
    report's ``environ`` may differ, so on CPU the interpreter is judged from it."""
    if device == "cpu":
        on = interpret not in (None, "", "0")
        return "yes (Triton interpreter: correct but slow)" if on else "no (only under TRITON_INTERPRET=1)"
    ok, why = available(device)
    return "yes" if ok else f"no ({why})"


def _cache_entry(path: str) -> dict[str, Any]:
    """A kernel cache directory: its top-level entries (one per kernel or
    artifact kind), the files below it and their bytes. Nothing is created."""
    entry: dict[str, Any] = {"path": path, "exists": os.path.isdir(path), "entries": 0, "files": 0, "bytes": 0}
    if not entry["exists"]:
        return entry
    entry["entries"] = len(os.listdir(path))
    for root, _, files in os.walk(path):
        for name in files:
            try:
                entry["bytes"] += os.lstat(os.path.join(root, name)).st_size
                entry["files"] += 1
            except OSError:  # removed while we walk: another process cleaning the cache
                continue
    return entry


def _format_report(report: dict[str, Any]) -> str:
    lines = ["stepfx environment report"]
    for section, content in report.items():
        lines.append(f"\n{section}")
        if section == "devices":
            content = {f"cuda:{d['index']}": f"{d['name']}, {_bytes(d['memory_bytes'])}, compute capability "
                       f"{d['capability']}" for d in content} or {"CUDA devices": "no CUDA device"}
        elif section == "kernel caches":
            content = {name: f"{c['path']}: " + (f"{c['entries']} entries, {c['files']} files, {_bytes(c['bytes'])}"
                                                 if c["exists"] else "not created yet") for name, c in content.items()}
        width = max(len(k) for k in content)
        lines += [f"  {k:<{width}}  {_value(v)}" for k, v in content.items()]
    return "\n".join(lines)


def _value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError("unreachable")


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _run_report(args: argparse.Namespace) -> int:
    report = environment_report()
    print(json.dumps(report, indent=2) if args.json else _format_report(report))
    return EXIT_OK


# -- the command table and main ---------------------------------------------------
@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, how it adds its arguments,
    and what it runs (returning the exit status)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: tuple[Command, ...] = (
    Command("check", "validate a DeepSpeed JSON config as stepfx reads it", _check_arguments, _run_check),
    Command("report", "versions, devices, backends and kernel caches (like DeepSpeed's ds_report)",
            _report_arguments, _run_report),
)


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepfx", description="stepfx: a compiler for whole PyTorch training steps")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in commands:
        sub_parser = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub_parser)
        sub_parser.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``) and return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return args.run(args)
