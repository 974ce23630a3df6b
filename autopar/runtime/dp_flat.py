"""Flat buffers and shards of the data-parallel sync (``autopar.runtime.dp_sync``): the layout of each
unit's flat buffer, the collectives over it, and the optimizer over a position's shard. Pure
functions: the sync holds the buffers.

Terms
- position: a rank's index inside the process group. Collectives lay out shards by position, so every
  shard below is indexed by position.
- unit: a set of trainable parameters flattened into one 1-D *flat buffer* in a fixed order shared
  by all ranks (by optimizer parameter group, then parameter order), described by a ``FlatLayout``
  (``flat_layouts``). ZeRO 0-2 use one unit holding every trainable parameter; ZeRO-3 uses one unit
  per block plus a root unit (``autopar.lowering.zero3_units``), or a single unit.
- shard: a contiguous range of a unit's flat buffer owned by one position, even or proportional to
  the stage's ``zero_shares`` (memory-proportional sharding; a share of 0 gives an empty shard).
  ``shard_bounds`` computes the ranges.
- shard Parameter: under ZeRO >= 1 each rank steps flat leaf Parameters covering the part of its
  shard in each (unit, optimizer parameter group), so the optimizer state is shard-sized; each holds
  at most one ZeRO chunk (``autopar.ir.costs.zero_chunk_numel``), so the temporaries of an optimizer
  that steps tensor by tensor (torch's on CPU: Adam's square root and division) stay chunk-sized
  instead of shard-sized (``sharded_optimizer``). Under ZeRO 1/2 it is a view of the unit's parameter
  buffer (the optimizer updates the weights in place: no second copy of the shard); under ZeRO-3 it
  holds the shard (the full buffer is freed).

Collectives without padding (memory as planned, ``autopar.cost.memory``). gloo's all-gather and
reduce-scatter need equal sizes per position; padding every shard to the largest would make a rank
with a small shard hold buffers of ``ranks x largest shard``. Instead:
- all-gather of uneven shards: one broadcast per position, from its owner, straight into the full
  buffer (the parameter buffer, or ZeRO-3's unit buffer): no buffer at all. Even shards: one
  all-gather in place (every rank's shard already sits at its place in the output).
- reduce-scatter: in rounds of ``c = autopar.ir.costs.zero_staging_numel`` elements per position
  (a unit's even shard, at most a gradient bucket over the positions), read from the parameters'
  ``.grad``: each round stages ``c`` elements of every position's shard (padded to ``c``) in a buffer
  of ``positions x c`` elements, reduce-scatters it and adds this position's part to the shard's sum;
  a unit of a bucket or less on even shards is one collective. The cost model prices the same buffer
  and rounds.

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

__all__ = ["DataParallelError", "FlatLayout", "shard_bounds", "ELEMENTWISE_OPTIMIZERS", "check_elementwise",
           "optimizer_groups", "flat_layouts", "sharded_optimizer", "merged_optimizer", "all_gather_flat", "all_gather_flat_start",
           "reduce_scatter_grads"]

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


def optimizer_groups(probe: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> list[int]:
    """The optimizer parameter group of each of ``params``; the optimizer must hold exactly them."""
    group_of: dict[int, int] = {}
    for k, group in enumerate(probe.param_groups):
        for p in group["params"]:
            if id(p) in group_of:
                raise DataParallelError(f"optimizer_factory: parameter groups {group_of[id(p)]} and {k} "
                                        f"share a parameter")
            group_of[id(p)] = k
    if set(group_of) != {id(p) for p in params}:
        raise DataParallelError(
            f"optimizer_factory: the optimizer must hold exactly the model's trainable parameters "
            f"({len(params)}), it holds {len(group_of)} (freeze a parameter with requires_grad=False "
            f"instead of leaving it out)")
    return [group_of[id(p)] for p in params]


def check_elementwise(probe: torch.optim.Optimizer, zero_stage: int) -> None:
    if type(probe) not in ELEMENTWISE_OPTIMIZERS:
        raise DataParallelError(
            f"optimizer_factory: {type(probe).__name__} is not supported under ZeRO-{zero_stage}: "
            f"sharded optimizer states are exact only for elementwise optimizers "
            f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}); use zero_stage=0")


def flat_layouts(params: Sequence[nn.Parameter], units: Sequence[Sequence[int]], probe: torch.optim.Optimizer,
                 shares: Sequence[float]) -> tuple[list[nn.Parameter], list[tuple[int, ...]], tuple[FlatLayout, ...]]:
    """The flat order (unit by unit; inside a unit by optimizer group, then parameter order) of
    ``params`` split into ``units`` (indices into ``params``): the parameters in that order, each unit's
    indices into it, and each unit's layout sharded by ``shares`` (one per position)."""
    group_of = optimizer_groups(probe, params)
    ordered_params: list[nn.Parameter] = []
    unit_params: list[tuple[int, ...]] = []
    layouts = []
    for members in units:
        ordered = sorted(members, key=lambda i: (group_of[i], i))
        first = len(ordered_params)
        ordered_params.extend(params[i] for i in ordered)
        unit_params.append(tuple(range(first, len(ordered_params))))
        numels = tuple(params[i].numel() for i in ordered)
        offsets = tuple(sum(numels[:k]) for k in range(len(numels)))
        group_bounds = [0]
        for k in range(len(probe.param_groups)):
            group_bounds.append(group_bounds[-1] + sum(params[i].numel() for i in ordered if group_of[i] == k))
        layouts.append(FlatLayout(numels=numels, offsets=offsets, group_bounds=tuple(group_bounds),
                                  bounds=shard_bounds(sum(numels), shares)))
    return ordered_params, unit_params, tuple(layouts)


def sharded_optimizer(probe: torch.optim.Optimizer, layouts: Sequence[FlatLayout], shards: Sequence[torch.Tensor],
                      position: int, zero_stage: int, dtype: torch.dtype, device: torch.device):
    """A flat shard Parameter per (unit, optimizer group, ZeRO chunk) that intersects this position's
    shard, and an optimizer of the probe's class over them with each group's hyperparameters:
    (optimizer, ((shard Parameter, unit, [a, b) in the unit's flat buffer), ...)). ``shards[u]``: this
    position's shard of unit ``u``'s flat parameters; under ZeRO 1/2 the shard Parameters are views of
    it (the optimizer updates the weights in place), under ZeRO-3 copies."""
    shard_params = []
    by_group: dict[int, list[nn.Parameter]] = {}
    for u, layout in enumerate(layouts):
        lo, hi = layout.shard(position)
        gb = layout.group_bounds
        chunk = zero_chunk_numel(layout.total_numel, dtype.itemsize)
        for k in range(len(probe.param_groups)):
            for a in range(max(gb[k], lo), min(gb[k + 1], hi), chunk):
                b = min(a + chunk, gb[k + 1], hi)
                piece = shards[u][a - lo:b - lo].detach()
                sp = nn.Parameter(piece if zero_stage in (1, 2) else piece.clone())
                shard_params.append((sp, u, (a, b)))
                by_group.setdefault(k, []).append(sp)
    if not by_group:                   # an empty shard still gets an optimizer
        by_group[0] = [nn.Parameter(torch.empty(0, dtype=dtype, device=device))]
    groups = [{**{key: v for key, v in probe.param_groups[k].items() if key != "params"}, "params": ps}
              for k, ps in sorted(by_group.items())]
    accepted = inspect.signature(type(probe).__init__).parameters
    defaults = {k: v for k, v in probe.defaults.items() if k in accepted}
    return type(probe)(groups, **defaults), tuple(shard_params)


def merged_optimizer(first: torch.optim.Optimizer, second: torch.optim.Optimizer | None) -> torch.optim.Optimizer:
    """One optimizer of ``first``'s class over both optimizers' parameter groups (each keeps its
    hyperparameters), so an engine that steps a sync's shards and parameters of its own steps once
    (one loss scaler's check, one checkpoint entry). Both must be of one class, with no state yet."""
    if second is None:
        return first
    if type(second) is not type(first):
        raise DataParallelError(f"optimizer_factory: made a {type(first).__name__} and a {type(second).__name__}; "
                                "it must make one optimizer class")
    accepted = inspect.signature(type(first).__init__).parameters
    defaults = {k: v for k, v in first.defaults.items() if k in accepted}
    return type(first)([*first.param_groups, *second.param_groups], **defaults)


# -- collectives on a unit's flat buffer ------------------------------------------------------------
def _write_shard(pieces, out: torch.Tensor) -> None:
    """This position's shard pieces ``(a, b, values)`` into their places in ``out`` (nothing to copy
    where they are views of ``out`` already, as under ZeRO 1/2)."""
    for a, b, values in pieces:
        dst = out[a:b]
        if dst.data_ptr() != values.data_ptr():
            dst.copy_(values)


def _even(layout: FlatLayout) -> bool:
    return layout.padded_numel == layout.total_numel


def all_gather_flat(layout: FlatLayout, pieces, position: int, group, dtype: torch.dtype, device: torch.device,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """A unit's full flat parameters gathered from every position's shard (this position's as
    ``pieces``: ``(a, b, values)``) into ``out`` (a new buffer when None): even shards in one
    all-gather in place, uneven ones by one broadcast from each owner (module docstring: no padded
    buffer)."""
    if out is None:
        out = torch.empty(layout.total_numel, dtype=dtype, device=device)
    _write_shard(pieces, out)
    if _even(layout):
        pg_all_gather_into(out, out[slice(*layout.shard(position))], group=group)
        return out
    ranks = pg_ranks(group)
    for p in range(layout.num_shards):
        a, b = layout.shard(p)
        if a < b:
            pg_broadcast(out[a:b], src=ranks[p], group=group)
    return out


def all_gather_flat_start(layout: FlatLayout, pieces, position: int, group, dtype: torch.dtype,
                          device: torch.device, out: torch.Tensor) -> PendingCollective:
    """``all_gather_flat`` started without waiting where the shards are even (one asynchronous
    all-gather); uneven shards are gathered at once (their broadcasts block), so the returned
    collective has nothing left to wait for."""
    if not _even(layout):
        all_gather_flat(layout, pieces, position, group, dtype, device, out)
        return PendingCollective()
    _write_shard(pieces, out)
    return pg_all_gather_into_async(out, out[slice(*layout.shard(position))], group=group)


def _grads_into(layout: FlatLayout, params, lo: int, hi: int, out: torch.Tensor) -> None:
    """Elements ``[lo, hi)`` of a unit's flat gradient (its parameters' ``.grad``; zeros where a
    parameter has none) copied into ``out`` (``hi - lo`` elements)."""
    for p, o, n in zip(params, layout.offsets, layout.numels):
        a, b = max(lo, o), min(hi, o + n)
        if a >= b:
            continue
        if p.grad is None:
            out[a - lo:b - lo].zero_()
        else:
            out[a - lo:b - lo].copy_(p.grad.reshape(-1)[a - o:b - o])


def reduce_scatter_grads(layout: FlatLayout, params, acc: torch.Tensor, position: int, group,
                         dtype: torch.dtype, device: torch.device) -> None:
    """Add to ``acc`` (this position's shard of the unit) the sum over ranks of that shard of the
    unit's gradient (its parameters' ``.grad``), in rounds through a staging buffer of at most one
    gradient bucket (module docstring). gloo implements the real reduce-scatter on CPU (checked on
    torch 2.13 with 3 processes), so there is no all-reduce + slice fallback."""
    n = layout.num_shards
    c = zero_staging_numel(layout.total_numel, n, dtype.itemsize)
    stage = torch.empty(n * c, dtype=dtype, device=device)
    got = torch.empty(c, dtype=dtype, device=device)
    mine = layout.shard(position)
    for k in range(0, layout.max_shard_numel, c):
        for p in range(n):
            a, b = layout.shard(p)
            lo, hi = min(a + k, b), min(a + k + c, b)
            _grads_into(layout, params, lo, hi, stage[p * c:p * c + hi - lo])
            stage[p * c + hi - lo:(p + 1) * c].zero_()
        pg_reduce_scatter_into(got, stage, group=group)
        m = max(0, min(c, mine[1] - mine[0] - k))
        if m:
            acc[k:k + m] += got[:m]
