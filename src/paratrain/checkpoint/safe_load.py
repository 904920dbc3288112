"""Loading a checkpoint never unpickles untrusted data.

DCP (torch 2.13) reads ``.metadata`` with plain ``pickle.load`` and non-tensor values with
``torch.load(weights_only=False)``; both can run code from a crafted checkpoint.
``safe_reader`` reads the metadata with an unpickler that admits only DCP's own metadata classes,
and ``safe_planner`` loads non-tensor values with ``weights_only=True``.
"""

from __future__ import annotations

import logging
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from paratrain.config import ConfigError

log = logging.getLogger("paratrain")


# Every global a DCP ``.metadata`` pickle of torch 2.13 refers to (found by recording the
# find_class calls while loading real paratrain checkpoints; DTensor shards of FSDP/TP are
# described by the same chunk classes): DCP's metadata dataclasses, torch.Size,
# dtypes, layouts (by name, through torch.serialization._get_layout), and pathlib paths (the
# checkpoint_id in StorageMeta). Constructing any of them runs no user-chosen code.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only DCP metadata classes, torch.Size and dtypes."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ConfigError(
            f"checkpoint {self.where} refers to {module}.{name}, which DCP metadata never contains;"
            " refusing to load it (unpickling it could run code): use a checkpoint you trust"
        )


def load_metadata(path: str, *, rank: int | None = None):
    """Read a DCP ``.metadata`` file (or a rank's ``__R.metadata``) with the restricted unpickler."""

    name = ".metadata" if rank is None else f"__{rank}.metadata"
    file = os.path.join(path, name)
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f, file).load()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or garbled: one clear line
        raise ConfigError(
            f"checkpoint metadata {file} cannot be read ({type(e).__name__}: {e}); the checkpoint is damaged"
        )
    if not isinstance(md, Metadata):
        raise ConfigError(f"checkpoint metadata {file} holds a {type(md).__name__}, not DCP Metadata; refusing it")
    return md


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata comes through the restricted unpickler, never plain pickle."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        md = load_metadata(os.fspath(self.path), rank=kwargs.get("rank"))
        for info in (md.storage_data or {}).values():
            # Shards are files of this folder, never paths that lead out of it.
            rel = os.fspath(getattr(info, "relative_path", ""))
            if not rel or os.path.basename(rel) != rel or rel in (".", ".."):
                raise ConfigError(
                    f"checkpoint {self.path}: its metadata points at {rel!r}, outside the"
                    " checkpoint folder; refusing it"
                )
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value) -> None:

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_reader(path: str):
    return SafeFileSystemReader(path)


def safe_planner(**kwargs):
    return SafeLoadPlanner(**kwargs)
