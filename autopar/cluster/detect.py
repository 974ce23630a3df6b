"""Detection: this machine's devices as a cluster's specs.

A CUDA/ROCm GPU is matched to a preset by its name and memory (``autopar.cluster.devices.match_preset``);
an unknown part gets its real memory and nominal compute (the cost model measures it). Nothing is
probed at import; ``detect_gpu_specs()`` probes when called.
"""

from __future__ import annotations

import re

from autopar.cluster.devices import PCIE4_X16_Bps, DeviceSpec, match_preset

__all__ = ["detect_gpu_specs"]


def detect_gpu_specs() -> list[DeviceSpec]:
    """One spec per visible CUDA/ROCm device, in device order; empty without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return []
    specs = []
    vendor = "amd" if getattr(torch.version, "hip", None) else "nvidia"
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        spec = match_preset(props.name, props.total_memory)
        if spec is None:
            # Unknown part: real memory, nominal compute (the cost model measures it).
            spec = DeviceSpec(name=re.sub(r"\s+", "-", props.name.strip()), vendor=vendor,
                              peak_flops_bf16=100e12, peak_flops_fp32=10e12,
                              memory_bytes=int(props.total_memory), mem_bandwidth_Bps=1000e9,
                              intra_bandwidth_Bps=PCIE4_X16_Bps)
        specs.append(spec)
    return specs
