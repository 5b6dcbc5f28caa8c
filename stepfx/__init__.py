"""stepfx: a compiler for PyTorch training steps.

Decorate an ordinary training step with ``@stepfx.parallelize(config)``;
stepfx captures forward, backward and optimizer update as one graph,
rewrites it with passes and runs it.
"""
from . import testing  # noqa: F401  (stepfx.testing is public)
from .api import ParallelStep, parallelize
from .config import Config, ConfigError, load_config
from .errors import CaptureError, CaptureWarning, ExecutionError, PassError, StepfxError

__all__ = [
    "parallelize",
    "ParallelStep",
    "Config",
    "ConfigError",
    "load_config",
    "StepfxError",
    "CaptureError",
    "CaptureWarning",
    "PassError",
    "ExecutionError",
]
__version__ = "0.1.0"
