"""What the measuring parts of the cost model share: where measurements are cached, reading and
writing that cache, and the example batch tiled to a given size.

Terms
- measurement cache: one JSON file per kind under ``cache_dir()`` (``$AUTOPAR_CACHE_DIR``, default
  ``~/.cache/autopar``); block timings and the step terms (``autopar.cost.step``) both live in
  ``measure.json``. A cache that cannot be read is empty; one that cannot be written is skipped.
- tiled batch: the example inputs repeated row by row to ``b`` rows (``tile_batch``), so a block can be
  timed at any micro-batch size from a small example.

Used by ``autopar.cost.profile`` and ``autopar.cost.step``; neither imports the other's internals.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__all__ = ["cache_dir", "measure_cache_path", "load_json", "save_json", "tile_batch"]


def cache_dir() -> Path:
    """The folder of autopar's measurement caches (``$AUTOPAR_CACHE_DIR`` or ``~/.cache/autopar``)."""
    root = os.environ.get("AUTOPAR_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "autopar"


def measure_cache_path() -> Path:
    """The file that caches block timings and step terms."""
    return cache_dir() / "measure.json"


def load_json(path: Path) -> dict:
    """The JSON object in ``path``; ``{}`` when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file, then a rename); skipped on a read-only
    home."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measurements are just not cached


def tile_batch(inputs: tuple, b: int) -> tuple:
    """``inputs`` with every tensor of dim >= 1 tiled row by row to ``b`` rows (row ``i`` is example row
    ``i % n``); other values pass through."""
    out = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            idx = torch.arange(b, device=t.device) % t.shape[0]
            out.append(t[idx])
        else:
            out.append(t)
    return tuple(out)
