"""The data-parallel execution engine with ZeRO stages 0-3 for single-stage plans: runs a step
(micro-steps, then the data-parallel sync's collectives and optimizer step) and reports the state.

The engine is the stage executor and the round schedule; ``autopar.runtime.dp_sync`` (the one
data-parallel sync every engine uses) holds the flat buffers, reduces the gradients, steps the
sharded optimizer and gathers ZeRO-3's units. Which parameters form a ZeRO-3 unit, the graph with the
units' hooks, and the per-block programs of recomputation come lowered in the ``RankProgram``
(``autopar.lowering``). This module re-exports the public names of the flat layout.

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
- unit, flat buffer, shard: trainable parameters flattened into 1-D buffers laid out by
  ``FlatLayout`` and split into one contiguous shard per position (``autopar.runtime.dp_flat``).
  ZeRO 0-2 use one unit holding every trainable parameter; ZeRO-3 uses one unit per block plus a
  root unit (``autopar.lowering.zero3_units``), or one unit with ``zero3_granularity="micro_step"``.
- micro loss weight: micro-batch ``m`` of size ``n_m`` contributes ``loss_m * n_m / B`` (``B`` the
  global batch size) to the backward pass, so gradients summed over all ranks and micro-batches are
  the gradient of the global-batch mean loss, exactly as on one device.
- rounds (ZeRO-2 and 3): the number of micro-steps of the member with the most; every rank joins every
  round's collectives, ranks without a micro-step in a round contribute zero gradients.

ZeRO stages (per step, after the member's micro-steps)
- 0: all-reduce the flat gradient; every rank steps the full optimizer.
- 1: all-reduce the flat gradient; each rank keeps optimizer state for its shard only and steps one
  flat shard Parameter per optimizer parameter group and ZeRO chunk (a leaf tensor holding that rank's slice, so
  the state is shard-sized); then all-gather the updated shards into the full parameters.
- 2: gradients are sharded: after every micro-step round each rank reduce-scatters its flat
  gradient (zeros without a micro-step in the round) and adds its shard to the shard's sum, and the
  full gradients are freed, so none is held across micro-steps (as DeepSpeed's ZeRO-2 reduces after
  every backward); one reduce-scatter per round instead of one all-reduce per step. Then as ZeRO-1.
- 3: parameters stay sharded between steps; units are gathered per block (``"block"``) or per
  micro-step (``"micro_step"``) and freed again, each round, each unit's gradient reduce-scattered
  as soon as backward has left its block (``autopar.runtime.dp_sync``).
  ``state_dict()`` is a collective (it gathers).

Buffers (allocated once, reused every step): under ZeRO 0 and 1 each unit's flat gradient is one
buffer and every parameter's ``.grad`` is a view of it, so backward accumulates straight into the
flat buffer (as DDP's ``gradient_as_bucket_view``): no flattening copy, no per-step allocation. The
shard's gradient sum (ZeRO 2 and 3) and the shard values sent by the all-gathers are kept too.

Overlap (``overlap=True``, the default; ``RunConfig.overlap``): under ZeRO 0/1 the flat gradient is
reduced in buckets while the last micro-step's backward still runs (``autopar.runtime.dp_overlap``:
launched in a fixed bucket order, waited for before the optimizer), and ZeRO-3 starts gathering the
next unit while the current one computes (``autopar.runtime.dp_sync``). ZeRO-2 reduces each round's
gradient after its backward, blocking (a bucketed reduce-scatter would need per-bucket shards).
Overlap changes when collectives run, never what they sum: overlap off gives the same state.

One rank alone (a process group of one, ZeRO 0-2): nothing needs reducing or sharding, so the engine
runs the plain loop: the user's optimizer over the model's own parameters and gradients, no flat
buffer and no collective (a ZeRO stage 1 or 2 there has nothing to shard). Unlike sharded ZeRO >= 1
it then skips parameters without a gradient, as torch's optimizers do. ZeRO-3 keeps its units even
alone (its collectives are local copies there).

Exactness: sharded optimizer states are exact only for elementwise optimizers
(``ELEMENTWISE_OPTIMIZERS``; see ``autopar.runtime.dp_flat``); others raise ``DataParallelError``
under ZeRO >= 1 (ZeRO-0 runs any optimizer). A trainable parameter that gets no gradient on any rank
is stepped with a zero gradient under ZeRO >= 1 (weight decay and momentum still apply), whereas
torch's optimizers skip parameters whose ``.grad`` is None.

Recomputation: with ``plan.stages[0].recompute`` each micro-step runs the captured graph block by
block (``RankProgram.blocks``, the graph cut at every block), each block under a non-reentrant
``torch.utils.checkpoint``: only the values between blocks stay saved and backward re-runs one block
at a time (inside the micro-step's compute block). It needs the captured graph with block
annotations. ZeRO-3 still goes block by block, as FSDP with activation checkpointing does: each
block's unit is gathered around its forward and freed after it, gathered again when backward re-runs
the block, and freed and reduce-scattered once backward has its gradients
(``DataParallelSync.enter_block`` / ``leave_block``), so a rank never holds the whole model's weights
or gradient. Buffers updated in forward (BatchNorm's running
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

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch import nn

from autopar.runtime.dp_flat import ELEMENTWISE_OPTIMIZERS, DataParallelError, FlatLayout, shard_bounds
from autopar.lowering.materialize import is_deterministic
from autopar.lowering.program import RankProgram, engine_kind
from autopar.lowering.zero3_units import ParamUnits
from autopar.runtime.base import (
    EngineInputs, compute_loss, global_batch_inputs, micro_slices, run_recomputed_blocks, share_slices,
)
from autopar.runtime.communicator import ReduceOp, pg_all_reduce, pg_ranks
from autopar.runtime.data import StepRows, local_inputs, rank_rows
from autopar.runtime.dp_overlap import BUCKET_BYTES
from autopar.runtime.dp_sync import DataParallelSync, Zero3Granularity
from autopar.passes.grad_fusion import fuse_linear_grads

# materialize(meta tensors, extra graph modules holding them) -> elements materialised
Materializer = Callable[[list, tuple], int]


def defers_materialization(plan) -> bool:
    """Whether the engine of ``plan`` materialises a meta model's trainable parameters itself, one
    ZeRO-3 unit at a time keeping only this rank's shard (a data-parallel plan at ZeRO-3): ``compile``
    then materialises every other tensor and hands the engine ``materialize=``."""
    return engine_kind(plan) == "dp" and int(plan.zero_stage) == 3

__all__ = ["DataParallelEngine", "DataParallelError", "defers_materialization", "Materializer", "FlatLayout", "shard_bounds", "ELEMENTWISE_OPTIMIZERS",
           "Zero3Granularity"]


def _units_over(units: ParamUnits, lowered: tuple, trainable: list[nn.Parameter]) -> ParamUnits:
    """``units`` (indices into the parameters they were lowered over) as indices into ``trainable``;
    trainable parameters the graph never reads join the root unit, as lowering over ``trainable``
    itself would put them."""
    index = {id(p): i for i, p in enumerate(trainable)}
    members = [tuple(index[id(lowered[i])] for i in unit if id(lowered[i]) in index) for unit in units.units]
    seen = {i for unit in members for i in unit}
    members[0] = tuple(sorted(set(members[0]) | (set(range(len(trainable))) - seen)))
    return ParamUnits(units=tuple(members), blocks=units.blocks, spans=units.spans)


class DataParallelEngine:
    """Runs a single-stage (data-parallel) plan with its ZeRO stage on one rank; see the module
    docstring. Build it on every rank of the process group with the same ``EngineInputs`` (but
    ``rank``, ``device`` and ``clock``) and this rank's ``program`` (``autopar.lowering.lower``).
    ``zero3_granularity`` (ZeRO-3 only): ``"block"`` gathers block by block where the program carries
    ZeRO-3 units, ``"micro_step"`` gathers everything per micro-step. ``overlap``: ZeRO 0/1 reduce
    the gradients in buckets during backward (``autopar.runtime.dp_overlap``) and ZeRO-3 prefetches
    the next unit (``autopar.runtime.dp_sync``); False: every collective after the computation that
    needs it, blocking. ``bucket_bytes``: the size of a gradient bucket (``dp_overlap.BUCKET_BYTES``).
    ``materialize`` (ZeRO-3 with a model whose trainable parameters are still on ``meta``; see
    ``defers_materialization``): ``materialize(tensors, roots)`` gives the listed meta tensors their
    values in place (``autopar.lowering.materialize.materialize_tensors``); the engine calls it unit by
    unit, keeps this rank's shard and frees the rest before the next unit."""

    def __init__(self, inputs: EngineInputs, program: RankProgram, *,
                 zero3_granularity: Zero3Granularity = "block", overlap: bool = True,
                 bucket_bytes: int = BUCKET_BYTES, materialize: Materializer | None = None):
        if zero3_granularity not in ("block", "micro_step"):
            raise DataParallelError(f"zero3_granularity: must be 'block' or 'micro_step', got {zero3_granularity!r}")
        self.inputs = inputs
        self.program = program
        plan = inputs.plan
        self.plan = plan
        self.zero_stage = int(plan.zero_stage)
        self.device = torch.device(inputs.device)
        self.clock = inputs.clock
        self.group = inputs.group
        self.loss_fn = inputs.loss_fn
        self._segment = None          # the open compute block of a micro-step, if any
        self.overlap = bool(overlap)
        self._check_plan()

        stage = plan.stages[0]
        shares = self._place_rank(stage)
        deferred, trainable = self._place_model(materialize)
        self.recompute = bool(getattr(stage, "recompute", False))
        self._block_programs = list(program.blocks) if self.recompute else None
        for prog in (self._block_programs or ()) if not deferred else ():
            prog.gm.to(self.device)

        probe = inputs.optimizer_factory(trainable)
        units = None
        if self.zero_stage == 3 and zero3_granularity == "block" and program.zero3_units is not None:
            units = _units_over(program.zero3_units, program.zero3_params, trainable)
        self.zero3_granularity: Zero3Granularity | None = \
            None if self.zero_stage != 3 else ("block" if units is not None else "micro_step")
        self._bn = [m for m in self.model.modules()
                    if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]

        # Every rank starts from the first member's weights (as DDP does); alone, it has them, and a
        # model compile materialised deterministically has them already on every rank. ZeRO-3 holds
        # one unit's full weights at a time: materialised (deferred), flattened, its shard kept, the
        # rest freed (the sync's construction).
        self.materialized_numels: list[int] = []      # deferred ZeRO-3: elements materialised per unit
        self.sync: DataParallelSync | None = None
        self.optimizer = probe
        self._params = trainable                      # alone: the plain loop's
        if not self._solo:
            equal = deferred or is_deterministic(inputs.model)
            name_of = {id(p): n for n, p in self.model.named_parameters()} if deferred else {}
            self.sync = DataParallelSync(
                trainable, probe, zero_stage=self.zero_stage, group=self.group, position=self._position,
                device=self.device, shares=shares, units=units.units if units is not None else None,
                pause=self._paused, overlap=self.overlap, bucket_bytes=bucket_bytes,
                src=None if equal else self._src_rank,
                prepare_unit=(lambda u, ps: self._materialize_unit(ps, materialize, name_of, program))
                if deferred else None)
            self.optimizer = self.sync.optimizer
            self._params = self.sync.params
        if deferred:
            self.model = self.model.to(self.device)
            self.gm = self.gm.to(self.device) if program.gm is not None else self.model
            for prog in self._block_programs or ():
                prog.gm.to(self.device)
        self._unit_of_block: dict[int, int] = {}
        if units is not None and self.recompute:     # each recomputed block gathers its unit (_forward)
            self.sync.track_units(units.blocks)
            self._unit_of_block = {b: u for u, b in enumerate(units.blocks) if b is not None}
        elif units is not None:
            self.gm = program.zero3_gm.to(self.device)
            self.sync.bind_hooks(self.gm, units.blocks)
        # ZeRO 0/1 over several micro-steps: weight gradients accumulate inside their GEMMs, into the
        # flat views (passes.grad_fusion). One micro-step has nothing to accumulate, and there autograd's
        # own product plus one copy measured 3-5% faster than the fused GEMM on gpt-tiny.
        kept = self.sync.kept_grads if self.sync is not None and len(self._micro) > 1 else None
        gms = [b.gm for b in self._block_programs] if self._block_programs is not None else [self.gm]
        self.fused_linears = fuse_linear_grads(gms, kept) \
            if kept is not None and all(isinstance(g, fx.GraphModule) for g in gms) else 0

    def _place_model(self, materialize) -> tuple[bool, list]:
        """(whether ZeRO-3 materialises the model unit by unit, its trainable parameters): the model and
        graph on this rank's device (.to() cannot move meta tensors: a deferred model moves once every
        unit is materialised), the parameters checked to share one floating dtype."""
        inputs, program = self.inputs, self.program
        deferred = materialize is not None and self.zero_stage == 3 and \
            any(p.is_meta for p in inputs.model.parameters() if p.requires_grad)
        if materialize is not None and not deferred and any(p.is_meta for p in inputs.model.parameters()):
            raise DataParallelError("materialize: only ZeRO-3 materialises parameters unit by unit; this plan "
                                    f"runs ZeRO-{self.zero_stage} (materialise the model before building the engine)")
        self.model = inputs.model if deferred else inputs.model.to(self.device)
        self.gm = (program.gm if deferred else program.gm.to(self.device)) if program.gm is not None else self.model
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if not trainable:
            raise DataParallelError("model: has no trainable parameters")
        dtypes = {p.dtype for p in trainable}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise DataParallelError(f"model: trainable parameters must share one floating dtype, got {dtypes}")
        self.dtype = next(iter(dtypes))
        return deferred, trainable

    def _place_rank(self, stage) -> list[float]:
        """This rank's place in the plan: its position in the group, its rows and micro-batches (none on
        an idle rank), the rows a local=True step is given; returns the ZeRO shares by position
        (``zero_shares`` are given per member, in member order; idle ranks get 0)."""
        inputs, plan = self.inputs, self.plan
        self._members = tuple(g[0] for g in stage.groups)
        group_ranks = self._group_ranks()
        outside = sorted(set(self._members) - set(group_ranks))
        if outside:
            raise DataParallelError(f"plan: ranks {outside} are not in the process group (ranks "
                                    f"{group_ranks}); pass EngineInputs.group over the plan's ranks")
        if inputs.rank not in group_ranks:
            raise DataParallelError(f"rank: {inputs.rank} is not in the process group {group_ranks}")
        self._position = group_ranks.index(inputs.rank)
        # Alone in the group: no collective, no flat buffer, the user's optimizer (module docstring).
        self._solo = len(group_ranks) == 1 and self.zero_stage < 3
        self._src_rank = self._members[0]
        if inputs.rank in self._members:
            member = self._members.index(inputs.rank)
            self._share = share_slices(plan)[member]
            self._micro = micro_slices(stage.micro_batches[member], self._share.start)
        else:                                         # an idle rank: no samples, no shard
            self._share, self._micro = slice(0, 0), []
        self._rounds = max(len(m) for m in stage.micro_batches)
        # The rows a local=True step is given (autopar.runtime.data), and how this step's tensors hold them.
        self.local_rows = rank_rows(plan, inputs.rank, targets=inputs.loss_fn is not None)
        self._rows = StepRows(plan.global_batch_size)
        shares = [0.0] * len(group_ranks)
        for g, r in enumerate(self._members):
            shares[group_ranks.index(r)] = float(stage.zero_shares[g]) if stage.zero_shares else 1.0
        return shares

    def _materialize_unit(self, params: list, materialize: "Materializer", name_of: dict,
                          program: RankProgram) -> list:
        """Give a unit's meta parameters their values (``materialize``) and return the new Parameter
        objects in their place (materialisation replaces a meta tensor by identity)."""
        todo = [p for p in params if p.is_meta]
        roots = tuple(g for g in (program.zero3_gm, *(b.gm for b in program.blocks or ())) if g is not None)
        materialize(todo, roots)
        out = []
        for old in params:
            new = old
            if old.is_meta:
                new = self.model.get_parameter(name_of[id(old)])
                if new.is_meta:
                    raise DataParallelError(f"materialize: left parameter {name_of[id(old)]!r} on meta")
            out.append(new)
        self.materialized_numels.append(sum(p.numel() for p in todo))
        return out

    @property
    def units(self) -> tuple[FlatLayout, ...]:
        """The flat layout of each unit (none for a rank alone)."""
        return self.sync.units if self.sync is not None else ()

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
        if getattr(stage, "recompute", False) and not self.program.blocks:
            raise DataParallelError("plan.stages[0].recompute: activation recomputation (Stage.recompute) "
                                    "needs the captured graph with block annotations (EngineInputs.gm)")

    def _forward(self, local: list) -> Any:
        """The model output on one micro-batch; with ``recompute`` block by block, each block under a
        non-reentrant checkpoint (only its inputs are kept; backward re-runs it)."""
        if self._block_programs is None:
            return self.gm(*local)
        from autopar.passes.split import flat_inputs

        return run_recomputed_blocks(self._block_programs, flat_inputs(self.program.gm, local), self.sync,
                                     self._unit_of_block)

    def _group_ranks(self) -> list[int]:
        return pg_ranks(self.group)

    # -- the step --------------------------------------------------------------------------------
    def _take(self, x: Any, rows: slice) -> Any:
        return self._rows.take(x, rows, self.device)

    def _micro_step(self, inputs: tuple, targets: Any, rows: slice) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch; returns its weighted loss (detached)."""
        n = rows.stop - rows.start
        local = [self._take(x, rows) for x in inputs]      # rows and copies: outside the compute block
        target = self._take(targets, rows)
        self._segment_begin()
        try:
            out = self._forward(local)
            loss = compute_loss(out, target, self.loss_fn)
            B = self.plan.global_batch_size
            weighted = loss if n == B else loss * (n / B)    # x * 1.0 == x: skip the multiply
            if self._unit_of_block:
                self.sync.backward_begins()
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

    @contextmanager
    def _paused(self) -> Iterator[None]:
        """The micro-step's compute block closed around a collective issued from a hook, if one is open."""
        paused = self._segment is not None
        if paused:
            self._segment_end()
        try:
            yield
        finally:
            if paused:
                self._segment_begin()

    def _check_batch(self, inputs: tuple, targets: Any, local: bool = False) -> tuple:
        """The step's inputs as a tuple, checked; sets how they hold the global batch (``_rows``)."""
        if not local:
            self._rows = StepRows(self.plan.global_batch_size)
            return global_batch_inputs(inputs, self.plan.global_batch_size, DataParallelError)
        self._rows = StepRows(self.local_rows.num_inputs, self.local_rows.inputs)
        return local_inputs(inputs, self.local_rows.num_inputs, DataParallelError)

    def step(self, inputs: tuple, targets: torch.Tensor | None, local: bool = False) -> float:
        """One optimizer step on the global batch (``local``: on this rank's rows of it, as
        ``self.local_rows`` says); returns the global mean loss (same on every rank)."""
        inputs = self._check_batch(inputs, targets, local)
        if self._solo:
            return self._solo_step(inputs, targets)
        sync = self.sync
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        sync.begin_step()
        if self.zero_stage >= 2:
            # Gradients are sharded: each round's are reduce-scattered into the shard's sum and freed
            # (ZeRO-3: unit by unit inside backward), so no rank holds a full gradient across
            # micro-steps (every rank joins every round; one without a micro-step in it contributes zeros).
            for r in range(self._rounds):
                rows = self._micro[r] if r < len(self._micro) else None
                run = None
                if rows is not None and rows.stop > rows.start:
                    run = functools.partial(self._micro_step, inputs, targets, rows)
                if self.zero_stage == 3:
                    loss = sync.zero3_round(run, by_block=self.zero3_granularity == "block")
                else:
                    loss = run() if run is not None else None
                    sync.reduce_round()
                if loss is not None:
                    loss_sum += loss.double()
        else:
            # Backward accumulates into the flat buffers (the .grad views), reduced bucket by bucket
            # during the last backward (overlap) or after it.
            active = [i for i, rows in enumerate(self._micro) if rows.stop > rows.start]
            for i in active:
                if i == active[-1]:
                    sync.arm()
                loss_sum += self._micro_step(inputs, targets, self._micro[i]).double()
            sync.reduce()
        pg_all_reduce(loss_sum, group=self.group)
        sync.step(self.clock.compute, self.optimizer)
        self._sync_batchnorm()
        return float(loss_sum)

    def _solo_step(self, inputs: tuple, targets: Any) -> float:
        """The step of a rank alone in its group (ZeRO 0-2): the plain loop, nothing reduced."""
        for p in self._params:
            p.grad = None
        loss_sum = None
        for rows in self._micro:
            if rows.stop > rows.start:
                loss = self._micro_step(inputs, targets, rows).double()
                loss_sum = loss if loss_sum is None else loss_sum + loss
        with self.clock.compute():
            self.optimizer.step()
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
            pg_all_reduce(flat, group=self.group)
            o = 0
            with torch.no_grad():
                for t in floats:
                    t.copy_(flat[o:o + t.numel()].view_as(t))
                    o += t.numel()
        if counters:
            flat = torch.stack([c.detach().reshape(()) for c in counters])
            pg_all_reduce(flat, group=self.group, op=ReduceOp.MAX)
            with torch.no_grad():
                for c, v in zip(counters, flat):
                    c.copy_(v)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded model state (keys of ``model.state_dict()``), as CPU clones on every
        rank. Under ZeRO-3 this is a collective: every rank must call it."""
        sync = self.sync
        flats = [sync.full_flat(u) for u in range(len(sync.units))] if self.zero_stage == 3 else None
        out = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            where = sync.where.get(id(t)) if sync is not None else None
            if where is not None and flats is not None:
                u, k = where
                o, n = self.units[u].offsets[k], self.units[u].numels[k]
                value = flats[u][o:o + n].view(t.shape)
            else:
                value = t
            out[key] = value.detach().to("cpu").clone()
        return out
