"""An emulated device's host memory, held the way a GPU's caching allocator holds device memory.

An emulated rank is charged the CPU time of its compute blocks (``autopar.runtime.emulate``), and its
tables are timed the same way (``autopar.measure.blocks``). glibc's allocator gives freed memory back
to the kernel (heap trimming, and large blocks ``mmap``-ed one by one), so the next step's allocations
fault the same pages in again: 2-20 thousand minor faults a step were measured in a rank, and their
kernel time is CPU time of the block that allocates. How many depends on what ran before in the same
process (other plans stepped in turn, the planner's own heap), not on the emulated device: measured on
torchtitan's Qwen3-MoE, the same plans' backward was timed 35% apart between the planning process and
the ranks. A GPU's caching allocator keeps freed blocks for the next step and faults nothing.

``hold_freed_memory()`` raises glibc's trim and ``mmap`` thresholds (``mallopt``) in this process, for
good: every emulated rank calls it when its clock is made (``autopar.runtime.emulate.clock_for``).
``freed_memory_held()`` holds it while tables are timed for emulated devices (``autopar.api.prepare``)
and restores glibc's defaults after, unless the process holds it for good. ``heap_held()`` says which
regime this process is in (the measurement caches are keyed by it). Where the C library is not glibc,
nothing is changed and both say so. Native CPU ranks and GPU ranks never call it: their allocator is
what users run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["hold_freed_memory", "freed_memory_held", "heap_held", "HELD_BYTES"]

HELD_BYTES = 1 << 30          # blocks up to this size come from the heap, and the heap keeps this much free
_M_TRIM_THRESHOLD = -1        # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_DEFAULT_BYTES = 128 * 1024   # glibc's default for both

_state = {"held": False, "for_good": False}


def _mallopt():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return getattr(libc, "mallopt", None)
    except OSError:
        return None


def _set(nbytes: int) -> bool:
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, nbytes)) and bool(mallopt(_M_MMAP_THRESHOLD, nbytes))


def hold_freed_memory() -> bool:
    """Keep freed memory in this process's heap from now on; whether the allocator took it."""
    if not _state["held"]:
        _state["held"] = _set(HELD_BYTES)
    _state["for_good"] = _state["held"]
    return _state["held"]


@contextmanager
def freed_memory_held() -> Iterator[bool]:
    """Keep freed memory in the heap inside the block (yields whether the allocator took it); glibc's
    defaults again after it, unless ``hold_freed_memory`` was called."""
    if _state["held"]:
        yield True
        return
    _state["held"] = _set(HELD_BYTES)
    try:
        yield _state["held"]
    finally:
        if _state["held"] and not _state["for_good"]:
            _set(_DEFAULT_BYTES)
            _state["held"] = False


def heap_held() -> bool:
    """Whether this process keeps freed memory in its heap now."""
    return _state["held"]
