"""Memory of a running rank: its measured peak, and an emulated device's ``memory_GB`` as a real limit.

Terms
- meter: what measures one rank's memory (``meter_for`` picks it from the rank's device):
  - ``TrackedMeter``, emulated devices: the bytes of the tensors this rank holds, tracked (below), with
    the device's ``memory_bytes`` (its ``memory_GB``, whole: the plan fills at most its
    ``memory_fraction``) as a limit. Past it, the allocation that crossed it raises
    ``MemoryLimitError`` naming the rank and the figures, as a CUDA OOM would.
  - ``CudaMeter``, GPU ranks: ``torch.cuda.max_memory_allocated`` of the rank's device; nothing tracked,
    no overhead, the device itself is the limit (``torch.OutOfMemoryError``).
  - ``NullMeter``, native CPU ranks (``emulate`` unset): nothing measured, no overhead; a ``TrackedMeter``
    without a limit when asked (``meter_for(..., track=True)``).
- tracked tensor bytes: while a ``TrackedMeter`` is active (``with meter:``; compile holds it while it
  materialises the model and builds the engine, ``Compiled.step`` while it steps), every tensor an
  operator returns on this thread (and the autograd work it starts) is counted once per storage, at
  the storage's size, until the storage is freed (a weak reference's callback). Tensors that existed
  before (a model built on CPU, not on meta) are counted by ``meter.track(tensors)``. This covers
  parameters, gradients, optimizer state, activations saved for backward, communication buffers
  (flat buffers, gathered shards: they are operator outputs) and temporaries. Not counted: tensors
  made while no meter is active (user code between steps, ``state_dict()``), and memory that is no
  tensor storage (Python objects, the allocator's caching and fragmentation, gloo's own buffers).
- peak: the most tracked bytes held at once since the last ``reset_peak()``.

Why tracked tensor bytes and not the allocator or the process. The CPU allocator keeps no statistics
torch exposes (``torch.cuda.max_memory_allocated`` has no CPU counterpart), and the process's peak
resident memory is one figure for the whole process: threaded test ranks share a process, and the
resident set also holds torch's libraries, the interpreter and freed-but-cached pages, so "above the
pre-model baseline" would measure the allocator's caching as much as the rank. Tensor bytes are
what the cost model prices (``autopar.cost.memory``) and what ``max_memory_allocated`` counts on a
GPU, so predicted and measured compare the same thing on emulated and real devices. The tracking is
a ``TorchDispatchMode`` (``torch.utils._python_dispatch``), whose stack is thread-local (and follows
autograd into its engine threads), so each thread-rank tracks only its own tensors.

Operators whose outputs alias their inputs (views, in-place and ``out=`` operators) are not looked at:
they make no new storage. A storage resized in place after it was first counted
(``UntypedStorage.resize_``, as ZeRO-3's unit buffers are freed and regathered) is no operator either:
whoever resizes one calls ``storage_resized(tensor)``, and every meter active on this thread recounts
it at its new size.

Cost: a Python call per operator while a ``TrackedMeter`` is active. On gpt-tiny (batch 8, one
thread) a training step took 1.97x and 2.05x the CPU time with tracking in two runs (median of 20
interleaved pairs, IQR 1.77-2.34x and 1.96-2.14x; 13.6 and 16.3 ms without;
``benchmarks/bench_memory.py --overhead``). On an emulated rank it runs inside the emulated clock's
compute blocks, so the clock stretches it too: emulated step times with the limit on are longer than
the cost model's (which measured blocks without it). GPU ranks and native CPU ranks never pay it.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar.errors import AutoparError

__all__ = ["MemoryLimitError", "TrackedMeter", "CudaMeter", "NullMeter", "meter_for", "module_tensors",
           "tracking_cost_per_op_s", "cpu_time_less_tracking", "storage_resized"]


class MemoryLimitError(AutoparError, RuntimeError):
    """A rank's tracked tensor bytes passed its emulated device's memory (as a CUDA out-of-memory)."""

    def __init__(self, message: str, rank: int | None = None, used_bytes: int = 0, limit_bytes: int = 0):
        super().__init__(message)
        self.rank, self.used_bytes, self.limit_bytes = rank, used_bytes, limit_bytes


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_ACTIVE = threading.local()         # .meters: the TrackedMeters active on this thread


def storage_resized(t: torch.Tensor) -> None:
    """After ``t.untyped_storage().resize_(...)``: every ``TrackedMeter`` active on this thread counts
    that storage at its size now (a storage it has not seen yet is left alone)."""
    for meter in getattr(_ACTIVE, "meters", ()):
        meter.resized(t)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def module_tensors(*modules) -> list[torch.Tensor]:
    """The parameters, their gradients and the buffers of ``modules`` (for ``TrackedMeter.track``)."""
    out = []
    for m in modules:
        if m is None:
            continue
        for p in m.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        out += list(m.buffers())
    return out


class _Tracking(TorchDispatchMode):
    """The dispatch mode of one ``TrackedMeter``: counts the storages operators return."""

    # a higher-order operator (flex attention) is one operator: its outputs are counted, what it
    # allocates inside and frees again is not
    supports_higher_order_operators = True

    def __init__(self, meter: "TrackedMeter"):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.meter.num_ops += 1
        out = func(*args, **(kwargs or {}))
        allocates = _ALLOCATES.get(func)
        if allocates is None:
            allocates = _ALLOCATES[func] = _may_allocate(func)
        if allocates:
            if type(out) in _PLAIN:
                self.meter._add(out, func)
            else:
                for t in (out if type(out) in (tuple, list) else tree_flatten(out)[0]):
                    if isinstance(t, torch.Tensor):
                        self.meter._add(t, func)
        return out


# operator -> whether its outputs may be new storages (views and in-place / out= operators return
# storages that already exist: skipping them is most of the tracking's saving)
_ALLOCATES: dict = {}


def _may_allocate(func) -> bool:
    try:
        schema = func._schema
        if func.is_view or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return False
        return not all(r.alias_info is not None for r in schema.returns)
    except (AttributeError, RuntimeError):
        return True


@functools.cache
def tracking_cost_per_op_s() -> float:
    """The CPU time one operator costs under tracking beyond its own work, measured once per process:
    small allocating operators with and without a tracking meter, the least of a few repeats (thread CPU
    time, the clock emulated devices stretch)."""
    x = torch.ones(4)
    n = 400

    def run() -> float:
        t0 = time.thread_time()
        for _ in range(n):
            y = x + 1.0
            del y
        return time.thread_time() - t0

    plain, tracked = [], []
    for _ in range(5):
        plain.append(run())
        meter = TrackedMeter()
        with meter:
            tracked.append(run())
    return max(0.0, (min(tracked) - min(plain)) / n)


class TrackedMeter:
    """Tracked tensor bytes of one rank, optionally limited (see the module docstring). ``with meter:``
    activates tracking on this thread (re-entrant: an inner ``with`` is a no-op)."""

    kind = "tracked"

    def __init__(self, rank: int | None = None, limit_bytes: int | None = None, device_name: str = "", *,
                 record: bool = False):
        if limit_bytes is not None and not limit_bytes > 0:
            raise AutoparError(f"limit_bytes: {limit_bytes!r} must be > 0 (or None for no limit)")
        self.rank, self.limit_bytes, self.device_name = rank, limit_bytes, device_name
        self.current_bytes = 0
        self.peak_bytes = 0
        self.num_ops = 0                      # operators dispatched through the tracking (see overhead_s)
        self._live: dict[int, Any] = {}       # storage key -> weak reference (its callback frees it)
        self._sizes: dict[int, int] = {}      # storage key -> bytes counted for it
        self._lock = threading.Lock()
        self._mode: _Tracking | None = None
        self._depth = 0
        # record=True (diagnosis): what made each live storage, and the live storages at the peak
        self._record = record
        self._made_by: dict[int, tuple[str, tuple, int]] = {}
        self.peak_snapshot: list[tuple[str, tuple, int]] = []

    # -- counting ------------------------------------------------------------------------------
    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors`` (those this rank held before tracking began) once per storage."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)

    def _add(self, t: torch.Tensor, func=None) -> None:
        # Plain tensors only: subclasses (fake tensors of shape propagation, wrappers) hold no storage of
        # their own; the real tensors inside a wrapper are counted as the operators that make them.
        if type(t) not in _PLAIN or t.is_meta or t.layout != torch.strided:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):   # tensors without storage (subclasses)
            return
        key, n = st._cdata, st.nbytes()
        with self._lock:
            if key in self._live:
                return
            self._live[key] = weakref.ref(st, lambda _ref, key=key: self._free(key))
            self._sizes[key] = n
            self.current_bytes += n
            if self._record:
                self._made_by[key] = (str(func) if func is not None else "track", tuple(t.shape), n)
            over = self._grew_locked()
        if over:
            raise self._error(n)

    def _grew_locked(self) -> bool:
        """After ``current_bytes`` grew (the lock held): the peak and its snapshot; whether the limit is passed."""
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            if self._record:
                self.peak_snapshot = sorted(self._made_by.values(), key=lambda v: -v[2])
        return self.limit_bytes is not None and self.current_bytes > self.limit_bytes

    def _free(self, key: int) -> None:
        with self._lock:
            if self._live.pop(key, None) is not None:
                self.current_bytes -= self._sizes.pop(key, 0)
                self._made_by.pop(key, None)

    def resized(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage at its size now, if this meter counts it (``storage_resized``)."""
        st = t.untyped_storage()
        key, n = st._cdata, st.nbytes()
        with self._lock:
            if key not in self._live:
                return
            self.current_bytes += n - self._sizes.get(key, 0)
            self._sizes[key] = n
            if self._record and key in self._made_by:
                op, shape, _ = self._made_by[key]
                self._made_by[key] = (op, shape, n)
            over = self._grew_locked()
        if over:
            raise self._error(n)

    def _error(self, n: int) -> MemoryLimitError:
        who = f"rank {self.rank}" + (f" ({self.device_name})" if self.device_name else "")
        return MemoryLimitError(
            f"{who}: out of memory: tracked tensors would hold {self.current_bytes} bytes "
            f"({_mib(self.current_bytes)}) after allocating {n} bytes, over the emulated device's memory_GB "
            f"of {self.limit_bytes} bytes ({_mib(self.limit_bytes)}); plan with a smaller batch, more devices or "
            "a higher ZeRO stage", self.rank, self.current_bytes, self.limit_bytes)

    @property
    def overhead_s(self) -> float:
        """CPU seconds the tracking itself has cost this thread so far: operators dispatched times the
        per-operator cost measured once per process (``tracking_cost_per_op_s``). An emulated clock
        subtracts it from the CPU time it stretches, so tracking does not slow the emulated device."""
        return self.num_ops * tracking_cost_per_op_s()

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.current_bytes
            self.peak_snapshot = sorted(self._made_by.values(), key=lambda v: -v[2])

    # -- activation ----------------------------------------------------------------------------
    def __enter__(self) -> "TrackedMeter":
        self._depth += 1
        if self._depth == 1:
            self._mode = _Tracking(self)
            self._mode.__enter__()
            _ACTIVE.meters = (*getattr(_ACTIVE, "meters", ()), self)
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0 and self._mode is not None:
            mode, self._mode = self._mode, None
            _ACTIVE.meters = tuple(m for m in getattr(_ACTIVE, "meters", ()) if m is not self)
            mode.__exit__(*exc)


class CudaMeter:
    """Peak memory of a GPU rank: the allocator's ``max_memory_allocated`` (no tracking, no limit)."""

    kind = "cuda"
    limit_bytes = None

    def __init__(self, device: torch.device, rank: int | None = None):
        self.device, self.rank = torch.device(device), rank

    def track(self, tensors: Iterable[torch.Tensor]) -> None:   # the allocator counts everything
        pass

    @property
    def current_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    @property
    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def __enter__(self) -> "CudaMeter":
        return self

    def __exit__(self, *exc) -> None:
        pass


class NullMeter:
    """A native CPU rank's meter: measures nothing (``peak_bytes`` None), costs nothing."""

    kind = "none"
    limit_bytes = None
    current_bytes = None
    peak_bytes = None

    def __init__(self, rank: int | None = None):
        self.rank = rank

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        pass

    def reset_peak(self) -> None:
        pass

    def __enter__(self) -> "NullMeter":
        return self

    def __exit__(self, *exc) -> None:
        pass


def meter_for(device, rank: int | None, torch_device: torch.device | str = "cpu", *,
              track: bool | None = None):
    """The meter of a rank on cluster ``device`` (an ``autopar.cluster.model.Device``) running on
    ``torch_device``: a ``CudaMeter`` on a GPU, a limited ``TrackedMeter`` on an emulated device, a
    ``NullMeter`` on a native CPU (``track=True``: an unlimited ``TrackedMeter``; ``track=False``: a
    ``NullMeter`` on an emulated device too, without the limit)."""
    torch_device = torch.device(torch_device)
    if torch_device.type == "cuda":
        return CudaMeter(torch_device, rank)
    spec = device.spec
    if spec.is_emulated and track is not False:
        return TrackedMeter(rank, int(spec.memory_bytes), spec.name)
    if track:
        return TrackedMeter(rank, None, spec.name)
    return NullMeter(rank)


def cpu_time_less_tracking(meter) -> Callable[[], float]:
    """This thread's CPU time less what ``meter``'s tracking has cost it (``TrackedMeter.overhead_s``):
    the clock an emulated device stretches, so that tracking its memory does not slow it down."""
    if not isinstance(meter, TrackedMeter):
        return time.thread_time
    return lambda: time.thread_time() - meter.overhead_s
