"""Where in the user's code something happened.

A "user frame" is the innermost frame that is neither torch's nor stepfx's
own code: the user's step function, their model, or a library model such as
a Hugging Face ``modeling_*.py`` (that is the code the user runs).
"""
from __future__ import annotations

import functools
import inspect
import linecache
import os
import re
import sys
import traceback
import types

import torch

__all__ = ["is_user_file", "user_frame_from_stack_trace", "user_frame_from_traceback", "format_frame"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STEPFX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_DIR) or path.startswith(_STEPFX_DIR):
        return False
    return not (filename.startswith("<") and filename.endswith(">"))


def format_frame(filename: str, lineno: int, func: str | None = None, code: str | None = None) -> str:
    text = f"{filename}:{lineno}"
    if func:
        text += f" in {func}"
    if code:
        text += f": {code.strip()}"
    return text


def user_frame_from_stack_trace(stack_trace: str | None) -> str | None:
    """The innermost user frame of an fx ``stack_trace`` string, as
    ``file:line in func: code``."""
    if not stack_trace:
        return None
    lines = stack_trace.splitlines()
    found = None
    for i, line in enumerate(lines):
        m = _FRAME_RE.match(line)
        if m and is_user_file(m["file"]):
            code = lines[i + 1] if i + 1 < len(lines) and not _FRAME_RE.match(lines[i + 1]) else None
            found = format_frame(m["file"], int(m["line"]), m["func"], code)
    return found


def user_frame_from_traceback(tb: types.TracebackType | None) -> str | None:
    """The innermost user frame of an exception's traceback."""
    found = None
    for frame in traceback.extract_tb(tb):
        if is_user_file(frame.filename):
            found = format_frame(frame.filename, frame.lineno, frame.name, frame.line)
    return found


def library_of_traceback(tb: types.TracebackType | None) -> tuple[str, str | None] | None:
    """When the innermost user frame of an exception's traceback is inside an
    installed package (``site-packages``/``dist-packages``: a model library,
    not the user's code), ``(package, the innermost frame outside installed
    packages)`` - the line of the user's own that led there, None if none
    did. None when the innermost user frame is the user's own."""
    frames = [f for f in traceback.extract_tb(tb) if is_user_file(f.filename)]
    if not frames:
        return None
    package = _installed_package(frames[-1].filename)
    if package is None:
        return None
    own = [f for f in frames if _installed_package(f.filename) is None]
    return package, (format_frame(own[-1].filename, own[-1].lineno, own[-1].name, own[-1].line) if own else None)


def innermost_user_line(tb: types.TracebackType | None) -> str:
    """The source text of the innermost user frame of an exception's traceback ("" if none)."""
    frames = [f for f in traceback.extract_tb(tb) if is_user_file(f.filename)]
    return (frames[-1].line or "") if frames else ""


def _installed_package(filename: str) -> str | None:
    """The top-level package or module a file under ``site-packages``/``dist-packages`` belongs to."""
    parts = os.path.abspath(filename).split(os.sep)
    for i in range(len(parts) - 2, -1, -1):  # the innermost such directory
        if parts[i] in ("site-packages", "dist-packages"):
            return parts[i + 1].removesuffix(".py")
    return None


def user_frame_of_caller() -> str | None:
    """The innermost user frame of the current Python stack."""
    found = None
    for frame in traceback.extract_stack():
        if is_user_file(frame.filename):
            found = format_frame(frame.filename, frame.lineno, frame.name, frame.line)
    return found


def innermost_user_frame() -> str | None:
    """The innermost user frame of the running Python stack, cheaply (a
    walk up the frame chain; no traceback objects): called once per traced
    op."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename):
            line = linecache.getline(code.co_filename, frame.f_lineno)
            return format_frame(code.co_filename, frame.f_lineno, code.co_name, line or None)
        frame = frame.f_back
    return None


def named_free_objects(fn) -> list[tuple[str, object]]:
    """(name, value) of what ``fn`` reads from its enclosing scopes: its
    closure cells, then the module globals its code names."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    found = []
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            found.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    module_globals = getattr(fn, "__globals__", {})
    found += [(name, module_globals[name]) for name in code.co_names if name in module_globals]
    return found


def other_module_tensors(fn, args: tuple, kwargs: dict, model) -> dict[int, str]:
    """id -> where it lives, for the parameters and buffers of modules the
    step reaches besides the one it trains (an EMA copy, a teacher): those
    passed as its arguments and those it reads from its scope."""
    modules = [(f"its argument #{i + 3}", a) for i, a in enumerate(args) if isinstance(a, torch.nn.Module)]
    modules += [(f"its argument {k}=", v) for k, v in kwargs.items() if isinstance(v, torch.nn.Module)]
    modules += [(f"{name!r} from its scope", v) for name, v in named_free_objects(fn) if isinstance(v, torch.nn.Module)]
    own = {id(t) for t in list(model.parameters()) + list(model.buffers())}
    found: dict[int, str] = {}
    for where, module in modules:
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if id(t) not in own:
                found.setdefault(id(t), f"{name} of {type(module).__name__} ({where})")
    return found
