"""The data-parallel execution engine with ZeRO stages 0-3 for single-stage plans.

Terms
- member: one rank of the plan's single stage (``plan.stages[0].groups`` are 1-tuples). Member ``g``
  owns rows ``share_slices(plan)[g]`` of the global batch and steps through its own micro-batches
  ``plan.stages[0].micro_batches[g]`` (gradient accumulation). Shares may be uneven or 0 and members
  may have different numbers of micro-steps.
- position: a rank's index inside the process group (``EngineInputs.group``, default: the world).
  Collectives lay out shards by position, so every shard below is indexed by position.
- idle rank: a rank of the process group that the plan leaves out (the planner may not use every
  device). It builds the engine too and joins every collective with no samples and an empty shard,
  so plans over a subset of the world need no subgroup.
- unit: a set of trainable parameters flattened into one 1-D *flat buffer* in a fixed order shared
  by all ranks (by optimizer parameter group, then parameter order), described by a ``FlatLayout``.
  ZeRO 0-2 use one unit holding every trainable parameter; ZeRO-3 uses one unit per block plus a
  root unit (``autopar.runtime.dp_units``), or one unit with ``zero3_granularity="micro_step"``.
- shard: a contiguous range of a unit's flat buffer owned by one position, even or proportional to
  the stage's ``zero_shares`` (memory-proportional sharding; a share of 0 gives an empty shard).
  ``shard_bounds`` computes the ranges. gloo's all-gather / reduce-scatter need equal sizes, so
  every shard travels padded to the largest shard (``FlatLayout.padded_numel``).
- micro loss weight: micro-batch ``m`` of size ``n_m`` contributes ``loss_m * n_m / B`` (``B`` the
  global batch size) to the backward pass, so gradients summed over all ranks and micro-batches are
  the gradient of the global-batch mean loss, exactly as on one device.
- rounds (ZeRO-3): the number of micro-steps of the member with the most; every rank joins every
  round's collectives, ranks without a micro-step in a round contribute zero gradients.

ZeRO stages (per step, after the member's micro-steps)
- 0: all-reduce the flat gradient; every rank steps the full optimizer.
- 1: all-reduce the flat gradient; each rank keeps optimizer state for its shard only and steps one
  flat shard Parameter per optimizer parameter group (a leaf tensor holding that rank's slice, so
  the state is shard-sized); then all-gather the updated shards into the full parameters.
- 2: reduce-scatter the flat gradient so each rank keeps only its shard's gradient (the full
  gradients are freed after the reduce; they live while a rank accumulates its micro-steps), then
  as ZeRO-1.
- 3: parameters stay sharded between steps: each full parameter is a view of its unit's full
  buffer, whose storage is resized to 0 bytes while the unit is freed (the tensors keep their
  shapes; reading one then fails). ``state_dict()`` is a collective (it gathers). Each round:
  - ``"block"`` granularity (the default when the graph carries block annotations): the root unit
    is gathered for the whole micro-step; hooks inserted into a copy of the captured graph gather
    each block's unit right before its first use in forward and free it right after its last use.
    In backward, a saved-tensor hook gathers a unit again when autograd first needs one of its
    parameters, always in the fixed reverse order (a request for unit ``u`` also gathers the units
    after ``u`` that backward has not reached), and a unit is freed again once every one of its
    parameters has accumulated its gradient. After backward, the units backward never needed are
    gathered (and freed) too, so every rank runs the same collectives: ranks without a micro-step
    in the round gather every unit forward and backward without computing. Then each unit's
    gradient is reduce-scattered into the shard's accumulated gradient and freed.
    Models that re-run forward code during backward (activation checkpointing) need
    ``"micro_step"``; a unit needed after it was freed raises instead of reading freed memory.
    Per-block gathering moves the same bytes but issues about twice as many collectives per block,
    so small models on high-latency links run faster per micro-step.
  - ``"micro_step"``: one unit, gathered before the micro-step's forward and freed after its
    backward once its gradient is reduce-scattered.

Exactness: sharded optimizer states are exact only for elementwise optimizers (SGD with or without
momentum, Adam, AdamW, ...: the update of each element depends only on that element and step-level
scalars, so it is the same on a flat shard as on the full tensors). Optimizers with cross-element
coupling (LAMB's or LARS's per-tensor trust ratios, Adafactor's factored moments, L-BFGS) are not
supported under ZeRO >= 1: ``ELEMENTWISE_OPTIMIZERS`` lists the accepted classes and anything else
raises ``DataParallelError`` naming the optimizer (ZeRO-0 runs any optimizer). Parameter groups are
kept (a flat shard per group, each with its group's hyperparameters). A trainable parameter that
gets no gradient on any rank is stepped with a zero gradient under ZeRO >= 1 (weight decay and
momentum still apply), whereas torch's optimizers skip parameters whose ``.grad`` is None.

Recomputation: with ``plan.stages[0].recompute`` each micro-step runs the captured graph block by
block (``passes.split`` cut at every block), each block under a non-reentrant
``torch.utils.checkpoint``: only the values between blocks stay saved and backward re-runs one block
at a time (inside the micro-step's compute block). It needs ``EngineInputs.gm`` with block
annotations; ZeRO-3 then gathers per micro-step (``zero3_granularity`` reports ``"micro_step"``), as
re-running forward code in backward needs. Buffers updated in forward (BatchNorm's running
statistics) are updated again by the recomputation.

BatchNorm (and any layer coupling the samples of a batch) normalises per micro-batch, not over the
global batch, so such models are not exact against one device. After each step the running
statistics of BatchNorm layers are averaged over the ranks weighted by their samples (counters take
the maximum), so every rank reports the same state.

Emulation: only compute runs inside ``clock.compute()`` (each micro-step's forward, loss and backward,
and the optimizer step); communication, flattening and copies run outside it. Per-block ZeRO-3
gathers from hooks inside forward and backward: the micro-step's compute block is closed before
each such gather and reopened after it, so the emulated slow-down never stretches communication.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.dp_units import insert_unit_hooks, param_units
from autopar.runtime.engine import (
    EngineInputs, compute_loss, global_batch_inputs, micro_slices, share_slices, take_rows,
)

__all__ = ["DataParallelEngine", "DataParallelError", "FlatLayout", "shard_bounds", "ELEMENTWISE_OPTIMIZERS",
           "Zero3Granularity"]

Zero3Granularity = Literal["block", "micro_step"]

# Optimizers whose update is elementwise (given step-level scalars): exact on flat shards.
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.Rprop,
    torch.optim.ASGD,
)


def _all_gather_single(output, input, group=None):
    # torch >= 2.10 renamed all_gather_into_tensor / reduce_scatter_tensor (same arguments).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group)


def _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group)


class DataParallelError(ValueError):
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
    total = sum(shares)
    exact = [total_numel * s / total for s in shares]
    sizes = [math.floor(e) for e in exact]
    rest = total_numel - sum(sizes)
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[:rest]:
        sizes[i] += 1
    bounds = [0]
    for n in sizes:
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


class _UnitHook(nn.Module):
    """Called from the hooked graph with a unit index: gathers or frees that unit."""

    def __init__(self, fn):
        super().__init__()
        self._fn = fn

    def forward(self, unit: int) -> None:
        self._fn(unit)


def _num_blocks(gm: Any) -> int:
    """The number of blocks annotated on a captured graph (0: none, or not a graph)."""
    if not isinstance(gm, torch.fx.GraphModule):
        return 0
    return max((int(n.meta["autopar.block"]) + 1 for n in gm.graph.nodes if "autopar.block" in n.meta),
               default=0)


def _run_block(prog: Any, num_flat: int, *values: Any) -> Any:
    """One block program (``passes.split.StageProgram``) on the flat inputs and received values."""
    return prog(values[:num_flat], values[num_flat:])


class DataParallelEngine:
    """Runs a single-stage (data-parallel) plan with its ZeRO stage on one rank; see the module
    docstring. Build it on every rank of the process group with the same ``EngineInputs`` (but
    ``rank``, ``device`` and ``clock``). ``zero3_granularity`` (ZeRO-3 only): ``"block"`` gathers
    block by block where the graph carries block annotations, ``"micro_step"`` gathers everything
    per micro-step."""

    def __init__(self, inputs: EngineInputs, *, zero3_granularity: Zero3Granularity = "block"):
        if zero3_granularity not in ("block", "micro_step"):
            raise DataParallelError(f"zero3_granularity: must be 'block' or 'micro_step', got {zero3_granularity!r}")
        self.inputs = inputs
        plan = inputs.plan
        self.plan = plan
        self.zero_stage = int(plan.zero_stage)
        self.device = torch.device(inputs.device)
        self.clock = inputs.clock
        self.group = inputs.group
        self.loss_fn = inputs.loss_fn
        self._segment = None          # the open compute block of a micro-step, if any
        self._check_plan()

        stage = plan.stages[0]
        self._members = tuple(g[0] for g in stage.groups)
        group_ranks = self._group_ranks()
        outside = sorted(set(self._members) - set(group_ranks))
        if outside:
            raise DataParallelError(f"plan: ranks {outside} are not in the process group (ranks "
                                    f"{group_ranks}); pass EngineInputs.group over the plan's ranks")
        if inputs.rank not in group_ranks:
            raise DataParallelError(f"rank: {inputs.rank} is not in the process group {group_ranks}")
        self._position = group_ranks.index(inputs.rank)
        self._src_rank = self._members[0]
        if inputs.rank in self._members:
            member = self._members.index(inputs.rank)
            self._share = share_slices(plan)[member]
            self._micro = micro_slices(stage.micro_batches[member], self._share.start)
        else:                                         # an idle rank: no samples, no shard
            self._share, self._micro = slice(0, 0), []
        self._rounds = max(len(m) for m in stage.micro_batches)
        # Shares by position (zero_shares are given per member, in member order; idle ranks get 0).
        shares = [0.0] * len(group_ranks)
        for g, r in enumerate(self._members):
            shares[group_ranks.index(r)] = float(stage.zero_shares[g]) if stage.zero_shares else 1.0

        self.model = inputs.model.to(self.device)
        self.gm = inputs.gm.to(self.device) if inputs.gm is not None else self.model
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if not trainable:
            raise DataParallelError("model: has no trainable parameters")
        dtypes = {p.dtype for p in trainable}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise DataParallelError(f"model: trainable parameters must share one floating dtype, got {dtypes}")
        self.dtype = next(iter(dtypes))
        self.recompute = bool(getattr(stage, "recompute", False))
        self._block_programs = self._split_blocks() if self.recompute else None

        probe = inputs.optimizer_factory(trainable)
        group_of = self._group_of(probe, trainable)
        units = None
        if self.zero_stage == 3 and zero3_granularity == "block" and not self.recompute \
                and isinstance(self.gm, torch.fx.GraphModule):   # recomputation re-runs forward: micro_step
            units = param_units(self.gm, trainable)
        self.zero3_granularity: Zero3Granularity | None = \
            None if self.zero_stage != 3 else ("block" if units is not None else "micro_step")
        unit_members = units.units if units is not None else (tuple(range(len(trainable))),)

        # Flat order: unit by unit; inside a unit by optimizer group, then parameter order.
        self._params: list[nn.Parameter] = []
        self._unit_params: list[tuple[int, ...]] = []
        layouts = []
        for members in unit_members:
            ordered = sorted(members, key=lambda i: (group_of[i], i))
            first = len(self._params)
            self._params.extend(trainable[i] for i in ordered)
            self._unit_params.append(tuple(range(first, len(self._params))))
            numels = tuple(trainable[i].numel() for i in ordered)
            offsets = tuple(sum(numels[:k]) for k in range(len(numels)))
            group_bounds = [0]
            for k in range(len(probe.param_groups)):
                group_bounds.append(group_bounds[-1] + sum(trainable[i].numel() for i in ordered
                                                           if group_of[i] == k))
            layouts.append(FlatLayout(numels=numels, offsets=offsets, group_bounds=tuple(group_bounds),
                                      bounds=shard_bounds(sum(numels), shares)))
        self.units: tuple[FlatLayout, ...] = tuple(layouts)
        self._shapes = tuple(p.shape for p in self._params)
        # id(param) -> (unit, index within the unit)
        self._where = {id(p): (u, k) for u, idx in enumerate(self._unit_params)
                       for k, p in enumerate(self._params[i] for i in idx)}
        self._bn = [m for m in self.model.modules()
                    if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]

        # Every rank starts from the first member's weights (as DDP does).
        flats = []
        for u in range(len(self.units)):
            flat = self._flatten_params(u)
            dist.broadcast(flat, src=self._src_rank, group=self.group)
            self._unflatten_into_params(u, flat)
            flats.append(flat)

        # (flat shard Parameter, unit, [start, stop) in the unit's flat buffer)
        self._shard_params: tuple[tuple[nn.Parameter, int, tuple[int, int]], ...] = ()
        if self.zero_stage == 0:
            self.optimizer = probe
        else:
            self._check_elementwise(probe)
            self.optimizer, self._shard_params = self._sharded_optimizer(probe, flats)
        del flats
        if self.zero_stage == 3:
            self._setup_zero3(units)

    @property
    def layout(self) -> FlatLayout:
        """The layout of the only unit (every ZeRO stage but per-block ZeRO-3 has one)."""
        if len(self.units) != 1:
            raise AttributeError(f"layout: this engine has {len(self.units)} units; see .units")
        return self.units[0]

    # -- checks and set-up -----------------------------------------------------------------------
    def _check_plan(self) -> None:
        plan = self.plan
        if len(plan.stages) != 1:
            raise DataParallelError(f"plan.stages: the data-parallel engine runs single-stage plans, got "
                                    f"{len(plan.stages)} stages")
        stage = plan.stages[0]
        if any(len(g) != 1 for g in stage.groups):
            raise DataParallelError(f"plan.stages[0].groups: need one rank per member (no tensor "
                                    f"parallelism), got {stage.groups}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise DataParallelError(f"plan.zero_stage: must be 0, 1, 2 or 3, got {plan.zero_stage!r}")
        if any(n < 0 for m in stage.micro_batches for n in m):
            raise DataParallelError(f"plan.stages[0].micro_batches: sizes must be >= 0, got {stage.micro_batches}")
        total = sum(stage.member_batch(g) for g in range(len(stage.groups)))
        if total != plan.global_batch_size:
            raise DataParallelError(f"plan.stages[0].micro_batches: sum to {total} samples, but "
                                    f"plan.global_batch_size is {plan.global_batch_size}")
        if stage.zero_shares and len(stage.zero_shares) != len(stage.groups):
            raise DataParallelError(f"plan.stages[0].zero_shares: need one share per member "
                                    f"({len(stage.groups)}), got {len(stage.zero_shares)}")
        if max(len(m) for m in stage.micro_batches) == 0:
            raise DataParallelError("plan.stages[0].micro_batches: no member has a micro-batch")
        if getattr(stage, "recompute", False) and not _num_blocks(self.inputs.gm):
            raise DataParallelError("plan.stages[0].recompute: activation recomputation (Stage.recompute) "
                                    "needs the captured graph with block annotations (EngineInputs.gm)")

    def _split_blocks(self) -> list:
        """``Stage.recompute``: the captured graph cut into one program per block (recomputed one by
        one in backward)."""
        from passes.split import split_stages

        return split_stages(self.gm, [(b, b + 1) for b in range(_num_blocks(self.gm))])

    def _forward(self, local: list) -> Any:
        """The model output on one micro-batch; with ``recompute`` block by block, each block under a
        non-reentrant checkpoint (only its inputs are kept; backward re-runs it)."""
        if self._block_programs is None:
            return self.gm(*local)
        from torch.utils.checkpoint import checkpoint

        from passes.split import flat_inputs

        flat = flat_inputs(self.gm, local)
        received: Any = ()
        for prog in self._block_programs:
            # tensors positional: checkpoint stashes the RNG state and autocast of their device
            received = checkpoint(_run_block, prog, len(flat), *flat, *received, use_reentrant=False)
            if not prog.is_last:
                received = tuple(received)
        return received

    def _group_ranks(self) -> list[int]:
        if self.group is None:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(self.group))

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

    def _sharded_optimizer(self, probe: torch.optim.Optimizer, flats: list[torch.Tensor]):
        """A flat shard Parameter per (unit, optimizer group) that intersects this rank's shard, and an
        optimizer of the probe's class over them with each group's hyperparameters."""
        shard_params = []
        by_group: dict[int, list[nn.Parameter]] = {}
        for u, layout in enumerate(self.units):
            lo, hi = layout.shard(self._position)
            gb = layout.group_bounds
            for k in range(len(probe.param_groups)):
                a, b = max(gb[k], lo), min(gb[k + 1], hi)
                if a < b:
                    sp = nn.Parameter(flats[u][a:b].detach().clone())
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
    def _unit(self, u: int):
        """(layout, parameters) of unit ``u``."""
        return self.units[u], [self._params[i] for i in self._unit_params[u]]

    def _flatten_params(self, u: int) -> torch.Tensor:
        layout, params = self._unit(u)
        if not params:
            return torch.zeros(0, dtype=self.dtype, device=self.device)
        return torch.cat([p.detach().reshape(-1) for p in params]).to(self.dtype)

    def _flatten_grads(self, u: int) -> torch.Tensor:
        layout, params = self._unit(u)
        flat = torch.zeros(layout.total_numel, dtype=self.dtype, device=self.device)
        for p, o, n in zip(params, layout.offsets, layout.numels):
            if p.grad is not None:
                flat[o:o + n].copy_(p.grad.reshape(-1))
        return flat

    def _unflatten_into_params(self, u: int, flat: torch.Tensor) -> None:
        layout, params = self._unit(u)
        with torch.no_grad():
            for p, o, n in zip(params, layout.offsets, layout.numels):
                p.copy_(flat[o:o + n].view_as(p))

    def _padded(self, u: int, flat: torch.Tensor) -> torch.Tensor:
        """Unit ``u``'s ``flat`` laid out position by position, each shard padded to the largest."""
        layout = self.units[u]
        m = layout.max_shard_numel
        out = torch.zeros(layout.padded_numel, dtype=flat.dtype, device=flat.device)
        for p in range(layout.num_shards):
            a, b = layout.shard(p)
            out[p * m:p * m + (b - a)].copy_(flat[a:b])
        return out

    def _unpadded(self, u: int, padded: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        layout = self.units[u]
        m = layout.max_shard_numel
        if out is None:
            out = torch.empty(layout.total_numel, dtype=padded.dtype, device=padded.device)
        for p in range(layout.num_shards):
            a, b = layout.shard(p)
            out[a:b].copy_(padded[p * m:p * m + (b - a)])
        return out

    def _my_shard_values(self, u: int) -> torch.Tensor:
        """This rank's shard of unit ``u``'s flat parameters, from the shard Parameters (padded)."""
        layout = self.units[u]
        out = torch.zeros(layout.max_shard_numel, dtype=self.dtype, device=self.device)
        lo, _ = layout.shard(self._position)
        for sp, su, (a, b) in self._shard_params:
            if su == u:
                out[a - lo:b - lo].copy_(sp.detach())
        return out

    # -- collectives -----------------------------------------------------------------------------
    def _all_gather_flat(self, u: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Unit ``u``'s full flat parameters gathered from every position's shard (into ``out``)."""
        layout = self.units[u]
        padded = torch.empty(layout.padded_numel, dtype=self.dtype, device=self.device)
        _all_gather_single(padded, self._my_shard_values(u), group=self.group)
        return self._unpadded(u, padded, out)

    def _reduce_scatter_grad(self, u: int, flat_grad: torch.Tensor) -> torch.Tensor:
        """This position's shard of the sum over ranks of unit ``u``'s ``flat_grad``. gloo implements
        the real reduce-scatter on CPU (checked on torch 2.13 with 3 processes), so there is no
        all-reduce + slice fallback."""
        layout = self.units[u]
        out = torch.empty(layout.max_shard_numel, dtype=flat_grad.dtype, device=flat_grad.device)
        _reduce_scatter_single(out, self._padded(u, flat_grad), op=dist.ReduceOp.SUM, group=self.group)
        lo, hi = layout.shard(self._position)
        return out[:hi - lo]

    # -- ZeRO-3: units gathered and freed in place ------------------------------------------------
    def _setup_zero3(self, units) -> None:
        self._full = [torch.empty(layout.total_numel, dtype=self.dtype, device=self.device)
                      for layout in self.units]
        for u, layout in enumerate(self.units):
            for p, o, n, i in zip(self._unit(u)[1], layout.offsets, layout.numels, self._unit_params[u]):
                p.data = self._full[u][o:o + n].view(self._shapes[i])
        self._gathered = [True] * len(self.units)
        self._blocks = units.blocks if units is not None else (None,)
        self._storage_unit: dict[int, int] = {}
        self._pending = [0] * len(self.units)
        self._bwd_order = tuple(range(len(self.units) - 1, 0, -1))    # block units, last first
        self._bwd_next = 0
        self._in_backward = False
        for u in range(len(self.units)):
            self._free(u)
        if units is not None:
            self.gm = insert_unit_hooks(self.gm, units, _UnitHook(self._forward_gather),
                                        _UnitHook(self._free))
            for u in range(1, len(self.units)):
                for p in self._unit(u)[1]:
                    p.register_post_accumulate_grad_hook(lambda _p, u=u: self._grad_ready(u))

    def _gather(self, u: int) -> None:
        if self._gathered[u] or not self.units[u].total_numel:
            return
        paused = self._segment is not None          # called from a hook inside a compute block
        if paused:
            self._segment_end()
        storage = self._full[u].untyped_storage()
        storage.resize_(self._full[u].numel() * self._full[u].element_size())
        self._all_gather_flat(u, out=self._full[u])
        if paused:
            self._segment_begin()
        self._storage_unit[storage.data_ptr()] = u
        self._gathered[u] = True

    def _free(self, u: int) -> None:
        if not self._gathered[u]:
            return
        storage = self._full[u].untyped_storage()
        self._storage_unit.pop(storage.data_ptr(), None)
        storage.resize_(0)
        self._gathered[u] = False

    def _forward_gather(self, u: int) -> None:
        if not self._in_backward:
            self._gather(u)

    def _backward_gather_through(self, stop: int) -> None:
        """Gather the block units of the backward order up to index ``stop`` (inclusive), in order."""
        while self._bwd_next <= stop:
            u = self._bwd_order[self._bwd_next]
            self._bwd_next += 1
            self._gather(u)
            if self._pending[u] == 0 and self._bwd_order.index(u) < stop:
                self._free(u)

    def _grad_ready(self, u: int) -> None:
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
        if block_mode:
            self._gather(0)
            if active:
                self._pending = [len(self._unit_params[u]) for u in units]
                self._bwd_next, self._in_backward = 0, False
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    loss_sum += self._micro_step(inputs, targets, rows).double()
                self._in_backward = True
                self._backward_gather_through(len(self._bwd_order) - 1)
                self._in_backward = False
            else:
                for u in units[1:]:                     # forward's gathers, then backward's
                    self._gather(u)
                    self._free(u)
                for u in self._bwd_order:
                    self._gather(u)
                    self._free(u)
        else:
            self._gather(0)
            if active:
                loss_sum += self._micro_step(inputs, targets, rows).double()
        for u in units:
            self._free(u)
            flat_grad = self._flatten_grads(u)
            for p in self._unit(u)[1]:
                p.grad = None
            if self.units[u].total_numel:
                shard_grads[u] += self._reduce_scatter_grad(u, flat_grad)
            del flat_grad

    # -- the step --------------------------------------------------------------------------------
    def _take(self, x: Any, rows: slice) -> Any:
        return take_rows(x, rows, self.plan.global_batch_size, self.device)

    def _micro_step(self, inputs: tuple, targets: Any, rows: slice) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch; returns its weighted loss (detached)."""
        n = rows.stop - rows.start
        local = [self._take(x, rows) for x in inputs]      # rows and copies: outside the compute block
        target = self._take(targets, rows)
        self._segment_begin()
        try:
            out = self._forward(local)
            loss = compute_loss(out, target, self.loss_fn)
            weighted = loss * (n / self.plan.global_batch_size)
            weighted.backward()
        finally:
            self._segment_end()
        return weighted.detach()

    def _segment_begin(self) -> None:
        """Open a compute block of the clock (closed by ``_segment_end``; see ``_gather``)."""
        self._segment = self.clock.compute()
        self._segment.__enter__()

    def _segment_end(self) -> None:
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.__exit__(None, None, None)

    def _check_batch(self, inputs: tuple, targets: Any) -> tuple:
        return global_batch_inputs(inputs, self.plan.global_batch_size, DataParallelError)

    def step(self, inputs: tuple, targets: torch.Tensor | None) -> float:
        """One optimizer step on the global batch; returns the global mean loss (same on every rank)."""
        inputs = self._check_batch(inputs, targets)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self._params:
            p.grad = None
        shard_grads = [torch.zeros(hi - lo, dtype=self.dtype, device=self.device)
                       for lo, hi in (layout.shard(self._position) for layout in self.units)]
        if self.zero_stage == 3:
            for r in range(self._rounds):
                self._zero3_round(inputs, targets, self._micro[r] if r < len(self._micro) else None,
                                  loss_sum, shard_grads)
        else:
            for rows in self._micro:
                if rows.stop > rows.start:
                    loss_sum += self._micro_step(inputs, targets, rows).double()
            for u, layout in enumerate(self.units):
                flat_grad = self._flatten_grads(u)
                params = self._unit(u)[1]
                if self.zero_stage == 2:
                    for p in params:
                        p.grad = None
                    shard_grads[u] = self._reduce_scatter_grad(u, flat_grad)
                else:
                    dist.all_reduce(flat_grad, op=dist.ReduceOp.SUM, group=self.group)
                    if self.zero_stage == 0:
                        for p, o, n in zip(params, layout.offsets, layout.numels):
                            p.grad = flat_grad[o:o + n].view_as(p)
                    else:
                        for p in params:
                            p.grad = None
                        lo, hi = layout.shard(self._position)
                        shard_grads[u] = flat_grad[lo:hi]
                del flat_grad
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=self.group)

        for sp, u, (a, b) in self._shard_params:
            lo = self.units[u].shard(self._position)[0]
            sp.grad = shard_grads[u][a - lo:b - lo].clone()
        del shard_grads
        with self.clock.compute():
            self.optimizer.step()
        for sp, _, _ in self._shard_params:
            sp.grad = None
        if self.zero_stage in (1, 2):
            for u in range(len(self.units)):
                self._unflatten_into_params(u, self._all_gather_flat(u))
        self._sync_batchnorm()
        return float(loss_sum)

    def _sync_batchnorm(self) -> None:
        """Average BatchNorm running statistics over ranks, weighted by samples (see the docstring)."""
        if not self._bn:
            return
        weight = (self._share.stop - self._share.start) / self.plan.global_batch_size
        floats, counters = [], []
        for m in self._bn:
            for name in ("running_mean", "running_var"):
                t = getattr(m, name, None)
                if t is not None:
                    floats.append(t)
            if getattr(m, "num_batches_tracked", None) is not None:
                counters.append(m.num_batches_tracked)
        if floats:
            flat = torch.cat([t.detach().reshape(-1).double() for t in floats]) * weight
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            o = 0
            with torch.no_grad():
                for t in floats:
                    t.copy_(flat[o:o + t.numel()].view_as(t))
                    o += t.numel()
        if counters:
            flat = torch.stack([c.detach().reshape(()) for c in counters])
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
            with torch.no_grad():
                for c, v in zip(counters, flat):
                    c.copy_(v)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded model state (keys of ``model.state_dict()``), as CPU clones on every
        rank. Under ZeRO-3 this is a collective: every rank must call it."""
        flats = [self._all_gather_flat(u) for u in range(len(self.units))] if self.zero_stage == 3 else None
        out = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            where = self._where.get(id(t))
            if where is not None and flats is not None:
                u, k = where
                o, n = self.units[u].offsets[k], self.units[u].numels[k]
                value = flats[u][o:o + n].view(t.shape)
            else:
                value = t
            out[key] = value.detach().to("cpu").clone()
        return out
