"""stepfx.config: DeepSpeed JSON configs, read as DeepSpeed reads them, as typed frozen dataclasses.

Plain data: this package imports nothing else of stepfx and reads no
environment variables. Reference: DeepSpeed v0.19.5 (commit edaa722),
transformers ``integrations/deepspeed.py`` and accelerate 1.x for "auto".

    from stepfx.config import load_config, resolve_auto, resolve_batch_sizes
    config = load_config("ds_config.json")            # ConfigError / ConfigWarning
    config = resolve_auto(config, hidden_size=4096, world_size=8, micro_batch_size=4, ...)
    train, micro, gas = resolve_batch_sizes(config, dp_world_size=8)

Which block is read strictly and which leniently, and why: ``rules.py``
(the rules), ``zero.py``, ``precision.py``, ``blocks.py``, ``schema.py``
(each block, with its DeepSpeed source). Keys stepfx acts on: ``applied.py``.
"""
from .applied import APPLIED
from .auto import resolve_auto, resolve_zero_auto
from .batch import resolve_batch_sizes
from .blocks import OptimizerConfig, SchedulerConfig, StepfxOptions
from .config import Config
from .errors import ConfigError, ConfigWarning
from .load import load_config
from .precision import BF16Config, FP16Config
from .tensor_parallel import LayerSpec, TensorParallelConfig, check_tensor_parallel
from .values import AUTO
from .zero import OffloadConfig, ZeroConfig

__all__ = [
    "AUTO", "APPLIED", "BF16Config", "Config", "ConfigError", "ConfigWarning", "FP16Config", "OffloadConfig",
    "LayerSpec", "OptimizerConfig", "SchedulerConfig", "StepfxOptions", "TensorParallelConfig", "ZeroConfig",
    "check_tensor_parallel", "load_config", "resolve_auto",
    "resolve_batch_sizes", "resolve_zero_auto",
]
