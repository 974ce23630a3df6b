"""Recording a training step's phases on every rank: what ``compiled.profile()`` reads.

Every clock (``autopar.runtime.emulate``), emulated or not, has a ``recorder`` (None: nothing
recorded), a ``PhaseRecorder`` once ``record_engine`` gave it one; ``autopar.ir.profile`` holds what it
gives. While a step runs under ``recorded_step(clock)`` (``Compiled.step``), the recorder is this thread's *active* recorder,
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

import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["PhaseRecorder", "RankSteps", "recorded_step", "active_recorder", "active_clock", "record_engine"]


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
    begin = getattr(clock, "begin_step", None)
    if begin is not None:
        begin()
    prev_clock = getattr(_ACTIVE, "clock", None)
    _ACTIVE.clock = clock if hasattr(clock, "paused") else None
    try:
        with _recording(getattr(clock, "recorder", None)):
            yield
    finally:
        _ACTIVE.clock = prev_clock


@contextmanager
def _recording(rec) -> Iterator[None]:
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


def active_clock():
    """This thread's clock while a step runs under ``recorded_step`` (for ``paused``), else None."""
    return getattr(_ACTIVE, "clock", None)


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
