"""Reading checkpoint files without running code from them.

torch.distributed.checkpoint (DCP) writes tensors in ``__<rank>_<n>.distcp``
files, which its reader loads with ``torch.load(weights_only=True)``, and
its index in a ``.metadata`` file that it reads with a plain
``pickle.load``: a crafted ``.metadata`` runs any code it names.
:class:`SafeReader` reads the index with an unpickler that rebuilds only
the classes DCP's index is made of (its metadata dataclasses, ``torch.Size``,
dtypes, layouts, paths) and refuses everything else with
:class:`UnsafeCheckpointError`, naming the file and the global it asked for.
stepfx's checkpoints store no pickled objects besides that index: their
non-tensor state is JSON.
"""
from __future__ import annotations

import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

__all__ = ["SafeReader", "UnsafeCheckpointError", "read_index"]

METADATA_FILE = ".metadata"

# (module, name) pairs DCP's index pickles refer to; measured on torch 2.11 and 2.13
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
_METADATA_CLASSES = {
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
    "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's index names something other than DCP's own metadata."""


class _IndexUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module == "torch.distributed.checkpoint.metadata" and name in _METADATA_CLASSES) or (module, name) in _ALLOWED:
            if module == "pathlib":
                return getattr(pathlib, name)
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.where}: the checkpoint index asks to load {module}.{name}, which is not part of a "
            f"torch.distributed.checkpoint index; refusing to unpickle it (the file may have been tampered with)"
        )


def read_index(directory: str | os.PathLike) -> dcp_metadata.Metadata:
    """DCP's ``.metadata`` of ``directory``, read with the restricted unpickler."""
    path = os.path.join(os.fspath(directory), METADATA_FILE)
    with open(path, "rb") as f:
        metadata = _IndexUnpickler(f, path).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{path}: not a torch.distributed.checkpoint index (got {type(metadata).__name__})")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader, reading the index safely (see the module
    docstring). Tensor data goes through DCP's own ``weights_only`` loads."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any):
        super().__init__(path, **kwargs)
        self._directory = os.fspath(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError(f"{self._directory}: per-rank checkpoint indexes are not a stepfx format")
        metadata = read_index(self._directory)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata
