"""Tuned kernel times for the cost model, read from the tuning cache (``kernels.cache``).

``kernel_time_s(kernel, shape, dtype)`` is the time the tuning run measured for the winning config in
the shape's bucket, scaled by the work ratio between the asked shape and the measured one (elements
for the row and elementwise kernels, ``M*N*K`` for matmul): a bucket spans at most a factor of two per
dim, over which these kernels' time is close to proportional to work. None when nothing was measured.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .cache import canonical_shape, lookup
from .devices import local_device_name

__all__ = ["kernel_time_s"]


def kernel_time_s(kernel: str, shape, dtype: torch.dtype | str, *, device_name: str | None = None,
                  cache_path: Path | str | None = None) -> float | None:
    """Seconds for one call of ``kernel`` (``"layer_norm"``, ``"layer_norm.bwd"``, ``"matmul"``...) on
    ``shape`` (the input's shape; ``(M, N, K)`` for matmul) and ``dtype``, on ``device_name`` (default:
    the local GPU). None when the cache has no entry (or there is no GPU and no ``device_name``)."""
    device_name = device_name or local_device_name()
    if device_name is None:
        return None
    entry = lookup(device_name, kernel, shape, dtype, cache_path)
    if not entry or "time_s" not in entry:
        return None
    asked = math.prod(canonical_shape(kernel, shape))
    measured = math.prod(canonical_shape(kernel, entry.get("shape") or shape))
    return float(entry["time_s"]) * (asked / measured if measured else 1.0)
