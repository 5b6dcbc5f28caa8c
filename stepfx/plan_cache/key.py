"""The key of a plan on disk: everything that decides the final per-rank graph.

A plan is reused across runs only when all of these are equal:

- what the in-memory fingerprint compares (``capture/fingerprint.py``):
  every parameter's and buffer's name, shape, dtype, device and
  requires_grad, the modules' train/eval modes, the optimizer's type, its
  baked-in hyperparameters (betas, eps, weight decay: the learning rate and
  betas are graph inputs, read at every call) and state, the batch's
  structure, shapes (or, for a symbolic plan, ranks) and dtypes, Python
  constants among the step's arguments, the capture options;
- the symbolic batch dimensions asked for (``stepfx.dynamic``);
- the resolved config as canonical JSON, less the keys that change no graph
  (``stepfx.cache_dir``, ``progress``, ``dump_dir``, ``cache_size``,
  ``freeze_gc``);
- the rank's place in the job: world size, rank, tensor-parallel size and
  rank, the process group names (collectives name their group);
- the source files of the step function, of every module class of the model
  and of the optimizer's class, by content (torch's own classes are covered
  by torch's version); the files the trace ran through besides these are
  checked when the plan is loaded (``CachedPlan.sources``);
- the device (CUDA: name and capability), Python, torch (and its CUDA),
  Triton and transformers versions, and stepfx's version and source, by
  content: a stepfx checkout with edited passes misses.

What is not seen: module-level constants changed at run time (tests patch
some; ``fuse_generic_regions.ON_CPU`` is keyed) and code reached by the
trace whose file is not a Python source file.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

__all__ = ["PlanKey", "NotCacheable", "plan_key", "file_digest", "source_file"]

# config keys that choose where things go or how much is kept, not what the graph is
_UNKEYED_OPTIONS = frozenset({"cache_dir", "progress", "dump_dir", "cache_size", "freeze_gc"})
_UNKEYED_FIELDS = frozenset({"raw", "source", "ignored_keys", "not_applied"})
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STEPFX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class NotCacheable(Exception):
    """Why this plan cannot be keyed safely (it is captured as usual and not written)."""


@dataclass(frozen=True)
class PlanKey:
    """``digest``: the hex SHA-256 the entry is filed under; ``items``: what
    went into it, as (label, text), kept in the entry to explain a miss;
    ``sources``: path -> content digest of the source files keyed."""

    digest: str
    items: tuple[tuple[str, str], ...]
    sources: Mapping[str, str]

    @property
    def short(self) -> str:
        return self.digest[:12]


def file_digest(path: str) -> str | None:
    """SHA-256 of a file's content; None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def source_file(obj: Any) -> str | None:
    """The Python source file that defines ``obj`` (a class, a function or
    a callable object's ``__call__``), or None."""
    if isinstance(obj, type):
        path = getattr(sys.modules.get(obj.__module__), "__file__", None)
    else:
        code = getattr(obj, "__code__", None) or getattr(getattr(obj, "__call__", None), "__code__", None)
        path = code.co_filename if code is not None else None
    if not path or not path.endswith(".py") or not os.path.isfile(path):
        return None
    return os.path.abspath(path)


def plan_key(fingerprint: tuple, *, fn: Callable, model: torch.nn.Module, optimizer, config: Any, mesh: tuple,
             device: torch.device, dynamic_dims: Mapping[str, frozenset[int]] | None) -> PlanKey:
    """The key of the plan a capture of this call would make. Raises
    :class:`NotCacheable` when something that decides the graph cannot be
    written down stably (a step function typed into the interpreter, an
    argument whose repr holds a memory address)."""
    names = {id(p): n for n, p in model.named_parameters()}
    items: list[tuple[str, str]] = []
    for label, value in fingerprint:
        if label in ("model", "optimizer"):
            continue  # object ids: this process's, not the plan's
        if label.startswith("optimizer group ") and label.endswith(" params"):
            value = tuple(names.get(i, "<not the model's>") for i in value)
        items.append((label, _stable_text(label, value)))
    items.append(("symbolic batch dimensions", repr(sorted((n, sorted(d)) for n, d in (dynamic_dims or {}).items()))))
    items.append(("config", json.dumps(_plain_config(config), sort_keys=True)))
    items.append(("ranks", repr(mesh)))
    items.append(("device", _device_text(device)))
    items.append(("versions", repr(_versions())))
    items.append(("stepfx source", _stepfx_source_digest()))
    items.append(("switches", repr(_switches())))
    sources = _source_files(fn, model, optimizer)
    items.append(("sources", repr(sorted(sources.items()))))
    digest = hashlib.sha256(json.dumps(items).encode()).hexdigest()
    return PlanKey(digest, tuple(items), sources)


def _stable_text(label: str, value: Any) -> str:
    text = repr(value)
    if " at 0x" in text:  # a default repr: differs every run, so the entry could never be found again
        raise NotCacheable(f"{label} has no stable description ({text[:80]})")
    return text


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, frozenset, set)):
        items = [_plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, enum.Enum):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _plain_config(config: Any) -> dict:
    out = {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name not in _UNKEYED_FIELDS}
    out["stepfx"] = {k: v for k, v in out["stepfx"].items() if k not in _UNKEYED_OPTIONS}
    return out


def _device_text(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda {torch.cuda.get_device_name(index)} capability {torch.cuda.get_device_capability(index)}"
    return f"{device.type} {platform.machine()}"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _versions() -> tuple:
    return (("python", sys.version), ("torch", torch.__version__), ("cuda", torch.version.cuda),
            ("triton", _version("triton")), ("transformers", _version("transformers")),
            ("stepfx", _stepfx_version()))


def _stepfx_version() -> str:
    from .. import __version__

    return __version__


@functools.cache
def _stepfx_source_digest() -> str:
    """SHA-256 over stepfx's own Python files (once per process, ~100 files)."""
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(_STEPFX_DIR)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, _STEPFX_DIR).encode())
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _switches() -> tuple:
    """Module constants that change what the passes emit."""
    from ..passes.fusion import fuse_generic_regions
    from ..codegen.registry import interpreting

    return (("fuse_generic_regions.ON_CPU", fuse_generic_regions.ON_CPU), ("TRITON_INTERPRET", interpreting()))


def _source_files(fn: Callable, model: torch.nn.Module, optimizer) -> dict[str, str]:
    """path -> content digest of the step function's file and of every
    module class's and the optimizer class's (torch's own excepted)."""
    owners: list[Any] = [getattr(fn, "__wrapped__", fn)]
    owners += list(dict.fromkeys(type(m) for m in model.modules()))
    if optimizer is not None:
        owners.append(type(optimizer))
    out: dict[str, str] = {}
    for owner in owners:
        if isinstance(owner, type) and owner.__module__.split(".")[0] == "torch":
            continue
        path = source_file(owner)
        if path is None:
            what = getattr(owner, "__qualname__", None) or type(owner).__qualname__
            raise NotCacheable(f"{what} has no Python source file to key its code by (defined interactively?)")
        if path.startswith(_TORCH_DIR):
            continue
        digest = file_digest(path)
        if digest is None:
            raise NotCacheable(f"cannot read {path}")
        out[path] = digest
    return out
