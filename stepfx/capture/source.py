"""Where in the user's code something happened.

A "user frame" is the innermost frame that is neither torch's nor stepfx's
own code: the user's step function, their model, or a library model such as
a Hugging Face ``modeling_*.py`` (that is the code the user runs).
"""
from __future__ import annotations

import functools
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
