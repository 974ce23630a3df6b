"""A rank's program: what lowering (``autopar.lowering.lower``) gives an engine to run.

Terms
- engine kind (``engine_kind``): which engine runs a plan. One stage without tensor parallelism:
  ``"dp"``; one tensor-parallel stage without recomputation: ``"tp"``; anything else (several
  stages, or one tensor-parallel stage that recomputes): ``"pipeline"``.
- position of a rank: its stage, its member (data-parallel participant) inside the stage, and its TP
  index inside the member; a rank the plan leaves out is *idle* (stage and member None). Under
  interleaving (``Plan.virtual_stages`` > 1) the stage is the rank's first chunk, its rank stage; the
  others are ``Plan.chunks_of(rank)`` (the same member index in each).
- stage program: ``passes.split.StageProgram``, the part of the captured graph one stage runs.
- TP module: a graph rewritten for one TP index (``passes.tp.tp_rewrite``). Its f / g carry no
  communication until the engine binds its group's all-reduce (``passes.tp.bind_all_reduce``), and its
  shards are cut from this rank's weights as they were at lowering: an engine that first makes the
  weights equal on every rank reloads them (``passes.tp.load_shards``).
- ZeRO-3 units: ``lowering.zero3_units.ParamUnits`` over ``zero3_params``, and the captured graph with
  the units' gather / free hooks inserted (unbound ``UnitHook``s that the data-parallel engine binds).
- local blocks: a plan of one recomputing stage of tensor-parallel members at ZeRO-3 runs on the
  pipeline engine block by block: its TP module cut at every block (``passes.split.split_stages``; the
  pieces share the module's parameters and f / g), so that each block's ZeRO-3 unit is gathered around
  it, as FSDP with activation checkpointing does (``runtime.pipeline``).

A ``RankProgram`` holds graphs, so it has no JSON form; it is built on the rank that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch.fx as fx

from autopar.ir.plan import Plan

__all__ = ["RankProgram", "EngineKind", "engine_kind", "rank_position"]

EngineKind = Literal["dp", "tp", "pipeline"]


def engine_kind(plan: Plan) -> EngineKind:
    """The engine that runs ``plan`` (see the module docstring)."""
    tp = any(len(g) > 1 for s in plan.stages for g in s.groups)
    if tp and len(plan.stages) == 1 and not plan.stages[0].recompute:
        return "tp"
    if len(plan.stages) == 1 and not tp:
        return "dp"
    return "pipeline"


def rank_position(plan: Plan, rank: int) -> tuple[int | None, int | None, int]:
    """``(stage, member, TP index)`` of ``rank`` in ``plan``; ``(None, None, 0)`` for an idle rank."""
    for s, stage in enumerate(plan.stages):
        for g, members in enumerate(stage.groups):
            if rank in members:
                return s, g, tuple(members).index(rank)
    return None, None, 0


@dataclass(frozen=True, eq=False)
class RankProgram:
    """What one rank runs for a plan. Fields an engine kind does not use stay empty."""

    plan: Plan
    rank: int
    kind: EngineKind
    gm: fx.GraphModule | None            # the whole captured graph as this rank runs it (kernels substituted)
    stage: int | None = None             # this rank's position (None: idle)
    member: int | None = None
    tp_index: int = 0
    stages: tuple[Any, ...] = ()         # "pipeline": every stage's StageProgram (the same split on every rank)
    local_stage: Any = None              # "pipeline": the StageProgram this rank runs (its TP shard on a TP member)
    local_chunks: tuple[Any, ...] = ()   # "pipeline", interleaved TP member: the TP StageProgram of each later chunk
                                         # (``Plan.chunks_of(rank)[1:]``, in that order)
    tp_module: fx.GraphModule | None = None   # "tp": this rank's TP module of ``gm``
    blocks: tuple[Any, ...] = ()         # "dp" with Stage.recompute: one StageProgram per block
    local_blocks: tuple[Any, ...] = ()   # "pipeline", one recomputing stage of TP members at ZeRO-3: this rank's
                                         # TP stage cut at every block (its ZeRO-3 goes block by block)
    zero3_units: Any = None              # "dp" at ZeRO-3: ParamUnits over ``zero3_params`` (None: no blocks)
    zero3_gm: fx.GraphModule | None = None    # ``gm`` with the units' (unbound) gather / free hooks
    zero3_params: tuple[Any, ...] = ()

    def __repr__(self) -> str:
        parts = [f"rank={self.rank}", f"kind={self.kind!r}", f"stage={self.stage}", f"member={self.member}"]
        if self.tp_index:
            parts.append(f"tp_index={self.tp_index}")
        if self.stages:
            parts.append(f"stages={len(self.stages)}")
        if self.tp_module is not None or (self.local_stage is not None and self.local_stage.gm is not
                                          self.stages[self.stage].gm):
            parts.append("tp")
        if self.blocks or self.local_blocks:
            parts.append(f"blocks={len(self.blocks or self.local_blocks)}")
        if self.zero3_units is not None:
            parts.append(f"zero3_units={self.zero3_units.num_units}")
        return f"RankProgram({', '.join(parts)})"
