"""DCP's file system reader and load planner, made safe: what ``sharded`` reads a checkpoint with.

Kept apart from ``sharded`` because defining them imports DCP (and with it
DTensor), about 0.7 s of CPU that every process importing pipeddp would pay;
``sharded`` imports this module only when it reads a checkpoint.
"""

from __future__ import annotations

import importlib
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from .checkpoint import DCP_METADATA as METADATA
from .checkpoint import DamagedCheckpointError, UnsafeCheckpointError

__all__ = ["SafeReader", "SafeLoadPlanner"]

#: The only globals a DCP metadata file may reference: its dataclasses and the torch values inside them.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle`` restricted to the classes of DCP's metadata (and torch dtypes): nothing else can be built."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"references {module}.{name}")


class SafeReader(FileSystemReader):
    """DCP's file system reader, with the metadata unpickled by ``_MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self.fs.concat_path(self.path, METADATA)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise DamagedCheckpointError(f"its {METADATA} holds a {type(metadata).__name__}, not DCP's metadata")
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            where: Any = self.original_state_dict  # nested dicts and lists, addressed by the key path
            path = self.mappings[fqn]
            for key in path[:-1]:
                where = where[key]
            where[path[-1]] = loaded
        else:
            self.state_dict[fqn] = loaded
