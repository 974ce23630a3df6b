"""The local GPU as tuning runs and benchmarks see it, and the peak figures they report against.

``DevicePeak`` is what a fraction of peak is measured against: any object with the HBM bandwidth
(``mem_bandwidth_Bps``, bytes per second) and the dense 16-bit tensor-core throughput
(``peak_flops_bf16``, FLOP per second, no sparsity). This package keeps no table of devices: the
caller passes the peak in (``kernels.tune.tune(peak=...)``, ``kernels.tune.main(peak_for=...)``).
autopar's CLI and benchmarks pass a preset of the one device table, ``autopar.cluster.devices``
(its ``DeviceSpec`` has both figures; ``match_preset(name, memory_bytes)`` finds the local GPU's),
since ``kernels/`` imports nothing of autopar. Without a peak no fraction of peak is reported.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["DevicePeak", "local_device_name", "local_device_memory_bytes"]


class DevicePeak(Protocol):
    """The peak figures of one device (``autopar.cluster.devices.DeviceSpec`` is one)."""
    mem_bandwidth_Bps: float
    peak_flops_bf16: float


def local_device_name() -> str | None:
    """The name of the current CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.cuda.current_device())


def local_device_memory_bytes() -> int | None:
    """The memory of the current CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
