"""Reading torch.distributed.checkpoint directories without unpickling arbitrary objects.

DCP's `.metadata` file is a pickle. It is read through an allow-list of the plain data types DCP
writes, so a tampered checkpoint cannot run code; tensor payloads are read with weights_only.
Shared by the training checkpoints (amsp/checkpoint.py) and the Hugging Face export, which both
read the same on-disk format (models/ may not import amsp/, so it lives here).
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
}


def _allowed(module: str, name: str) -> bool:
    # Only the plain data types DCP writes into its metadata: no callables with side effects.
    if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
        return True
    return (module, name) in _ALLOWED_GLOBALS


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not on the "
                                         f"allow-list of DCP metadata types; refusing to load it")
        return super().find_class(module, name)


class SafeFileSystemReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is unpickled through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
