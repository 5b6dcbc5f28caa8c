"""Checkpoints of a training run (torch.distributed.checkpoint underneath):
save/load with resharding (checkpoint.py), Hugging Face safetensors export
(export.py), DeepSpeed ZeRO checkpoints imported (deepspeed_import.py),
safe reading of DCP's index (storage.py)."""
from .checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint, save_checkpoint
from .deepspeed_import import import_deepspeed
from .export import export_checkpoint, save_pretrained, write_safetensors
from .storage import SafeReader, UnsafeCheckpointError, read_index

__all__ = ["CheckpointError", "SafeReader", "UnsafeCheckpointError", "export_checkpoint", "import_deepspeed",
           "load_checkpoint", "read_index", "resolve_checkpoint", "save_checkpoint", "save_pretrained",
           "write_safetensors"]
