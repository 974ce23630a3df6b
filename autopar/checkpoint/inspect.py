"""Reading a checkpoint without a job: what it holds (``describe``) and the full model state for export
(``consolidate``).

Tensor names: a checkpoint of a compiled model stores the model's parameters and buffers under
``model.<fqn>`` and the optimizer state under ``optim.<fqn>.<key>`` (``MODEL_PREFIX``); ``consolidate``
writes the model's tensors (prefix removed) to one safetensors file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from autopar.checkpoint.pieces import whole_piece
from autopar.checkpoint.safe_read import read_state_metadata
from autopar.checkpoint.store import CheckpointError, Manifest, load, read_manifest

__all__ = ["MODEL_PREFIX", "TensorEntry", "describe", "consolidate"]

MODEL_PREFIX = "model."


@dataclass(frozen=True)
class TensorEntry:
    fqn: str
    shape: tuple[int, ...]
    dtype: str
    num_chunks: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def describe(directory) -> tuple[Manifest, list[TensorEntry]]:
    """The manifest (step, plan, files) and every tensor saved: full shape, dtype, how many pieces."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    manifest = read_manifest(directory)
    md = read_state_metadata(manifest.path)
    entries = [TensorEntry(fqn, tuple(m.size), str(m.properties.dtype).removeprefix("torch."), len(m.chunks))
               for fqn, m in sorted(md.items()) if isinstance(m, TensorStorageMetadata)]
    return manifest, entries


def consolidate(directory, out, *, prefix: str = MODEL_PREFIX) -> dict[str, tuple[int, ...]]:
    """Write the full tensors named ``prefix...`` (the model state) of the checkpoint to the safetensors file
    ``out``, prefix removed; returns their shapes. Holds the full model state (it is an export)."""
    from safetensors.torch import save_file

    _, entries = describe(directory)
    pieces = [whole_piece(e.fqn, torch.empty(e.shape, dtype=getattr(torch, e.dtype)))
              for e in entries if e.fqn.startswith(prefix)]
    if not pieces:
        raise CheckpointError(f"checkpoint: {directory} holds no tensor named {prefix}*: nothing to consolidate")
    load(directory, pieces)          # one read of the checkpoint: every tensor whole
    tensors = {p.fqn[len(prefix):]: p.tensor for p in pieces}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    return {k: tuple(v.shape) for k, v in tensors.items()}
