"""The runtime: starting ranks (``launch``, ``init``), each rank's ``RankContext``, and the clocks of
emulated devices. See ``autopar.runtime.launcher`` and ``autopar.runtime.emulate``."""

from autopar.runtime.emulate import ClockStats, EmulatedClock, NullClock, clock_for, oversubscription
from autopar.runtime.launcher import (RankContext, context, default_backend, init, is_initialized, launch,
                                    shutdown, subgroup_backend)

__all__ = [
    "launch", "init", "shutdown", "context", "is_initialized", "RankContext",
    "default_backend", "subgroup_backend",
    "EmulatedClock", "NullClock", "ClockStats", "clock_for", "oversubscription",
]
