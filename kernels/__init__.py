"""Triton kernels for the ops that dominate transformer training, their tuning runs and tuning cache.

``layer_norm``, ``rms_norm``, ``softmax``, ``bias_gelu``, ``swiglu``, ``cross_entropy`` and ``matmul``
are differentiable (each a ``torch.autograd.Function``), take fp32/fp16/bf16 tensors of any leading
shape, and match the torch op within the dtype's tolerance. They run natively on CUDA, and on CPU in
Triton's interpreter when ``TRITON_INTERPRET=1`` is set before triton is imported.

Submodules: ``kernels.tune`` (tuning runs, ``autopar tune``), ``kernels.timing`` (tuned times for the
cost model), ``kernels.cache`` (the cache file), ``kernels.devices`` (the local GPU;
the peak figures the caller passes in),
``kernels.configs`` (launch configs), ``kernels.check`` (correctness against torch).

Importing this package imports neither triton nor the kernels: each is loaded on first use, so that
``TRITON_INTERPRET`` may still be set after ``import kernels``. This package depends on nothing else
in the repository: its errors (``KernelInputError``) are plain ``ValueError``s, and device peak figures
come from the caller (autopar's one preset table), not from a table here.
"""

from __future__ import annotations

import importlib

__all__ = ["layer_norm", "rms_norm", "softmax", "bias_gelu", "swiglu", "cross_entropy", "matmul",
           "KernelInputError"]

_WHERE = {
    "layer_norm": "norms",
    "rms_norm": "norms",
    "softmax": "softmax_kernel",
    "bias_gelu": "activations",
    "swiglu": "activations",
    "cross_entropy": "cross_entropy_kernel",
    "matmul": "matmul_kernel",
    "KernelInputError": "_common",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_WHERE))
