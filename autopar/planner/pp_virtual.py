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
- hybrid interleaving (``interleave_hybrid``): the joint (TP + PP + DP) search's fastest 1F1B plans,
  whose members may be tensor-parallel groups, interleaved at each V (no climb: a few simulations per
  plan, at most ``HYBRID_TOP`` plans), priced by the same simulator and checked by
  ``interleaved_memory_bytes``; a variant is kept only where it fits and is predicted faster than
  every plan known. A flat plan whose busiest rank stage's compute alone (``_flat_bound``, no bubble)
  is not below the fastest step known is skipped. Two chunk splits are tried: the flat split's, and,
  where that does not fit or pay, the flat split evened over rank stages of one kind
  (``_chunk_splits``): a 1F1B split shaped by memory (fewer blocks on the early stages, which hold
  more micro-batches in flight) need not fit once interleaved, where the even one does (a
  405B-class model on 512 H100: PP 16, V = 4 at 34.2 s against 36.9 s flat, PREDICTED). Its
  chunks keep their rank stage's members, shares and SP / recompute flags, as the engine requires.
  A variant over memory turns on recompute chunk by chunk on the over-memory rank stages only
  (``_recompute_until_fits``: earliest chunk first, by the cheap bound, then the exact memory); a
  schedule-free step bound (``busiest_rank_stage_s``) drops it before any simulation where its
  busiest rank stage alone is not faster than the fastest plan. On llama-140b / hethub-768 / 1024
  (PREDICTED) every variant then fits but none pays: recomputing the first chunks costs more than
  interleaving saves (V = 2: 56.33 s against 48.62 s flat).
- interleaved memory (``interleaved_memory_bytes``): per rank, at the moment of its action list when
  its chunks' live activations peak, the sum over its chunks of ``cost.memory.stage_memory_bytes``
  for that chunk (TP shards and all) holding the micro-batches live in it then; the loss's bytes only
  on the last chunk. On llama-140b's 11 rank stages at M = 64 a rank stage's peak holds 16, 14.3 and
  13.5 stages' worth of micro-batches at V = 2, 3, 4 against 1F1B's 11 (the sum of each chunk's own
  peak, ``in_flight_micro_batches``, would say 17, 18 and 17.25).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from autopar.cost.memory import (fits_memory, loss_bytes_per_sample, stage_input_bytes, stage_memory_bytes,
                                 usable_bytes)
from autopar.cost.pipeline import PipelineContext, pipeline_memory_bytes, plan_timeline, stage_durations
from autopar.errors import PlanError
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.ir.schedule import make_schedule
from autopar.ir.timeline import Timeline


__all__ = ["VIRTUAL_COUNTS", "MAX_VIRTUAL_STAGES", "check_virtual_stages", "chunk_sizes", "chunked_stages",
           "interleaved_plans", "HYBRID_TOP", "interleaved_memory_bytes", "interleave_hybrid",
           "busiest_rank_stage_s"]

VIRTUAL_COUNTS: tuple[int, ...] = (2, 3, 4)
MAX_VIRTUAL_STAGES = 64
_CLIMB_ROUNDS = 2
_CLIMB_MAX_STAGES = 16   # larger interleaved pipelines keep the chunk split (each move is a simulation)
HYBRID_TOP = 4           # at most this many flat plans interleave_hybrid tries (by their bound)


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
        return []   # two rank stages; TP members: interleave_hybrid (pipeline_memory_bytes is per rank)
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


def _live_at_peak(stages: Sequence[Stage], V: int, weight: Sequence[float], exact: bool) -> list[int]:
    """Per stage (chunk), its micro-batches live when its rank stage's weighted live activations peak:
    ``exact``, walking the rank stage's action list (``make_schedule``, which may search for a
    deadlock-free order: seconds on large pipelines); else at the end of the warm-up Megatron's order
    gives without extra forwards (the first backward's moment: a lower bound, cheap)."""
    S = len(stages)
    R, M = S // V, len(stages[0].micro_batches[0])
    out = [0] * S
    schedule = make_schedule("interleaved-1f1b", S, M, V) if exact else None
    for p in range(R):
        if exact:
            acts = schedule.actions[p]
        else:   # the warm-up forwards and the first steady one: rounds of R micro-batches, chunks in order
            order = [v * R + p for g in range(0, M, R) for v in range(V) for _ in range(g, min(g + R, M))]
            acts = [_Fwd(c) for c in order[:min(V * M, 2 * (R - p - 1) + (V - 1) * R + 1)]]
        live, total, peak = [0] * S, 0.0, -1.0
        for a in acts:
            if a.kind == "F":
                live[a.stage] += 1
                total += weight[a.stage]
            elif a.kind in ("B", "BI"):
                live[a.stage] -= 1
                total -= weight[a.stage]
            if total > peak:
                peak = total
                for c in range(p, S, R):
                    out[c] = live[c]
    return out


@dataclasses.dataclass(frozen=True)
class _Fwd:
    stage: int
    kind: str = "F"


def interleaved_memory_bytes(costs, stages: Sequence[Stage], zero_stage: int, virtual_stages: int,
                             replicated_fraction: float | None = None, *, exact: bool = True,
                             memo: dict | None = None) -> dict[int, int]:
    """Peak bytes of every rank of an interleaved plan whose members may be tensor-parallel (see the
    module docstring): per rank stage, the moment of its action list (``make_schedule``) when its
    chunks' live activations (forwards not yet backwarded, each weighted by its chunk's activation
    bytes) peak; then per chunk ``stage_memory_bytes`` of the chunk alone holding as many micro-batches
    as were live in it then (its largest ones; at least one), less the loss's bytes on every chunk
    but the last; summed over a rank's chunks. ``exact=False``: a cheap lower bound (``_live_at_peak``).
    ``memo``: a dict the caller keeps while it prices variants of the same chunks (each chunk's bytes
    by the chunk and its live count: a round of recompute changes a few chunks, not the others')."""
    S, V = len(stages), virtual_stages
    # a recomputing chunk holds only its input per live micro-batch
    weight = [(stage_input_bytes(costs, st) if st.recompute else float(costs.act_bytes[st.block_start:st.block_stop].sum()))
              * max(max(mb) for mb in st.micro_batches) for st in stages]
    live_at_peak = _live_at_peak(stages, V, weight, exact)
    memo = {} if memo is None else memo
    loss = loss_bytes_per_sample(costs)
    out: dict[int, int] = {}
    R = S // V
    for p in range(R):      # a rank stage's chunks have its members: one vector over its ranks
        total = None
        for s in range(p, S, R):
            got = _chunk_bytes(costs, stages[s], max(1, live_at_peak[s]), zero_stage, replicated_fraction,
                               0.0 if s == S - 1 else loss, memo)
            total = got if total is None else total + got
        out.update(zip((r for g in stages[p].groups for r in g), total.tolist()))
    return dict(sorted(out.items()))


def _chunk_bytes(costs, st: Stage, n: int, zero_stage: int, rho, loss: float, memo: dict) -> np.ndarray:
    """Bytes of each rank of chunk ``st`` (in ``st.groups`` order) holding its ``n`` largest
    micro-batches per member, less ``loss`` bytes per sample of the largest (see
    ``interleaved_memory_bytes``); kept in ``memo`` with the chunk, so its id is not reused."""
    key = (id(st), n, zero_stage, rho, loss)
    hit = memo.get(key)
    if hit is not None and hit[0] is st:
        return hit[1]
    kept = tuple(tuple(sorted(mb, reverse=True)[:n]) for mb in st.micro_batches)
    # "gpipe" holds every listed micro-batch: the chunk's live count at its rank's peak
    mem = stage_memory_bytes(costs, [dataclasses.replace(st, micro_batches=kept)], "gpipe", zero_stage, rho)
    ranks = [r for g in st.groups for r in g]
    less = np.repeat([int(loss * max(k, default=0)) for k in kept], [len(g) for g in st.groups])
    got = np.maximum(np.array([mem[r] for r in ranks], dtype=np.int64) - less, 0)
    memo[key] = (st, got)
    return got


def interleave_hybrid(costs, cluster, best: Sequence[tuple[float, Plan, str]], memory_fraction: float,
                      virtual_counts: Sequence[int] = VIRTUAL_COUNTS, top: int = HYBRID_TOP, *,
                      kinds: dict | None = None, require_faster: bool = True,
                      stats: dict | None = None) -> list[tuple[float, Plan, str]]:
    """The interleaved variants (step seconds, plan, label) of flat plans among ``best`` (the joint
    search's (step seconds, plan, label), 1F1B plans of at least two stages) that fit in
    ``memory_fraction`` of every rank's memory and are predicted faster than every plan of ``best``
    (see the module docstring; ``require_faster=False``: the ``top`` fastest flat plans' variants,
    faster or not, for a pinned interleaving). The ``top`` fastest flat plans whose bubble-free bound
    (``_flat_bound``) is below the fastest step known are tried; the others cannot win.
    ``kinds``: ``stage_durations``' memo of TP groups' kinds on ``cluster``. ``stats``, when given,
    receives ``interleave_flat`` (flat plans interleaved), ``interleave_bound`` (flat plans skipped by
    their bound), ``interleave_priced`` (variants priced) and ``interleave_kept``."""
    kinds = {} if kinds is None else kinds
    out = []
    flat_plans = [x for x in sorted(best, key=lambda x: x[0])
                  if x[1].schedule in ("1f1b", "interleaved-1f1b") and x[1].virtual_stages == 1
                  and x[1].num_stages >= 2]
    fastest = min((x[0] for x in best), default=math.inf)
    tried = skipped = priced = 0
    for step0, plan, label in flat_plans:
        if tried == top:
            break
        if require_faster and _flat_bound(costs, cluster, plan, kinds) >= fastest * (1 - 1e-9):
            skipped += 1
            continue   # no interleaving of this flat plan can be the fastest
        tried += 1
        R = plan.num_stages
        for V in virtual_counts:
            if R * V > MAX_VIRTUAL_STAGES:
                continue
            got = None
            for sizes in _chunk_splits(cluster, plan.stages, V):
                priced += 1
                got = _fit_and_price(costs, cluster, plan, chunked_stages(plan.stages, sizes), V, memory_fraction,
                                     fastest if require_faster else math.inf, kinds=kinds)
                if got is not None:
                    break
            if got is None:
                continue
            probe, timeline, step = got
            fastest = min(fastest, step)
            stages, mem = probe.stages, probe.predicted.memory_bytes
            breakdown = {**plan.predicted.breakdown, "bubble_fraction": timeline.bubble_fraction,
                         "pipeline_s": timeline.step_time_s, "allreduce_s": step - timeline.step_time_s,
                         "num_stages": float(len(stages)), "virtual_stages": float(V)}
            predicted = dataclasses.replace(plan.predicted, step_time_s=step, memory_bytes=mem, breakdown=breakdown,
                                            samples_per_s=plan.global_batch_size / step if step > 0 else 0.0)
            out.append((step, dataclasses.replace(probe, predicted=predicted),
                        f"{label.rsplit(' ', 2)[0]} interleaved-1f1b V={V} chunks={list(sizes)}{_recompute_label(stages)} "
                        f"zero-{plan.zero_stage}"))
    if stats is not None:
        stats.update(interleave_flat=tried, interleave_bound=skipped, interleave_priced=priced,
                     interleave_kept=len(out))
    return out


def _flat_bound(costs, cluster, plan: Plan, kinds: dict) -> float:
    """A lower bound of any interleaving of a flat ``plan``: its busiest rank stage's forward and backward
    seconds over all its micro-batches (``stage_durations``, its recompute flags; interleaving keeps
    every block on its rank stage and only turns more recompute on)."""
    fwd, bwd = stage_durations(costs, cluster, plan.stages,
                               replicated_fraction=plan.predicted.breakdown.get("tp_replicated_fraction"),
                               kinds=kinds)[:2]
    return float((fwd + bwd).sum(axis=1).max())


def _chunk_splits(cluster, rank_stages: Sequence[Stage], V: int) -> list[tuple[int, ...]]:
    """The chunk splits tried at V chunks per rank stage: the flat split's (``chunk_sizes``), then, where
    it differs, that of the flat split evened over rank stages of one kind (the same device types,
    member shapes and shares: each kind keeps its blocks, spread as evenly as whole blocks allow, the
    extra ones on its later stages, which hold fewer micro-batches in flight). A flat split shaped by
    1F1B's memory (fewer blocks where more micro-batches are in flight) may not fit once interleaved,
    where every rank stage holds more of them, while the even split does."""
    flat = [st.num_layers for st in rank_stages]
    kinds: dict = {}
    for p, st in enumerate(rank_stages):
        key = (tuple(tuple(cluster.devices[r].spec.name for r in g) for g in st.groups),
               tuple(len(mb) for mb in st.micro_batches), st.tp_shares, st.sequence_parallel)
        kinds.setdefault(key, []).append(p)
    even = list(flat)
    for members in kinds.values():
        q, r = divmod(sum(flat[p] for p in members), len(members))
        for i, p in enumerate(members):
            even[p] = q + (1 if i >= len(members) - r else 0)
    out = []
    for sizes in (chunk_sizes(flat, V), chunk_sizes(even, V)):
        if sizes is not None and sizes not in out:
            out.append(sizes)
    return out


def _recompute_label(stages: Sequence[Stage]) -> str:
    flags = [s for s, st in enumerate(stages) if st.recompute]
    return f" recompute={flags}" if flags else ""


def _fit_and_price(costs, cluster, plan: Plan, stages: tuple[Stage, ...], V: int, memory_fraction: float,
                   step0: float, *, kinds: dict | None = None) -> tuple[Plan, Timeline, float] | None:
    """(plan, timeline, step seconds) of ``plan`` interleaved as ``stages`` (V chunks per rank stage)
    with the recompute that makes it fit, or None where it cannot fit or is not predicted faster than
    ``step0``. A variant whose busiest rank stage (``busiest_rank_stage_s``) is not below ``step0``
    before any recompute is dropped first: recompute only adds forwards, so none of its fitting
    variants is faster (on llama-140b / hethub-768 that drops 23 of 24 variants without pricing their
    memory). The lower bound's recompute is priced next: the exact memory (a schedule to build:
    seconds on large pipelines) can only turn on more chunks, which only adds forwards, so a variant
    already too slow there is dropped without it; before either simulation, one whose busiest rank
    stage's compute alone (``busiest_rank_stage_s``) is not below ``step0``, also after each round
    of recompute the fitting turns on (``_recompute_until_fits(too_slow=)``: later rounds only add)."""
    rho = plan.predicted.breakdown.get("tp_replicated_fraction")
    timed: list = [None, None]   # the last chunks timed and their stage_durations
    rows: dict = {}              # each chunk's rows (``stage_durations(rows=)``): rounds change a few chunks

    def durations_of(chunks):
        if timed[0] is None or timed[0] != chunks:
            timed[:] = [chunks, stage_durations(costs, cluster, chunks, replicated_fraction=rho, kinds=kinds,
                                                rows=rows)]
        return timed[1]

    def too_slow(chunks) -> bool:   # its busiest rank stage alone is no faster than the flat plan
        busiest = busiest_rank_stage_s(costs, cluster, chunks, V, rho, durations=durations_of(chunks))
        return busiest >= step0 * (1 - 1e-9)

    if too_slow(stages):
        return None   # too slow before any recompute, which only adds forwards: no fitting variant is faster
    priced = None
    memo: dict = {}    # each chunk's bytes by its live count, across the rounds of both passes
    for exact in (False, True):
        fitted = _recompute_until_fits(costs, cluster, stages, plan.zero_stage, V, rho, memory_fraction, exact,
                                       too_slow, memo)
        if fitted is None:
            return None
        stages, mem = fitted
        probe = dataclasses.replace(plan, schedule="interleaved-1f1b", stages=stages, virtual_stages=V,
                                    predicted=dataclasses.replace(plan.predicted, memory_bytes=mem))
        durations = durations_of(stages)
        if too_slow(stages):
            return None   # its busiest rank stage alone takes longer than the flat plan's step
        if priced is None or priced[0].stages != stages:
            priced = (probe, *plan_timeline(probe, costs, cluster, durations=durations))
        if priced[2] >= step0 * (1 - 1e-9):
            return None
    return probe, priced[1], priced[2]


def busiest_rank_stage_s(costs, cluster, stages: Sequence[Stage], V: int, rho=None, *, durations=None) -> float:
    """A lower bound of an interleaved plan's step that needs no schedule: over rank stages p, the
    forward and backward seconds of all of p's chunks and micro-batches (``stage_durations``, a
    recompute chunk's rerun forwards included; a rank runs its actions one at a time), plus the
    fastest forward and backward of every virtual stage before p (p's first action is its chunk 0's
    forward, which waits for virtual stages 0..p-1; its last is chunk 0's backward, which virtual
    stages p-1..0 follow)."""
    fwd, bwd = (durations if durations is not None else
                stage_durations(costs, cluster, stages, replicated_fraction=rho))[:2]
    per_stage, edge = (fwd + bwd).sum(axis=1), fwd.min(axis=1) + bwd.min(axis=1)
    R = len(stages) // V
    return float(max(per_stage[p::R].sum() + edge[:p].sum() for p in range(R)))


def _recompute_until_fits(costs, cluster, stages: tuple[Stage, ...], zero_stage: int, V: int, rho,
                          memory_fraction: float, exact: bool,
                          too_slow=None, memo: dict | None = None) -> tuple[tuple[Stage, ...], dict[int, int]] | None:
    """(chunks, memory) of an interleaved variant that fits by ``interleaved_memory_bytes(exact=exact)``,
    or None: as given, else recompute turned on one chunk at a time on every rank stage holding a rank
    over its usable memory (its earliest chunk not yet recomputing: the one with the most
    micro-batches in flight), re-checked after each round, until it fits or an over-memory rank stage
    has no chunk left to turn on. ``too_slow(chunks)``, when given, is asked after each round that
    turned recompute on: True ends the search with None before the memory is priced again (for a
    caller that drops any variant at least that slow: later rounds only turn more chunks on)."""
    R = len(stages) // V
    first = True
    while True:
        if not first and too_slow is not None and too_slow(stages):
            return None
        first = False
        mem = interleaved_memory_bytes(costs, stages, zero_stage, V, rho, exact=exact, memo=memo)
        if fits_memory(cluster, mem, memory_fraction):
            return stages, mem
        over = {r for r, v in mem.items() if v > usable_bytes(cluster.devices[r].spec, memory_fraction)}
        turn = set()
        for p in range(R):
            if any(r in over for g in stages[p].groups for r in g):
                left = [s for s in range(p, len(stages), R) if not stages[s].recompute]
                if not left:
                    return None   # this rank stage recomputes every chunk and is still over
                turn.add(left[0])
        stages = tuple(dataclasses.replace(st, recompute=True) if s in turn else st for s, st in enumerate(stages))
