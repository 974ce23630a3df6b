"""Lowering: a plan and the captured graph give one rank its ``RankProgram``.

The passes, in order (each a function over fx graphs from ``autopar.passes``):

1. kernel substitution (``passes.triton_patterns.substitute_kernels``) when ``use_triton``; with
   ``Stage.recompute_attention`` (selective recomputation, every stage), the attention calls under
   checkpoint (``passes.attention_recompute``);
2. for a ``"pipeline"`` plan: the stage split (``passes.split.split_stages``) at the stages' block
   ranges (with ``Plan.virtual_stages`` > 1 these are the model chunks, several per rank: the engine
   runs every stage of ``Plan.chunks_of(rank)``), then, on a tensor-parallel member, the TP rewrite of
   this rank's stage (``passes.tp.tp_rewrite``), and with ``Stage.sequence_parallel`` sequence
   parallelism on it (``passes.tp_sp.sp_rewrite``: the blocks it supports; the others as they were);
3. for a ``"tp"`` plan: the TP rewrite of the whole graph for this rank (an idle rank gets the
   one-rank rewrite: it never runs and holds no shard), with SP as in 2;
   on a TP member in 2 and 3: the backward overlap (``passes.tp_overlap``) and, where
   ``forward_overlap_on`` says, the forward overlap (``passes.tp_fwd_overlap``); a plan of one
   recomputing stage of TP members at ZeRO-3 (``ir.plan.zero3_by_block``) also gets that TP module
   cut at every block (``RankProgram.local_blocks``: its ZeRO-3 gathers block by block);
4. for a ``"dp"`` plan: with ``Stage.recompute`` the split at every block (the engine recomputes block
   by block); at ZeRO-3 without recomputation, the gather units and the graph with their hooks
   (``autopar.lowering.zero3_units``).

Lowering does no communication and needs no process group: the engine binds the TP all-reduces and
the ZeRO-3 hooks, and makes the weights equal on every rank.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx as fx
from torch import nn

from autopar.errors import PlanError
from autopar.ir.plan import Plan, zero3_by_block
from autopar.lowering.program import RankProgram, engine_kind, rank_position
from autopar.lowering.zero3_units import insert_unit_hooks, param_units
from autopar.passes.attention_recompute import checkpoint_attention
from autopar.passes.meta import BLOCK
from autopar.passes.split import split_stages
from autopar.passes.tp import tp_rewrite
from autopar.passes.tp_sp import sp_rewrite
from autopar.passes.tp_overlap import overlap_tp_backward
from autopar.passes.tp_fwd_overlap import overlap_tp_forward

__all__ = ["lower", "num_blocks", "tp_shares_of", "tp_member_module", "forward_overlap_on"]


def num_blocks(gm) -> int:
    """The number of blocks annotated on a captured graph (0: none, or not a graph)."""
    if not isinstance(gm, fx.GraphModule):
        return 0
    return max((int(n.meta[BLOCK]) + 1 for n in gm.graph.nodes if BLOCK in n.meta), default=0)


def tp_shares_of(plan: Plan, stage: int, member: int) -> tuple[int, ...]:
    """The head shares of the ranks of ``member`` of ``stage`` (even when the plan gives none)."""
    st = plan.stages[stage]
    return tuple(int(x) for x in st.tp_shares[member]) if st.tp_shares else (1,) * len(st.groups[member])


def tp_member_module(plan: Plan, stage: int, member: int, tp_index: int, gm: fx.GraphModule,
                     granularity: int = 8, *, defer_sp_grads: bool = False,
                     keep_whole: frozenset = frozenset()) -> fx.GraphModule:
    """The TP rewrite of ``gm`` (the whole graph, or stage ``stage``'s) for TP index ``tp_index`` of
    ``member``, sequence-parallel where ``Stage.sequence_parallel`` asks and the block supports it.
    ``defer_sp_grads``: the engine sums the SP region's parameter gradients once per step
    (``runtime.tp.sum_deferred_sp_grads``; the TP engine does), else backward sums them per micro-step. ``keep_whole``:
    parameters (by name in ``gm``) that other stages hold too, which no vocabulary end may shard."""
    shares = tp_shares_of(plan, stage, member)
    local = tp_rewrite(gm, shares, tp_index, granularity=granularity, keep_whole=keep_whole)
    if not plan.stages[stage].sequence_parallel:
        return local
    return sp_rewrite(local, shares, tp_index, defer_param_grads=defer_sp_grads)


def _shared_params(stages, s: int) -> frozenset:
    """Names of stage ``s``'s parameters that another stage holds too (a GPT's embedding and head tied
    across stages): they stay whole under TP (``passes.tp_head``)."""
    others = {id(p) for t, st in enumerate(stages) if t != s for p in st.gm.parameters()}
    return frozenset(n for n, p in stages[s].gm.named_parameters() if id(p) in others)


def _fill_blocks(gm: fx.GraphModule) -> None:
    """Annotate the nodes a rewrite inserted without a block (sequence parallelism's collectives and
    lengths) with their inputs' latest block, or where they read no annotated node, their users'
    earliest: a node put between two ops of a block belongs to it."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    for n in nodes:
        if BLOCK not in n.meta:
            got = [a.meta[BLOCK] for a in n.all_input_nodes if BLOCK in a.meta]
            if got:
                n.meta[BLOCK] = max(got)
    for n in reversed(nodes):
        if BLOCK not in n.meta:
            got = [u.meta[BLOCK] for u in n.users if BLOCK in u.meta]
            n.meta[BLOCK] = min(got) if got else 0


def _block_programs(local) -> tuple:
    """A TP stage program (``passes.split.StageProgram``) cut at every block, before the overlap passes
    (each block gets them on its own: a TP pair lies inside one block); the last piece keeps the
    stage's output structure. The pieces share the stage module's parameters and f / g modules."""
    import dataclasses

    n = num_blocks(local.gm)
    if not n:
        return ()
    _fill_blocks(local.gm)
    blocks = tuple(split_stages(local.gm, [(b, b + 1) for b in range(n)]))
    if blocks[-1].out_spec is None and local.out_spec is not None:
        blocks = (*blocks[:-1], dataclasses.replace(blocks[-1], out_spec=local.out_spec))
    return blocks


def forward_overlap_on(plan: Plan, rank: int, choice: bool | None, backends: Sequence[str] | None,
                       tp_overlap: bool = True) -> bool:
    """Whether ``rank``'s TP member chunks its forward collectives (``passes.tp_fwd_overlap``):
    ``choice`` True / False (``RunConfig.overlap_forward``) as asked; None (auto) only with the
    backward overlap on and where every rank of the member has backend ``"nccl"`` (``backends``: per
    rank, ``DeviceSpec.backend``; None: unknown, off), the rule of ``autopar.cost.tp.comm_hides``."""
    if choice is not None:
        return bool(choice)
    stage, member, _ = rank_position(plan, rank)
    if not tp_overlap or backends is None or stage is None or member is None:
        return False
    ranks = plan.stages[stage].groups[member]
    return len(ranks) > 1 and all(backends[r] == "nccl" for r in ranks)


def _overlap(gm: fx.GraphModule, tp_overlap: bool, forward: bool) -> None:
    if tp_overlap or forward:
        overlap_tp_backward(gm)     # f's backward collective overlaps the weight gradients
    if forward:
        overlap_tp_forward(gm)      # f's all-gather / g's reduce-scatter chunked against the GEMMs


def lower(plan: Plan, gm: fx.GraphModule | None, rank: int, *, use_triton: bool = False,
          tp_granularity: int = 8, params: Sequence[nn.Parameter] | None = None,
          tp_overlap: bool = True, tp_overlap_forward: bool | None = None,
          backends: Sequence[str] | None = None) -> RankProgram:
    """This rank's program for ``plan`` (see the module docstring). ``gm``: the captured graph with
    block annotations (``passes.analyze``); ``tp_granularity``: MLP features per TP granule of a
    ``"tp"`` plan; ``params``: the trainable parameters ZeRO-3 units index (default: ``gm``'s);
    ``tp_overlap``: a TP rank's f collectives overlap its weight gradients (``passes.tp_overlap``);
    ``tp_overlap_forward`` / ``backends``: its SP forward collectives are chunked against the GEMMs
    (``passes.tp_fwd_overlap``; ``forward_overlap_on`` decides)."""
    forward = forward_overlap_on(plan, rank, tp_overlap_forward, backends, tp_overlap)
    if gm is not None and use_triton:
        from autopar.passes.triton_patterns import substitute_kernels

        gm = substitute_kernels(gm)
    selective = [st.recompute_attention for st in plan.stages]
    if any(selective) and gm is not None:
        if not all(selective):
            raise PlanError("Stage.recompute_attention: selective recomputation on some stages only; "
                            "the runtime recomputes the attention cores of every stage or of none")
        gm = checkpoint_attention(gm)
    kind = engine_kind(plan)
    stage, member, tp_index = rank_position(plan, rank)
    common = dict(plan=plan, rank=rank, kind=kind, gm=gm, stage=stage, member=member, tp_index=tp_index)
    if kind == "pipeline":
        import dataclasses

        stages = tuple(split_stages(gm, [(st.block_start, st.block_stop) for st in plan.stages]))
        local = stages[stage] if stage is not None else None
        blocks = ()    # one recomputing TP stage at ZeRO-3: its TP module cut at every block
        if local is not None and len(plan.stages[stage].groups[member]) > 1:
            local = dataclasses.replace(local, gm=tp_member_module(plan, stage, member, tp_index, local.gm,
                                                                   keep_whole=_shared_params(stages, stage)))
            if zero3_by_block(plan.stages, plan.zero_stage):
                blocks = _block_programs(local)
                for b in blocks:
                    _overlap(b.gm, tp_overlap, forward)
            _overlap(local.gm, tp_overlap, forward)
        chunks = ()    # interleaving on a TP member: every later chunk of this rank rewritten alike
        if local is not None and len(plan.stages[stage].groups[member]) > 1:
            chunks = tuple(_tp_chunk(plan, s, member, tp_index, stages[s], tp_overlap, forward,
                                     _shared_params(stages, s)) for s in plan.chunks_of(rank)[1:])
        return RankProgram(**common, stages=stages, local_stage=local, local_chunks=chunks, local_blocks=blocks)
    if kind == "tp":
        if gm is None:
            return RankProgram(**common)
        if member is None:
            module = tp_rewrite(gm, (1,), 0)
        else:
            module = tp_member_module(plan, 0, member, tp_index, gm, tp_granularity, defer_sp_grads=True)
            _overlap(module, tp_overlap, forward)
        return RankProgram(**common, tp_module=module)
    st = plan.stages[0]
    zero3: dict = {}
    if plan.zero_stage == 3 and isinstance(gm, fx.GraphModule):
        trainable = tuple(params) if params is not None else tuple(p for p in gm.parameters() if p.requires_grad)
        units = param_units(gm, list(trainable))
        if units is not None:
            zero3 = dict(zero3_units=units, zero3_params=trainable)
    if st.recompute:    # ZeRO-3's units gathered around each recomputed block by the engine, not in the graph
        n = num_blocks(gm)
        blocks = tuple(split_stages(gm, [(b, b + 1) for b in range(n)])) if n else ()
        return RankProgram(**common, blocks=blocks, **(zero3 if blocks else {}))
    if zero3:
        return RankProgram(**common, **zero3, zero3_gm=insert_unit_hooks(gm, zero3["zero3_units"]))
    return RankProgram(**common)


def _tp_chunk(plan: Plan, stage: int, member: int, tp_index: int, program, tp_overlap: bool, forward: bool,
              keep_whole: frozenset = frozenset()):
    """The stage program ``program`` of chunk ``stage`` rewritten for ``tp_index`` of ``member`` (as
    the rank stage's is above: TP, SP where asked, the backward and forward overlaps)."""
    import dataclasses

    gm = tp_member_module(plan, stage, member, tp_index, program.gm, keep_whole=keep_whole)
    _overlap(gm, tp_overlap, forward)
    return dataclasses.replace(program, gm=gm)
