"""Helpers shared by the kernel modules: input checks, flattening to rows, and launch facts.

Terms: a *row kernel* works on a tensor viewed as ``(num_rows, num_cols)``: every leading dimension
folded into rows, the last dimension as columns. ``BLOCK_N`` is the number of columns a program
holds at once; when it covers the whole row the kernel takes its single-pass path (one read of the
row), otherwise it loops over the row in ``BLOCK_N`` chunks.
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "KernelInputError",
    "SUPPORTED_DTYPES",
    "check_float",
    "as_rows",
    "interpreting",
    "next_power_of_2",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelInputError(ValueError):
    """A kernel was called with an input it does not support; the message names the argument.

    Its own ``ValueError``, not an ``autopar.AutoparError``: ``kernels/`` imports nothing of autopar
    (it is usable, and tested, alone). Catch ``ValueError`` to handle both."""


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise KernelInputError(f"{name}: dtype {t.dtype} is not supported; use float32, float16 or bfloat16")
    if t.device.type != "cuda" and not interpreting():
        raise KernelInputError(
            f"{name}: tensor on {t.device} needs a CUDA device, or TRITON_INTERPRET=1 set before triton is "
            "imported to run the kernels in Triton's CPU interpreter")


def as_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous ``(num_rows, num_cols)`` matrix over its last dimension."""
    check_float(name, t)
    if t.dim() == 0:
        raise KernelInputError(f"{name}: expected at least one dimension, got a scalar")
    if t.shape[-1] == 0:
        raise KernelInputError(f"{name}: last dimension is empty")
    return t.contiguous().view(-1, t.shape[-1])
