"""Checkpoints of a training run (torch.distributed.checkpoint underneath)."""
from .storage import SafeReader, UnsafeCheckpointError, read_index

__all__ = ["SafeReader", "UnsafeCheckpointError", "read_index"]
