"""The registry of kernels stepfx emits: launcher, eager reference, Triton source."""
from __future__ import annotations

import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Kernel", "KERNELS", "register", "kernel_source", "available", "interpreting"]


@dataclass(frozen=True)
class Kernel:
    """One kernel: ``launch`` runs it (Triton), ``reference`` is the eager
    PyTorch function with the same signature and meaning, ``jit`` are the
    ``@triton.jit`` functions it launches and the helpers they call (their
    source is what stepfx shows)."""

    name: str
    launch: Callable
    reference: Callable
    jit: tuple = field(default=())
    what: str = ""


KERNELS: dict[str, Kernel] = {}


def register(name: str, *, reference: Callable, jit: tuple = (), what: str = "") -> Callable[[Callable], Callable]:
    """Decorator for a kernel launcher: records it in :data:`KERNELS`."""

    if interpreting():
        from ..compat import patch_triton_language_once

        patch_triton_language_once()

    def wrap(launch: Callable) -> Callable:
        if name in KERNELS and KERNELS[name].launch is not launch:
            raise ValueError(f"kernel {name!r} registered twice")
        KERNELS[name] = Kernel(name, launch, reference, tuple(jit), what or (launch.__doc__ or "").strip().split("\n")[0])
        return launch

    return wrap


def kernel_source(name: str) -> str:
    """The Triton source of a registered kernel (every ``@triton.jit`` function it launches)."""
    kernel = KERNELS[name]
    parts = []
    for fn in kernel.jit:
        py = getattr(fn, "fn", fn)
        parts.append(inspect.getsource(py))
    return "\n\n".join(parts)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device_type: str) -> tuple[bool, str]:
    """Whether stepfx's Triton kernels can run on ``device_type``, and if not, why."""
    if importlib.util.find_spec("triton") is None:  # pragma: no cover - triton is a dependency
        return False, "triton is not installed"
    if device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        return True, ""
    if device_type == "cpu":
        if interpreting():
            return True, "Triton interpreter (TRITON_INTERPRET=1): correct but slow, for tests"
        return False, "Triton kernels need CUDA; on CPU only under TRITON_INTERPRET=1 (the interpreter, for tests)"
    return False, f"no Triton kernels for device type {device_type!r}"
