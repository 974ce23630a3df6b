"""The emulation time scale: the one factor that both the cost model (``autopar.cost``) and the
runtime's clocks (``autopar.runtime.emulate``) apply to an emulated device, so predicted and measured
step times are in the same units.

Terms
- oversubscription: ``max(1, num_ranks / num_cores)``, how many rank processes share each core of this
  machine. A speed-1.0 emulated rank already runs that much slower than the CPU.
- emulation time scale: twice the oversubscription. Every emulated device's target time is
  ``cpu_time / speed * time_scale``, so the ranks' CPU demand (sum of speed / scale) stays well under
  the cores and the speed *ratios* between devices survive some contention.

Pure functions of their arguments; only the default core count reads this process's CPU affinity.
"""

from __future__ import annotations

import os

__all__ = ["emulation_time_scale", "oversubscription"]


def emulation_time_scale(num_ranks: int, num_cores: int | None = None) -> float:
    """The ``time_scale`` of a run's emulated devices: twice the oversubscription (see the module
    docstring)."""
    return 2.0 * oversubscription(num_ranks, num_cores)


def oversubscription(num_ranks: int, num_cores: int | None = None) -> float:
    """``max(1, num_ranks / num_cores)``: the ``time_scale`` that keeps emulated speed ratios right when
    ``num_ranks`` CPU processes share ``num_cores`` cores (default: the cores this process may use)."""
    if num_cores is None:
        try:
            num_cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            num_cores = os.cpu_count() or 1
    return max(1.0, num_ranks / max(1, num_cores))
