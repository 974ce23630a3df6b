"""Interleaved pipelines in the pipeline planner's search (``autopar.planner.pp``): from a flat plan's
rank stages, the plans with V virtual stages (model chunks) per rank stage, scored by the same
prediction (``autopar.cost.pipeline.plan_timeline``) and memory (``pipeline_memory_bytes``).

Terms
- rank stages: the stages of a flat (one chunk per stage) candidate: members, micro-batch shares and
  block count each; the members' shares were cut by their speed on the whole of their blocks.
- chunk split: rank stage p's blocks spread over its V chunks as evenly as whole blocks allow (the
  extra blocks to its first chunks), in model order chunk v of every rank stage before chunk v + 1:
  a rank stage that held more blocks (a faster device) holds larger chunks, so the chunk sizes
  differ by device as the flat split did. Then boundaries move one block at a time while the
  prediction improves (``_CLIMB_ROUNDS`` rounds, up to ``_CLIMB_MAX_STAGES`` virtual stages).
- where interleaving pays: a pipeline whose bubble matters (few micro-batches per stage) and whose
  transfers are cheap next to compute, since every micro-batch crosses V times as many boundaries.
  Searched for V in ``VIRTUAL_COUNTS`` while every rank stage has at least V blocks and the pipeline
  has at most ``MAX_VIRTUAL_STAGES`` stages (each prediction simulates V times as many actions).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from autopar.cost.pipeline import PipelineContext, pipeline_memory_bytes, plan_timeline
from autopar.errors import PlanError
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.ir.schedule import Timeline


__all__ = ["VIRTUAL_COUNTS", "MAX_VIRTUAL_STAGES", "check_virtual_stages", "chunk_sizes", "chunked_stages",
           "interleaved_plans"]

VIRTUAL_COUNTS: tuple[int, ...] = (2, 3, 4)
MAX_VIRTUAL_STAGES = 64
_CLIMB_ROUNDS = 2
_CLIMB_MAX_STAGES = 16   # larger interleaved pipelines keep the chunk split (each move is a simulation)


def check_virtual_stages(virtual_stages, schedule: str) -> None:
    """``PlanError`` unless ``virtual_stages`` is None or an integer >= 1, and > 1 only with schedule
    "interleaved-1f1b" or "auto"."""
    if virtual_stages is None:
        return
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1 or (
            virtual_stages > 1 and schedule not in ("auto", "interleaved-1f1b")):
        raise PlanError(f"virtual_stages: {virtual_stages!r}, need None or an integer >= 1 (> 1 only with "
                        f"schedule 'interleaved-1f1b' or 'auto', not {schedule!r})")


def chunk_sizes(sizes: Sequence[int], virtual_stages: int) -> tuple[int, ...] | None:
    """Blocks per virtual stage (``v * R + p`` for chunk v of rank stage p) of a flat split ``sizes``
    (see the module docstring; a rank stage with fewer blocks than chunks first takes blocks from the
    largest); None when the model has fewer blocks than virtual stages."""
    V, R = virtual_stages, len(sizes)
    sizes = list(sizes)
    if sum(sizes) < R * V:
        return None
    while min(sizes) < V:   # a rank stage short of blocks takes one from the largest
        sizes[sizes.index(max(sizes))] -= 1
        sizes[sizes.index(min(sizes))] += 1
    out = [0] * (R * V)
    for p, k in enumerate(sizes):
        q, r = divmod(k, V)
        for v in range(V):
            out[v * R + p] = q + (1 if v < r else 0)
    return tuple(out)


def chunked_stages(rank_stages: Sequence[Stage], sizes: Sequence[int]) -> tuple[Stage, ...]:
    """The virtual stages of ``rank_stages`` with ``sizes`` blocks each (chunk s on rank stage s % R,
    with its members, shares and recompute flag)."""
    R, out, start = len(rank_stages), [], 0
    for s, k in enumerate(sizes):
        out.append(dataclasses.replace(rank_stages[s % R], block_start=start, block_stop=start + k))
        start += k
    return tuple(out)


def _score(ctx: PipelineContext, rank_stages, sizes, V, seen: dict):
    key = (tuple(sizes), V)
    if key not in seen:
        stages = chunked_stages(rank_stages, sizes)
        mem = pipeline_memory_bytes(ctx.costs, stages, "interleaved-1f1b", ctx.zero_stage, V)
        if any(v > ctx.cap_bytes(r) for r, v in mem.items()):
            seen[key] = None
        else:
            probe = Plan(strategy="pp", global_batch_size=ctx.global_batch, zero_stage=ctx.zero_stage,
                         schedule="interleaved-1f1b", stages=stages, virtual_stages=V,
                         predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes=mem))
            timeline, step = plan_timeline(probe, ctx.costs, ctx.cluster)
            seen[key] = (step, stages, V, timeline, mem)
    return seen[key]


def interleaved_plans(ctx: PipelineContext, rank_stages: Sequence[Stage],
                      virtual_counts: Sequence[int] = VIRTUAL_COUNTS
                      ) -> list[tuple[float, tuple[Stage, ...], int, Timeline, dict]]:
    """(step seconds, virtual stages, V, timeline, memory) of the interleaved plans of one flat
    candidate's ``rank_stages`` that fit, one per V: the chunk split, then one-block moves while the
    prediction improves (see the module docstring)."""
    R = len(rank_stages)
    flat = [st.num_layers for st in rank_stages]
    if R < 2 or any(len(g) > 1 for st in rank_stages for g in st.groups):
        return []   # interleaving needs two rank stages; the engine runs chunks on one-rank members
    out = []
    for V in virtual_counts:
        sizes = chunk_sizes(flat, V)
        if sizes is None or R * V > MAX_VIRTUAL_STAGES:
            continue
        seen: dict = {}
        best = _score(ctx, rank_stages, sizes, V, seen)
        for _ in range(_CLIMB_ROUNDS if best is not None and R * V <= _CLIMB_MAX_STAGES else 0):
            improved = False
            for i in range(len(sizes) - 1):
                for d in (-1, 1):
                    moved = list(best[1][j].num_layers for j in range(len(sizes)))
                    moved[i] += d
                    moved[i + 1] -= d
                    if min(moved) < 1:
                        continue
                    got = _score(ctx, rank_stages, moved, V, seen)
                    if got is not None and got[0] < best[0] * (1 - 1e-9):
                        best, improved = got, True
            if not improved:
                break
        if best is not None:
            out.append(best)
    return out
