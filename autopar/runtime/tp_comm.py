"""The tensor-parallel group's sum as engines bind it into f / g (and sequence parallelism's
reduce-scatter): blocking, or started asynchronously for the backward overlap of ``passes.tp_overlap``.

Terms
- ``GroupAllReduce(group)``: what ``bind_tp_group`` binds (``passes.tp.bind_all_reduce``). Calling it
  all-reduces a tensor in place and blocks (``communicator.pg_all_reduce``: forward g, and f where it
  is not fused). ``start(tensor)`` issues the same all-reduce asynchronously
  (``communicator.pg_all_reduce_async``) and returns its wait: ``CopyToGroup.backward_comm_async``
  hands it to the fused columns, which compute the weight gradients before calling it.
- ``GroupReduceScatter(group)``: what ``bind_sp_group`` binds as sequence parallelism's
  ``reduce_scatter_into`` (``passes.tp_sp_comm.SeqContext``). Calling it reduce-scatters and blocks
  (``communicator.pg_reduce_scatter_into``: forward g under SP); ``start(output, tensor)`` issues the
  same reduce-scatter asynchronously and returns its wait: ``SeqContext.start_reduce_scatter`` (the
  backward of an SP f, ``SeqGatherToGroup.backward_comm_async``) uses it, so a sequence-parallel
  block's f overlaps its reduce-scatter with the weight gradients as a TP block's f does its all-reduce.
- ``GroupAllGather(group)``: sequence parallelism's ``all_gather``. Called as ``(outputs, tensor)``
  it blocks (``communicator.pg_all_gather``: an unchunked f's forward); ``start_into(output, tensor)``
  issues the all-gather into one flat tensor asynchronously and returns its wait: the forward
  overlap's chunked all-gather (``passes.tp_fwd_overlap``, ``SeqContext.gather_chunks``) starts chunk
  c+1 before the columns (or, in a chunked row's backward, the input gradient) compute chunk c.
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
``1 - exposed_on / collective_off`` next to the backward's own off / on ratio; ``--sp`` does the same
for a sequence-parallel stage, whose f collective is ``GroupReduceScatter``'s
(``benchmarks/results/tp_overlap-sp.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autopar.runtime.communicator import (PendingCollective, emulation_paused, pg_all_gather,
                                        pg_all_gather_into_async, pg_all_reduce, pg_all_reduce_async,
                                        pg_group_size, pg_is_initialized, pg_ranks, pg_reduce_scatter_into,
                                        record_issue, record_issued)

__all__ = ["GroupAllReduce", "GroupReduceScatter", "GroupAllGather", "pg_reduce_scatter_into_async"]


def _waiter(pending: PendingCollective) -> Callable[[], None]:
    """The wait of a started collective: blocks outside the emulated clock's accounting."""
    def wait() -> None:
        if not pending.done:
            with emulation_paused():
                pending.wait()
    return wait


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
            return _waiter(pg_all_reduce_async(tensor, group=self.group))

    def __repr__(self) -> str:
        ranks = pg_ranks(self.group) if pg_is_initialized() else "?"
        return f"GroupAllReduce(ranks={ranks})"


def pg_reduce_scatter_into_async(output: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                                 op=dist.ReduceOp.SUM) -> PendingCollective:
    """``communicator.pg_reduce_scatter_into`` started without waiting (``async_op=True``): ``output``
    holds this rank's piece of the sum once the returned ``PendingCollective`` is waited on; neither
    tensor may be touched before."""
    if pg_group_size(group) == 1:
        output.copy_(tensor.reshape(output.shape))
        return PendingCollective()
    # torch >= 2.10 renamed reduce_scatter_tensor (same arguments), as communicator does
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    issued = record_issue("reduce_scatter", tensor.numel() * tensor.element_size(), group)
    work = fn(output, tensor, op=op, group=group, async_op=True)
    return PendingCollective(work, record_issued(issued))


class GroupReduceScatter:
    """The reduce-scatter over one process group (``None``: the default group) as
    ``SeqContext.reduce_scatter_into`` calls it; see the module docstring."""

    __slots__ = ("group",)

    def __init__(self, group: Any = None):
        self.group = group

    def __call__(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        pg_reduce_scatter_into(output, tensor, group=self.group)

    def start(self, output: torch.Tensor, tensor: torch.Tensor) -> Callable[[], None]:
        """Issue the reduce-scatter of ``tensor`` (laid out position by position) into ``output``
        (neither to be read or written until the wait; the emulated clock as in
        ``GroupAllReduce.start``); returns the wait."""
        with emulation_paused():
            return _waiter(pg_reduce_scatter_into_async(output, tensor, group=self.group))

    def __repr__(self) -> str:
        ranks = pg_ranks(self.group) if pg_is_initialized() else "?"
        return f"GroupReduceScatter(ranks={ranks})"


class GroupAllGather:
    """The all-gather over one process group (``None``: the default group) as
    ``SeqContext.all_gather`` calls it: ``(outputs, tensor)`` blocks (``communicator.pg_all_gather``);
    ``start_into(output, tensor)`` issues the all-gather of ``tensor`` into the flat ``output`` (every
    rank's tensor in group order) asynchronously and returns its wait (the emulated clock as in
    ``GroupAllReduce.start``): the chunked forward of an SP f (``SeqContext.gather_chunks``,
    ``passes.tp_fwd_overlap``) and of a chunked row's backward use it."""

    __slots__ = ("group",)

    def __init__(self, group: Any = None):
        self.group = group

    def __call__(self, outputs: list, tensor: torch.Tensor) -> None:
        pg_all_gather(outputs, tensor, group=self.group)

    def start_into(self, output: torch.Tensor, tensor: torch.Tensor) -> Callable[[], None]:
        """Issue the all-gather (neither tensor to be read or written until the wait); returns the wait."""
        with emulation_paused():
            return _waiter(pg_all_gather_into_async(output, tensor, group=self.group))

    def __repr__(self) -> str:
        ranks = pg_ranks(self.group) if pg_is_initialized() else "?"
        return f"GroupAllGather(ranks={ranks})"
