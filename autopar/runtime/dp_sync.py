"""The one data-parallel sync: ZeRO stages 0-3 over flat buffers, for every engine whose ranks hold
copies of the same parameters (the data-parallel engine's members, a pipeline stage's members, the
ranks at one TP index of a TP stage's members).

One ``DataParallelSync`` per rank and parameter set: it lays the parameters out in flat buffers
(``autopar.runtime.dp_flat``: layouts, shards, collectives), keeps the buffers, reduces the gradients,
steps the optimizer over this rank's shard and gathers the parameters back. An engine composes it with
its own stage executor and schedule and calls, per step:

- ``begin_step()`` before the first backward;
- ZeRO 0/1: ``arm()`` before this rank's last backward (the buckets then reduce while it runs);
- ZeRO-2: ``reduce_round()`` after each round of backwards (or once, after all of them);
- ZeRO-3: ``zero3_round(run)`` for each round (``run`` the micro-step, or None on a rank without one),
  or ``gather_all()`` before the step's backwards and ``reduce_round()`` after (a stage that keeps
  its units gathered for the whole step);
- ``reduce()`` after the last: the reduction left (ZeRO 0/1);
- ``step(compute)``: the optimizer step (inside ``compute()``, the emulated clock's compute block),
  the parameters' all-gather.

Terms (position, unit, shard, shard Parameter) as in ``autopar.runtime.dp_flat``. ZeRO stages:

- 0: the flat gradient is all-reduced (in buckets during the last backward with ``overlap``,
  ``autopar.runtime.dp_overlap``); every rank steps the full optimizer.
- 1: as 0 with buckets (``overlap``); without, the flat gradient is reduce-scattered into the shard
  instead, as Megatron's distributed optimizer. Then each rank steps its shard only (shard
  Parameters: views of the parameter buffer) and the parameter buffer is all-gathered from every shard.
- 2: gradients are sharded: each round's gradient is reduce-scattered into the shard's sum and freed.
- 3: parameters stay sharded between steps; each unit is gathered before its use and freed after it
  (per block through hooks lowering put in the graph, ``autopar.lowering.zero3_units``, or per
  micro-step), the next one prefetched, and each unit's gradient reduce-scattered as soon as backward
  has left its block (``_reduce_unit``), so a rank never holds the full gradient.

Buffers are allocated once: under ZeRO 0/1 each unit's flat gradient, every ``.grad`` a view of it
once the step's first gradient of the parameter is copied in (later backwards accumulate in place, as
DDP's ``gradient_as_bucket_view``; no zeroing pass; a linear layer's weight gradient is written
there by its GEMM, ``passes.grad_fusion``); under ZeRO 0-2 the parameters
are views of one flat buffer, which the all-gather writes straight into; under ZeRO 2/3 the shard's
gradient sum.

Emulation: a collective issued from a hook inside a compute block runs inside ``pause()`` (the
engine's: it closes the block and reopens it after), so the emulated slow-down never stretches
communication.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Literal, Sequence

import torch
from torch import nn

from autopar.lowering.zero3_units import POST_HOOK, PRE_HOOK
from autopar.runtime.communicator import PendingCollective, pg_all_reduce, pg_broadcast, pg_ranks
from autopar.runtime.dp_flat import (
    DataParallelError, FlatLayout, all_gather_flat, all_gather_flat_start, check_elementwise, flat_layouts,
    reduce_scatter_grads, sharded_optimizer,
)
from autopar.runtime.dp_overlap import BUCKET_BYTES, GradBuckets
from autopar.runtime.memory import storage_resized

__all__ = ["DataParallelSync", "KeptGrads", "Zero3Granularity"]

Zero3Granularity = Literal["block", "micro_step"]


class DataParallelSync:
    """ZeRO ``zero_stage`` over ``params`` on this rank (module docstring). Build it on every rank of
    ``group`` with parameters of the same shapes in the same order.

    ``probe``: the user's optimizer over ``params`` (its class, groups and hyperparameters; stepped
    as is under ZeRO-0); ``position``: this rank's index in ``group``; ``shares``: each position's
    share of a shard (None: even); ``units``: indices into ``params`` per unit (ZeRO-3 by block; None:
    one unit); ``pause``: a context manager factory closing the caller's compute block around a
    collective issued from a hook; ``overlap``: bucketed gradient all-reduce during backward (ZeRO
    0/1) and the next unit's prefetch (ZeRO-3); ``src``: the global rank whose weights every rank
    starts from (None: they are equal already); ``prepare_unit(u, params)``: called before unit ``u``
    is flattened, returns its parameters (deferred materialisation gives new Parameter objects)."""

    def __init__(self, params: Sequence[nn.Parameter], probe: torch.optim.Optimizer, *, zero_stage: int,
                 group: Any, position: int, device: torch.device, shares: Sequence[float] | None = None,
                 units: Sequence[Sequence[int]] | None = None,
                 pause: Callable[[], AbstractContextManager] = nullcontext, overlap: bool = True,
                 bucket_bytes: int = BUCKET_BYTES, src: int | None = None,
                 prepare_unit: Callable[[int, list], list] | None = None):
        params = list(params)
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise DataParallelError(f"model: trainable parameters must share one floating dtype, got {dtypes}")
        if zero_stage not in (0, 1, 2, 3):
            raise DataParallelError(f"plan.zero_stage: must be 0, 1, 2 or 3, got {zero_stage!r}")
        self.zero_stage = int(zero_stage)
        self.group, self.position, self.device = group, int(position), torch.device(device)
        self.dtype = next(iter(dtypes))
        self.overlap = bool(overlap)
        self._pause = pause
        n = len(pg_ranks(group))
        shares = [1.0] * n if shares is None else [float(s) for s in shares]
        members = tuple(tuple(u) for u in units) if units is not None else (tuple(range(len(params))),)
        self.params, self.unit_params, self.units = flat_layouts(params, members, probe, shares)
        self.shapes = tuple(p.shape for p in self.params)
        if self.zero_stage >= 1:
            check_elementwise(probe, self.zero_stage)

        shards = self._flatten_units(src, prepare_unit)
        self.where = {id(self.params[i]): (u, k) for u, idx in enumerate(self.unit_params)
                      for k, i in enumerate(idx)}
        # (flat shard Parameter, unit, [start, stop) in the unit's flat buffer)
        self.shard_params: tuple[tuple[nn.Parameter, int, tuple[int, int]], ...] = ()
        if self.zero_stage == 0:
            self.optimizer = probe
        else:
            self.optimizer, self.shard_params = sharded_optimizer(
                probe, self.units, shards, self.position, self.zero_stage, self.dtype, self.device)
        del shards
        self._gradient_buffers(n, pause, bucket_bytes)
        # ZeRO-3 state
        self._gathered = [False] * len(self.units)
        self._inflight: dict[int, PendingCollective] = {}
        self._storage_unit: dict[int, int] = {}
        self._reduced = [False] * len(self.units)
        self._late: list[int] = []
        self._pending = [0] * len(self.units)
        self._bwd_order = tuple(range(len(self.units) - 1, 0, -1))     # block units, last first
        self._bwd_next = 0
        self._in_backward = False
        self._blocks: tuple = (None,) * len(self.units)
        self._unpacks = False

    def _flatten_units(self, src: int | None, prepare_unit) -> list[torch.Tensor]:
        """This rank's shard of every unit: made (``prepare_unit``), flattened, broadcast from ``src``.
        ZeRO 0-2 keep the flat buffer as the parameters' storage, ZeRO-3 frees the full weights."""
        shards, self.param_flats = [], []
        self.full_buffers: list[torch.Tensor] = []      # ZeRO-3: each unit's full buffer, freed or gathered
        for u in range(len(self.units)):
            if prepare_unit is not None:
                idx = self.unit_params[u]
                for i, p in zip(idx, prepare_unit(u, [self.params[i] for i in idx])):
                    self.params[i] = p
            flat = self._flatten(u)
            if self.zero_stage < 3:
                self.param_flats.append(flat)
                self._bind_param_views(u, flat)
            if src is not None:
                pg_broadcast(flat, src=src, group=self.group)
            lo, hi = self.units[u].shard(self.position)
            shards.append(flat[lo:hi].clone() if self.zero_stage == 3 else flat[lo:hi])
            del flat
            if self.zero_stage == 3:
                self._hold_unit(u)
        return shards

    def _gradient_buffers(self, n: int, pause, bucket_bytes: int) -> None:
        """ZeRO 0/1: the flat gradients (each .grad a view of it, bucketed over ``n`` ranks with
        overlap); ZeRO >= 2, and ZeRO-1 without buckets: the shard's gradient sum."""
        new = dict(dtype=self.dtype, device=self.device)
        self.grad_flats = self.shard_grads = None
        self.buckets = self._grads = None
        if self.zero_stage in (0, 1):
            self.grad_flats = [torch.zeros(layout.total_numel, **new) for layout in self.units]
            if self.overlap and n > 1:
                self.buckets = GradBuckets(self.unit_params, self.units, self.grad_flats, self.group, pause,
                                           bucket_bytes)
            views: list = [None] * len(self.params)     # each .grad's place in its unit's flat gradient
            for u, flat in enumerate(self.grad_flats):
                for i, o, k in zip(self.unit_params[u], self.units[u].offsets, self.units[u].numels):
                    views[i] = flat[o:o + k].view(self.shapes[i])
            # each step's first gradient is copied into its view, which .grad then is (KeptGrads)
            self._grads = KeptGrads(self.params, into=views,
                                    then=self.buckets.grad_ready if self.buckets is not None else None)
        if self.zero_stage >= 2 or (self.zero_stage == 1 and self.buckets is None):
            # the shard's gradient sum (ZeRO-1 without buckets reduce-scatters into it, as Megatron's
            # distributed optimizer: the bytes of the all-reduce it replaces, half of them moved)
            self.shard_grads = [torch.zeros(hi - lo, **new)
                                for lo, hi in (layout.shard(self.position) for layout in self.units)]

    # -- layout ----------------------------------------------------------------------------------
    @property
    def kept_grads(self) -> KeptGrads | None:
        """ZeRO 0/1: the gradients kept as views of the flat gradient (None under ZeRO 2/3)."""
        return self._grads

    @property
    def gathered(self) -> tuple[bool, ...]:
        """ZeRO-3: whether each unit's full weights are gathered now."""
        return tuple(self._gathered)

    def unit(self, u: int) -> tuple[FlatLayout, list[nn.Parameter]]:
        """(layout, parameters) of unit ``u``."""
        return self.units[u], [self.params[i] for i in self.unit_params[u]]

    def _flatten(self, u: int) -> torch.Tensor:
        params = self.unit(u)[1]
        if not params:
            return torch.zeros(0, dtype=self.dtype, device=self.device)
        return torch.cat([p.detach().reshape(-1) for p in params]).to(self.dtype)

    def _bind_param_views(self, u: int, flat: torch.Tensor) -> None:
        """Unit ``u``'s parameters become views of ``flat`` (holding their values), so an all-gather
        into ``flat`` updates them in place: no unflattening copy (ZeRO 0-2)."""
        layout, params = self.unit(u)
        for p, o, k in zip(params, layout.offsets, layout.numels):
            p.data = flat[o:o + k].view(p.shape)

    def full_flat(self, u: int) -> torch.Tensor:
        """Unit ``u``'s full flat parameters: the parameter buffer (ZeRO 0-2), or gathered into a new
        buffer (ZeRO-3: a collective, every rank calls it)."""
        if self.zero_stage < 3:
            return self.param_flats[u]
        return all_gather_flat(self.units[u], self._shard_pieces(u), self.position, self.group,
                               self.dtype, self.device)

    def _shard_pieces(self, u: int) -> list[tuple[int, int, torch.Tensor]]:
        return [(a, b, sp.detach()) for sp, su, (a, b) in self.shard_params if su == u]

    # -- a step ----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before the step's first backward: gradients None (ZeRO 0/1: each parameter's first gradient
        of the step is copied into its place in the flat gradient, which it then views, so later
        backwards accumulate in place; ``KeptGrads``), the shard sums zeroed."""
        if self._grads is not None:
            self._grads.begin_step()
        else:
            for p in self.params:
                p.grad = None
        for g in self.shard_grads or ():
            g.zero_()

    def arm(self) -> None:
        """ZeRO 0/1 with overlap: before this rank's last backward of the step."""
        if self.buckets is not None:
            self.buckets.arm()

    def reduce_round(self) -> None:
        """ZeRO 2/3: every unit's gradient (zeros where a parameter has none) reduce-scattered into the
        shard sums, then freed (every rank calls it, once per round)."""
        for u in range(len(self.units)):
            self._reduced[u] = False
            self._reduce_unit(u)

    def reduce(self) -> None:
        """ZeRO 0/1, after the step's last backward: the all-reduce left (the buckets not launched
        yet, or every flat gradient without overlap), waited for; ZeRO-1 without buckets
        reduce-scatters into the shard instead. Nothing under ZeRO 2/3."""
        if self.zero_stage not in (0, 1):
            return
        self._grads.settle()
        if self.buckets is not None:
            self.buckets.finish()
        elif self.zero_stage == 1:
            self.reduce_round()
        else:
            for flat in self.grad_flats:
                pg_all_reduce(flat, group=self.group)

    def step(self, compute: Callable[[], AbstractContextManager] = nullcontext,
             optimizer: Any = None) -> None:
        """After ``reduce`` (and any other collective of the step): the optimizer step inside
        ``compute()`` (``optimizer``: the engine's wrapper of ``self.optimizer``, e.g. fp16's loss
        scaler; None: ``self.optimizer``), then the parameters' all-gather (ZeRO 1/2)."""
        for sp, u, (a, b) in self.shard_params:
            lo = self.units[u].shard(self.position)[0]
            sp.grad = self.grad_flats[u][a:b] if self.shard_grads is None else self.shard_grads[u][a - lo:b - lo]
        with compute():
            (optimizer if optimizer is not None else self.optimizer).step()
        for sp, _, _ in self.shard_params:
            sp.grad = None
        if self.zero_stage in (1, 2):
            for u in range(len(self.units)):
                all_gather_flat(self.units[u], self._shard_pieces(u), self.position, self.group, self.dtype,
                                self.device, out=self.param_flats[u])

    def _reduce_unit(self, u: int) -> None:
        """Reduce-scatter unit ``u``'s gradient into this rank's shard sum and free it, once a round.
        ZeRO-3 by block calls it when backward first needs the unit after ``u``: autograd runs every
        node of a later block before any node of an earlier one (its ready queue takes the highest
        sequence number first, and accumulates a gradient as soon as it is made), so ``u``'s gradient
        is complete and every rank issues the reduce-scatter at the same place of the same collective
        sequence. A gradient arriving later anyway is caught (``_late``), never lost silently."""
        if self._reduced[u]:
            return
        self._reduced[u] = True
        layout, params = self.unit(u)
        if layout.total_numel:
            with self._pause():
                reduce_scatter_grads(layout, params, self.shard_grads[u], self.position, self.group,
                                     self.dtype, self.device)
        if self.grad_flats is None:           # ZeRO 2/3: the gradient is freed (ZeRO-1 keeps its buffer)
            for p in params:
                p.grad = None

    # -- ZeRO-3: gathering and freeing units in place --------------------------------------------
    def _hold_unit(self, u: int) -> None:
        """Unit ``u``'s parameters become views of its full buffer, freed (0 bytes)."""
        layout, params = self.unit(u)
        full = torch.empty(layout.total_numel, dtype=self.dtype, device=self.device)
        for p, o, k, i in zip(params, layout.offsets, layout.numels, self.unit_params[u]):
            p.data = full[o:o + k].view(self.shapes[i])
        full.untyped_storage().resize_(0)
        storage_resized(full)                         # a tracking meter counts it freed
        self.full_buffers.append(full)

    def bind_hooks(self, hooked, blocks: Sequence[int | None]) -> None:
        """ZeRO-3 by block: bind the unit hooks of the lowered graph ``hooked`` to gather and free,
        and count each unit's gradients as backward accumulates them."""
        self.track_units(blocks)
        hooked.get_submodule(PRE_HOOK).bind(self._forward_gather)
        hooked.get_submodule(POST_HOOK).bind(self.free)
        self._unpacks = True       # backward finds a unit's weights by the saved tensors it unpacks

    def track_units(self, blocks: Sequence[int | None]) -> None:
        """ZeRO-3 by block: ``blocks[u]`` is unit ``u``'s block; count each unit's gradients as backward
        accumulates them (a unit is freed once they are all in)."""
        self._blocks = tuple(blocks)
        for u in range(1, len(self.units)):
            for p in self.unit(u)[1]:
                p.register_post_accumulate_grad_hook(lambda _p, u=u: self._grad_ready(u))

    def enter_block(self, u: int) -> None:
        """A recomputed block of unit ``u`` starts (the engine runs each under a checkpoint): in forward
        it is gathered (and the next prefetched); when backward re-runs it, the units of the backward
        order are gathered through it, the one before reduce-scattered, as ``_unpack`` does."""
        if not self._in_backward:
            self._forward_gather(u)
        else:
            self._backward_gather_through(self._bwd_order.index(u))

    def leave_block(self, u: int) -> None:
        """A recomputed block of unit ``u`` ends: freed after its forward; after its recomputation it
        stays until backward has its gradients (``_grad_ready``)."""
        if not self._in_backward:
            self.free(u)

    def backward_begins(self) -> None:
        """The micro-step's backward starts (recomputed blocks gather for backward from here on)."""
        self._in_backward = True

    def gather(self, u: int) -> None:
        """Unit ``u`` gathered, waiting for its prefetch if one is in flight."""
        if self._gathered[u] or not self.units[u].total_numel:
            return
        with self._pause():
            started = self._inflight.pop(u, None)
            if started is not None:
                started.wait()
            else:
                self._allocate(u)
                all_gather_flat(self.units[u], self._shard_pieces(u), self.position, self.group, self.dtype,
                                self.device, out=self.full_buffers[u])
        self._gathered[u] = True

    def gather_all(self) -> None:
        for u in range(len(self.units)):
            self.gather(u)

    def free_all(self) -> None:
        for u in range(len(self.units)):
            self.free(u)

    def _gather_then(self, u: int, prefetch: int | None) -> None:
        self.gather(u)
        if prefetch is not None and self.overlap:
            with self._pause():
                self._prefetch(prefetch)

    def _allocate(self, u: int) -> None:
        storage = self.full_buffers[u].untyped_storage()
        storage.resize_(self.full_buffers[u].numel() * self.full_buffers[u].element_size())
        storage_resized(self.full_buffers[u])
        self._storage_unit[storage.data_ptr()] = u

    def _prefetch(self, u: int) -> None:
        """Start gathering unit ``u``: the same collectives in the same order as gathering it later, so
        ranks that prefetch and ranks that do not stay matched."""
        if self._gathered[u] or u in self._inflight or not self.units[u].total_numel:
            return
        self._allocate(u)
        self._inflight[u] = all_gather_flat_start(self.units[u], self._shard_pieces(u), self.position,
                                                  self.group, self.dtype, self.device, self.full_buffers[u])

    def free(self, u: int) -> None:
        started = self._inflight.pop(u, None)
        if started is not None:                     # a prefetch nobody used: complete it, then free
            started.wait()
            self._gathered[u] = True
        if not self._gathered[u]:
            return
        storage = self.full_buffers[u].untyped_storage()
        self._storage_unit.pop(storage.data_ptr(), None)
        storage.resize_(0)
        storage_resized(self.full_buffers[u])
        self._gathered[u] = False

    def _forward_next(self, u: int) -> int | None:
        return u + 1 if u + 1 < len(self.units) else None

    def _forward_gather(self, u: int) -> None:
        if not self._in_backward:
            self._gather_then(u, self._forward_next(u))

    def _backward_gather_through(self, stop: int) -> None:
        """Gather the block units of the backward order up to index ``stop`` (inclusive), in order,
        each prefetching the next; before gathering one, reduce-scatter the unit before it, which
        backward has left (``_reduce_unit``)."""
        while self._bwd_next <= stop:
            u = self._bwd_order[self._bwd_next]
            if self._bwd_next > 0:
                self._reduce_unit(self._bwd_order[self._bwd_next - 1])
            self._bwd_next += 1
            nxt = self._bwd_order[self._bwd_next] if self._bwd_next < len(self._bwd_order) else None
            self._gather_then(u, nxt)
            if self._pending[u] == 0 and self._bwd_order.index(u) < stop:
                self.free(u)

    def _grad_ready(self, u: int) -> None:
        if self._reduced[u]:
            self._late.append(u)
        self._pending[u] -= 1
        if self._pending[u] == 0 and self._in_backward and self._bwd_order.index(u) < self._bwd_next:
            self.free(u)

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

    def zero3_round(self, run: Callable[[], Any] | None, by_block: bool) -> Any:
        """One ZeRO-3 round: every rank runs the same collectives; ``run`` (the micro-step's forward
        and backward) None: no compute. ``by_block``: units gathered through the hooks (``bind_hooks``),
        else every unit for the whole micro-step. Returns what ``run`` returns."""
        units = range(len(self.units))
        self._reduced = [False] * len(self.units)
        self._late, self._bwd_next = [], 0
        out = None
        if by_block:
            self._gather_then(0, self._forward_next(0))
            if run is not None:
                self._pending = [len(self.unit_params[u]) for u in units]
                self._in_backward = False
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack) if self._unpacks \
                        else nullcontext():     # recomputed blocks gather through enter_block instead
                    out = run()
            else:
                self._pending = [0] * len(self.units)
                for u in units[1:]:                     # forward's gathers, then backward's
                    self._gather_then(u, self._forward_next(u))
                    self.free(u)
            self._in_backward = True                    # the units backward never needed, in order
            self._backward_gather_through(len(self._bwd_order) - 1)
            self._in_backward = False
        else:
            self.gather_all()
            if run is not None:
                out = run()
        for u in units:                                 # the root and the last block unit (or the one unit)
            self.free(u)
            self._reduce_unit(u)
        if self._late:
            u = self._late[0]
            raise DataParallelError(
                f"zero3_granularity: a gradient of unit {u} (block {self._blocks[u]}) grew after backward had "
                "left its block and it was reduce-scattered; use zero3_granularity='micro_step' for this model")
        return out


class KeptGrads:
    """Gradients kept in the same tensors from step to step: ``begin_step`` sets every ``.grad`` of
    ``params`` to None; a parameter's first gradient of the step is copied into its kept tensor, which
    ``.grad`` then is and backward accumulates into. A step so reuses its gradients' memory instead of
    allocating it anew (on a CPU, fresh pages to fault in), and copying once is one pass where zeroing
    and adding would be two.

    The kept tensors are ``into`` (fixed: views of a sync's flat gradient) or, without it, each
    parameter's first gradient ever (a parameter that gets no gradient stays None, so the optimizer
    skips it, as after ``zero_grad``). ``then(i)``: called after parameter ``i``'s gradient is in place
    (the sync's buckets). It is also the sink of ``passes.grad_fusion`` (``index``, ``add_mm``,
    ``add_row_sum``): a fused linear's gradient is computed into the kept tensor, not copied."""

    def __init__(self, params: Sequence[nn.Parameter], into: Sequence[torch.Tensor] | None = None,
                 then: Callable[[int], None] | None = None):
        self.params = list(params)
        self._fixed = into is not None
        self._kept: list[torch.Tensor | None] = list(into) if into is not None else [None] * len(self.params)
        self._then = then
        self._landed = [False] * len(self.params)
        self._fused = [0] * len(self.params)      # hooks to come for gradients ``_land`` put in place
        self._index = {id(p): i for i, p in enumerate(self.params)}
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._grad_in(i))

    def index(self, p: torch.Tensor) -> int | None:
        """``p``'s place in ``params`` (None: not kept here)."""
        return self._index.get(id(p))

    def begin_step(self) -> None:
        for p in self.params:
            p.grad = None
        self._landed = [False] * len(self.params)
        self._fused = [0] * len(self.params)

    def _grad_in(self, i: int) -> None:
        if self._fused[i]:      # the hook of a gradient ``_land`` put in place: autograd brought none
            self._fused[i] -= 1
            return
        if not self._landed[i]:
            self._landed[i] = True
            p, kept = self.params[i], self._kept[i]
            if not self._fixed and (kept is None or kept.shape != p.grad.shape or kept.dtype != p.grad.dtype):
                self._kept[i] = p.grad
            else:
                kept.copy_(p.grad)
                p.grad = kept
        if self._then is not None:
            self._then(i)

    def add_mm(self, i: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Parameter ``i``'s gradient += ``a @ b``, computed into its kept tensor (the step's first
        gradient written there, later ones accumulated by the GEMM: ``passes.grad_fusion``)."""
        self._land(i, lambda out: torch.mm(a, b, out=out), lambda g: g.addmm_(a, b))

    def add_row_sum(self, i: int, t: torch.Tensor) -> None:
        """Parameter ``i``'s gradient += ``t.sum(0)`` (a bias), into its kept tensor likewise."""
        self._land(i, lambda out: torch.sum(t, 0, out=out), lambda g: g.add_(t.sum(0)))

    def _land(self, i: int, write, add) -> None:
        """Autograd still runs the parameter's accumulate node, with no gradient, and its hook fires
        after this: ``_grad_in`` lets that call pass."""
        p = self.params[i]
        self._fused[i] += 1
        if self._landed[i]:
            add(p.grad)
        else:
            self._landed[i] = True
            kept = self._kept[i]
            if kept is None or kept.shape != p.shape or kept.dtype != p.dtype:
                kept = torch.empty_like(p, memory_format=torch.contiguous_format)
                if not self._fixed:
                    self._kept[i] = kept
            write(kept)
            p.grad = kept
        if self._then is not None:
            self._then(i)

    def settle(self) -> None:
        """Fixed tensors, after the step's backwards: a gradient set without autograd's accumulation
        (the zero-bubble weight half sets ``.grad`` itself) is copied in, and a parameter without one
        gets zeros there, so every ``.grad`` is its fixed tensor."""
        for i, landed in enumerate(self._landed):
            if not landed:
                self._landed[i] = True
                p, kept = self.params[i], self._kept[i]
                if p.grad is None:
                    kept.zero_()
                else:
                    kept.copy_(p.grad)
                p.grad = kept
