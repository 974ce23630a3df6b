"""Emulated devices: make a CPU process run at a fraction of this CPU's speed.

This is emulation for development and tests on machines without the real cluster. It is used only for
devices that the cluster marks as emulated (``DeviceSpec.emulate == "cpu"``); GPU ranks, and CPU ranks
at their native speed, get a ``NullClock`` that does nothing.

Terms
- speed: the fraction of this CPU's speed an emulated device runs at (0.5 = half as fast). "This CPU"
  is one core running one torch thread: an emulated rank runs single-threaded (see CPU share).
- compute block: code wrapped in ``with clock.compute():``. Its CPU time (``time.thread_time``, the
  CPU time of the calling thread) measures the work it did. Thread CPU time, not process CPU time:
  the process also holds gloo's and autograd's threads, whose CPU time is not the block's work; and
  not wall time, which grows with every neighbour that shares the core. It is exact only because the
  rank computes on the calling thread alone (one intra-op thread); with more, it would miss the
  other threads' share. The block's target wall time is ``cpu_time / speed * time_scale``; after the
  block the clock sleeps ``target - wall_elapsed - debt``.
- debt: how far the clock is behind its targets, carried to the next block. A sleep that oversleeps
  (the scheduler wakes the rank late), or a block that overran its target because neighbours took
  the core, leaves debt; the next block sleeps that much less. The emulated wall time of a run of
  blocks is therefore the sum of their targets, whatever the neighbours did, as long as later
  blocks sleep enough to repay it. A block adds at most its own target to the debt, so a rank that
  really stalled inside a compute block (it should not: communication stays outside) is not hidden. Communication (blocked waiting, no CPU) is never slowed down; wrap only the compute.
- time scale: a common factor on every emulated device's target (``emulation_time_scale``: twice
  ``num_ranks / num_cores`` when ranks outnumber cores, else 2). It slows every device alike so that
  the ranks' CPU demand stays well under the cores and the *ratios* between speeds stay right; the
  cost model prices emulated devices with the same factor.
- CPU share (``CpuShare``, decided by ``autopar.cluster.emulation.cpu_shares``, applied by
  ``apply_cpu_share`` in every CPU rank ``launch`` starts): the cores a rank may run on and its torch
  thread counts. Emulated ranks: one intra-op and one inter-op thread, pinned to one core (more ranks
  than cores: heaviest first onto the least loaded core, weighing a rank by its speed) or a block of
  cores of their own. Native CPU ranks: a block of cores and as many threads.
- pause (``paused()``, which the communicator enters around every collective while a step runs under
  ``autopar.runtime.recorder.recorded_step``): a collective inside a compute block (tensor
  parallelism's all-reduces) first settles the block's work so far (sleeps to its target), so the
  peers meet at emulated times and waiting never counts towards a block's target.
- steady (``clock_for``'s clocks; ``AUTOPAR_EMULATION_STEADY=0`` turns it off): a block is charged
  the least CPU time any block at the same position of a step has taken (positions count from 0 at
  every ``begin_step``, which ``recorded_step`` calls), not its own. A step runs the same blocks in
  the same order, so this is the block's uncontended work. Positions are compared only between steps
  of one layout: the minima hold once two steps in a row have cut the same number of blocks, and a
  step whose number differs from its predecessor's starts them afresh (until then a block is charged
  its own CPU time). A first step that runs extra collectives (a vocabulary-parallel head learns its
  gather order once) cuts more blocks, and position by position its small segments were taken as the
  minima of later steps' large ones: the quarter-speed rank of a tensor-parallel Llama was charged half
  its work. Otherwise: the CPU time of the same block varies by
  15-40% from step to step when neighbours share the core (caches, preemption), and that inflation is
  the host's, not the emulated device's. The cost model times blocks the same way (the least of its
  repeats, ``autopar.measure.blocks.measure_blocks``). The first steps (warm-up) charge what they take.
- totals: ``compute_s`` (CPU time measured in blocks), ``slept_s`` (time spent sleeping, measured),
  ``overrun_s`` and ``num_overruns`` (wall time of blocks beyond their own target, and how many such
  blocks: contention the time scale did not absorb), ``num_blocks``; ``stats()`` returns them as a frozen ``ClockStats`` for reporting.

Blocks may nest; only the outermost block measures and sleeps.

``emulation_time_scale``, ``oversubscription``, ``CpuShare`` and ``cpu_shares`` live in
``autopar.cluster.emulation`` (the cost model uses the same factor) and are re-exported here.

Step recording (``autopar.runtime.recorder``): every clock has a ``recorder`` (None: nothing
recorded) that its outermost compute blocks report to.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from autopar.cluster.emulation import (
    NUM_CORES_ENV, CpuShare, cpu_shares, emulation_time_scale, oversubscription, steady_emulation,
)
from autopar.cluster.heap import hold_freed_memory
from autopar.errors import ClusterError

__all__ = ["ClockStats", "EmulatedClock", "NullClock", "clock_for", "emulation_time_scale", "oversubscription",
           "CpuShare", "cpu_shares", "apply_cpu_share"]


@dataclass(frozen=True, slots=True)
class ClockStats:
    speed: float | None       # None for a NullClock (native speed, nothing emulated)
    compute_s: float          # CPU time measured inside compute blocks
    slept_s: float            # time the clock added by sleeping
    num_blocks: int
    overrun_s: float = 0.0    # wall time beyond target (contention, late wake-ups), carried as debt
    num_overruns: int = 0     # blocks that ended behind their target


@contextmanager
def _inner_block(clock) -> Iterator[None]:
    """A compute block opened inside another (or one a ``NullClock`` does not record): it only counts
    the nesting depth; the outermost block charges and records the time."""
    clock._depth += 1
    try:
        yield
    finally:
        clock._depth -= 1


class EmulatedClock:
    """Slows compute blocks down to ``speed`` x this CPU (see the module docstring)."""

    def __init__(self, speed: float, *, time_scale: float = 1.0,
                 cpu_time: Callable[[], float] = time.thread_time,
                 wall_time: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, steady: bool = False):
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
        self.overrun_s = 0.0
        self.num_overruns = 0
        self._debt_s = 0.0
        self._depth = 0
        self.recorder = None      # an autopar.runtime.recorder.PhaseRecorder while profiling
        self.steady = bool(steady)
        self._segment: tuple[float, float] | None = None     # (cpu, wall) where the open segment began
        self._least_cpu: list[float] | None = None   # steady: per block position, the least CPU time seen
        self._step_cpu: list[float] = []    # steady: this step's CPU time per block position
        self._position = 0
        self._trusted = False     # steady: the minima come from two steps of one layout

    def begin_step(self) -> None:
        """A step starts: block positions count from 0 again (``steady``). The minima are kept when the
        step that ended cut as many blocks as the one before it (one layout), else they start afresh."""
        ended = self._step_cpu
        if ended:     # the minima (or the previous step's times) have the previous step's count
            same = self._least_cpu is not None and len(self._least_cpu) == len(ended)
            self._least_cpu = [min(a, b) for a, b in zip(self._least_cpu, ended)] if same else ended
            self._trusted = same
        self._step_cpu = []
        self._position = 0

    @contextmanager
    def compute(self, label: str | None = None) -> Iterator[None]:
        """A compute block (see the module docstring); ``label`` names its phase for the recorder
        ("forward", "backward", "optimizer", ...; default: inferred)."""
        if self._depth:
            with _inner_block(self):
                yield
            return
        self._depth = 1
        rec = self.recorder if self.recorder is not None and self.recorder.active else None
        if rec is not None:
            rec.block_begin(label)
        self._segment = (self._cpu_time(), self._wall_time())
        try:
            yield
        finally:
            self._depth = 0
            t_work, t_end = self._settle(rec)
            self._segment = None
            self.num_blocks += 1
            if rec is not None:
                rec.block_end(t_work, t_end)

    def _settle(self, rec) -> tuple[float, float]:
        """Charge the open segment of the block (from ``_segment`` until now) and sleep to its target;
        returns (end of the work, end of the sleep) in ``time.perf_counter`` seconds."""
        cpu0, wall0 = self._segment if self._segment is not None else (self._cpu_time(), self._wall_time())
        cpu_s = max(0.0, self._cpu_time() - cpu0)
        charged_s = cpu_s
        if self.steady:
            i = self._position
            self._position += 1
            self._step_cpu.append(cpu_s)
            least = self._least_cpu if self._trusted else None
            if least is not None and i < len(least):
                charged_s = min(least[i], cpu_s)
        target_s = charged_s / self.speed * self.time_scale
        wall_s = self._wall_time() - wall0
        t_work = time.perf_counter() if rec is not None else 0.0
        sleep_s = target_s - wall_s - self._debt_s
        slept_s = 0.0
        if sleep_s > 0:
            t0 = self._wall_time()
            self._sleep(sleep_s)
            slept_s = self._wall_time() - t0
        behind_s = slept_s - sleep_s        # > 0: overslept, or still behind with nothing to sleep
        self._debt_s = min(max(0.0, behind_s), self._debt_s + target_s)
        if wall_s > target_s:
            self.overrun_s += wall_s - target_s
            self.num_overruns += 1
        self.compute_s += cpu_s
        self.slept_s += slept_s
        return t_work, (time.perf_counter() if slept_s > 0 and rec is not None else t_work)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Communication inside a compute block (a tensor-parallel all-reduce): the block's work so far
        is charged and slept to its target first, the communication is not stretched, and the block
        goes on from its end. Outside a block, or already paused, nothing."""
        if not self._depth or self._segment is None:
            yield
            return
        rec = self.recorder if self.recorder is not None and self.recorder.active else None
        t_work, t_end = self._settle(rec)
        if rec is not None and t_end > t_work:
            rec.message("sleep", t_work, 0, None)
        self._segment = None
        try:
            yield
        finally:
            self._segment = (self._cpu_time(), self._wall_time())

    def stats(self) -> ClockStats:
        return ClockStats(self.speed, self.compute_s, self.slept_s, self.num_blocks, self.overrun_s,
                          self.num_overruns)

    def __repr__(self) -> str:
        return (f"EmulatedClock(speed={self.speed}, time_scale={self.time_scale}, compute_s={self.compute_s:.3f}, "
                f"slept_s={self.slept_s:.3f}, overrun_s={self.overrun_s:.3f}, num_blocks={self.num_blocks})")


class NullClock:
    """The clock of a device at native speed (every GPU rank): ``compute()`` does nothing."""

    speed = None
    compute_s = 0.0
    slept_s = 0.0
    num_blocks = 0

    def __init__(self):
        self.recorder = None      # an autopar.runtime.recorder.PhaseRecorder while profiling
        self._depth = 0

    @contextmanager
    def compute(self, label: str | None = None) -> Iterator[None]:
        rec = self.recorder
        if rec is None or not rec.active or self._depth:
            with _inner_block(self):
                yield
            return
        self._depth = 1
        rec.block_begin(label)
        try:
            yield
        finally:
            self._depth = 0
            t = time.perf_counter()
            rec.block_end(t, t)

    def stats(self) -> ClockStats:
        return ClockStats(None, 0.0, 0.0, 0)

    def __repr__(self) -> str:
        return "NullClock()"


def clock_for(device, time_scale: float = 1.0, cpu_time: Callable[[], float] = time.thread_time
              ) -> EmulatedClock | NullClock:
    """The clock for a cluster ``Device`` (or its ``DeviceSpec``): an emulated device gets an
    ``EmulatedClock`` (stretching ``cpu_time``) at the speed it really runs at (``actual_speed`` when the
    cluster file gives one, else ``speed``: the planner sees ``speed``) unless that is 1.0 with no time
    scale; everything else, GPUs above all, a ``NullClock``. An emulated rank's process keeps freed memory
    in its heap from then on (``autopar.cluster.heap``), as its tables were timed."""
    spec = getattr(device, "spec", device)
    if getattr(spec, "emulate", None):
        speed = float(spec.run_speed)
        if speed != 1.0 or time_scale != 1.0:
            hold_freed_memory()       # as a device's caching allocator: no pages faulted in again per step
            return EmulatedClock(speed, time_scale=time_scale, steady=steady_emulation(), cpu_time=cpu_time)
    return NullClock()


def apply_cpu_share(share: CpuShare | None, num_cores: int) -> None:
    """Give this process (every thread it has now, and those it starts later) ``share``'s cores and
    torch thread counts, and record ``num_cores``, the cores shared out among the ranks, in
    ``AUTOPAR_NUM_CORES`` for the time scale (``autopar.cluster.emulation.machine_cores``); ``None`` (a
    GPU rank) changes nothing but that. Call it first thing in a rank, before torch starts its thread
    pools: the inter-op count can only be set once, and is left as it is if torch refuses."""
    os.environ[NUM_CORES_ENV] = str(int(num_cores))
    if share is None:
        return
    import torch

    cores = set(share.cores)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except (AttributeError, OSError):   # no affinity on this platform, or the thread ended
            pass
    torch.set_num_threads(share.num_threads)
    if torch.get_num_interop_threads() != share.num_interop_threads:
        try:
            torch.set_num_interop_threads(share.num_interop_threads)
        except RuntimeError:                 # the inter-op pool already started
            pass
