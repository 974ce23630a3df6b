"""The tensor-parallel execution engine: single-stage plans whose members are tensor-parallel groups.

Terms
- member: one data-parallel participant of the plan's single stage, a tuple of ranks forming a
  tensor-parallel (TP) group (``plan.stages[0].groups[g]``); ``plan.stages[0].tp_shares[g]`` gives
  each of its ranks' head counts (uneven shares put devices of different speeds in one group). A
  one-rank member runs the whole model. Member ``g`` owns rows ``share_slices(plan)[g]`` of the global
  batch and steps through its micro-batches ``micro_batches[g]``; every rank of the member sees the
  same rows.
- TP index: a rank's position inside its member's group (which shard of each pair it holds).
- sharded parameter: a slice of a column / row Linear weight (``passes.tp.ParamShard``); every other
  parameter is replicated and, since the TP ranks of a member compute on identical inputs and f / g
  all-reduce, receives identical gradients on them (no reduce inside the member).
- micro loss weight: micro-batch of ``n`` samples contributes ``loss * n / B`` (``B`` the global batch),
  so gradients summed over members are the global-batch mean gradient.

Gradient reduction across members, once per step after the member's micro-steps:
- equal shardings (every member has the same shares): as Megatron, one data-parallel group per TP
  index (the ranks at that index of every member) all-reduces the flat local gradient.
- different shardings (``((0, 1), (2,))``, or shares (3, 1) against (2, 2)): each rank lays its
  gradient into a full-model flat buffer (sharded parameters at their global positions, replicated
  ones from TP index 0 only, zeros elsewhere) and the whole plan group all-reduces it, so every element
  is summed exactly once per member. This costs a full-model all-reduce on every rank.

The optimizer steps the local parameters (shards and replicas): exact for elementwise optimizers
(SGD, Adam, AdamW...). Equal shardings over at least two members sync through the one data-parallel
sync (``runtime.dp_sync``) over each TP index's data-parallel group under ZeRO >= 1, at the plan's
ZeRO stage (ZeRO-0 all-reduces a flat copy of the gradient over that group): ZeRO-1 is
Megatron's distributed optimizer (each rank steps its shard, the group all-gathers the parameters: the bytes of the
all-reduce they replace); ZeRO-2 reduce-scatters the step's gradient into the shard and frees it
(the whole gradient is held during the step's backwards, so its peak is ZeRO-1's); ZeRO-3 keeps only
the shard between steps and gathers the member's whole local parameters for the step (one unit: the
stage), as torchtitan's FSDP under pipelining does (``reshard_after_forward=False``): the bytes and
the peak of ZeRO-2. Different shardings and a single member run ZeRO-0; ``zero_stage_applied`` records what ran. ``state_dict()`` gathers the shards (a collective inside
each member) and returns the full state on every rank.

The rewrite itself is lowered (``RankProgram.tp_module``, ``passes.tp.tp_rewrite``); the engine binds its
f / g to the member's group (``bind_tp_group``) and reloads its shards once every rank holds the first
rank's weights. From a meta model, compile leaves the full parameters this rank shards on meta
(``lowering.materialize.rank_tensors``): the engine makes each alone, cuts its shard and drops it, so
a rank holds its shards, the replicated parameters and at most one full tensor, never the model.
For the pipeline engine: ``bind_tp_group``, ``gather_full_params`` and ``flat_full_grad`` are the
per-stage pieces; ``shard_stage_module`` rewrites and binds in one call (for a graph used on
its own).

Sequence parallelism (``Stage.sequence_parallel``, ``passes.tp_sp``): lowering rewrites the blocks
that support it; ``bind_tp_group`` binds their collectives too. A block that does not support it runs
without (never an error), and ``sp_blocks_applied`` records the blocks that do. The replicated
parameters those blocks read (norm weights, row biases) get partial gradients (their tokens only):
this engine sums them over the TP group once per step (``sum_deferred_sp_grads``, one all-reduce,
before the reductions below); a pipeline stage's module sums them inside backward, per micro-step.
Either way the reductions below see full, identical gradients on every TP rank, as without SP.

Emulation: only compute (each micro-step's forward, loss and backward, and the optimizer step) runs
inside ``clock.compute()``; the f / g all-reduces inside forward and backward block without CPU time.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn

from autopar.errors import AutoparError
from autopar.lowering.materialize import is_deterministic, tensor_value
from autopar.lowering.program import RankProgram
from autopar.passes.meta import TP_LAYOUT
from autopar.passes.tp import TPLayout, assemble_full, bind_all_reduce, tp_rewrite
from autopar.passes.tp_head import bind_all_gather
from autopar.passes.tp_overlap import overlap_tp_backward
from autopar.passes.tp_sp import SP_META_KEY, bind_sp_collectives
from autopar.runtime.base import EngineInputs, compute_loss, global_batch_inputs, micro_slices, share_slices
from autopar.runtime.communicator import (
    pg_all_gather, pg_all_reduce, pg_broadcast, pg_is_initialized, pg_new_group, pg_ranks,
)
from autopar.runtime.data import StepRows, local_inputs, rank_rows
from autopar.runtime.dp_sync import DataParallelSync
from autopar.runtime.tp_comm import GroupAllGather, GroupAllReduce, GroupReduceScatter

__all__ = ["TensorParallelEngine", "TensorParallelError", "tp_zero_applies", "tp_zero_groups", "shard_stage_module", "bind_tp_group", "tp_layout",
           "gather_full_params", "flat_full_grad", "bind_sp_group", "sum_deferred_sp_grads"]


class TensorParallelError(AutoparError):
    """A plan the tensor-parallel engine cannot run (names the field)."""


# --------------------------------------------------------------------------------------------------
# Per-stage pieces (also for the pipeline engine)


def bind_tp_group(local_gm: fx.GraphModule, group=None) -> None:
    """Make the f / g of a TP module (``passes.tp.tp_rewrite``) all-reduce over the process ``group``
    (None: the default group); without torch.distributed they stay without communication."""
    if pg_is_initialized():
        bind_all_reduce(local_gm, GroupAllReduce(group))   # start(): f's async backward (passes.tp_overlap)
        bind_all_gather(local_gm, GroupAllGather(group))   # the heads' gathers (passes.tp_head)
        bind_sp_group(local_gm, group)


def bind_sp_group(local_gm: fx.GraphModule, group=None) -> None:
    """Make the sequence-parallel modules of a TP module (``passes.tp_sp.sp_rewrite``; none: nothing to
    do) communicate over the process ``group``: padded all-gathers and reduce-scatters (NCCL, gloo in
    this torch, and the threaded test group have both), all-reduces for the replicated gradients. Both
    sums have ``start`` (``runtime.tp_comm``): an SP f's backward reduce-scatter runs asynchronously,
    overlapped with its columns' weight gradients (``passes.tp_overlap``)."""
    if not pg_is_initialized() or SP_META_KEY not in getattr(local_gm, "meta", {}):
        return
    bind_sp_collectives(local_gm, GroupAllReduce(group), GroupAllGather(group),
                        GroupReduceScatter(group))


def tp_zero_applies(zero_stage: int, tp_shares: Sequence[Sequence[int]]) -> bool:
    """Whether a stage whose members hold head shares ``tp_shares`` shards its optimizer state over
    its members: a ZeRO stage >= 1 asked, at least two members, and the same shares in each (members
    with different shares lay out different local tensors, whose gradients the engines sum in
    full-model buffers instead: ZeRO-0)."""
    shares = [tuple(s) for s in tp_shares]
    return zero_stage >= 1 and len(shares) > 1 and len(set(shares)) == 1


def tp_zero_groups(new_group: Callable, plan) -> dict[tuple[int, int], object]:
    """The data-parallel peer groups of every pipeline stage of ``plan`` with tensor-parallel members
    that syncs through ``runtime.dp_sync`` (``tp_zero_applies``), keyed by (stage, TP index):
    ``new_group(ranks)`` for the ranks at that index of every member. Every rank must call it
    (process groups are made collectively), in the same place of its setup."""
    out = {}
    for s, st in enumerate(plan.stages):
        if not any(len(m) > 1 for m in st.groups):
            continue
        shares = st.tp_shares or tuple((1,) * len(m) for m in st.groups)
        if tp_zero_applies(plan.zero_stage, shares):
            for i in range(len(st.groups[0])):
                out[(s, i)] = new_group([m[i] for m in st.groups])
    return out


def sum_deferred_sp_grads(local_gm: fx.GraphModule, group=None) -> None:
    """Sum over the TP ``group`` (one all-reduce) the accumulated partial gradients of the parameters
    that SP left to the engine (``SPLayout.deferred_params``: norm weights, row biases read only on a
    sequence shard); call once per step, after the last micro-step's backward, on every rank of the
    group. Nothing to do without SP or deferred parameters."""
    sp = getattr(local_gm, "meta", {}).get(SP_META_KEY)
    if sp is None or not sp.deferred_params or not pg_is_initialized():
        return
    params = list({id(p): p for p in (local_gm.get_parameter(n) for n in sp.deferred_params)}.values())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    pg_all_reduce(flat, group=group)
    offset = 0
    for p in params:
        value = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if p.grad is None:
            p.grad = value.clone()
        else:
            p.grad.copy_(value)     # in place: ZeRO binds gradients to views of its buffers


def shard_stage_module(stage_gm: fx.GraphModule, shares: tuple[int, ...], idx: int, group=None, *,
                       granularity: int = 8) -> fx.GraphModule:
    """The module TP index ``idx`` of a group with head ``shares`` runs for ``stage_gm`` (a captured
    graph or one pipeline stage's graph, with shapes from ``passes.analysis``), f / g bound to
    ``group``; ``tp_layout(result)`` lists the sharded parameters. Replicated parameters stay shared
    with ``stage_gm``. (Engines get the rewrite lowered and only bind it: ``bind_tp_group``.)"""
    local = tp_rewrite(stage_gm, tuple(shares), idx, granularity=granularity)
    overlap_tp_backward(local)
    bind_tp_group(local, group)
    return local


def tp_layout(local_gm: fx.GraphModule) -> TPLayout:
    """The ``TPLayout`` that ``passes.tp.tp_rewrite`` recorded on its result."""
    layout = getattr(local_gm, "meta", {}).get(TP_LAYOUT)
    if layout is None:
        raise TensorParallelError("local_gm: not a module made by shard_stage_module / tp_rewrite")
    return layout


def gather_full_params(local_gm: fx.GraphModule, group=None) -> dict[str, torch.Tensor]:
    """Full tensors of every sharded parameter, keyed by its ``ParamShard.source`` name (a collective
    over the TP ``group``: every member must call it). One padded all-gather of all shards."""
    layout = tp_layout(local_gm)
    if not layout.params:
        return {}
    n = len(layout.shares)
    local = torch.cat([local_gm.get_parameter(s.local).detach().reshape(-1) for s in layout.params])
    sizes = [sum(s.local_numel(m) for s in layout.params) for m in range(n)]
    if n == 1:
        flats = [local]
    else:
        # Group ranks are sorted global ranks, not TP indices: each piece carries its TP index first.
        padded = local.new_zeros(1 + max(sizes))
        padded[0] = layout.rank_index
        padded[1:1 + local.numel()] = local
        gathered = [torch.empty_like(padded) for _ in range(n)]
        pg_all_gather(gathered, padded, group=group)
        flats = [None] * n
        for t in gathered:
            flats[int(t[0])] = t[1:]
    out, offsets = {}, [0] * n
    for s in layout.params:
        pieces = []
        for m in range(n):
            k = s.local_numel(m)
            shape = list(s.full_shape)
            shape[s.dim] = sum(b - a for a, b in s.ranges[m])
            pieces.append(flats[m][offsets[m]:offsets[m] + k].view(shape))
            offsets[m] += k
        out[s.source] = assemble_full(s, pieces)
    return out


def flat_full_grad(local_gm: fx.GraphModule, source_params: list[tuple[str, nn.Parameter]],
                   replicated_too: bool) -> torch.Tensor:
    """This rank's gradients laid into a full-model flat buffer. ``source_params`` lists (name,
    parameter) of the unsharded source module in an order common to all ranks; sharded parameters go
    to their global positions, replicated ones (the same Parameter objects in the local module) only
    when ``replicated_too`` (TP index 0), zeros elsewhere."""
    layout = tp_layout(local_gm)
    shards = {s.source: s for s in layout.params}
    parts = []
    for source, p in source_params:
        s = shards.get(source)
        device = local_gm.get_parameter(s.local).device if s is not None else p.device   # p: meta if sharded
        full = torch.zeros(s.full_shape if s is not None else p.shape, dtype=p.dtype, device=device)
        if s is not None:
            g = local_gm.get_parameter(s.local).grad
            if g is not None:
                offset = 0
                for a, b in s.ranges[layout.rank_index]:
                    full.narrow(s.dim, a, b - a).copy_(g.narrow(s.dim, offset, b - a))
                    offset += b - a
        elif replicated_too and p.grad is not None:
            full.copy_(p.grad)
        parts.append(full.reshape(-1))
    return torch.cat(parts)


def _to_device(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` with its tensors on ``device``, but those still on meta (not this rank's to hold)."""
    return module._apply(lambda t: t if t.is_meta else t.to(device))


# --------------------------------------------------------------------------------------------------
# The engine


class TensorParallelEngine:
    """Runs a single-stage plan whose members are TP groups; see the module docstring. Build it on
    every rank of the process group with the same ``EngineInputs`` (but ``rank``, ``device``,
    ``clock``) and this rank's ``program`` (``autopar.lowering.lower``). Every rank of the default group
    must build it (it creates sub-groups)."""

    def __init__(self, inputs: EngineInputs, program: RankProgram):
        self.inputs = inputs
        self.program = program
        self.plan = plan = inputs.plan
        self.device = torch.device(inputs.device)
        self.clock = inputs.clock
        self.group = inputs.group
        self.loss_fn = inputs.loss_fn
        self.zero_stage_applied = 0
        self._check_plan()
        stage = plan.stages[0]
        if stage.recompute:
            raise TensorParallelError("plan.stages[0].recompute: activation recomputation is not supported by the "
                                      "single-stage tensor-parallel engine; plan without it, or as a pipeline "
                                      "(whose stages recompute with tensor-parallel members too)")
        self._members = stage.groups
        shares = self._shares()
        group_ranks = pg_ranks(self.group)
        outside = sorted(set(stage.ranks) - set(group_ranks))
        if outside or inputs.rank not in group_ranks:
            raise TensorParallelError(f"plan: ranks {outside or [inputs.rank]} are not in the process group "
                                      f"(ranks {group_ranks}); pass EngineInputs.group over the plan's ranks")
        # An idle rank (in the group, left out by the plan) joins every group-wide collective empty.
        self._has_idle = bool(set(group_ranks) - set(stage.ranks))
        self._src_rank = self._members[0][0]
        self._member, self._tp_index = next(((g, m.index(inputs.rank)) for g, m in enumerate(self._members)
                                             if inputs.rank in m), (None, None))
        if self._member is None:
            self._share, self._micro = slice(0, 0), []
        else:
            self._share = share_slices(plan)[self._member]
            self._micro = micro_slices(stage.micro_batches[self._member], self._share.start)
        # The rows a local=True step is given (the same on every rank of a member), and how this
        # step's tensors hold them.
        self.local_rows = rank_rows(plan, inputs.rank, targets=inputs.loss_fn is not None)
        self._rows = StepRows(plan.global_batch_size)

        self._make_groups(shares)
        self.model = _to_device(inputs.model, self.device)
        source = _to_device(program.gm, self.device) if program.gm is not None else None
        if source is None or program.tp_module is None:
            raise TensorParallelError("gm: the tensor-parallel engine needs the captured graph")
        # Every rank starts from the first rank's weights (as DDP does), unless compile materialised
        # the model deterministically: then every rank has them already.
        with torch.no_grad():
            for p in source.parameters() if not is_deterministic(inputs.model) else ():
                pg_broadcast(p.data, src=self._src_rank, group=self.group)
        self._source_params = [(name, p) for name, p in source.named_parameters() if p.requires_grad]
        # The lowered TP module (an idle rank's never runs and holds no shard): shards cut again from
        # the broadcast weights, f / g over the member's group.
        self.gm = _to_device(program.tp_module, self.device)
        self.layout = tp_layout(self.gm)
        sp = self.gm.meta.get(SP_META_KEY)
        self.sp_blocks_applied: tuple[int, ...] = sp.blocks if sp is not None else ()
        self._load_shards(source)
        if self._member is not None:
            bind_tp_group(self.gm, self.tp_group)
        self._free_sources(source)
        self._params = [p for p in self.gm.parameters() if p.requires_grad]
        # The data-parallel sync over this TP index's ranks of every member (``runtime.dp_sync``), when
        # every member has the same shares (so their local tensors lay out alike); else full-model buffers.
        self.optimizer = inputs.optimizer_factory(self._params)
        self.sync = None
        if self._member is not None and self.dp_group is not None and tp_zero_applies(plan.zero_stage, shares):
            self.zero_stage_applied = int(plan.zero_stage)
            self.sync = DataParallelSync(self._params, self.optimizer, zero_stage=self.zero_stage_applied,
                                         group=self.dp_group, position=pg_ranks(self.dp_group).index(inputs.rank),
                                         device=self.device, overlap=False)
            self.optimizer = self.sync.optimizer

    def _make_groups(self, shares) -> None:
        """Sub-groups, every rank creating every group in the same order: each TP member's, then, when
        every member has the same shares, one data-parallel group per TP index."""
        rank = self.inputs.rank
        self.tp_group = None
        for m in self._members:
            if len(m) > 1:
                pg = pg_new_group(m)
                if rank in m:
                    self.tp_group = pg
        self._equal = len(set(shares)) == 1
        self.dp_group = None
        if self._equal and len(self._members) > 1:
            for i in range(len(self._members[0])):
                pg = pg_new_group([m[i] for m in self._members])
                if i == self._tp_index:
                    self.dp_group = pg

    def _free_sources(self, source: fx.GraphModule) -> None:
        """The full weights of sharded Linears are no longer needed on this rank: freed (as ZeRO-3 does;
        state_dict() rebuilds them from the shards; from a meta model they were never made). Keeps the
        model's state_dict keys of each source parameter (tied parameters have several)."""
        with torch.no_grad():
            for s in self.layout.params:
                p = source.get_parameter(s.source)
                if not p.is_meta:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        keys_of: dict[int, list[str]] = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            keys_of.setdefault(id(t), []).append(key)
        self._source_keys = {name: keys_of.get(id(p), []) for name, p in source.named_parameters()}

    def _load_shards(self, source: fx.GraphModule) -> None:
        """Each sharded parameter's values, cut from its full parameter of ``source``; a full parameter
        compile left on meta (``lowering.materialize.rank_tensors``) is made alone, cut and dropped, so
        the rank never holds more than one full tensor beyond its shards."""
        with torch.no_grad():
            for s in self.layout.params:
                full = source.get_parameter(s.source)
                if full.is_meta:
                    full = tensor_value(self.inputs.model, full).to(self.device)
                value = torch.cat([full.narrow(s.dim, a, b - a) for a, b in s.ranges[self.layout.rank_index]],
                                  dim=s.dim)
                local = self.gm.get_parameter(s.local)
                if local.is_meta:
                    owner, _, attr = s.local.rpartition(".")
                    self.gm.get_submodule(owner)._parameters[attr] = nn.Parameter(
                        value.to(local.dtype), requires_grad=local.requires_grad)
                else:
                    local.copy_(value)
                del full

    # -- checks --------------------------------------------------------------------------------
    def _check_plan(self) -> None:
        plan = self.plan
        if len(plan.stages) != 1:
            raise TensorParallelError(f"plan.stages: the tensor-parallel engine runs single-stage plans, "
                                      f"got {len(plan.stages)} stages")
        stage = plan.stages[0]
        if any(n < 0 for m in stage.micro_batches for n in m):
            raise TensorParallelError(f"plan.stages[0].micro_batches: sizes must be >= 0, got {stage.micro_batches}")
        total = sum(stage.member_batch(g) for g in range(len(stage.groups)))
        if total != plan.global_batch_size:
            raise TensorParallelError(f"plan.stages[0].micro_batches: sum to {total} samples, but "
                                      f"plan.global_batch_size is {plan.global_batch_size}")

    def _shares(self) -> list[tuple[int, ...]]:
        stage = self.plan.stages[0]
        if not stage.tp_shares:
            return [tuple([1] * len(m)) for m in stage.groups]   # even split
        if len(stage.tp_shares) != len(stage.groups) or any(
                len(s) != len(m) for s, m in zip(stage.tp_shares, stage.groups)):
            raise TensorParallelError(f"plan.stages[0].tp_shares: need one share per rank of each group "
                                      f"{stage.groups}, got {stage.tp_shares}")
        if any(x < 0 for s in stage.tp_shares for x in s) or any(sum(s) <= 0 for s in stage.tp_shares):
            raise TensorParallelError(f"plan.stages[0].tp_shares: need non-negative shares with a positive "
                                      f"sum per group, got {stage.tp_shares}")
        return [tuple(int(x) for x in s) for s in stage.tp_shares]

    # -- stepping ------------------------------------------------------------------------------
    def _take(self, x: Any, rows: slice) -> Any:
        return self._rows.take(x, rows, self.device)

    def _micro_step(self, inputs: tuple, targets: Any, rows: slice) -> torch.Tensor:
        n = rows.stop - rows.start
        with self.clock.compute():
            out = self.gm(*(self._take(x, rows) for x in inputs))
            loss = compute_loss(out, self._take(targets, rows), self.loss_fn)
            weighted = loss * (n / self.plan.global_batch_size)
            weighted.backward()
        return weighted.detach()

    def step(self, inputs: tuple, targets: torch.Tensor | None, local: bool = False) -> float:
        """One optimizer step on the global batch (``local``: on this rank's rows of it, as
        ``self.local_rows`` says); returns the global mean loss (same on every rank)."""
        if local:
            self._rows = StepRows(self.local_rows.num_inputs, self.local_rows.inputs)
            inputs = local_inputs(inputs, self.local_rows.num_inputs, TensorParallelError)
        else:
            self._rows = StepRows(self.plan.global_batch_size)
            inputs = global_batch_inputs(inputs, self.plan.global_batch_size, TensorParallelError)
        if self.sync is not None:
            self.sync.begin_step()
            if self.sync.zero_stage == 3:       # the member's local parameters, for the whole step
                self.sync.gather_all()
        else:
            for p in self._params:
                p.grad = None
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for rows in self._micro:
            if rows.stop > rows.start:
                loss_sum += self._micro_step(inputs, targets, rows).double()
        if self._member is not None and self._micro:
            sum_deferred_sp_grads(self.gm, self.tp_group)   # the SP region's partial gradients, once a step
        if self._tp_index != 0:
            loss_sum.zero_()      # each member's loss counts once
        pg_all_reduce(loss_sum, group=self.group)
        if self.sync is not None:
            if self.sync.zero_stage == 3:
                self.sync.free_all()
            if self.sync.zero_stage >= 2:
                self.sync.reduce_round()
            self.sync.reduce()
            self.sync.step(self.clock.compute, self.optimizer)
            return float(loss_sum)
        if not self._equal:
            self._reduce_padded()
        elif self._member is not None:
            self._reduce_equal()
        if self._member is not None:
            with self.clock.compute():
                self.optimizer.step()
        return float(loss_sum)

    def _reduce_equal(self) -> None:
        """ZeRO-0 over members of the same shares: this TP index's flat gradient all-reduced over its
        data-parallel group (none for a single member)."""
        flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1)
                          for p in self._params])
        if self.dp_group is not None:
            pg_all_reduce(flat, group=self.dp_group)
        offset = 0
        for p in self._params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def _reduce_padded(self) -> None:
        flat = flat_full_grad(self.gm, self._source_params, replicated_too=self._tp_index == 0)
        pg_all_reduce(flat, group=self.group)
        shards = {s.source: s for s in self.layout.params}
        offset = 0
        for source, p in self._source_params:
            shape = shards[source].full_shape if source in shards else p.shape
            full = flat[offset:offset + math.prod(shape)].view(shape)
            offset += math.prod(shape)
            s = shards.get(source)
            if s is not None:
                self.gm.get_parameter(s.local).grad = torch.cat(
                    [full.narrow(s.dim, a, b - a) for a, b in s.ranges[self._tp_index]], dim=s.dim)
            else:
                p.grad = full   # replicated: the local module holds this same Parameter

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded model state (keys of ``model.state_dict()``), as CPU clones on every
        rank. A collective: every rank must call it (shards are gathered inside each member; idle
        ranks receive the state from the plan's first rank)."""
        zero3 = self.sync is not None and self.sync.zero_stage == 3
        if zero3:                               # sharded between steps: gathered for this
            self.sync.gather_all()
        full = gather_full_params(self.gm, self.tp_group) if self._member is not None else {}
        replace = {}
        for source, t in full.items():
            for key in self._source_keys.get(source, []):
                replace[key] = t
        state = {key: replace.get(key, t).detach() for key, t in self.model.state_dict(keep_vars=True).items()}
        if self._has_idle:
            floats = [k for k, t in state.items() if t.is_floating_point()]
            flat = torch.cat([state[k].reshape(-1).to(self.device) for k in floats]) if floats else None
            if flat is not None:
                pg_broadcast(flat, src=self._src_rank, group=self.group)
                offset = 0
                for k in floats:
                    n = state[k].numel()
                    state[k] = flat[offset:offset + n].view(state[k].shape)
                    offset += n
        out = {key: t.to("cpu").clone() for key, t in state.items()}
        if zero3:
            self.sync.free_all()
        return out
