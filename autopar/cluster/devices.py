"""Device facts: one preset table of accelerator specifications, each figure cited from its datasheet.

Terms and units
- peak_flops_bf16: dense (no structured sparsity) bf16 tensor-core peak, FLOP/s. Devices without
  bf16 (V100, T4) carry their fp16 tensor-core peak instead; the comment says so.
- peak_flops_fp32: plain fp32 (non-tensor-core, "vector") peak, FLOP/s.
- memory_bytes: device memory capacity. Vendors' "GB" of device memory are binary: 80 GB = 80 GiB.
- mem_bandwidth_Bps, intra_bandwidth_Bps: bytes per second, decimal (1 GB/s = 1e9 B/s).
- intra_bandwidth_Bps: the default device-to-device link inside a node, per direction, aggregate per
  device (what one device can push into a ring through NVSwitch / Infinity Fabric / PCIe). Datasheets
  quote NVLink and Infinity Fabric as bidirectional aggregates: the table halves them.
- emulated device: a CPU process that runs the model at ``speed`` times this machine's CPU speed (the
  runtime slows it down). Its peak figures are nominal (``CPU_NOMINAL`` scaled by ``speed``); the cost
  model measures emulated devices instead of trusting them.
- native CPU device (the preset ``CPU``, ``device: cpu`` in a cluster file): this machine's CPU at its
  own speed, not emulated. Its rank gets no clock (as a GPU rank does); the cost model measures its
  time tables on this CPU, unscaled.

Nothing here probes the machine at import; ``cpu_spec_detect()`` does, when called.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Literal

from autopar.errors import ClusterError

__all__ = [
    "DeviceSpec", "Vendor", "VENDORS", "PRESETS", "CPU_NOMINAL", "PCIE3_X16_Bps", "PCIE4_X16_Bps",
    "PCIE5_X16_Bps", "SHARED_MEMORY_Bps", "GiB", "preset", "preset_names", "match_preset", "emulated_spec",
    "cpu_spec_detect", "NO_BF16",
]

Vendor = Literal["nvidia", "amd", "cpu", "other"]
VENDORS: tuple[str, ...] = ("nvidia", "amd", "cpu", "other")

GiB = 1 << 30
_T = 1e12  # TFLOP/s -> FLOP/s
_G = 1e9   # GB/s -> B/s

# Host links, per direction. PCIe x16: Gen3 32 GB/s, Gen4 64 GB/s, Gen5 128 GB/s bidirectional as
# NVIDIA/AMD datasheets quote them ("PCIe Gen4: 64 GB/s").
PCIE3_X16_Bps = 16 * _G
PCIE4_X16_Bps = 32 * _G
PCIE5_X16_Bps = 64 * _G
# Nominal copy bandwidth between two CPU processes of one machine (gloo over loopback / shared memory).
SHARED_MEMORY_Bps = 4 * _G


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str                     # "A100-80GB", or a custom/emulated name; the device *type* name
    vendor: str                   # "nvidia" | "amd" | "cpu" | "other"
    peak_flops_bf16: float        # dense bf16/fp16 FLOP/s
    peak_flops_fp32: float
    memory_bytes: int
    mem_bandwidth_Bps: float
    intra_bandwidth_Bps: float    # default device-to-device link inside a node
    emulate: str | None = None    # "cpu" for an emulated device (a CPU process at `speed`); None native
    speed: float = 1.0            # emulated devices only: fraction of this CPU's speed
    # emulated devices only: the speed it really runs at when not `speed` (None: `speed`); the planner
    # sees `speed`, the emulated clock runs `actual_speed` (autopar.runtime.emulate, docs/emulation.md)
    actual_speed: float | None = None

    def __post_init__(self):
        # A spec built in code; cluster files and dicts are validated (with field paths) in
        # autopar.cluster.schema before they get here.
        if not isinstance(self.name, str) or not self.name:
            raise ClusterError(f"DeviceSpec.name: {self.name!r} must be a non-empty string")
        if self.vendor not in VENDORS:
            raise ClusterError(f"DeviceSpec.vendor: {self.vendor!r} is not one of {VENDORS}")
        for field in ("peak_flops_bf16", "peak_flops_fp32", "memory_bytes", "mem_bandwidth_Bps",
                      "intra_bandwidth_Bps"):
            value = getattr(self, field)
            if not value > 0:
                raise ClusterError(f"DeviceSpec.{field}: {value!r} must be > 0 ({self.name})")
        if self.emulate not in (None, "cpu"):
            raise ClusterError(f"DeviceSpec.emulate: {self.emulate!r} must be None or 'cpu'")
        if not 0 < self.speed <= 1:
            raise ClusterError(f"DeviceSpec.speed: {self.speed!r} must be in (0, 1]")
        if self.actual_speed is not None and (self.emulate is None or not 0 < self.actual_speed <= 1):
            raise ClusterError(f"DeviceSpec.actual_speed: {self.actual_speed!r} must be in (0, 1], on an "
                               "emulated device only")

    @property
    def is_emulated(self) -> bool:
        return self.emulate is not None

    @property
    def run_speed(self) -> float:
        """The speed an emulated device's clock runs it at: ``actual_speed`` when given, else ``speed``."""
        return self.speed if self.actual_speed is None else self.actual_speed

    @property
    def backend(self) -> str:
        """torch.distributed backend: "gloo" for CPU and emulated devices, else "nccl" (RCCL on AMD;
        a vendor "other" accelerator is assumed to ship an NCCL-compatible collective library)."""
        return "gloo" if self.is_emulated or self.vendor == "cpu" else "nccl"

    @property
    def memory_GB(self) -> float:
        return self.memory_bytes / GiB


def _gpu(name, vendor, bf16_tflops, fp32_tflops, memory_gib, mem_GBps, intra_GBps) -> DeviceSpec:
    return DeviceSpec(name, vendor, bf16_tflops * _T, fp32_tflops * _T, int(memory_gib * GiB),
                      mem_GBps * _G, intra_GBps * _G)


# fmt: off
_PRESET_LIST: tuple[DeviceSpec, ...] = (
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 Tensor Core 312 TFLOPS (624 sparse),
    # FP32 19.5 TFLOPS, 80GB HBM2e at 2,039 GB/s, NVLink 600 GB/s (bidirectional) -> 300 per direction.
    _gpu("A100-80GB",     "nvidia",  312.0,  19.5,  80, 2039, 300),
    # Same datasheet (SXM4 40GB): 312 / 19.5 TFLOPS, 40GB HBM2 at 1,555 GB/s, NVLink 600 GB/s.
    _gpu("A100-40GB",     "nvidia",  312.0,  19.5,  40, 1555, 300),
    # Same datasheet (PCIe 80GB): 312 / 19.5 TFLOPS, 80GB HBM2e at 1,935 GB/s; NVLink bridges pair two
    # cards only -> PCIe Gen4 x16 64 GB/s, 32 per direction.
    _gpu("A100-PCIe-80GB", "nvidia", 312.0,  19.5,  80, 1935,  32),
    # NVIDIA A800 Tensor Core GPU datasheet (SXM 80GB): 312 / 19.5 TFLOPS, 80GB HBM2e at 2,039 GB/s,
    # NVLink 400 GB/s (bidirectional; export-limited A100) -> 200 per direction.
    _gpu("A800-80GB",     "nvidia",  312.0,  19.5,  80, 2039, 200),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS with sparsity ->
    # 989.5 dense, FP32 67 TFLOPS, 80GB HBM3 at 3.35 TB/s, NVLink 900 GB/s -> 450 per direction.
    _gpu("H100-80GB",     "nvidia",  989.5,  67.0,  80, 3350, 450),
    # Same datasheet (PCIe): BF16 Tensor Core 1,513 TFLOPS with sparsity -> 756.5 dense, FP32 51 TFLOPS,
    # 80GB HBM2e at 2 TB/s; NVLink bridges pair two cards only -> PCIe Gen5 x16, 64 per direction.
    _gpu("H100-PCIe-80GB", "nvidia", 756.5,  51.0,  80, 2000,  64),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS sparse -> 989.5 dense, FP32 67,
    # 141GB HBM3e at 4.8 TB/s, NVLink 900 GB/s -> 450 per direction.
    _gpu("H200-141GB",    "nvidia",  989.5,  67.0, 141, 4800, 450),
    # NVIDIA V100 Tensor Core GPU datasheet (SXM2 16GB): no bf16 -> FP16 Tensor Core 125 TFLOPS,
    # FP32 15.7 TFLOPS, 16GB HBM2 at 900 GB/s, NVLink 300 GB/s -> 150 per direction.
    _gpu("V100-16GB",     "nvidia",  125.0,  15.7,  16,  900, 150),
    # Same datasheet (V100S PCIe 32GB): no bf16 -> FP16 Tensor Core 130 TFLOPS, FP32 16.4 TFLOPS,
    # 32GB HBM2 at 1,134 GB/s, PCIe Gen3 32 GB/s -> 16 per direction.
    _gpu("V100S-32GB",    "nvidia",  130.0,  16.4,  32, 1134,  16),
    # NVIDIA T4 Tensor Core GPU datasheet: no bf16 -> mixed-precision FP16/FP32 65 TFLOPS,
    # FP32 8.1 TFLOPS, 16GB GDDR6 at 300 GB/s (as the datasheet states), PCIe Gen3 x16 32 GB/s -> 16.
    _gpu("T4-16GB",       "nvidia",   65.0,   8.1,  16,  300,  16),
    # NVIDIA L4 Tensor Core GPU datasheet: BF16 Tensor Core 242 TFLOPS with sparsity -> 121 dense,
    # FP32 30.3 TFLOPS, 24GB GDDR6 at 300 GB/s, PCIe Gen4 x16 64 GB/s -> 32 per direction.
    _gpu("L4-24GB",       "nvidia",  121.0,  30.3,  24,  300,  32),
    # NVIDIA A10 Tensor Core GPU datasheet: BF16 Tensor Core 250 TFLOPS with sparsity -> 125 dense,
    # FP32 31.2 TFLOPS, 24GB GDDR6 at 600 GB/s, PCIe Gen4 64 GB/s -> 32 per direction.
    _gpu("A10-24GB",      "nvidia",  125.0,  31.2,  24,  600,  32),
    # NVIDIA Ada Lovelace GPU Architecture whitepaper, GeForce RTX 4090: peak BF16 / FP16 Tensor with
    # FP32 accumulate 165.2 TFLOPS (330.4 sparse), FP32 82.6 TFLOPS, 24GB GDDR6X at 1,008 GB/s;
    # no NVLink, PCIe Gen4 x16 -> 32 per direction.
    _gpu("RTX4090-24GB",  "nvidia",  165.2,  82.6,  24, 1008,  32),
    # NVIDIA Ampere GA102 GPU Architecture whitepaper, GeForce RTX 3090: peak BF16 / FP16 Tensor with
    # FP32 accumulate 71 TFLOPS (142 sparse), FP32 35.6 TFLOPS, 24GB GDDR6X at 936 GB/s; NVLink bridges
    # pair two cards only -> PCIe Gen4 x16, 32 per direction.
    _gpu("RTX3090-24GB",  "nvidia",   71.0,  35.6,  24,  936,  32),
    # NVIDIA Turing GPU Architecture whitepaper and the TITAN RTX product page: no bf16 -> FP16 Tensor
    # with FP32 accumulate 130 TFLOPS, FP32 16.3 TFLOPS, 24GB GDDR6 at 672 GB/s; NVLink bridges pair two
    # cards only -> PCIe Gen3 x16, 16 per direction.
    _gpu("TitanRTX-24GB", "nvidia",  130.0,  16.3,  24,  672,  16),
    # NVIDIA Turing GPU Architecture whitepaper, GeForce RTX 2080 Ti (reference clocks): no bf16 -> FP16
    # Tensor with FP32 accumulate 53.8 TFLOPS (107.6 with FP16 accumulate), FP32 13.4 TFLOPS, 11GB
    # GDDR6 at 616 GB/s; NVLink bridges pair two cards only -> PCIe Gen3 x16, 16 per direction.
    _gpu("RTX2080-Ti-11GB", "nvidia", 53.8,  13.4,  11,  616,  16),
    # AMD Instinct MI210 Accelerator datasheet: peak FP16/BF16 181.0 TFLOPS, FP32 vector 22.6 TFLOPS,
    # 64GB HBM2e at 1.6 TB/s (1,638.4 GB/s), Infinity Fabric up to 3 links, 300 GB/s peak aggregate
    # -> 150 per direction.
    _gpu("MI210-64GB",    "amd",     181.0,  22.6,  64, 1638.4, 150),
    # AMD Instinct MI250X Accelerator datasheet: peak FP16/BF16 383.0 TFLOPS, FP32 vector 47.9 TFLOPS,
    # 128GB HBM2e at 3.2 TB/s (3,276.8 GB/s), up to 8 Infinity Fabric links, 800 GB/s aggregate -> 400.
    _gpu("MI250X-128GB",  "amd",     383.0,  47.9, 128, 3276.8, 400),
    # AMD Instinct MI300X Accelerator datasheet: peak FP16/BF16 1,307.4 TFLOPS dense (2,614.9 sparse),
    # FP32 vector 163.4 TFLOPS, 192GB HBM3 at 5.3 TB/s, Infinity Fabric 896 GB/s aggregate -> 448.
    _gpu("MI300X-192GB",  "amd",    1307.4, 163.4, 192, 5300, 448),
)
# fmt: on

# Nominal CPU, not a datasheet: a few cores of a current x86 server (AVX2/AVX-512 FMA, fp32; bf16 no
# faster on most parts), ~20 GB/s memory bandwidth per process group. As a preset it is this machine's
# CPU at native speed (not emulated); emulated devices (`emulated_spec`) scale the peaks by `speed`. The
# cost model measures both on this CPU instead of trusting these figures.
CPU_NOMINAL = DeviceSpec("CPU", "cpu", 0.2 * _T, 0.2 * _T, 16 * GiB, 20 * _G, SHARED_MEMORY_Bps)

PRESETS: dict[str, DeviceSpec] = {spec.name: spec for spec in (*_PRESET_LIST, CPU_NOMINAL)}

# Presets without bf16 math (their datasheets list FP16 but no BF16 Tensor Core figure: NVIDIA V100 and
# V100S Tensor Core GPU datasheet, NVIDIA T4 Tensor Core GPU datasheet, the Turing whitepaper; Volta and
# Turing predate bf16, which NVIDIA introduced with Ampere). Their ``peak_flops_bf16`` holds the FP16
# peak; bf16 runs there at fp32 speed (``autopar.cost.precision.peak_flops``).
NO_BF16: frozenset[str] = frozenset({"V100-16GB", "V100S-32GB", "T4-16GB", "TitanRTX-24GB", "RTX2080-Ti-11GB"})


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def preset(name: str) -> DeviceSpec:
    """The preset of that name (case-insensitive); ``KeyError`` if there is none."""
    if name in PRESETS:
        return PRESETS[name]
    for key, spec in PRESETS.items():
        if key.lower() == name.lower():
            return spec
    raise KeyError(name)


def _words(name: str) -> list[str]:
    return [t.upper() for t in re.split(r"[^A-Za-z0-9]+", name) if t]


def match_preset(device_name: str, memory_bytes: int) -> DeviceSpec | None:
    """The preset of a device as its driver names it (``"NVIDIA A100-SXM4-80GB"``, ``"Tesla T4"``,
    ``"NVIDIA GeForce RTX 4090"``) with ``memory_bytes`` of memory, or None.

    A preset matches when every word of its model name (the preset name without the memory size:
    ``H100``, ``H100-PCIe``) is a word of the device name, or two adjacent ones run together
    (``RTX 4090``), and its memory is within 10% of ``memory_bytes`` (drivers report a little less
    than the datasheet). Among matches the one naming the most words wins (``H100 PCIe`` over ``H100``).
    This is the one matcher of hardware names: detection and the kernel benchmarks use it."""
    tokens = _words(device_name)
    words = set(tokens) | {a + b for a, b in zip(tokens, tokens[1:])}
    best, best_key = None, None
    for spec in PRESETS.values():
        if spec.is_emulated or spec.vendor == "cpu":
            continue
        model = _words(spec.name.rsplit("-", 1)[0])
        if not all(w in words for w in model):
            continue
        if abs(memory_bytes - spec.memory_bytes) > 0.1 * spec.memory_bytes:
            continue
        key = (len(model), len(spec.name))
        if best_key is None or key > best_key:
            best, best_key = spec, key
    return best


def emulated_spec(name: str, speed: float, memory_bytes: int) -> DeviceSpec:
    """An emulated device: a CPU process running at ``speed`` x this CPU, with a memory budget."""
    return replace(CPU_NOMINAL, name=name, peak_flops_bf16=CPU_NOMINAL.peak_flops_bf16 * speed,
                   peak_flops_fp32=CPU_NOMINAL.peak_flops_fp32 * speed, memory_bytes=int(memory_bytes),
                   emulate="cpu", speed=float(speed))


def _meminfo_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cpu_spec_detect() -> DeviceSpec:
    """This machine's CPU as a native (not emulated) device: nominal peaks, real memory capacity."""
    memory = _meminfo_total_bytes() or CPU_NOMINAL.memory_bytes
    return replace(CPU_NOMINAL, memory_bytes=int(memory))
