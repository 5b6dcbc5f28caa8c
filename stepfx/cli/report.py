"""``stepfx report``: versions, devices, backends and kernel caches (as DeepSpeed's ``ds_report``)."""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from typing import Any, Callable

from .status import EXIT_OK

__all__ = ["environment_report"]

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

    from .. import __version__, compat
    from ..codegen import available

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


