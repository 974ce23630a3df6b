"""FLOP formulas the PyTorch flop counter lacks: grouped matrix products, the GEMMs of mixture-of-experts
layers (``torch._grouped_mm``, ``torch.nn.functional.grouped_mm`` and the custom ops libraries register
for them, such as transformers' ``grouped_mm_fallback``), and their backward ops.

Terms
- grouped product: ``grouped_mm(a, b, offs)`` multiplies groups of rows (or columns, or of the
  contracted dimension) cut by ``offs``. The groups partition one dimension, so the total is that of
  one product over the whole of it, whatever the routing put in each group: ``2 * out.numel() * K``
  with ``K = a.shape[-1]``, except where ``a`` and ``b`` are both 2-D (groups cut the contracted
  dimension; ``out`` is ``[G, M, N]`` and each group contracts only its part: ``2 * M * N * K``).
  The rows of an expert GEMM are the routed tokens (tokens x experts per token), a static shape, so
  the count is that of the expected tokens per expert summed over experts.
- backward op: a library's one op computing both gradients of a grouped product (name containing
  ``grouped_mm`` and ``backward``, inputs ``(a, b, offs, grad_out)``): twice the forward product.
- ``GroupedMmCounting``: a mixin for ``FlopCounterMode`` that counts ops whose name contains
  ``grouped_mm`` by these formulas, where torch's registry has none.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["grouped_mm_flops", "GroupedMmCounting"]


def _shape(x: Any) -> tuple[int, ...] | None:
    return tuple(int(d) for d in x.shape) if isinstance(x, torch.Tensor) else None


def grouped_mm_flops(name: str, args: tuple, out: Any) -> int | None:
    """FLOPs of one grouped-product op (``name``: the op's name; ``args``: its positional arguments;
    ``out``: its output), or None where the arguments are not those of a grouped product."""
    a, b = (_shape(x) for x in (args[:2] if len(args) >= 2 else (None, None)))
    if a is None or b is None or len(a) not in (2, 3) or len(b) not in (2, 3):
        return None
    if "backward" in name:
        m = a[0] if len(a) == 2 else a[0] * a[1]
        n = b[-1]
        return 2 * 2 * m * a[-1] * n
    o = _shape(out[0] if isinstance(out, (tuple, list)) and out else out)
    if o is None:
        return None
    k = a[-1]
    if len(a) == 2 and len(b) == 2:       # groups cut the contracted dimension: out is [G, M, N]
        return 2 * math.prod(o[1:]) * k
    return 2 * math.prod(o) * k


class GroupedMmCounting:
    """Mixin for ``torch.utils.flop_counter.FlopCounterMode``: grouped products counted by
    ``grouped_mm_flops`` where torch's registry has no formula (module docstring)."""

    def _count_flops(self, func_packet, out, args, kwargs):
        if func_packet not in self.flop_registry:
            name = str(getattr(func_packet, "_qualified_op_name", "") or getattr(func_packet, "__name__", ""))
            if "grouped_mm" in name:
                flops = grouped_mm_flops(name, tuple(args), out)
                if flops:
                    for par in set(self.mod_tracker.parents):
                        self.flop_counts[par][func_packet] += flops
                return out
        return super()._count_flops(func_packet, out, args, kwargs)
