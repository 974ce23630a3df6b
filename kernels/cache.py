"""The tuning cache: the best launch config and its time, per (device name, kernel, shape bucket).

Terms:
- *kernel*: a kernel name from ``KERNEL_NAMES``; a backward pass is stored as ``"<name>.bwd"``.
- *canonical shape*: ``(num_rows, num_cols)`` for the row and elementwise kernels (leading dims folded
  into rows, as the kernels see them), ``(M, N, K)`` for matmul.
- *shape bucket*: the dtype and the canonical shape with every dim rounded up to a power of two, e.g.
  ``"bfloat16:8192x4096"``; shapes in one bucket share a config.

The file is JSON at ``$AUTOPAR_CACHE_DIR/kernels.json`` (default ``~/.cache/autopar/kernels.json``):
``{"version": 1, "devices": {device: {kernel: {bucket: entry}}}}`` where an entry holds ``config``
(a dict, see ``kernels.configs``), ``time_s``, the measured ``shape`` and ``dtype``, and versions.
Reading never fails: a missing or unreadable file is an empty cache.
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
from pathlib import Path

import torch

from ._common import next_power_of_2
from .configs import config_from_dict

__all__ = [
    "KERNEL_NAMES",
    "cache_path",
    "canonical_shape",
    "shape_bucket",
    "read_cache",
    "write_entries",
    "lookup",
    "tuned_config",
    "invalidate",
]

KERNEL_NAMES = ("layer_norm", "rms_norm", "softmax", "bias_gelu", "swiglu", "cross_entropy", "matmul")
CACHE_VERSION = 1


def cache_path() -> Path:
    base = os.environ.get("AUTOPAR_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "autopar"
    return root / "kernels.json"


def _base_kernel(kernel: str) -> str:
    base = kernel.removesuffix(".bwd")
    if base not in KERNEL_NAMES:
        raise ValueError(f"kernel: unknown kernel {kernel!r}; expected one of {KERNEL_NAMES} (or '<name>.bwd')")
    return base


def canonical_shape(kernel: str, shape) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if _base_kernel(kernel) == "matmul":
        if len(shape) != 3:
            raise ValueError(f"shape: matmul shapes are (M, N, K), got {shape}")
        return shape
    if not shape:
        raise ValueError(f"shape: {kernel} needs at least one dimension")
    return (math.prod(shape[:-1]), shape[-1])


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else str(dtype)


def shape_bucket(kernel: str, shape, dtype) -> str:
    dims = "x".join(str(next_power_of_2(d)) for d in canonical_shape(kernel, shape))
    return f"{_dtype_name(dtype)}:{dims}"


@functools.lru_cache(maxsize=8)
def _read(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    devices = data.get("devices")
    return devices if isinstance(devices, dict) else {}


def read_cache(path: Path | str | None = None) -> dict:
    """``{device: {kernel: {bucket: entry}}}``; empty when the file is absent or unreadable."""
    return _read(str(path or cache_path()))


def invalidate() -> None:
    """Forget what was read, so that the next lookup reads the file again."""
    _read.cache_clear()
    _tuned.cache_clear()


def write_entries(entries: list[tuple[str, str, str, dict]], path: Path | str | None = None) -> Path:
    """Merge ``(device, kernel, bucket, entry)`` tuples into the cache file, atomically."""
    path = Path(path or cache_path())
    devices = json.loads(json.dumps(read_cache(path)))  # a private deep copy
    for device, kernel, bucket, entry in entries:
        devices.setdefault(device, {}).setdefault(kernel, {})[bucket] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kernels-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": CACHE_VERSION, "devices": devices}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    invalidate()
    return path


def lookup(device: str, kernel: str, shape, dtype, path: Path | str | None = None) -> dict | None:
    """The cache entry for this device, kernel and the bucket of ``shape``, or None."""
    bucket = shape_bucket(kernel, shape, dtype)
    return read_cache(path).get(device, {}).get(kernel, {}).get(bucket)


@functools.lru_cache(maxsize=4096)
def _tuned(path: str, device: str, kernel: str, bucket: str):
    entry = _read(path).get(device, {}).get(kernel, {}).get(bucket)
    if not entry or "config" not in entry:
        return None
    try:
        return config_from_dict(entry["config"])
    except (TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=16)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def tuned_config(kernel: str, shape, dtype, device: torch.device):
    """The tuned launch config for a call on ``device``, or None (CPU, or not tuned yet)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _tuned(str(cache_path()), _cuda_name(index), kernel, shape_bucket(kernel, shape, dtype))
