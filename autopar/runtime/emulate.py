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
- totals: ``compute_s`` (CPU time measured in blocks), ``slept_s`` (time spent sleeping, measured),
  ``overrun_s`` and ``num_overruns`` (wall time of blocks beyond their own target, and how many such
  blocks: contention the time scale did not absorb), ``num_blocks``; ``stats()`` returns them as a frozen ``ClockStats`` for reporting.

Blocks may nest; only the outermost block measures and sleeps.

``emulation_time_scale``, ``oversubscription``, ``CpuShare`` and ``cpu_shares`` live in
``autopar.cluster.emulation`` (the cost model uses the same factor) and are re-exported here.

Step recording (``PhaseRecorder``; ``compiled.profile()`` reads it, ``autopar.ir.profile`` holds the
result). Every clock, emulated or not, has a ``recorder`` (None: nothing recorded). While a step runs
under ``recorded_step(clock)`` (``Compiled.step``), the recorder is this thread's *active* recorder,
and two places every engine goes through write time-stamped events (``time.perf_counter``, which on
Linux is ``CLOCK_MONOTONIC``: one clock for every process of a machine):
- the clock: each outermost compute block, cut into labelled segments, and its emulation sleep;
- the communicator (``autopar.runtime.communicator``): each collective and point-to-point call.
A compute block's label is ``compute(label)`` when the engine names it; otherwise it is inferred from
marks that hooks put on the recorder's timeline (``PhaseRecorder.attach``): a forward hook on the
rank's graph marks the end of forward, a hook on the forward's output gradient the start of backward,
and the optimizer's step pre/post hooks the optimizer; a block opened while autograd runs a backward
is backward. A block without any mark is ``"compute"`` (forward and backward undivided, e.g. a graph
run block by block under recomputation). Cost: two clock reads and a tuple per block or call.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from autopar.cluster.emulation import NUM_CORES_ENV, CpuShare, cpu_shares, emulation_time_scale, oversubscription
from autopar.errors import ClusterError

__all__ = ["ClockStats", "EmulatedClock", "NullClock", "clock_for", "emulation_time_scale", "oversubscription",
           "CpuShare", "cpu_shares", "apply_cpu_share", "PhaseRecorder", "RankSteps", "recorded_step",
           "active_recorder", "record_engine"]


@dataclass(frozen=True, slots=True)
class ClockStats:
    speed: float | None       # None for a NullClock (native speed, nothing emulated)
    compute_s: float          # CPU time measured inside compute blocks
    slept_s: float            # time the clock added by sleeping
    num_blocks: int
    overrun_s: float = 0.0    # wall time beyond target (contention, late wake-ups), carried as debt
    num_overruns: int = 0     # blocks that ended behind their target


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
        self.overrun_s = 0.0
        self.num_overruns = 0
        self._debt_s = 0.0
        self._depth = 0
        self.recorder: PhaseRecorder | None = None

    @contextmanager
    def compute(self, label: str | None = None) -> Iterator[None]:
        """A compute block (see the module docstring); ``label`` names its phase for the recorder
        ("forward", "backward", "optimizer", ...; default: inferred)."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._depth = 1
        rec = self.recorder if self.recorder is not None and self.recorder.active else None
        if rec is not None:
            rec.block_begin(label)
        cpu0, wall0 = self._cpu_time(), self._wall_time()
        try:
            yield
        finally:
            self._depth = 0
            cpu_s = max(0.0, self._cpu_time() - cpu0)
            target_s = cpu_s / self.speed * self.time_scale
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
            self.num_blocks += 1
            if rec is not None:
                rec.block_end(t_work, time.perf_counter() if slept_s > 0 else t_work)

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
        self.recorder: PhaseRecorder | None = None
        self._depth = 0

    @contextmanager
    def compute(self, label: str | None = None) -> Iterator[None]:
        rec = self.recorder
        if rec is None or not rec.active or self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
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


def clock_for(device, time_scale: float = 1.0) -> EmulatedClock | NullClock:
    """The clock for a cluster ``Device`` (or its ``DeviceSpec``): an emulated device gets an
    ``EmulatedClock`` unless it runs at speed 1.0 with no time scale; everything else, GPUs above all,
    a ``NullClock``."""
    spec = getattr(device, "spec", device)
    if getattr(spec, "emulate", None) and (float(spec.speed) != 1.0 or time_scale != 1.0):
        return EmulatedClock(spec.speed, time_scale=time_scale)
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


# -- step recording ---------------------------------------------------------------------------------
_ACTIVE = threading.local()

# A mark's phase: of the time before it (when it is a block's first mark) and of the time after it.
_BEFORE = {"fwd_end": "forward", "bwd_start": "backward", "opt_pre": "optimizer", "opt_post": "optimizer"}
_AFTER = {"fwd_end": "forward", "bwd_start": "backward", "opt_pre": "optimizer", "opt_post": "optimizer"}


def _in_backward() -> bool:
    import torch

    node = getattr(torch._C, "_current_autograd_node", None)
    return node is not None and node() is not None


@dataclass(frozen=True, slots=True)
class RankSteps:
    """What one rank recorded (``PhaseRecorder.snapshot``): per step ``(index, t0, t1, events)``, each
    event ``(phase, t0, t1, nbytes, key[, entry])`` in ``time.perf_counter`` seconds; ``key`` matches a
    collective or message across ranks (None for compute); ``entry``, when present, is when an
    asynchronous collective was issued (``t0`` is when the rank started waiting on it)."""
    rank: int
    host: str
    steps: tuple


class PhaseRecorder:
    """Per-rank recorder of the last ``max_steps`` steps' phases (see the module docstring)."""

    def __init__(self, rank: int = 0, max_steps: int = 64):
        self.rank = int(rank)
        self.steps: deque = deque(maxlen=max_steps)
        self.num_steps = 0
        self.active = False
        self._events: list = []
        self._marks: list = []
        self._in_block = False
        self._label: str | None = None
        self._t0 = self._blk_t0 = 0.0
        self._blk_backward = False
        self._blk_first = 0
        self._seq: dict = {}
        self._seen_forward = False
        self._hooks: list = []

    # steps
    def begin_step(self) -> None:
        self._events = []
        self._seq = {}
        self.active = True
        self._t0 = time.perf_counter()

    def end_step(self) -> None:
        t1 = time.perf_counter()
        self.active = False
        self.steps.append((self.num_steps, self._t0, t1, tuple(self._events)))
        self.num_steps += 1
        self._events = []

    def clear(self) -> None:
        self.steps.clear()

    def snapshot(self) -> RankSteps:
        return RankSteps(self.rank, socket.gethostname(), tuple(self.steps))

    # marks and compute blocks (the clock calls these)
    def mark(self, kind: str) -> None:
        if kind == "fwd_end":
            self._seen_forward = True
        if self._in_block:
            self._marks.append((time.perf_counter(), kind))

    def block_begin(self, label: str | None) -> None:
        self._in_block = True
        self._marks = []
        self._label = label
        self._blk_backward = label is None and _in_backward()
        self._blk_first = len(self._events)
        self._blk_t0 = time.perf_counter()

    def block_end(self, t_work: float, t_sleep_end: float) -> None:
        self._in_block = False
        t0, ev = self._blk_t0, self._events
        if self._label is not None:
            segs = [(self._label, t0, t_work)]
        elif not self._marks:
            lbl = "backward" if self._blk_backward else ("forward" if self._seen_forward else "compute")
            segs = [(lbl, t0, t_work)]
        else:
            marks = sorted(self._marks)
            first = "backward" if self._blk_backward else _BEFORE[marks[0][1]]
            segs = [(first, t0, marks[0][0])]
            for (ta, ka), (tb, _) in zip(marks, marks[1:] + [(t_work, None)]):
                segs.append((_AFTER[ka], ta, tb))
        inner = [(e[1], e[2]) for e in ev[self._blk_first:]]   # communication inside the block
        if inner:
            segs = [piece for seg in segs for piece in _cut(seg, inner)]
        last = None
        for lbl, a, b in segs:
            if b <= a:
                continue
            if last is not None and last[0] == lbl and last[2] == a:
                last[2] = b
            else:
                if last is not None:
                    ev.append((last[0], last[1], last[2], 0, None))
                last = [lbl, a, b]
        if last is not None:
            ev.append((last[0], last[1], last[2], 0, None))
        if t_sleep_end > t_work:
            ev.append(("sleep", t_work, t_sleep_end, 0, None))

    # communication (the communicator calls these)
    def comm(self, kind: str, t0: float, nbytes: int, group: tuple | None, key: tuple | None = None,
             entry: float | None = None) -> None:
        """A collective ``kind`` over the ranks ``group`` that blocked from ``t0`` until now; ``entry``:
        when this rank issued it, if earlier (an asynchronous collective waited on later; its ``key``
        from ``collective_key`` at issue)."""
        t1 = time.perf_counter()
        if key is None and group is not None:
            key = self.collective_key(kind, group)
        if entry is None:
            self._events.append((kind, t0, t1, int(nbytes), key))
        else:
            self._events.append((kind, t0, t1, int(nbytes), key, entry))

    def collective_key(self, kind: str, group: tuple) -> tuple:
        """The key of the next collective over ``group`` in this step (the same on every rank of it)."""
        n = self._seq.get(group, 0)
        self._seq[group] = n + 1
        return (kind, group, n)

    def message_key(self, src: int, dst: int, tag: int) -> tuple:
        """The key of the next point-to-point message ``src -> dst`` with ``tag`` in this step."""
        k = ("p2p", src, dst, tag)
        n = self._seq.get(k, 0)
        self._seq[k] = n + 1
        return (src, dst, tag, n)

    def message(self, kind: str, t0: float, nbytes: int, key: tuple | None) -> None:
        self._events.append((kind, t0, time.perf_counter(), int(nbytes), key))

    # hooks that place the marks
    def attach(self, module=None, optimizer=None) -> None:
        """Mark the end of ``module``'s forward, the start of its backward (a hook on its outputs'
        gradients) and ``optimizer.step()`` (its step pre/post hooks). No effect on the values."""
        import torch

        if module is not None:
            def on_output_grad(_grad):
                self.mark("bwd_start")

            def on_forward(_mod, _args, out):
                if not self.active:
                    return None
                self.mark("fwd_end")
                if torch.is_grad_enabled():
                    for t in torch.utils._pytree.tree_flatten(out)[0]:
                        if isinstance(t, torch.Tensor) and t.requires_grad:
                            t.register_hook(on_output_grad)
                return None
            self._hooks.append(module.register_forward_hook(on_forward))
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            self._hooks.append(optimizer.register_step_pre_hook(
                lambda *_: self.mark("opt_pre") if self.active else None))
            self._hooks.append(optimizer.register_step_post_hook(
                lambda *_: self.mark("opt_post") if self.active else None))

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _cut(seg: tuple, holes: list) -> list:
    """``seg`` = (label, a, b) less the intervals ``holes``."""
    lbl, a, b = seg
    out = []
    for h0, h1 in sorted(holes):
        if h1 <= a or h0 >= b:
            continue
        if h0 > a:
            out.append((lbl, a, h0))
        a = max(a, h1)
    if b > a:
        out.append((lbl, a, b))
    return out


def active_recorder() -> PhaseRecorder | None:
    """This thread's recorder while a step is recorded (``recorded_step``), else None."""
    return getattr(_ACTIVE, "recorder", None)


@contextmanager
def recorded_step(clock) -> Iterator[None]:
    """Record one step on ``clock``'s recorder (nothing when it has none), as this thread's active
    recorder for the communicator."""
    rec = getattr(clock, "recorder", None)
    if rec is None:
        yield
        return
    prev = getattr(_ACTIVE, "recorder", None)
    _ACTIVE.recorder = rec
    rec.begin_step()
    try:
        yield
    finally:
        rec.end_step()
        _ACTIVE.recorder = prev


def record_engine(engine, rank: int, max_steps: int = 64) -> PhaseRecorder | None:
    """Give ``engine``'s clock a ``PhaseRecorder`` for ``rank``, its marks hooked on the engine's graph
    (``gm``, or its program's) and optimizer; None when the engine has no clock."""
    clock = getattr(engine, "clock", None)
    if clock is None:
        return None
    rec = PhaseRecorder(rank, max_steps)
    module = getattr(engine, "gm", None)
    if module is None:
        module = getattr(getattr(engine, "program", None), "gm", None)
    rec.attach(module if hasattr(module, "register_forward_hook") else None, getattr(engine, "optimizer", None))
    clock.recorder = rec
    return rec
