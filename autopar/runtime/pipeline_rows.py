"""Rows of a pipeline plan: which global-batch rows each member of each stage owns per micro-batch,
and the transfers between neighbouring stages that follow from them.

Terms (as in ``autopar.runtime.pipeline``)
- rows: micro-batch ``m`` is the contiguous run of global-batch rows after micro-batches ``0..m-1``;
  inside it, member ``g`` of a stage owns ``stage.micro_batches[g][m]`` rows, in member order
  (``row_layout``). Every stage must cut the same micro-batch totals.
- transfer: the rows of micro-batch m that member g of stage s sends to member h of stage s+1: the
  overlap of their rows (``transfers``). A receiver gets an unbatched value whole from its *primary*
  sender, the sender holding its first row (``primary_sender``).

Pure functions of the plan: no process group, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import PlanError
from autopar.ir.plan import Plan

__all__ = ["Transfer", "row_layout", "transfers", "primary_sender", "check_pipeline_plan"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """Rows ``[start, stop)`` of one micro-batch that member ``sender`` of a stage sends to member
    ``receiver`` of the next stage."""

    sender: int
    receiver: int
    start: int
    stop: int


def row_layout(plan: Plan) -> list[list[list[tuple[int, int]]]]:
    """``[stage][member][micro] -> (start, stop)`` global-batch rows; raises ``PlanError`` when the
    stages disagree on the micro-batch sizes or they do not add up to the global batch."""
    M = plan.num_micro_batches
    totals = None
    for s, stage in enumerate(plan.stages):
        sizes = [sum(mb[m] if m < len(mb) else 0 for mb in stage.micro_batches) for m in range(M)]
        if totals is None:
            totals = sizes
        elif sizes != totals:
            raise PlanError(f"plan.stages[{s}].micro_batches: micro-batch sizes {sizes} differ from stage "
                            f"0's {totals}; every stage must cut the same micro-batches")
    if sum(totals) != plan.global_batch_size:
        raise PlanError(f"plan: micro-batches add up to {sum(totals)} samples but global_batch_size is "
                        f"{plan.global_batch_size}")
    starts = [sum(totals[:m]) for m in range(M)]
    out = []
    for stage in plan.stages:
        rows = [[None] * M for _ in stage.groups]
        for m in range(M):
            at = starts[m]
            for g, mb in enumerate(stage.micro_batches):
                n = mb[m] if m < len(mb) else 0
                rows[g][m] = (at, at + n)
                at += n
        out.append(rows)
    return out


def transfers(layout, stage: int, micro: int) -> list[Transfer]:
    """The transfers of micro-batch ``micro`` from stage ``stage`` to ``stage + 1``, in (sender,
    receiver) order; empty overlaps are left out."""
    out = []
    for g, rows_g in enumerate(layout[stage]):
        a, b = rows_g[micro]
        for h, rows_h in enumerate(layout[stage + 1]):
            c, d = rows_h[micro]
            lo, hi = max(a, c), min(b, d)
            if lo < hi:
                out.append(Transfer(g, h, lo, hi))
    return out


def primary_sender(layout, stage: int, micro: int, receiver: int) -> int | None:
    """The member of ``stage`` that holds the first row of ``receiver`` (of stage + 1) in ``micro``."""
    c, d = layout[stage + 1][receiver][micro]
    if c >= d:
        return None
    for g, rows_g in enumerate(layout[stage]):
        a, b = rows_g[micro]
        if a <= c < b:
            return g
    return None


def check_pipeline_plan(plan: Plan, world_size: int) -> None:
    """Raise ``PlanError`` unless every member of ``plan`` has ranks, its shares fit it, and no rank is
    used twice (chunks of one rank stage aside: ``Plan.virtual_stages``) or lies outside
    ``[0, world_size)``."""
    for s, stage in enumerate(plan.stages):
        if stage.tp_shares and (len(stage.tp_shares) != len(stage.groups) or any(
                len(sh) != len(m) or any(x < 0 for x in sh) or sum(sh) <= 0
                for sh, m in zip(stage.tp_shares, stage.groups))):
            raise PlanError(f"plan.stages[{s}].tp_shares={stage.tp_shares}: need one non-negative share per "
                            f"rank of each member {stage.groups}, with a positive sum per member")
        if any(not m for m in stage.groups):
            raise PlanError(f"plan.stages[{s}].groups={stage.groups}: a member needs at least one rank")
    if plan.virtual_stages > 1 and plan.rank_stages < 2:
        raise PlanError(f"plan.virtual_stages: {plan.virtual_stages} chunks on one rank stage; interleaving "
                        f"needs at least two rank stages")
    ranks = [r for st in plan.stages[:plan.rank_stages] for r in st.ranks]   # chunks repeat their ranks
    if len(set(ranks)) != len(ranks):
        raise PlanError(f"plan: a rank appears in more than one stage member ({ranks})")
    if any(not 0 <= r < world_size for r in ranks):
        raise PlanError(f"plan: ranks {sorted(ranks)} must be within [0, {world_size})")
