"""From user code to one graph: capture a whole training step.

``capture_step`` traces forward, backward and optimizer update into one
aten-level StepGraph. Capture knows nothing of what happens next (passes,
runtime): it only describes the step.
"""
from .trace import LOSS_SCALE, CaptureOptions, StepInputs, capture_step, collect_inputs
from .optimizers import SUPPORTED_OPTIMIZERS, group_hyperparam_key

__all__ = [
    "CaptureOptions",
    "LOSS_SCALE",
    "StepInputs",
    "capture_step",
    "collect_inputs",
    "SUPPORTED_OPTIMIZERS",
    "group_hyperparam_key",
]
