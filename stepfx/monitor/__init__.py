"""stepfx.monitor: training logs (``steps_per_print``) and DeepSpeed's monitor blocks.

    monitor = Monitor(config, rank=rank, world_size=world_size)   # once, from the resolved config
    monitor.after_update(updates, loss=loss, lr=lr, tokens=tokens)   # after every optimizer update
    monitor.close()

``monitor.py``: the Monitor (what is logged when, and the no-sync
invariant). ``log.py``: the log line. ``writers.py``: tensorboard,
csv_monitor and wandb, as DeepSpeed writes them. ``step_values.py``: the
conventions that find a step's loss, token count and FLOPs per token.
Imports config and torch; nothing of stepfx imports it but the public face.
"""
from .log import Summary, format_line
from .monitor import MAX_PENDING, PHASES, TAGS, Monitor
from .step_values import dense_flops_per_token, loss_of, tokens_in
from .writers import CSVWriter, TensorBoardWriter, WandbWriter, Writer, check_writers_available, writers_from_config

__all__ = [
    "CSVWriter", "MAX_PENDING", "Monitor", "PHASES", "Summary", "TAGS", "TensorBoardWriter", "WandbWriter", "Writer",
    "check_writers_available", "dense_flops_per_token", "format_line", "loss_of", "tokens_in", "writers_from_config",
]
