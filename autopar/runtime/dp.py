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
- flat buffer: every trainable parameter flattened into one 1-D buffer in a fixed order shared by all
  ranks (the order of the optimizer's parameter groups, then of the parameters in each group).
- shard: a contiguous range of the flat buffer owned by one position, even or proportional to the
  stage's ``zero_shares`` (memory-proportional sharding; a share of 0 gives an empty shard).
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
- 3: parameters stay sharded between steps (each full parameter's storage is replaced by an empty
  placeholder). Every round all-gathers the full parameters before the micro-step's forward and,
  after its backward, reduce-scatters the gradient into the shard's accumulated gradient and frees
  the full parameters and gradients again. ``state_dict()`` is then a collective (it gathers).

Exactness: sharded optimizer states are exact only for elementwise optimizers (SGD with or without
momentum, Adam, AdamW, ...: the update of each element depends only on that element and step-level
scalars, so it is the same on a flat shard as on the full tensors). Optimizers with cross-element
coupling (LAMB's or LARS's per-tensor trust ratios, Adafactor's factored moments, L-BFGS) are not
supported under ZeRO >= 1: ``ELEMENTWISE_OPTIMIZERS`` lists the accepted classes and anything else
raises ``DataParallelError`` naming the optimizer (ZeRO-0 runs any optimizer). Parameter groups are
kept (a flat shard per group, each with its group's hyperparameters). A trainable parameter that
gets no gradient on any rank is stepped with a zero gradient under ZeRO >= 1 (weight decay and
momentum still apply), whereas torch's optimizers skip parameters whose ``.grad`` is None.

BatchNorm (and any layer coupling the samples of a batch) normalises per micro-batch, not over the
global batch, so such models are not exact against one device. After each step the running
statistics of BatchNorm layers are averaged over the ranks weighted by their samples (counters take
the maximum), so every rank reports the same state.

Emulation: only compute runs inside ``clock.compute()`` (each micro-step's forward, loss and backward,
and the optimizer step); communication, flattening and copies run outside it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.engine import EngineInputs, compute_loss, micro_slices, share_slices

__all__ = ["DataParallelEngine", "DataParallelError", "FlatLayout", "shard_bounds", "ELEMENTWISE_OPTIMIZERS"]

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
    """Where each trainable parameter lives in the flat buffer and which range each position owns."""

    numels: tuple[int, ...]          # per parameter, in flat order
    offsets: tuple[int, ...]         # per parameter: start in the flat buffer
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


class DataParallelEngine:
    """Runs a single-stage (data-parallel) plan with its ZeRO stage on one rank; see the module
    docstring. Build it on every rank of the plan with the same ``EngineInputs`` (but ``rank``,
    ``device`` and ``clock``)."""

    def __init__(self, inputs: EngineInputs):
        self.inputs = inputs
        plan = inputs.plan
        self.plan = plan
        self.zero_stage = int(plan.zero_stage)
        self.device = torch.device(inputs.device)
        self.clock = inputs.clock
        self.group = inputs.group
        self.loss_fn = inputs.loss_fn
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

        probe = inputs.optimizer_factory(trainable)
        self._params, group_sizes = self._flat_order(probe, trainable)
        numels = tuple(p.numel() for p in self._params)
        offsets, start = [], 0
        for n in numels:
            offsets.append(start)
            start += n
        group_bounds = [0]
        for n in group_sizes:
            group_bounds.append(group_bounds[-1] + n)
        self.layout = FlatLayout(numels=numels, offsets=tuple(offsets), group_bounds=tuple(group_bounds),
                                 bounds=shard_bounds(start, shares))
        self._shapes = tuple(p.shape for p in self._params)
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        self._bn = [m for m in self.model.modules()
                    if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]

        # Every rank starts from the first position's weights (as DDP does).
        flat = self._flatten_params()
        dist.broadcast(flat, src=self._src_rank, group=self.group)
        self._unflatten_into_params(flat)

        if self.zero_stage == 0:
            self.optimizer = probe
            # (flat shard Parameter, its [start, stop) in the flat buffer) per optimizer group
            self._shard_params: tuple[tuple[nn.Parameter, tuple[int, int]], ...] = ()
        else:
            self._check_elementwise(probe)
            self.optimizer, self._shard_params = self._sharded_optimizer(probe, flat)
            if self.zero_stage == 3:
                self._free_params()
        del flat

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

    def _group_ranks(self) -> list[int]:
        if self.group is None:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(self.group))

    @staticmethod
    def _flat_order(probe: torch.optim.Optimizer, trainable: list[nn.Parameter]):
        """The trainable parameters in the optimizer's group order, and each group's element count."""
        seen: dict[int, nn.Parameter] = {}
        sizes = []
        for k, group in enumerate(probe.param_groups):
            n = 0
            for p in group["params"]:
                if id(p) in seen:
                    raise DataParallelError(f"optimizer_factory: parameter group {k} repeats a parameter")
                seen[id(p)] = p
                n += p.numel()
            sizes.append(n)
        if set(seen) != {id(p) for p in trainable}:
            raise DataParallelError(
                f"optimizer_factory: the optimizer must hold exactly the model's trainable parameters "
                f"({len(trainable)}), it holds {len(seen)} (freeze a parameter with requires_grad=False "
                f"instead of leaving it out)")
        return list(seen.values()), sizes

    def _check_elementwise(self, probe: torch.optim.Optimizer) -> None:
        if type(probe) not in ELEMENTWISE_OPTIMIZERS:
            raise DataParallelError(
                f"optimizer_factory: {type(probe).__name__} is not supported under ZeRO-{self.zero_stage}: "
                f"sharded optimizer states are exact only for elementwise optimizers "
                f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}); use zero_stage=0")

    def _sharded_optimizer(self, probe: torch.optim.Optimizer, flat: torch.Tensor):
        """One flat shard Parameter per optimizer group that intersects this rank's shard, and an
        optimizer of the probe's class over them with each group's hyperparameters."""
        lo, hi = self.layout.shard(self._position)
        gb = self.layout.group_bounds
        groups, shard_params = [], []
        for k, group in enumerate(probe.param_groups):
            a, b = max(gb[k], lo), min(gb[k + 1], hi)
            if a < b or (k == len(probe.param_groups) - 1 and not groups):
                a, b = (a, b) if a < b else (lo, lo)          # an empty shard still gets an optimizer
                sp = nn.Parameter(flat[a:b].detach().clone())
                shard_params.append((sp, (a, b)))
                groups.append({**{key: v for key, v in group.items() if key != "params"}, "params": [sp]})
        accepted = inspect.signature(type(probe).__init__).parameters
        defaults = {k: v for k, v in probe.defaults.items() if k in accepted}
        return type(probe)(groups, **defaults), tuple(shard_params)

    # -- flat buffers ----------------------------------------------------------------------------
    def _flatten_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self._params]).to(self.dtype)

    def _flatten_grads(self) -> torch.Tensor:
        flat = torch.zeros(self.layout.total_numel, dtype=self.dtype, device=self.device)
        for p, o, n in zip(self._params, self.layout.offsets, self.layout.numels):
            if p.grad is not None:
                flat[o:o + n].copy_(p.grad.reshape(-1))
        return flat

    def _unflatten_into_params(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, o, n in zip(self._params, self.layout.offsets, self.layout.numels):
                p.copy_(flat[o:o + n].view_as(p))

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` laid out position by position, each shard padded to the largest shard."""
        m = self.layout.max_shard_numel
        out = torch.zeros(self.layout.padded_numel, dtype=flat.dtype, device=flat.device)
        for p in range(self.layout.num_shards):
            a, b = self.layout.shard(p)
            out[p * m:p * m + (b - a)].copy_(flat[a:b])
        return out

    def _unpadded(self, padded: torch.Tensor) -> torch.Tensor:
        m = self.layout.max_shard_numel
        return torch.cat([padded[p * m:p * m + (self.layout.shard(p)[1] - self.layout.shard(p)[0])]
                          for p in range(self.layout.num_shards)])

    def _my_shard_values(self) -> torch.Tensor:
        """This rank's shard of the flat parameters, from the shard Parameters (padded)."""
        out = torch.zeros(self.layout.max_shard_numel, dtype=self.dtype, device=self.device)
        lo, _ = self.layout.shard(self._position)
        for sp, (a, b) in self._shard_params:
            out[a - lo:b - lo].copy_(sp.detach())
        return out

    # -- collectives -----------------------------------------------------------------------------
    def _all_gather_flat(self) -> torch.Tensor:
        """The full flat parameters gathered from every position's shard."""
        padded = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        _all_gather_single(padded, self._my_shard_values(), group=self.group)
        return self._unpadded(padded)

    def _reduce_scatter_grad(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """This position's shard of the sum over ranks of ``flat_grad``. gloo implements the real
        reduce-scatter on CPU (checked on torch 2.13 with 3 processes), so there is no all-reduce +
        slice fallback."""
        m = self.layout.max_shard_numel
        out = torch.empty(m, dtype=flat_grad.dtype, device=flat_grad.device)
        _reduce_scatter_single(out, self._padded(flat_grad), op=dist.ReduceOp.SUM, group=self.group)
        lo, hi = self.layout.shard(self._position)
        return out[:hi - lo]

    # -- ZeRO-3 materialisation ------------------------------------------------------------------
    def _materialise(self, flat: torch.Tensor) -> None:
        for p, o, n, shape in zip(self._params, self.layout.offsets, self.layout.numels, self._shapes):
            p.data = flat[o:o + n].view(shape)

    def _free_params(self) -> None:
        for p in self._params:
            p.grad = None
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)

    # -- the step --------------------------------------------------------------------------------
    def _take(self, x: Any, rows: slice) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == self.plan.global_batch_size:
            return x[rows].to(self.device, non_blocking=True)
        if isinstance(x, torch.Tensor):
            return x.to(self.device, non_blocking=True)
        return x

    def _micro_step(self, inputs: tuple, targets: Any, rows: slice) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch; returns its weighted loss (detached)."""
        n = rows.stop - rows.start
        with self.clock.compute():
            out = self.gm(*(self._take(x, rows) for x in inputs))
            loss = compute_loss(out, self._take(targets, rows), self.loss_fn)
            weighted = loss * (n / self.plan.global_batch_size)
            weighted.backward()
        return weighted.detach()

    def _check_batch(self, inputs: tuple, targets: Any) -> tuple:
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        inputs = tuple(inputs)
        B = self.plan.global_batch_size
        sizes = {int(x.shape[0]) for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
        if B not in sizes:
            raise DataParallelError(f"inputs: every rank must be given the whole global batch of "
                                    f"plan.global_batch_size={B} samples (dim 0), got batch sizes {sorted(sizes)}")
        return inputs

    def step(self, inputs: tuple, targets: torch.Tensor | None) -> float:
        """One optimizer step on the global batch; returns the global mean loss (same on every rank)."""
        inputs = self._check_batch(inputs, targets)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self._params:
            p.grad = None
        if self.zero_stage == 3:
            shard_grad = self._zero3_micro_steps(inputs, targets, loss_sum)
        else:
            for rows in self._micro:
                if rows.stop > rows.start:
                    loss_sum += self._micro_step(inputs, targets, rows).double()
            flat_grad = self._flatten_grads()
            if self.zero_stage == 2:
                for p in self._params:
                    p.grad = None
                shard_grad = self._reduce_scatter_grad(flat_grad)
            else:
                dist.all_reduce(flat_grad, op=dist.ReduceOp.SUM, group=self.group)
                if self.zero_stage == 0:
                    for p, o, n in zip(self._params, self.layout.offsets, self.layout.numels):
                        p.grad = flat_grad[o:o + n].view_as(p)
                else:
                    for p in self._params:
                        p.grad = None
                    lo, hi = self.layout.shard(self._position)
                    shard_grad = flat_grad[lo:hi]
            del flat_grad
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=self.group)

        if self.zero_stage == 0:
            with self.clock.compute():
                self.optimizer.step()
        else:
            lo, _ = self.layout.shard(self._position)
            for sp, (a, b) in self._shard_params:
                sp.grad = shard_grad[a - lo:b - lo].clone()
            with self.clock.compute():
                self.optimizer.step()
            for sp, _ in self._shard_params:
                sp.grad = None
            if self.zero_stage != 3:
                self._unflatten_into_params(self._all_gather_flat())
        self._sync_batchnorm()
        return float(loss_sum)

    def _zero3_micro_steps(self, inputs: tuple, targets: Any, loss_sum: torch.Tensor) -> torch.Tensor:
        lo, hi = self.layout.shard(self._position)
        shard_grad = torch.zeros(hi - lo, dtype=self.dtype, device=self.device)
        for r in range(self._rounds):
            flat = self._all_gather_flat()
            rows = self._micro[r] if r < len(self._micro) else None
            if rows is not None and rows.stop > rows.start:
                self._materialise(flat)
                loss_sum += self._micro_step(inputs, targets, rows).double()
                flat_grad = self._flatten_grads()
                self._free_params()
            else:
                flat_grad = torch.zeros(self.layout.total_numel, dtype=self.dtype, device=self.device)
            del flat
            shard_grad += self._reduce_scatter_grad(flat_grad)
            del flat_grad
        return shard_grad

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
        flat = self._all_gather_flat() if self.zero_stage == 3 else None
        out = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            i = self._param_index.get(id(t))
            if i is not None and flat is not None:
                o, n = self.layout.offsets[i], self.layout.numels[i]
                value = flat[o:o + n].view(self._shapes[i])
            else:
                value = t
            out[key] = value.detach().to("cpu").clone()
        return out
