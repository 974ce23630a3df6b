"""Reading a DCP checkpoint without running code from it.

``torch.distributed.checkpoint`` keeps its metadata as a pickle (``.metadata``) and byte items as
``torch.save`` files, and reads them with ``pickle.load`` and ``torch.load(weights_only=False)``: a
planted file runs whatever it names. Here:

- ``.metadata`` is unpickled by ``_MetadataUnpickler``, which resolves only the classes DCP's own
  metadata is made of (``ALLOWED``: its dataclasses, ``torch.Size``, dtypes, layouts, paths); any other
  name stops the read with ``CheckpointError`` naming the file and the name;
- byte items (a rank's RNG state and data position) are read with ``torch.load(weights_only=True)``:
  tensors and plain containers only;
- ``check_owner`` refuses a checkpoint directory, or a file in it, that another user owns or can write.

What is trusted, and why: ``docs/security.md``.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

from autopar.checkpoint.error import CheckpointError

__all__ = ["ALLOWED", "safe_reader", "read_metadata_file", "read_state_metadata", "read_byte_item", "check_owner"]

ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),      # and every dtype (``_MetadataUnpickler.find_class``)
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"checkpoint: {self._path} names {module}.{name}, which DCP's metadata never "
                              "holds; refused without running it (a planted or foreign file)")


def read_metadata_file(path: Path):
    """DCP's ``Metadata`` in ``path`` through the allow-list (module docstring)."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, MemoryError) as exc:
        raise CheckpointError(f"checkpoint: {path} cannot be read ({type(exc).__name__}: {exc}); "
                              "nothing was loaded") from None


def safe_reader(directory):
    """A ``FileSystemReader`` of ``directory`` whose metadata goes through the allow-list."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            md = read_metadata_file(Path(self._get_metadata_path(kwargs.get("rank"))))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader(str(directory))


def read_state_metadata(directory) -> dict:
    """``state_dict_metadata`` of the checkpoint in ``directory``, read through the allow-list."""
    return safe_reader(directory).read_metadata().state_dict_metadata


def read_byte_item(value: io.BytesIO, what: str) -> Any:
    """A byte item (``what`` names it in errors) as ``torch.load(weights_only=True)`` reads it."""
    import torch

    try:
        return torch.load(value, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ...
        raise CheckpointError(f"checkpoint: the item {what} holds more than tensors and plain data "
                              f"({str(exc).splitlines()[0][:200]}); refused without running it") from None


def check_owner(directory: Path) -> None:
    """``CheckpointError`` when ``directory`` or a file directly in it belongs to another user or can be
    written by other users (group or world): its contents could have been replaced under its owner."""
    if not hasattr(os, "getuid"):   # pragma: no cover - not POSIX
        return
    me = os.getuid()
    for p in (directory, *sorted(directory.iterdir())):
        st = os.lstat(p)
        if st.st_uid != me or st.st_mode & 0o022:
            who = "another user owns" if st.st_uid != me else "other users can write"
            raise CheckpointError(f"checkpoint: {p}: {who} it (mode {st.st_mode & 0o777:o}); a checkpoint is "
                                  "read only from this user's own directories (chmod go-w, or copy it)")
