"""Pausing Python's cyclic garbage collector around work that makes many long-lived objects.

A full collection walks every object alive, torch's import-time objects included; the analysis of a
large graph and the planner's search make enough new objects to set off several. Within
``gc_paused()`` reference counting still frees what it can; garbage in cycles waits until the end, when
the collector is back as it was. Side processes forked inside inherit the pause."""

from __future__ import annotations

import contextlib
import gc

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector off while this lasts, restored (to on, if it was on) after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
