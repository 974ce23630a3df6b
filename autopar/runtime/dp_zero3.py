"""ZeRO-3 in the data-parallel engine (``autopar.runtime.dp``): units gathered before use and freed
after it, in place, so parameters stay sharded between steps.

Each full parameter is a view of its unit's full buffer, whose storage is resized to 0 bytes while
the unit is freed (the tensors keep their shapes; reading one then fails). Every resize is reported
to the memory meters (``autopar.runtime.memory.storage_resized``), so an emulated rank's tracked
bytes hold a unit's weights only while it is gathered. Terms (unit, position,
shard) as in ``autopar.runtime.dp_flat``; a round is one micro-step slot that every rank joins (ranks
without a micro-step in it contribute zero gradients). Each round:

- ``"block"`` granularity (the default when the graph carries block annotations): the root unit
  is gathered for the whole micro-step; hooks that lowering inserted into a copy of the captured graph
  (``RankProgram.zero3_gm``, ``autopar.lowering.zero3_units.insert_unit_hooks``), bound here, gather each block's unit right before its first
  use in forward and free it right after its last use. In backward, a saved-tensor hook gathers a
  unit again when autograd first needs one of its parameters, always in the fixed reverse order (a
  request for unit ``u`` also gathers the units after ``u`` that backward has not reached), and a
  unit is freed again once every one of its parameters has accumulated its gradient. After
  backward, the units backward never needed are gathered (and freed) too, so every rank runs the
  same collectives: ranks without a micro-step in the round gather every unit forward and backward
  without computing. Then each unit's gradient is reduce-scattered into the shard's accumulated
  gradient and freed. Models that re-run forward code during backward (activation checkpointing)
  need ``"micro_step"``; a unit needed after it was freed raises instead of reading freed memory.
  Per-block gathering moves the same bytes but issues about twice as many collectives per block,
  so small models on high-latency links run faster per micro-step.
- ``"micro_step"``: one unit, gathered before the micro-step's forward and freed after its
  backward once its gradient is reduce-scattered.

Prefetch (the engine's ``overlap``): gathering a unit also *starts* gathering the unit this rank's
sequence needs next (forward: the next block; backward: the next in the reverse order), without
waiting; the later gather only waits for it. Every rank issues the same all-gathers in the same order
as without prefetch, so ranks stay matched and the values are the same (an all-gather is a copy). It
holds one more unit's full weights while the current one computes.

Emulation: a gather called from a hook inside a micro-step's compute block closes the block before
the collective and reopens it after, so the emulated slow-down never stretches communication.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from autopar.lowering.zero3_units import POST_HOOK, PRE_HOOK
from autopar.runtime.dp_flat import DataParallelError
from autopar.runtime.memory import storage_resized

__all__ = ["Zero3Granularity", "Zero3Mixin"]

Zero3Granularity = Literal["block", "micro_step"]


class Zero3Mixin:
    """The ZeRO-3 half of ``DataParallelEngine``: gathering and freeing units in place, and one round.
    Uses the engine's flat buffers (``FlatBuffersMixin``: ``units``, ``_unit``, ``_all_gather_flat``,
    ``_reduce_scatter_grads``), its ``_unit_params``, ``_shapes``, ``gm``, ``zero3_granularity``, and
    its micro-step (``_micro_step``, ``_segment``, ``_segment_begin``, ``_segment_end``) and its lowered
    ``program`` (``zero3_gm``)."""

    def _hold_unit(self, u: int) -> None:
        """Unit ``u``'s parameters become views of its full buffer, freed (0 bytes): called unit by unit
        in order as the engine takes each unit's shard, so one unit's full weights exist at a time."""
        if u == 0:
            self._full = []
        layout = self.units[u]
        full = torch.empty(layout.total_numel, dtype=self.dtype, device=self.device)
        for p, o, n, i in zip(self._unit(u)[1], layout.offsets, layout.numels, self._unit_params[u]):
            p.data = full[o:o + n].view(self._shapes[i])
        full.untyped_storage().resize_(0)
        storage_resized(full)                         # a tracking meter counts it freed
        self._full.append(full)

    def _setup_zero3(self, units) -> None:
        """The gathering state over the held units (``_hold_unit``: every unit freed)."""
        self._gathered = [False] * len(self.units)
        self._inflight: dict[int, Any] = {}          # unit -> a prefetch started, not waited for
        self._blocks = units.blocks if units is not None else (None,)
        self._storage_unit: dict[int, int] = {}
        self._pending = [0] * len(self.units)
        self._bwd_order = tuple(range(len(self.units) - 1, 0, -1))    # block units, last first
        self._bwd_next = 0
        self._in_backward = False
        self._reduced = [False] * len(self.units)     # this round's gradient already reduce-scattered
        self._late: list[int] = []                    # units whose gradient grew after their reduce-scatter
        self._shard_grads_round: list[torch.Tensor] | None = None
        if units is not None:
            hooked = self.program.zero3_gm.to(self.device)
            hooked.get_submodule(PRE_HOOK).bind(self._forward_gather)
            hooked.get_submodule(POST_HOOK).bind(self._free)
            self.gm = hooked
            for u in range(1, len(self.units)):
                for p in self._unit(u)[1]:
                    p.register_post_accumulate_grad_hook(lambda _p, u=u: self._grad_ready(u))

    def _gather_then(self, u: int, prefetch: int | None) -> None:
        """``_gather(u)``; with ``overlap``, then start gathering unit ``prefetch`` (the one this rank's
        sequence gathers next) without waiting for it."""
        self._gather(u)
        if prefetch is not None and self.overlap:
            with self._paused():
                self._prefetch(prefetch)

    def _gather(self, u: int) -> None:
        """Unit ``u`` gathered, waiting for its prefetch if one is in flight."""
        if self._gathered[u] or not self.units[u].total_numel:
            return
        paused = self._segment is not None          # called from a hook inside a compute block
        if paused:
            self._segment_end()
        started = self._inflight.pop(u, None)
        if started is not None:
            self._all_gather_flat_finish(u, started, self._full[u])
        else:
            self._allocate(u)
            self._all_gather_flat(u, out=self._full[u])
        self._gathered[u] = True
        if paused:
            self._segment_begin()

    def _allocate(self, u: int) -> None:
        storage = self._full[u].untyped_storage()
        storage.resize_(self._full[u].numel() * self._full[u].element_size())
        storage_resized(self._full[u])
        self._storage_unit[storage.data_ptr()] = u

    def _prefetch(self, u: int) -> None:
        """Start gathering unit ``u`` (see ``_gather``); the same collectives in the same order as
        gathering it later, so ranks that prefetch and ranks that do not stay matched."""
        if self._gathered[u] or u in self._inflight or not self.units[u].total_numel:
            return
        self._allocate(u)
        self._inflight[u] = self._all_gather_flat_start(u, self._full[u])

    def _free(self, u: int) -> None:
        started = self._inflight.pop(u, None)
        if started is not None:                     # a prefetch nobody used: complete it, then free
            self._all_gather_flat_finish(u, started, self._full[u])
            self._gathered[u] = True
        if not self._gathered[u]:
            return
        storage = self._full[u].untyped_storage()
        self._storage_unit.pop(storage.data_ptr(), None)
        storage.resize_(0)
        storage_resized(self._full[u])
        self._gathered[u] = False

    def _forward_next(self, u: int) -> int | None:
        """The unit forward gathers after unit ``u`` (units 1.. in block order), or None."""
        return u + 1 if u + 1 < len(self.units) else None

    def _forward_gather(self, u: int) -> None:
        if not self._in_backward:
            self._gather_then(u, self._forward_next(u))

    def _backward_gather_through(self, stop: int) -> None:
        """Gather the block units of the backward order up to index ``stop`` (inclusive), in order,
        each prefetching the next; before gathering one, reduce-scatter the gradient of the unit
        before it, which backward has finished (see ``_reduce_unit``)."""
        while self._bwd_next <= stop:
            u = self._bwd_order[self._bwd_next]
            if self._bwd_next > 0:
                self._reduce_unit(self._bwd_order[self._bwd_next - 1])
            self._bwd_next += 1
            self._gather_then(u, self._bwd_order[self._bwd_next] if self._bwd_next < len(self._bwd_order) else None)
            if self._pending[u] == 0 and self._bwd_order.index(u) < stop:
                self._free(u)

    def _reduce_unit(self, u: int) -> None:
        """Reduce-scatter unit ``u``'s gradient into this rank's shard sum and free it, once a round.
        In backward it runs when backward first needs the unit after ``u``: autograd runs every node
        of a later block before any node of an earlier one (its ready queue takes the highest
        sequence number first, and accumulates a gradient as soon as it is made), so ``u``'s gradient
        is complete; every rank issues it at the same place of the same collective sequence. A
        gradient arriving later anyway is caught (``_late``), never lost silently."""
        if self._reduced[u]:
            return
        self._reduced[u] = True
        if self.units[u].total_numel:
            with self._paused():
                self._reduce_scatter_grads(u, self._shard_grads_round[u])
        for p in self._unit(u)[1]:
            p.grad = None

    def _grad_ready(self, u: int) -> None:
        if self._reduced[u]:
            self._late.append(u)
        self._pending[u] -= 1
        if self._pending[u] == 0 and self._in_backward and self._bwd_order.index(u) < self._bwd_next:
            self._free(u)

    def _pack(self, t: torch.Tensor):
        try:
            return self._storage_unit.get(t.untyped_storage().data_ptr()), t
        except (RuntimeError, NotImplementedError):      # tensors without a plain storage
            return None, t

    def _unpack(self, packed):
        u, t = packed
        if u is not None and u != 0:
            self._in_backward = True
            self._backward_gather_through(self._bwd_order.index(u))
            if not self._gathered[u]:
                raise RuntimeError(f"ZeRO-3: backward needs unit {u} (block {self._blocks[u]}) again after "
                                   f"freeing it; use zero3_granularity='micro_step' for this model")
        return t

    def _zero3_round(self, inputs: tuple, targets: Any, rows: slice | None, loss_sum: torch.Tensor,
                     shard_grads: list[torch.Tensor]) -> None:
        """One ZeRO-3 round: every rank runs the same collectives; ``rows`` None or empty: no compute."""
        active = rows is not None and rows.stop > rows.start
        block_mode = self.zero3_granularity == "block"
        units = range(len(self.units))
        self._reduced = [False] * len(self.units)
        self._shard_grads_round, self._late = shard_grads, []
        self._bwd_next = 0
        if block_mode:
            self._gather_then(0, self._forward_next(0))
            if active:
                self._pending = [len(self._unit_params[u]) for u in units]
                self._in_backward = False
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    loss_sum += self._micro_step(inputs, targets, rows).double()
            else:
                self._pending = [0] * len(self.units)
                for u in units[1:]:                     # forward's gathers, then backward's
                    self._gather_then(u, self._forward_next(u))
                    self._free(u)
            self._in_backward = True                    # the units backward never needed, in order
            self._backward_gather_through(len(self._bwd_order) - 1)
            self._in_backward = False
        else:
            self._gather(0)
            if active:
                loss_sum += self._micro_step(inputs, targets, rows).double()
        for u in units:                                 # the root, the last block unit (every unit per micro-step)
            self._free(u)
            self._reduce_unit(u)
        if self._late:
            raise DataParallelError(
                f"zero3_granularity: a gradient of unit {self._late[0]} (block {self._blocks[self._late[0]]}) "
                "grew after backward had left its block and it was reduce-scattered; use "
                "zero3_granularity='micro_step' for this model")
