"""Peak figures of the GPUs that tuning runs and benchmarks report against.

``DevicePeak`` gives the HBM bandwidth (``mem_bandwidth_Bps``, bytes per second) and the dense 16-bit
tensor-core throughput (``bf16_flops``, FLOP per second, no sparsity). A CUDA device name matches the
first entry whose ``pattern`` it contains (case-insensitive); an unknown device has no peak, and then
no fraction of peak is reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DevicePeak", "PEAKS", "device_peak", "local_device_name", "peak_for"]


@dataclass(frozen=True, slots=True)
class DevicePeak:
    pattern: str
    mem_bandwidth_Bps: float
    bf16_flops: float


# Most specific first. Figures from NVIDIA's datasheets.
PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak("H200", 4.8e12, 989e12),          # H200 SXM: 4.8 TB/s HBM3e, 1,979 TFLOPS bf16 sparse = 989 dense
    DevicePeak("H100 PCIe", 2.0e12, 756e12),     # H100 PCIe: 2.0 TB/s HBM2e, 1,513 sparse = 756 dense
    DevicePeak("H100", 3.35e12, 989e12),         # H100 SXM: 3.35 TB/s HBM3, 1,979 sparse = 989 dense
    DevicePeak("A100-SXM4-80GB", 2.039e12, 312e12),  # A100 80GB SXM: 2,039 GB/s, 312 TFLOPS bf16 dense
    DevicePeak("A100 80GB PCIe", 1.935e12, 312e12),  # A100 80GB PCIe: 1,935 GB/s
    DevicePeak("A100", 1.555e12, 312e12),        # A100 40GB: 1,555 GB/s
)


def peak_for(name: str | None) -> DevicePeak | None:
    if not name:
        return None
    lowered = name.lower()
    return next((p for p in PEAKS if p.pattern.lower() in lowered), None)


def local_device_name() -> str | None:
    """The name of the current CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.cuda.current_device())


def device_peak() -> DevicePeak | None:
    """The peak figures of the current CUDA device, or None (no GPU, or not in the table)."""
    return peak_for(local_device_name())
