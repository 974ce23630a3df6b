"""The precision each device type is priced at: one rule for the cost model and for the bounds.

Accelerators (a GPU, not emulated) are priced for mixed-precision training, bf16 tensor-core math: that
is how large models are trained on them, and what ``peak_flops_bf16`` quotes. CPUs, and emulated
devices (which are this CPU slowed down), run the model in fp32, so they are priced at
``peak_flops_fp32``. The roofline (``autopar.cost.profile``) divides FLOPs by this peak, and MFU
(``autopar.planner.bounds.mfu``) divides by the sum of it, so a plan's utilisation is measured
against the same peak its time was predicted from.
"""

from __future__ import annotations

__all__ = ["is_mixed_precision", "priced_peak_flops"]


def is_mixed_precision(spec) -> bool:
    """Whether ``spec`` (a ``DeviceSpec``) is priced for bf16 mixed precision (see the module docstring)."""
    return not (spec.is_emulated or spec.vendor == "cpu")


def priced_peak_flops(spec) -> float:
    """The peak FLOP/s ``spec`` is priced at: bf16 on accelerators, fp32 on CPUs and emulated devices,
    because those are the precisions each trains in (see the module docstring)."""
    return float(spec.peak_flops_bf16 if is_mixed_precision(spec) else spec.peak_flops_fp32)
