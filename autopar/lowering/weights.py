"""Weight files for ``compile(..., weights=PATH)`` and ``autopar.materialize(..., weights=PATH)``.

A source is a safetensors file or a directory of ``*.safetensors`` shards (the names of every shard
together; a name in two shards is an error). Opening one reads only the files' headers; a tensor is
read when asked for (``safe_open(...).get_tensor(name)``), so a rank reads only the tensors it holds.

Names are the keys of the model's ``state_dict()``. A tensor reachable under several names (a tied
embedding and LM head) is found under any of them, as ``safetensors.torch.save_model`` keeps one.
Autopar checkpoints (``compiled.save``) are not read here yet: a directory without safetensors files
raises ``WeightsError`` saying so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from autopar.errors import AutoparError

__all__ = ["WeightsError", "WeightSource", "open_weights"]


class WeightsError(AutoparError):
    """A weights path that cannot be read, or a tensor in it that does not fit the model."""


class WeightSource:
    """The tensors of one safetensors file or directory of shards, by name (read lazily)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file_of: dict[str, Path] = {}
        files = self._files()
        try:
            from safetensors import safe_open
        except ImportError as exc:   # a dependency of autopar, but say what is missing
            raise WeightsError("weights: reading safetensors needs the safetensors package "
                               "(pip install safetensors)") from exc
        self._safe_open = safe_open
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as handle:
                    keys = list(handle.keys())
            except Exception as exc:  # noqa: BLE001 - any header error: name the file
                raise WeightsError(f"weights: {f} is not a readable safetensors file: {exc}") from exc
            for k in keys:
                if k in self._file_of:
                    raise WeightsError(f"weights: tensor {k!r} is in both {self._file_of[k]} and {f}")
                self._file_of[k] = f
        self.reads: list[str] = []           # names read so far, in order (tests count them)

    def _files(self) -> list[Path]:
        p = self.path
        if not p.exists():
            raise WeightsError(f"weights: {p} does not exist")
        if p.is_file():
            return [p]
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"weights: {p} is a directory without *.safetensors files; autopar "
                               "checkpoints (compiled.save) are not loadable through weights= yet")
        return files

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._file_of)

    def find(self, aliases: Sequence[str]) -> str | None:
        """The first of ``aliases`` the source holds (None: none)."""
        return next((a for a in aliases if a in self._file_of), None)

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Tensor ``name`` on the CPU, checked against the shape of ``like`` and cast to its dtype."""
        with self._safe_open(str(self._file_of[name]), framework="pt") as handle:
            t = handle.get_tensor(name)
        self.reads.append(name)
        if tuple(t.shape) != tuple(like.shape):
            raise WeightsError(f"weights: {name!r} has shape {tuple(t.shape)} in {self._file_of[name]} but "
                               f"the model's is {tuple(like.shape)}")
        return t.to(like.dtype)


def open_weights(path) -> WeightSource | None:
    """A ``WeightSource`` for ``path`` (None passes through; a source is returned as is)."""
    if path is None or isinstance(path, WeightSource):
        return path
    return WeightSource(path)
