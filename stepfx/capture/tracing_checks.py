"""Where a model library took its "being traced" path while stepfx traced it.

Hugging Face transformers asks ``is_tracing(tensor)`` before reading a
tensor's values in Python (is the attention mask all ones? are the position
ids one packed sequence?), and counts fake tensors as tracing, so under
stepfx's capture (as under torch.compile, where the same check is true) it
takes the path that needs no values: for a causal LM with ``use_cache=False``
and no attention mask it builds an explicit causal mask instead of calling
SDPA with ``is_causal=True`` as eager does. Both are right; they round
differently in the last bits, so such a step is not bitwise equal to eager.
The answers cannot be had without the values, so stepfx does not change
them: it watches the check and names each place it was taken (the library
line and the model line that led there) for ``explain()``.

How: while tracing, ``transformers.utils.import_utils.is_fake_tensor`` (the
test ``is_tracing`` makes of its tensor, looked up there by name at each
call) is wrapped; a True answer records its caller's caller (the library
function that asked) and the innermost frame outside transformers' mask and
utility code. Nothing is recorded when transformers is not imported.
"""
from __future__ import annotations

import contextlib
import linecache
import os
import sys
from dataclasses import dataclass
from typing import Iterator

from .source import format_frame

__all__ = ["TRACING_CHECKS_KEY", "TracingCheck", "watch_tracing_checks"]

TRACING_CHECKS_KEY = "library_tracing_checks"  # signature.extra: tuple[TracingCheck, ...]

# transformers' own plumbing between the model and the check
_PLUMBING = (os.sep + "transformers" + os.sep + "utils" + os.sep, os.sep + "transformers" + os.sep + "masking_utils.py",
             os.sep + "transformers" + os.sep + "integrations" + os.sep)


@dataclass(frozen=True)
class TracingCheck:
    where: str          # the library line that asked, "file:line in func: code"
    reached_from: str | None  # the model's line that led there

    def describe(self) -> str:
        text = f"transformers took its tracing path at {self.where}"
        return text + (f" (reached from {self.reached_from})" if self.reached_from else "")


def _frame_text(frame) -> str:
    code = frame.f_code
    return format_frame(code.co_filename, frame.f_lineno, code.co_name,
                        linecache.getline(code.co_filename, frame.f_lineno) or None)


@contextlib.contextmanager
def watch_tracing_checks() -> Iterator[list[TracingCheck]]:
    """Record, in the list yielded, each distinct place where transformers
    decided it was being traced."""
    seen: list[TracingCheck] = []
    utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(utils, "is_fake_tensor", None)
    if original is None:
        yield seen
        return

    def is_fake_tensor(*args, **kwargs):
        answer = original(*args, **kwargs)
        if answer:
            frame = sys._getframe(1)          # is_tracing
            asker = frame.f_back if frame.f_code.co_name == "is_tracing" else frame
            if asker is not None:
                outer = asker.f_back
                while outer is not None and any(p in os.path.abspath(outer.f_code.co_filename) for p in _PLUMBING):
                    outer = outer.f_back
                check = TracingCheck(_frame_text(asker), _frame_text(outer) if outer is not None else None)
                if check not in seen:
                    seen.append(check)
        return answer

    utils.is_fake_tensor = is_fake_tensor
    try:
        yield seen
    finally:
        utils.is_fake_tensor = original
