"""Gradient reduction overlapping backward in the data-parallel engine (``autopar.runtime.dp``), as
DDP does: the flat gradient of ZeRO 0/1 is cut into buckets, and each bucket's all-reduce starts
(asynchronously, ``pg_all_reduce_async``) as soon as backward has produced every gradient in it, while
backward goes on computing the gradients of earlier layers.

Terms
- bucket: a contiguous range ``[lo, hi)`` of one unit's flat gradient holding whole parameters,
  at most ``BUCKET_BYTES`` (a parameter larger than that is a bucket alone). Buckets are cut in
  *reverse* flat order (the last parameters first), because backward produces the gradients of the
  last layers first (``bucket_ranges``).
- ready: every parameter of the bucket has accumulated its gradient in this rank's *last*
  micro-step of the step (the sync's ``register_post_accumulate_grad_hook`` calls ``grad_ready``
  once the gradient is in the flat buffer); earlier micro-steps only
  accumulate, as under DDP's ``no_sync``.
- launch order: buckets are launched strictly in bucket order (bucket ``k`` only after ``k - 1``),
  as DDP does, so every rank issues the same collectives in the same order whatever order its hooks
  fire in. A rank with no micro-step in the step (an idle rank, a share of 0) and buckets whose
  parameters got no gradient are launched by ``finish`` after the rank's micro-steps, in order.
- exposed: what is left of the reduction after backward: ``finish`` waits for every bucket; with
  backward's compute ahead of the reduction, that is about the last bucket.

Exactness: the sum over ranks of every element is the same sum, only issued in pieces; the backends
(gloo's ring, the threaded test group) may add the ranks' values in a different order for a piece
than for the whole buffer, so overlap on and off agree to float rounding (bitwise on the threaded
group), and both equal the one-device oracle to the api.md tolerances.

Emulation: a launch called from a hook inside the micro-step's compute block closes the block before
the collective is issued and reopens it after (the engine's ``pause``), so the emulated device has
reached that point of its backward (its sleep included) when the bucket leaves it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from autopar.config import GRAD_BUCKET_BYTES
from autopar.ir.costs import bucket_ranges   # one packing rule: the engine's and the cost model's
from autopar.runtime.communicator import PendingCollective, pg_all_reduce_async

__all__ = ["BUCKET_BYTES", "Bucket", "bucket_ranges", "GradBuckets"]

BUCKET_BYTES = GRAD_BUCKET_BYTES     # autopar.config: the planner prices the same buckets


@dataclass(frozen=True, slots=True)
class Bucket:
    unit: int                     # the unit whose flat gradient it covers
    lo: int                       # [lo, hi) in that flat gradient
    hi: int
    params: tuple[int, ...]       # indices into the engine's parameter list


class GradBuckets:
    """The bucketed, overlapped all-reduce of ZeRO 0/1's flat gradients (see the module docstring).

    ``flats``: each unit's flat gradient (every ``.grad`` a view of it); ``unit_params``: per unit, the
    engine parameter indices in flat order; ``layouts``: per unit, its ``FlatLayout``; ``pause``: a
    context manager factory that suspends the emulated compute block around a launch."""

    def __init__(self, unit_params: Sequence[Sequence[int]], layouts,
                 flats: Sequence[torch.Tensor], group, pause: Callable[[], AbstractContextManager],
                 bucket_bytes: int = BUCKET_BYTES):
        self._flats = list(flats)
        self._group = group
        self._pause = pause
        buckets = []
        for u in range(len(layouts) - 1, -1, -1):          # later units first, as backward reaches them
            layout, idx = layouts[u], list(unit_params[u])
            element = max(1, flats[u].element_size())
            for members in bucket_ranges(layout.numels, layout.offsets, max(1, bucket_bytes // element)):
                lo = min(layout.offsets[k] for k in members)
                hi = max(layout.offsets[k] + layout.numels[k] for k in members)
                buckets.append(Bucket(u, lo, hi, tuple(idx[k] for k in members)))
        self.buckets: tuple[Bucket, ...] = tuple(buckets)
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.params}
        self._pending = [0] * len(self.buckets)
        self._handles: list[PendingCollective] = []
        self._next = 0
        self._armed = False
        self.launched_early = 0       # buckets of the last step launched from backward's hooks

    def arm(self) -> None:
        """Before this rank's last micro-step of the step: count every bucket's gradients again."""
        self._pending = [len(b.params) for b in self.buckets]
        self._armed = True
        self.launched_early = 0

    def grad_ready(self, i: int) -> None:
        """Parameter ``i`` has accumulated its gradient (the owner's post-accumulate-grad hook, after
        the gradient is in the flat buffer)."""
        if not self._armed:
            return
        b = self._bucket_of[i]
        self._pending[b] -= 1
        if self._next == b and self._pending[b] == 0:
            with self._pause():
                self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._start(self._next)
            self.launched_early += 1

    def _start(self, b: int) -> None:
        bucket = self.buckets[b]
        self._handles.append(pg_all_reduce_async(self._flats[bucket.unit][bucket.lo:bucket.hi], group=self._group))
        self._next = b + 1

    def finish(self) -> None:
        """After this rank's micro-steps: launch the buckets not launched yet, in order, and wait for
        every one (the reduced gradients are in the flat buffers after it)."""
        self._armed = False
        while self._next < len(self.buckets):
            self._start(self._next)
        for h in self._handles:
            h.wait()
        self._handles.clear()
        self._next = 0
