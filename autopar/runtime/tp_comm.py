"""The tensor-parallel group's sum as engines bind it into f / g: blocking, or started asynchronously
for the backward overlap of ``passes.tp_overlap``.

Terms
- ``GroupAllReduce(group)``: what ``bind_tp_group`` binds (``passes.tp.bind_all_reduce``). Calling it
  all-reduces a tensor in place and blocks (``communicator.pg_all_reduce``: forward g, and f where it
  is not fused). ``start(tensor)`` issues the same all-reduce asynchronously
  (``communicator.pg_all_reduce_async``) and returns its wait: ``CopyToGroup.backward_comm_async``
  hands it to the fused columns, which compute the weight gradients before calling it.
- hidden / exposed: of a backward collective's time, the part the weight gradients computed while it
  was in flight covered, and the rest, which the backward waits for.

Emulation (an emulated clock active under ``autopar.runtime.recorder.recorded_step``): ``start``
first settles the compute block so far (the clock sleeps to its target, ``EmulatedClock.paused``), so
the collective leaves when the emulated device has computed the input gradient, not earlier. The
weight gradients computed after it are charged (thread CPU time) and slept as any compute while the
collective is in flight, in the backend's own thread; the wait settles them first, then blocks
outside the block's accounting. So an emulated backward takes ``compute + max(0, collective - weight
gradients)`` per fused f: only the exposed part of the collective is added, and waiting is never
charged as compute. On an emulated CPU rank the backend's thread shares the rank's core, and the
weight gradients computed beside it took ~6% more thread CPU in the benchmark (charged as compute,
as it is work the rank really did slower). On the threaded test group the collective completes when its last rank issues
it (no real overlap, the order start, weight gradients, wait is the same); on gloo processes and on
GPUs (NCCL's stream) it really runs meanwhile.

Measured: ``benchmarks/bench_tp_overlap.py`` times each rank's backward (its own compute block) and
the time inside f's backward collectives (blocking calls with the overlap off, waits with it on; the
clock's settling sleep excluded) in one run, and reports the hidden fraction
``1 - exposed_on / collective_off`` next to the backward's own off / on ratio.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autopar.runtime.communicator import emulation_paused, pg_all_reduce, pg_all_reduce_async, pg_is_initialized, pg_ranks

__all__ = ["GroupAllReduce"]


class GroupAllReduce:
    """The sum over one process group (``None``: the default group); see the module docstring."""

    __slots__ = ("group",)

    def __init__(self, group: Any = None):
        self.group = group

    def __call__(self, tensor: torch.Tensor) -> None:
        pg_all_reduce(tensor, group=self.group)

    def start(self, tensor: torch.Tensor) -> Callable[[], None]:
        """Issue the all-reduce of ``tensor`` in place (not to be read or written until the wait);
        returns the wait."""
        with emulation_paused():
            pending = pg_all_reduce_async(tensor, group=self.group)

        def wait() -> None:
            if not pending.done:
                with emulation_paused():
                    pending.wait()
        return wait

    def __repr__(self) -> str:
        ranks = pg_ranks(self.group) if pg_is_initialized() else "?"
        return f"GroupAllReduce(ranks={ranks})"
