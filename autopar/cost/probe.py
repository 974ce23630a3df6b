"""The largest micro-batch that really fits on a local GPU, found by bisection over real steps.

The memory model (``autopar.planner.dp.max_micro_batch``) predicts the largest micro-batch from the
analysis; on a real GPU the allocator's fragmentation and the kernels' workspaces decide. ``probe``
runs a training micro-step (forward + backward) at candidate sizes, catching out-of-memory, and
bisects between the largest size that ran and the smallest that did not.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["is_oom", "probe_max_micro_batch"]


def is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom_type is not None and isinstance(oom_type, type) and isinstance(exc, oom_type)) \
        or (isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def probe_max_micro_batch(step: Callable[[int], None], upper: int, *, lower: int = 1,
                          cleanup: Callable[[], None] | None = None) -> int:
    """Largest ``b`` in ``[lower, upper]`` for which ``step(b)`` runs without running out of memory
    (0 when even ``lower`` does not). Assumes fitting is monotone in ``b``; other errors propagate.
    ``cleanup`` runs after every attempt (e.g. ``torch.cuda.empty_cache``)."""
    cleanup = cleanup or (torch.cuda.empty_cache if torch.cuda.is_available() else (lambda: None))

    def fits(b: int) -> bool:
        try:
            step(b)
            return True
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is an answer; the rest re-raises
            if not is_oom(exc):
                raise
            return False
        finally:
            cleanup()

    if upper < lower:
        return 0
    if fits(upper):
        return upper
    if not fits(lower):
        return 0
    good, bad = lower, upper
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good
