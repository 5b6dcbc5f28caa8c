"""The one line the monitor logs every ``steps_per_print`` updates.

    stepfx: step 100 | loss 2.3456 | lr 1.000e-04 | 41,000 tokens/s | 80.0 samples/s | MFU 38.5% |
    peak memory 12.30 GiB | loss scale 65536 | skipped 0 | ms/update: forward 12.1, backward 25.0

(one line; wrapped here). A field is left out when its value is not known
(no FLOPs figures: no MFU; not fp16: no loss scale). Everything but lr,
loss scale and skipped steps (values at the printed step) summarises the
window of updates since the previous line.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Summary", "format_line"]


@dataclass
class Summary:
    """What one log line says. ``phase_ms``: mean milliseconds per update of
    each wall-clock-breakdown phase, in the order given."""

    step: int
    loss: float | None = None
    lr: float | None = None
    tokens_per_second: float | None = None
    samples_per_second: float | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None
    loss_scale: float | None = None
    skipped_steps: int | None = None
    phase_ms: dict[str, float] = field(default_factory=dict)


def format_line(s: Summary) -> str:
    parts = [f"step {s.step}"]
    if s.loss is not None:
        parts.append(f"loss {s.loss:.4f}")
    if s.lr is not None:
        parts.append(f"lr {s.lr:.3e}")
    if s.tokens_per_second is not None:
        parts.append(f"{s.tokens_per_second:,.0f} tokens/s")
    if s.samples_per_second is not None:
        parts.append(f"{s.samples_per_second:,.1f} samples/s")
    if s.mfu is not None:
        parts.append(f"MFU {100 * s.mfu:.1f}%")
    if s.peak_memory_bytes is not None:
        parts.append(f"peak memory {s.peak_memory_bytes / 2**30:.2f} GiB")
    if s.loss_scale is not None:
        parts.append(f"loss scale {s.loss_scale:g}")
    if s.skipped_steps is not None:
        parts.append(f"skipped {s.skipped_steps}")
    if s.phase_ms:
        parts.append("ms/update: " + ", ".join(f"{name} {ms:.1f}" for name, ms in s.phase_ms.items()))
    return "stepfx: " + " | ".join(parts)
