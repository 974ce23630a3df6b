"""Flat buffers and shards of the data-parallel engine (``autopar.runtime.dp``): the layout of each
unit's flat buffer, the collectives over it, and the optimizer over this rank's shard.

Terms
- position: a rank's index inside the process group. Collectives lay out shards by position, so every
  shard below is indexed by position.
- unit: a set of trainable parameters flattened into one 1-D *flat buffer* in a fixed order shared
  by all ranks (by optimizer parameter group, then parameter order), described by a ``FlatLayout``.
  ZeRO 0-2 use one unit holding every trainable parameter; ZeRO-3 uses one unit per block plus a
  root unit (``autopar.runtime.dp_units``), or a single unit.
- shard: a contiguous range of a unit's flat buffer owned by one position, even or proportional to
  the stage's ``zero_shares`` (memory-proportional sharding; a share of 0 gives an empty shard).
  ``shard_bounds`` computes the ranges.
- shard Parameter: under ZeRO >= 1 each rank steps flat leaf Parameters covering the part of its
  shard in each (unit, optimizer parameter group), so the optimizer state is shard-sized; each holds
  at most one ZeRO chunk (``autopar.ir.costs.zero_chunk_numel``), so the temporaries of an optimizer
  that steps tensor by tensor (torch's on CPU: Adam's square root and division) stay chunk-sized
  instead of shard-sized. Under ZeRO 1/2
  it is a view of the unit's parameter buffer (the optimizer updates the weights in place: no second
  copy of the shard); under ZeRO-3 it holds the shard (the full buffer is freed).
- parameter buffer (ZeRO 0-2, more than one rank): each unit's parameters are views of one flat
  buffer (``_bind_param_views``), which the ZeRO-1/2 all-gather writes straight into.
- kept buffers (``_setup_buffers``, allocated once): ZeRO 0/1 keep each unit's flat gradient, with
  every parameter's ``.grad`` a view of it (``_bind_grad_views``); ZeRO 2/3 keep the shard's gradient
  sum. ZeRO 1/2 send their shard from the parameter buffer itself (``_shard_out``: views of it).

Collectives without padding (memory as planned, ``autopar.cost.memory``). gloo's all-gather and
reduce-scatter need equal sizes per position; padding every shard to the largest would make a rank
with a small shard hold buffers of ``ranks x largest shard``. Instead:
- all-gather of uneven shards: one broadcast per position, from its owner, straight into the full
  buffer (the parameter buffer, or ZeRO-3's unit buffer): no buffer at all. Even shards: one
  all-gather in place (every rank's shard already sits at its place in the output).
- reduce-scatter: in rounds of at most ``staging_numel`` elements per position, read from the
  parameters' ``.grad`` (no flattened copy of the gradient): each round stages one chunk of every
  position's shard (padded to the chunk) in a buffer of ``positions x chunk`` elements, reduce-scatters
  it and adds this position's chunk to the shard's sum. The staging buffer is
  ``autopar.ir.costs.zero_staging_numel`` (the cost model prices the same).

Exactness: sharded optimizer states are exact only for elementwise optimizers (SGD with or without
momentum, Adam, AdamW, ...: the update of each element depends only on that element and step-level
scalars, so it is the same on a flat shard as on the full tensors). Optimizers with cross-element
coupling (LAMB's or LARS's per-tensor trust ratios, Adafactor's factored moments, L-BFGS) are not
supported under ZeRO >= 1: ``ELEMENTWISE_OPTIMIZERS`` lists the accepted classes and anything else
raises ``DataParallelError`` naming the optimizer (ZeRO-0 runs any optimizer). Parameter groups are
kept (a flat shard per group, each with its group's hyperparameters).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.ir.costs import zero_chunk_numel, zero_shard_numels, zero_staging_numel
from autopar.runtime.communicator import (
    PendingCollective, pg_all_gather_into, pg_all_gather_into_async, pg_broadcast, pg_ranks, pg_reduce_scatter_into,
)

__all__ = ["DataParallelError", "FlatLayout", "shard_bounds", "ELEMENTWISE_OPTIMIZERS", "FlatBuffersMixin"]

# Optimizers whose update is elementwise (given step-level scalars): exact on flat shards.
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.Rprop,
    torch.optim.ASGD,
)


class DataParallelError(AutoparError):
    """The plan, the model or the optimizer cannot run on the data-parallel engine."""


def shard_bounds(total_numel: int, shares: Sequence[float]) -> tuple[int, ...]:
    """Boundaries ``b`` (length ``len(shares) + 1``, ``b[0] = 0``, ``b[-1] = total_numel``) splitting
    ``total_numel`` elements into contiguous shards proportional to ``shares`` (largest-remainder
    rounding, ties to the lower index). Shares must be finite, >= 0 and not all 0."""
    if total_numel < 0:
        raise DataParallelError(f"shard_bounds: total_numel must be >= 0, got {total_numel}")
    shares = [float(s) for s in shares]
    if not shares:
        raise DataParallelError("shard_bounds: need at least one share")
    if any(not math.isfinite(s) or s < 0 for s in shares) or sum(shares) <= 0:
        raise DataParallelError(f"zero_shares: need finite shares >= 0 with a positive sum, got {shares}")
    bounds = [0]
    for n in zero_shard_numels(total_numel, shares):
        bounds.append(bounds[-1] + n)
    return tuple(bounds)


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """One unit's flat buffer: where each of its parameters lives and which range each position owns."""

    numels: tuple[int, ...]          # per parameter of the unit, in flat order
    offsets: tuple[int, ...]         # per parameter: start in the unit's flat buffer
    group_bounds: tuple[int, ...]    # optimizer parameter group k covers [group_bounds[k], [k+1])
    bounds: tuple[int, ...]          # position p owns [bounds[p], bounds[p+1])

    @property
    def total_numel(self) -> int:
        return self.bounds[-1]

    @property
    def num_shards(self) -> int:
        return len(self.bounds) - 1

    @property
    def max_shard_numel(self) -> int:
        return max(self.bounds[p + 1] - self.bounds[p] for p in range(self.num_shards))

    @property
    def padded_numel(self) -> int:
        return self.max_shard_numel * self.num_shards

    def shard(self, position: int) -> tuple[int, int]:
        return self.bounds[position], self.bounds[position + 1]


class FlatBuffersMixin:
    """The flat-buffer half of ``DataParallelEngine``: flattening, padding, the collectives on a unit's
    flat buffer and the sharded optimizer. Reads the engine's ``units`` (``FlatLayout`` per unit),
    ``_params``, ``_unit_params``, ``_shard_params``, ``_position``, ``group``, ``dtype``, ``device``
    and ``zero_stage``."""

    # -- optimizer over flat shards --------------------------------------------------------------
    @staticmethod
    def _group_of(probe: torch.optim.Optimizer, trainable: list[nn.Parameter]) -> list[int]:
        """The optimizer parameter group of each trainable parameter."""
        group_of: dict[int, int] = {}
        for k, group in enumerate(probe.param_groups):
            for p in group["params"]:
                if id(p) in group_of:
                    raise DataParallelError(f"optimizer_factory: parameter groups {group_of[id(p)]} and {k} "
                                            f"share a parameter")
                group_of[id(p)] = k
        if set(group_of) != {id(p) for p in trainable}:
            raise DataParallelError(
                f"optimizer_factory: the optimizer must hold exactly the model's trainable parameters "
                f"({len(trainable)}), it holds {len(group_of)} (freeze a parameter with requires_grad=False "
                f"instead of leaving it out)")
        return [group_of[id(p)] for p in trainable]

    def _check_elementwise(self, probe: torch.optim.Optimizer) -> None:
        if type(probe) not in ELEMENTWISE_OPTIMIZERS:
            raise DataParallelError(
                f"optimizer_factory: {type(probe).__name__} is not supported under ZeRO-{self.zero_stage}: "
                f"sharded optimizer states are exact only for elementwise optimizers "
                f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}); use zero_stage=0")

    def _sharded_optimizer(self, probe: torch.optim.Optimizer, shards: list[torch.Tensor]):
        """A flat shard Parameter per (unit, optimizer group, ZeRO chunk) that intersects this rank's shard, and an
        optimizer of the probe's class over them with each group's hyperparameters. ``shards[u]``:
        this rank's shard of unit ``u``'s flat parameters (``[lo, hi)`` of the flat buffer)."""
        shard_params = []
        by_group: dict[int, list[nn.Parameter]] = {}
        for u, layout in enumerate(self.units):
            lo, hi = layout.shard(self._position)
            gb = layout.group_bounds
            chunk = zero_chunk_numel(layout.total_numel, self.dtype.itemsize)
            for k in range(len(probe.param_groups)):
                for a in range(max(gb[k], lo), min(gb[k + 1], hi), chunk):
                    b = min(a + chunk, gb[k + 1], hi)
                    piece = shards[u][a - lo:b - lo].detach()    # ZeRO 1/2: a view of the weights
                    sp = nn.Parameter(piece if self.zero_stage in (1, 2) else piece.clone())
                    shard_params.append((sp, u, (a, b)))
                    by_group.setdefault(k, []).append(sp)
        if not by_group:                   # an empty shard still gets an optimizer
            by_group[0] = [nn.Parameter(torch.empty(0, dtype=self.dtype, device=self.device))]
        groups = [{**{key: v for key, v in probe.param_groups[k].items() if key != "params"}, "params": ps}
                  for k, ps in sorted(by_group.items())]
        accepted = inspect.signature(type(probe).__init__).parameters
        defaults = {k: v for k, v in probe.defaults.items() if k in accepted}
        return type(probe)(groups, **defaults), tuple(shard_params)

    # -- flat buffers ----------------------------------------------------------------------------
    def _setup_buffers(self) -> None:
        """The buffers kept across steps (module docstring); none for a rank alone (``_solo``)."""
        self._grad_flats: list[torch.Tensor] | None = None
        self._grad_views: list[tuple[torch.Tensor, ...]] | None = None
        self._shard_grads: list[torch.Tensor] | None = None
        self._shard_out: list[torch.Tensor] | None = None
        if getattr(self, "_solo", False):
            return
        new = dict(dtype=self.dtype, device=self.device)
        if self.zero_stage in (0, 1):
            self._grad_flats = [torch.zeros(layout.total_numel, **new) for layout in self.units]
            self._grad_views = [tuple(flat[o:o + n].view(p.shape) for p, o, n in
                                      zip(self._unit(u)[1], self.units[u].offsets, self.units[u].numels))
                                for u, flat in enumerate(self._grad_flats)]
        else:
            self._shard_grads = [torch.zeros(hi - lo, **new)
                                 for lo, hi in (layout.shard(self._position) for layout in self.units)]
        if self.zero_stage in (1, 2):       # the shard is sent from the parameter buffer itself
            self._shard_out = [self._param_flats[u][slice(*layout.shard(self._position))]
                               for u, layout in enumerate(self.units)]

    def _bind_grad_views(self) -> None:
        """Zero the kept flat gradients and make every parameter's ``.grad`` its view into them, so
        backward accumulates in place (``0 + g == g``: exact)."""
        for u, flat in enumerate(self._grad_flats):
            flat.zero_()
            for p, view in zip(self._unit(u)[1], self._grad_views[u]):
                p.grad = view

    def _bind_param_views(self, u: int, flat: torch.Tensor) -> None:
        """Unit ``u``'s parameters become views of ``flat`` (holding their values), so an all-gather
        into ``flat`` updates them in place: no unflattening copy (ZeRO 0-2)."""
        layout, params = self._unit(u)
        for p, o, n in zip(params, layout.offsets, layout.numels):
            p.data = flat[o:o + n].view(p.shape)

    def _unit(self, u: int):
        """(layout, parameters) of unit ``u``."""
        return self.units[u], [self._params[i] for i in self._unit_params[u]]

    def _flatten_params(self, u: int) -> torch.Tensor:
        layout, params = self._unit(u)
        if not params:
            return torch.zeros(0, dtype=self.dtype, device=self.device)
        return torch.cat([p.detach().reshape(-1) for p in params]).to(self.dtype)

    def _grads_into(self, u: int, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements ``[lo, hi)`` of unit ``u``'s flat gradient (its parameters' ``.grad``; zeros where a
        parameter has none) copied into ``out`` (``hi - lo`` elements)."""
        layout, params = self._unit(u)
        for p, o, n in zip(params, layout.offsets, layout.numels):
            a, b = max(lo, o), min(hi, o + n)
            if a >= b:
                continue
            if p.grad is None:
                out[a - lo:b - lo].zero_()
            else:
                out[a - lo:b - lo].copy_(p.grad.reshape(-1)[a - o:b - o])

    def _write_my_shard(self, u: int, out: torch.Tensor) -> None:
        """This rank's shard of unit ``u``'s flat parameters into its place in ``out`` (from the shard
        Parameters; nothing to copy where they are views of ``out`` already, as under ZeRO 1/2)."""
        for sp, su, (a, b) in self._shard_params:
            if su == u:
                dst = out[a:b]
                if dst.data_ptr() != sp.data_ptr():
                    dst.copy_(sp.detach())

    # -- collectives -----------------------------------------------------------------------------
    def _even(self, u: int) -> bool:
        layout = self.units[u]
        return layout.padded_numel == layout.total_numel

    def _all_gather_flat(self, u: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Unit ``u``'s full flat parameters gathered from every position's shard, into ``out`` (a new
        buffer when None): even shards in one all-gather in place, uneven ones by one broadcast from
        each owner (module docstring: no padded buffer)."""
        layout = self.units[u]
        if out is None:
            out = torch.empty(layout.total_numel, dtype=self.dtype, device=self.device)
        self._write_my_shard(u, out)
        if self._even(u):
            pg_all_gather_into(out, out[slice(*layout.shard(self._position))], group=self.group)
            return out
        ranks = pg_ranks(self.group)
        for p in range(layout.num_shards):
            a, b = layout.shard(p)
            if a < b:
                pg_broadcast(out[a:b], src=ranks[p], group=self.group)
        return out

    def _all_gather_flat_start(self, u: int, out: torch.Tensor) -> PendingCollective:
        """``_all_gather_flat(u, out)`` started without waiting where the shards are even (one
        asynchronous all-gather); uneven shards are gathered at once (their broadcasts block), so the
        returned collective has nothing left to wait for. ``_all_gather_flat_finish`` completes it."""
        layout = self.units[u]
        if not self._even(u):
            self._all_gather_flat(u, out)
            return PendingCollective()
        self._write_my_shard(u, out)
        return pg_all_gather_into_async(out, out[slice(*layout.shard(self._position))], group=self.group)

    def _all_gather_flat_finish(self, u: int, started: PendingCollective, out: torch.Tensor) -> None:
        started.wait()

    def _reduce_scatter_grads(self, u: int, acc: torch.Tensor) -> None:
        """Add to ``acc`` (this position's shard of unit ``u``) the sum over ranks of that shard of the
        unit's gradient (its parameters' ``.grad``), in rounds through a small staging buffer (module
        docstring). gloo implements the real reduce-scatter on CPU (checked on torch 2.13 with 3
        processes), so there is no all-reduce + slice fallback."""
        layout = self.units[u]
        n = layout.num_shards
        c = zero_staging_numel(layout.total_numel, n, self.dtype.itemsize)
        stage = torch.empty(n * c, dtype=self.dtype, device=self.device)
        got = torch.empty(c, dtype=self.dtype, device=self.device)
        mine = layout.shard(self._position)
        for k in range(0, layout.max_shard_numel, c):
            for p in range(n):
                a, b = layout.shard(p)
                lo, hi = min(a + k, b), min(a + k + c, b)
                self._grads_into(u, lo, hi, stage[p * c:p * c + hi - lo])
                stage[p * c + hi - lo:(p + 1) * c].zero_()
            pg_reduce_scatter_into(got, stage, group=self.group)
            m = max(0, min(c, mine[1] - mine[0] - k))
            if m:
                acc[k:k + m] += got[:m]
