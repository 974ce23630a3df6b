"""The precision each device type is priced at: one rule for the cost model and for the bounds.

With an explicit ``precision`` (``PlanConfig.precision``: ``"fp32"``, ``"bf16"``, ``"fp16"``; what
``autopar.runtime.precision`` runs) the functions below price that precision on every device type:

- peak FLOP/s (``peak_flops``): fp32 at ``peak_flops_fp32``; bf16 and fp16 at the 16-bit tensor peak
  ``peak_flops_bf16`` (every preset's datasheet quotes the same dense FP16 and BF16 figure, and the
  presets without bf16, ``NO_BF16`` in ``autopar.cluster.devices``, store their FP16 peak there), except
  bf16 on a device without bf16 math, priced at its fp32 peak. CPUs and emulated devices: an emulated
  device is this CPU slowed down, and its block times are measured on this CPU in fp32; at bf16/fp16
  they are those fp32 times scaled by its preset's 16-bit/fp32 peak ratio, which for ``CPU_NOMINAL``
  (the preset of every emulated device) is 1: the planner prices an emulated device the same at every
  precision. (The emulated run itself computes under CPU autocast, whose speed differs from fp32 by
  what this CPU's bf16 support gives: a source of prediction error, not hidden by a made-up ratio.)
- activation bytes (``activation_bytes_factor``): saved activations and pipeline sends at the compute
  dtype, 0.5 of fp32. This is exact where every saved tensor is a matmul's input or a pointwise op of
  a matmul's output (an MLP: measured 0.53); autocast keeps losses, and type promotion keeps residual
  sums, in fp32, so transformer blocks save more (gpt-tiny measured 0.58, llama-tiny 0.67 of fp32).
- communication bytes (``comm_bytes_factor``): gradient reduction in fp32 (the runtime reduces the fp32
  ``.grad``): 1.0; ``grad_reduce_dtype="bf16"`` would be 0.5 (not run yet).
- state bytes per parameter (``state_bytes_per_param``): fp32 weights (the master copy *is* the
  parameter), fp32 gradients and the optimizer's fp32 state, plus ``autocast_copy_bytes_per_param``:
  autocast's compute-dtype copy of each weight, kept for backward per micro-batch in flight.

Accelerators (a GPU, not emulated) are priced for mixed-precision training, bf16 tensor-core math: that
is how large models are trained on them, and what ``peak_flops_bf16`` quotes. CPUs, and emulated
devices (which are this CPU slowed down), run the model in fp32, so they are priced at
``peak_flops_fp32``. The roofline (``autopar.cost.profile``) divides FLOPs by this peak, and MFU
(``autopar.planner.bounds.mfu``) divides by the sum of it, so a plan's utilisation is measured
against the same peak its time was predicted from.
"""

from __future__ import annotations

__all__ = ["is_mixed_precision", "priced_peak_flops", "PRECISION_BYTES", "peak_flops", "activation_bytes_factor",
           "comm_bytes_factor", "autocast_copy_bytes_per_param", "state_bytes_per_param"]

PRECISION_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}   # bytes of one compute-dtype element


def _bytes(precision: str) -> int:
    try:
        return PRECISION_BYTES[precision]
    except KeyError:
        raise ValueError(f"precision: {precision!r} must be one of {', '.join(map(repr, PRECISION_BYTES))}") from None


def peak_flops(spec, precision: str) -> float:
    """The peak FLOP/s of ``spec`` (a ``DeviceSpec``) computing at ``precision`` (module docstring)."""
    from autopar.cluster.devices import NO_BF16

    _bytes(precision)
    if precision == "fp32" or (precision == "bf16" and spec.name in NO_BF16):
        return float(spec.peak_flops_fp32)
    return float(spec.peak_flops_bf16)


def activation_bytes_factor(precision: str) -> float:
    """Saved-activation and pipeline-send bytes at ``precision`` over those at fp32."""
    return _bytes(precision) / 4


def comm_bytes_factor(precision: str, grad_reduce_dtype: str = "fp32") -> float:
    """Gradient-reduction bytes over fp32's: the reduction runs in ``grad_reduce_dtype`` whatever the
    compute precision (``precision`` only validated)."""
    _bytes(precision)
    return _bytes(grad_reduce_dtype) / 4


def autocast_copy_bytes_per_param(precision: str) -> int:
    """Bytes per parameter of autocast's compute-dtype weight copy (0 at fp32), per micro-batch in flight."""
    return 0 if precision == "fp32" else _bytes(precision)


def state_bytes_per_param(precision: str, optimizer_state_bytes: int) -> dict[str, int]:
    """Training-state bytes per parameter at ``precision`` as the runtime keeps them: fp32 weights and
    gradients (no separate master copy), the optimizer's state, and autocast's weight copy."""
    _bytes(precision)
    return {"weights": 4, "grads": 4, "optimizer": int(optimizer_state_bytes),
            "autocast_copy": autocast_copy_bytes_per_param(precision)}


def is_mixed_precision(spec) -> bool:
    """Whether ``spec`` (a ``DeviceSpec``) is priced for bf16 mixed precision (see the module docstring)."""
    return not (spec.is_emulated or spec.vendor == "cpu")


def priced_peak_flops(spec) -> float:
    """The peak FLOP/s ``spec`` is priced at: bf16 on accelerators, fp32 on CPUs and emulated devices,
    because those are the precisions each trains in (see the module docstring)."""
    return float(spec.peak_flops_bf16 if is_mixed_precision(spec) else spec.peak_flops_fp32)
