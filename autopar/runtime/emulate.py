"""Emulated devices: make a CPU process run at a fraction of this CPU's speed.

This is emulation for development and tests on machines without the real cluster. It is used only for
devices that the cluster marks as emulated (``DeviceSpec.emulate == "cpu"``); GPU ranks, and CPU ranks
at their native speed, get a ``NullClock`` that does nothing.

Terms
- speed: the fraction of this CPU's speed an emulated device runs at (0.5 = half as fast).
- compute block: code wrapped in ``with clock.compute():``. Its CPU time (``time.thread_time``, the
  CPU time of the calling thread) measures the work it did; CPU time rather than wall time so that
  contention between ranks sharing few cores does not inflate the estimate. After the block the clock
  sleeps so that the block's wall time becomes ``cpu_time / speed``:
  ``sleep max(0, cpu_time / speed - wall_elapsed)``. If contention already made the block slower than
  that, it does not sleep. Communication (blocked waiting, no CPU) is therefore never slowed down;
  wrap only the compute.
- time scale: an optional common factor on every emulated device's target,
  ``cpu_time / speed * time_scale``. When more ranks than cores share this machine, even a speed-1.0
  rank runs slower than the CPU; ``time_scale = num_ranks / num_cores`` (``oversubscription``)
  slows every device alike so that the *ratios* between speeds stay right. It only applies to an
  ``EmulatedClock``; ``clock_for`` gives one to every emulated device when ``time_scale > 1``.
- totals: ``compute_s`` (CPU time measured in blocks), ``slept_s`` (time added by sleeping),
  ``num_blocks``; ``stats()`` returns them as a frozen ``ClockStats`` for reporting.

Blocks may nest; only the outermost block measures and sleeps.

``emulation_time_scale`` and ``oversubscription`` live in ``autopar.cluster.emulation`` (the cost model
uses the same factor) and are re-exported here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from autopar.cluster.emulation import emulation_time_scale, oversubscription
from autopar.errors import ClusterError

__all__ = ["ClockStats", "EmulatedClock", "NullClock", "clock_for", "emulation_time_scale", "oversubscription"]


@dataclass(frozen=True, slots=True)
class ClockStats:
    speed: float | None       # None for a NullClock (native speed, nothing emulated)
    compute_s: float          # CPU time measured inside compute blocks
    slept_s: float            # time the clock added by sleeping
    num_blocks: int


class EmulatedClock:
    """Slows compute blocks down to ``speed`` x this CPU (see the module docstring)."""

    def __init__(self, speed: float, *, time_scale: float = 1.0,
                 cpu_time: Callable[[], float] = time.thread_time,
                 wall_time: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed < math.inf:
            raise ClusterError(f"EmulatedClock.speed: must be a finite number > 0, got {speed!r}")
        if isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) \
                or not 0 < time_scale < math.inf:
            raise ClusterError(f"EmulatedClock.time_scale: must be a finite number > 0, got {time_scale!r}")
        self.speed = float(speed)
        self.time_scale = float(time_scale)
        self._cpu_time, self._wall_time, self._sleep = cpu_time, wall_time, sleep
        self.compute_s = 0.0
        self.slept_s = 0.0
        self.num_blocks = 0
        self._depth = 0

    @contextmanager
    def compute(self) -> Iterator[None]:
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._depth = 1
        cpu0, wall0 = self._cpu_time(), self._wall_time()
        try:
            yield
        finally:
            self._depth = 0
            cpu_s = max(0.0, self._cpu_time() - cpu0)
            wall_s = self._wall_time() - wall0
            sleep_s = max(0.0, cpu_s / self.speed * self.time_scale - wall_s)
            if sleep_s > 0:
                self._sleep(sleep_s)
            self.compute_s += cpu_s
            self.slept_s += sleep_s
            self.num_blocks += 1

    def stats(self) -> ClockStats:
        return ClockStats(self.speed, self.compute_s, self.slept_s, self.num_blocks)

    def __repr__(self) -> str:
        return (f"EmulatedClock(speed={self.speed}, time_scale={self.time_scale}, compute_s={self.compute_s:.3f}, "
                f"slept_s={self.slept_s:.3f}, num_blocks={self.num_blocks})")


class NullClock:
    """The clock of a device at native speed (every GPU rank): ``compute()`` does nothing."""

    speed = None
    compute_s = 0.0
    slept_s = 0.0
    num_blocks = 0

    @contextmanager
    def compute(self) -> Iterator[None]:
        yield

    def stats(self) -> ClockStats:
        return ClockStats(None, 0.0, 0.0, 0)

    def __repr__(self) -> str:
        return "NullClock()"


def clock_for(device, time_scale: float = 1.0) -> EmulatedClock | NullClock:
    """The clock for a cluster ``Device`` (or its ``DeviceSpec``): an emulated device gets an
    ``EmulatedClock`` unless it runs at speed 1.0 with no time scale; everything else, GPUs above all,
    a ``NullClock``."""
    spec = getattr(device, "spec", device)
    if getattr(spec, "emulate", None) and (float(spec.speed) != 1.0 or time_scale != 1.0):
        return EmulatedClock(spec.speed, time_scale=time_scale)
    return NullClock()
