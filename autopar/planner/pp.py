"""Heterogeneous pipeline planning (HETHUB-style): stage device groupings, an uneven block split by
dynamic programming, a micro-batch count search, and a final prediction from the schedule simulator.
This module searches; ``autopar.cost.pipeline`` prices a grouping (its stage cost tensor) and a built
plan (stage durations, the simulated prediction), ``autopar.cost.memory`` its memory; the names the
tests and callers know are re-exported here. Upper and compute bounds are ``autopar.planner.bounds``'.

Terms
- grouping: an ordered list of pipeline stages, each a tuple of *members* (data-parallel participants
  of the stage; a member is a tuple of ranks, a 1-tuple without tensor parallelism). See
  ``stage_groupings``.
- split: the number of consecutive blocks each stage holds (``sizes``, summing to ``num_blocks``).
- micro-batch sizes: ``M`` micro-batches of ``global_batch // M`` or one more sample (the larger ones
  first). A member's share of each micro-batch is proportional to its speed on its stage's blocks.
- stage time ``t_s``: forward + backward seconds of stage s on one (largest) micro-batch: its slowest
  member (two compute calls, each with ``ModelCosts.call_overhead``), plus the p2p send of its output to the next stage (split over min(k, l) parallel links
  between stages of k and l members).
- classic estimate: ``sum_s t_s + (M - 1) * max_s t_s``; the split DP minimises it (``split_blocks``).
  It is no bound of the simulated prediction (it prices a stage's forward and backward as one unit),
  so the search does not stop at its split: a stage count with few splits has every split evaluated
  as a pinned split would be, so that the chosen split is the best the prediction knows; larger ones
  move the best plan's boundaries block by block while the prediction improves (``_best_split``).
- stage memory: weights + gradients + optimizer state of its blocks (sharded over its members under
  ZeRO) + activations of the micro-batches in flight: GPipe holds all M, 1F1B holds ``min(M, S - s)``
  on stage s. It must fit in ``memory_fraction`` of each member's device memory.
- activation recomputation (``Stage.recompute``; ``plan_pipeline(recompute=True)``): the stage keeps
  per micro-batch in flight only its input (``stage_input_bytes``) plus, at its peak, one micro-batch's
  full activations, and its backward reruns the forward (backward + forward seconds, one more call).
  The split DP offers it exactly where keeping every activation does not fit
  (``autopar.cost.pipeline.pipeline_cost_tensor``).
- prediction: ``plan_timeline`` (``autopar.cost.pipeline``) of each shortlisted candidate: the simulated
  schedule, then gradient all-reduces, optimizer steps and ZeRO gathers. Its breakdown's
  ``allreduce_s`` is everything after the schedule (all-reduces and optimizer).
- schedules: "auto" predicts every shortlisted split under each flat schedule it is given (GPipe,
  1F1B, ZB-H1), and with "interleaved-1f1b" among them the best few flat candidates
  (``_INTERLEAVE_TOP``) again interleaved with 2-4 virtual stages per rank stage
  (``autopar.planner.pp_virtual``); the fastest that fits wins (near-ties to 1F1B).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from autopar.config import MEMORY_FRACTION, PlanConfig, ScheduleChoice
from autopar.cost.memory import check_zero_stage, stage_memory_bytes
from autopar.cost.pipeline import (  # the cost model's public names stay importable from here (``__all__``)
    PipelineContext, pipeline_cost_tensor, pipeline_split_feasible, plan_timeline, stage_durations, stage_input_bytes,
    stage_optimizer_s,
)
from autopar.cost.stage import micro_sizes
from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.ir.schedule import ALL_SCHEDULES, PIPELINE_SCHEDULES
from autopar.ir.timeline import Timeline
from autopar.planner.pp_virtual import VIRTUAL_COUNTS, check_virtual_stages, interleaved_plans
from autopar.planner.split import min_bottleneck, split_blocks, split_objective  # re-exported (``__all__``)

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = [
    "StageGrouping", "stage_groupings", "micro_sizes", "micro_candidates", "member_shares",
    "split_objective", "split_blocks", "min_bottleneck", "plan_pipeline", "plan_timeline", "stage_durations",
    "save_plan_timeline", "stage_optimizer_s", "stage_input_bytes", "PipelineContext", "pipeline_cost_tensor",
]
_GiB = float(1 << 30)
_TOP_K = 6            # candidates (by classic estimate) that the simulator ranks
_TIE = 1e-3           # relative step-time difference below which plans count as equally fast
_ESTIMATE_SLACK = 1.1  # a shortlisted estimate this much above the best simulated step is not simulated
_EXHAUSTIVE_SPLITS = 24  # a stage count with at most this many splits has every split simulated
_CLIMB_MAX_STAGES = 8  # ... for pipelines of at most this many stages (each move is one simulation)
_CLIMB_ROUNDS = 2     # rounds of one-block boundary moves elsewhere
_CLIMB_SLACK = 1.03   # ... simulated where their estimate is at most this much above the start's
_INTERLEAVE_TOP = 3   # the fastest flat candidates that "auto" also tries interleaved


# -- groupings ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StageGrouping:
    """Which devices form each pipeline stage: ``stages[s]`` = members of stage s, a member = ranks."""

    name: str
    stages: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def max_members(self) -> int:
        """The most members of any stage (what ``micro_candidates`` needs)."""
        return max((len(st) for st in self.stages), default=0)

    def __repr__(self) -> str:
        return f"StageGrouping({self.name!r}, {[tuple(r for m in st for r in m) for st in self.stages]})"


def stage_groupings(cluster: "Cluster", ranks: Sequence[int] | None = None) -> list[StageGrouping]:
    """Candidate stage device groupings, in this order, duplicates removed: every device its own stage
    (rank order); every node one stage (its devices data-parallel members); every device type one
    stage (``cluster.device_types()`` order)."""
    ranks = tuple(range(len(cluster.devices))) if ranks is None else tuple(ranks)
    chosen = set(ranks)
    out: list[StageGrouping] = []

    def add(name, stages):
        stages = tuple(st for st in stages if st)
        if stages and all(g.stages != stages for g in out):
            out.append(StageGrouping(name, stages))

    add("per-device", [((r,),) for r in ranks])
    nodes: dict[int, list[int]] = {}
    for r in ranks:
        nodes.setdefault(cluster.devices[r].node, []).append(r)
    add("per-node", [tuple((r,) for r in rs) for rs in nodes.values()])
    add("per-type", [tuple((r,) for r in rs if r in chosen) for rs in cluster.device_types().values()])
    return out


def _chunk_grouping(ranks: Sequence[int], num_stages: int) -> StageGrouping:
    """``ranks`` in order cut into ``num_stages`` runs of near-equal length (members of one stage)."""
    q, r = divmod(len(ranks), num_stages)
    stages, i = [], 0
    for s in range(num_stages):
        k = q + (1 if s < r else 0)
        stages.append(tuple((x,) for x in ranks[i:i + k]))
        i += k
    return StageGrouping(f"{num_stages}-chunks", tuple(stages))


# -- small pure helpers ------------------------------------------------------------------------------

def micro_candidates(batch: int, num_stages: int, max_members: int = 0) -> tuple[int, ...]:
    """Micro-batch counts to try: 1..16, then a geometric ladder, S multiples and divisors of the batch
    up to max(4S, 64, batch / max_members); never more than the batch. ``max_members``: the most
    members (data-parallel replicas) of any stage; with few members per stage a large batch needs
    many micro-batches of a sample or so per member to hold its activations (a pipeline of single
    devices on a batch of 1024 may need all 1024); 0 leaves that term out."""
    hi = min(batch, max(4 * num_stages, 64, -(-batch // max_members) if max_members > 0 else 0))
    cands = set(range(1, min(hi, 16) + 1))
    x = 16.0
    while x < hi:
        cands.add(int(round(x)))
        x *= 1.25
    cands.update(k * num_stages for k in (1, 2, 3, 4))
    cands.update(d for d in range(1, hi + 1) if batch % d == 0)
    cands.add(hi)
    return tuple(sorted(c for c in cands if 1 <= c <= hi))


def member_shares(samples: int, speeds: Sequence[float], rotate: int = 0) -> tuple[int, ...]:
    """Split ``samples`` in proportion to ``speeds`` (largest remainder; sums exactly). Equal remainders
    go first to member ``rotate``, then the following ones (cyclically), so that successive
    micro-batches can spread the extra samples over equally fast members."""
    w = np.asarray(speeds, dtype=np.float64)
    if samples == 0:
        return (0,) * len(w)
    exact = samples * w / w.sum()
    base = np.floor(exact).astype(int)
    rest = samples - int(base.sum())
    frac = exact - base
    order = sorted(range(len(w)), key=lambda g: (-frac[g], (g - rotate) % len(w)))
    base[order[:rest]] += 1
    return tuple(int(x) for x in base)


# -- stages of a candidate ---------------------------------------------------------------------------

def _build_stages(ctx: PipelineContext, grouping: StageGrouping, sizes: Sequence[int], num_micro: int,
                  recompute: Sequence[bool] = ()) -> tuple[Stage, ...]:
    c = ctx.costs
    micro = micro_sizes(ctx.global_batch, num_micro)
    stages, start = [], 0
    recompute = tuple(recompute) or (False,) * len(sizes)
    for members, k, rc in zip(grouping.stages, sizes, recompute):
        blocks = slice(start, start + k)
        ref = max(micro[0] / len(members), 1.0)
        speeds = [1.0 / max(c.step_time(ctx.type_of(m[0]), ref, blocks), 1e-30) for m in members]
        per_micro, rotate = [], 0
        for b in micro:
            per_micro.append(member_shares(b, speeds, rotate))
            rotate += b
        stages.append(Stage(block_start=start, block_stop=start + k, groups=tuple(members),
                            micro_batches=tuple(tuple(pm[g] for pm in per_micro) for g in range(len(members))),
                            recompute=bool(rc)))
        start += k
    return tuple(stages)


# -- the planner ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Candidate:
    estimate_s: float
    grouping: StageGrouping
    sizes: tuple[int, ...]
    num_micro: int
    recompute: tuple[bool, ...] = ()


@dataclass(frozen=True, slots=True)
class _Scored:
    step_time_s: float
    candidate: _Candidate
    schedule: str
    stages: tuple[Stage, ...]
    timeline: Timeline
    memory_bytes: dict
    virtual_stages: int = 1


def _check_args(costs, cluster, global_batch, schedule, pp_layers, num_micro, zero_stage,
                memory_fraction, ranks) -> tuple[int, ...]:
    if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
        raise PlanError(f"global_batch: {global_batch!r}, need an integer >= 1")
    PlanConfig(schedule=schedule, memory_fraction=memory_fraction)   # the choices' one check
    check_zero_stage(zero_stage)
    if zero_stage >= 2:
        raise PlanError(f"zero_stage: {zero_stage} shards gradients, which a pipeline stage would then reduce "
                        f"after every micro-batch; pipelines take ZeRO 0 or 1 (data parallelism, strategy "
                        f"'dp', takes 2 and 3)")
    if num_micro is not None and not (isinstance(num_micro, (int, np.integer)) and 1 <= num_micro <= global_batch):
        raise PlanError(f"num_micro: {num_micro!r}, need an integer in 1..global_batch ({global_batch})")
    ranks = tuple(range(len(cluster.devices))) if ranks is None else tuple(int(r) for r in ranks)
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < len(cluster.devices) for r in ranks):
        raise PlanError(f"ranks: {ranks!r}, need distinct ranks of the cluster (0..{len(cluster.devices) - 1})")
    missing = sorted({cluster.devices[r].spec.name for r in ranks} - set(costs.fwd_table))
    if missing:
        raise PlanError(f"costs: no time table for device type(s) {missing} (tables for {list(costs.fwd_table)})")
    n = costs.num_blocks
    if pp_layers is not None:
        layers = list(pp_layers)
        bad = [x for x in layers if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1]
        if not layers or bad:
            raise PlanError(f"pp_layers: {layers!r}, every entry must be a positive integer")
        if sum(layers) != n:
            raise PlanError(f"pp_layers: {layers} covers {sum(layers)} blocks, the model has {n}")
        if len(layers) > len(ranks):
            raise PlanError(f"pp_layers: {len(layers)} stages need at least {len(layers)} devices, "
                            f"{len(ranks)} given")
    return ranks


def _no_fit_error(ctx: PipelineContext, ranks: Sequence[int], tried: int) -> PlanError:
    c = ctx.costs
    state = c.state_bytes(slice(None), ctx.zero_stage)
    act = float(c.act_bytes.sum())
    avail = {}
    for r in ranks:
        t = ctx.type_of(r)
        cnt, cap = avail.get(t, (0, ctx.cap_bytes(r)))
        avail[t] = (cnt + 1, cap)
    have = ", ".join(f"{t}: {k} x {cap / _GiB:.3g} GiB" for t, (k, cap) in avail.items())
    return PlanError(
        f"no pipeline plan fits in memory ({tried} stage layouts x micro-batch counts tried): the model "
        f"needs {state / _GiB:.3g} GiB of weights+gradients+optimizer state (ZeRO-{ctx.zero_stage} within "
        f"a stage) plus {act / _GiB:.3g} GiB of activations per sample in flight; available per device "
        f"({ctx.memory_fraction:.0%} of memory): {have}")


def plan_pipeline(costs: ModelCosts, cluster: "Cluster", global_batch: int, *, schedule: ScheduleChoice = "auto",
                  pp_layers: Sequence[int] | None = None, num_micro: int | None = None, zero_stage: int = 0,
                  uniform: bool = False, memory_fraction: float = MEMORY_FRACTION,
                  ranks: Sequence[int] | None = None, recompute: bool = False,
                  virtual_stages: int | None = None, schedules: Sequence[str] | None = None) -> Plan:
    """The fastest heterogeneous pipeline plan (see the module docstring), or with ``uniform=True`` the
    Megatron-style baseline (equal blocks per stage, one device per stage in rank order).

    ``pp_layers`` pins blocks per stage; ``num_micro`` pins the micro-batch count; ``ranks`` restricts
    the devices; ``recompute``: whether a stage whose in-flight activations do not fit may recompute
    them (``pipeline_cost_tensor``; never for the uniform baseline). ``schedules``: what schedule
    "auto" chooses among (None: GPipe and 1F1B, ``PIPELINE_SCHEDULES``; the strategy search passes
    ``ALL_SCHEDULES``); ``virtual_stages``: chunks per rank stage of "interleaved-1f1b" (None: 2-4
    searched). Upper bound, compute bound and
    efficiency are left at 0: ``autopar.planner.bounds.with_all_bounds`` sets them.
    Raises ``PlanError`` on bad arguments or when nothing fits."""
    ranks = _check_args(costs, cluster, global_batch, schedule, pp_layers, num_micro, zero_stage,
                        memory_fraction, ranks)
    check_virtual_stages(virtual_stages, schedule)
    ctx = PipelineContext(costs, cluster, int(global_batch), zero_stage, memory_fraction)
    n = costs.num_blocks
    pinned = tuple(int(x) for x in pp_layers) if pp_layers is not None else None

    groupings, pinned = _groupings(cluster, ranks, n, pinned, uniform)
    dp_schedule = "1f1b" if schedule == "auto" else schedule
    # The uniform (Megatron-style) baseline keeps every activation, as it did.
    tensors, tried = _cost_tensors(ctx, groupings, num_micro, dp_schedule, recompute and not uniform)
    chosen = tuple(PIPELINE_SCHEDULES if schedules is None else schedules) if schedule == "auto" else (schedule,)
    bad = [x for x in chosen if x not in ALL_SCHEDULES]
    if bad or not chosen:
        raise PlanError(f"schedules: {list(chosen)!r}, need some of {list(ALL_SCHEDULES)}")
    names = tuple(x for x in chosen if x != "interleaved-1f1b") or ("1f1b",)
    sims: dict = {}
    if pinned is not None:
        scored = _score(ctx, _shortlist(_split_candidates(tensors, pinned)), names, sims, prune=True)
    else:
        candidates = []
        for grouping, M, cost, rc in tensors:
            found = split_blocks(cost, M)
            if found is not None:
                candidates.append(_candidate(grouping, M, cost, rc, found[0], found[1]))
        scored = _score(ctx, _shortlist(candidates), names, sims, prune=True)
        scored = _best_split(ctx, tensors, names, sims, scored, n)
        scored = list({(x.candidate.grouping.stages, x.candidate.sizes, x.candidate.num_micro, x.schedule): x
                       for x in scored}.values())
    # Interleaving re-cuts the blocks into chunks: not where pp_layers pins the split, unless asked.
    interleave = "interleaved-1f1b" in chosen and (schedule != "auto" or pinned is None)
    if interleave and not uniform and virtual_stages != 1:
        scored = _interleave(ctx, scored, "interleaved-1f1b" if chosen == ("interleaved-1f1b",) else "auto",
                             virtual_stages)
    elif schedule == "interleaved-1f1b":   # one chunk per rank stage: 1F1B's lists
        scored = [dataclasses.replace(x, schedule="interleaved-1f1b") for x in scored]
    if not scored:
        raise _no_fit_error(ctx, ranks, tried)
    # Near-ties with the fastest (within _TIE) go to 1F1B, which holds less activation memory.
    fastest = min(x.step_time_s for x in scored)
    scored.sort(key=lambda x: (x.step_time_s > fastest * (1 + _TIE), x.schedule != "1f1b", x.step_time_s))
    best = scored[0]

    notes = [f"chosen: {_describe(best)}"]
    idle = [r for r in ranks if r not in {x for st in best.stages for x in st.ranks}]
    if idle:
        notes.append(f"unused ranks (more devices than blocks): {idle}")
    notes += [f"runner-up: {_describe(x)}" for x in scored[1:6]]
    return _make_plan(ctx, "uniform-pp" if uniform else "pp", best.schedule, best.stages, best.step_time_s,
                      _breakdown(ctx, best, zero_stage), best.memory_bytes, tuple(notes), best.virtual_stages)


def _breakdown(ctx: PipelineContext, best: _Scored, zero_stage: int) -> dict:
    """The predicted step's parts of the chosen pipeline plan (``Predicted.breakdown``)."""
    return {
        "bubble_fraction": best.timeline.bubble_fraction,
        "pipeline_s": best.timeline.step_time_s,
        "allreduce_s": best.step_time_s - best.timeline.step_time_s,   # everything after the schedule
        "optimizer_s": max(stage_optimizer_s(ctx.costs, ctx.cluster, st, zero_stage) for st in best.stages),
        "estimate_s": best.candidate.estimate_s,
        "num_micro": float(best.candidate.num_micro),
        "num_stages": float(len(best.stages)),
        "virtual_stages": float(best.virtual_stages),
        "max_busy_s": max(best.timeline.busy_s),
    }


def _groupings(cluster, ranks, n: int, pinned, uniform: bool) -> tuple[list[StageGrouping], tuple | None]:
    """(the stage groupings to try, the pinned blocks per stage): the uniform baseline's one (equal
    blocks, one device per stage in rank order), else every grouping of at least two stages that has
    no more stages than blocks (one stage only where nothing else applies), of the pinned depth."""
    if uniform:
        k = len(pinned) if pinned else min(len(ranks), n)
        if pinned is None:
            q, rem = divmod(n, k)
            pinned = tuple(q + (1 if s < rem else 0) for s in range(k))
        return [StageGrouping("uniform", tuple(((r,),) for r in ranks[:k]))], pinned
    groupings = [g for g in stage_groupings(cluster, ranks) if g.num_stages <= n]
    # The pipeline strategy pipelines: a one-stage grouping is data parallelism (strategy "dp"),
    # kept only when nothing else applies (one rank, one block).
    groupings = [g for g in groupings if g.num_stages >= 2] or groupings
    if pinned is not None:
        groupings = [g for g in groupings if g.num_stages == len(pinned)] or [_chunk_grouping(ranks, len(pinned))]
    return groupings, pinned


def _cost_tensors(ctx: PipelineContext, groupings, num_micro, dp_schedule: str, rc_ok: bool) -> tuple[list, int]:
    """((grouping, M, cost tensor, recompute flags) of every (grouping, micro-batch count) with a split
    that fits, how many pairs were tried)."""
    tensors = []
    tried = 0
    for grouping in groupings:
        S = grouping.num_stages
        counts = ((num_micro,) if num_micro is not None else
                  micro_candidates(ctx.global_batch, S, grouping.max_members))
        one_type = all(len({ctx.type_of(m[0]) for m in st}) == 1 for st in grouping.stages)
        fits = {M: pipeline_split_feasible(ctx, grouping.stages, M, dp_schedule, recompute=rc_ok)
                for M in counts[-1:] if dp_schedule == "1f1b" and M >= S and one_type}
        # From M = S on, 1F1B keeps S - s micro-batches in flight on stage s, and on a stage of one
        # device type each member's part of one, ceil(b / members), only shrinks as M grows: an entry
        # that fits at some count fits at every larger one. Where no split fits at the largest, none
        # fits at any count >= S, and those tensors are not built (they would add no candidate).
        full = all(fits.values())
        for M in counts:
            tried += 1
            if not full and M >= S:
                continue
            # a tensor with no split whose every stage is finite adds no candidate, pinned or not
            ok = fits.get(M)
            if not (ok if ok is not None else pipeline_split_feasible(ctx, grouping.stages, M, dp_schedule,
                                                                      recompute=rc_ok)):
                continue
            cost, rc = pipeline_cost_tensor(ctx, grouping.stages, M, dp_schedule, recompute=rc_ok)
            tensors.append((grouping, M, cost, rc))
    return tensors, tried


def _interleave(ctx: PipelineContext, scored: list[_Scored], schedule: str, virtual_stages) -> list[_Scored]:
    """``scored`` plus the interleaved plans (``pp_virtual.interleaved_plans``) of its ``_INTERLEAVE_TOP``
    fastest distinct flat stage layouts; only those under an explicit "interleaved-1f1b"."""
    counts = VIRTUAL_COUNTS if virtual_stages is None else (int(virtual_stages),)
    out, seen = [], set()
    for x in sorted(scored, key=lambda x: x.step_time_s):
        if x.stages in seen:
            continue
        seen.add(x.stages)
        for step, stages, V, timeline, mem in interleaved_plans(ctx, x.stages, counts):
            out.append(_Scored(step, x.candidate, "interleaved-1f1b", stages, timeline, mem, V))
        if len(seen) >= _INTERLEAVE_TOP:
            break
    if schedule == "interleaved-1f1b" and scored and not out:
        raise PlanError(f"schedule: no 'interleaved-1f1b' plan with {list(counts)} chunks per rank stage fits "
                        f"(one-rank members, at least two rank stages, a block per chunk)")
    return out if schedule == "interleaved-1f1b" else scored + out


# -- candidates and their simulated prediction --------------------------------------------------------

def _candidate(grouping, M, cost, rc, sizes, value) -> _Candidate:
    b = np.concatenate([[0], np.cumsum(sizes)])
    flags = tuple(bool(rc[s, b[s], b[s + 1]]) for s in range(len(sizes)))
    return _Candidate(float(value), grouping, tuple(int(x) for x in sizes), M, flags)


def _split_candidates(tensors, sizes: Sequence[int]) -> list[_Candidate]:
    """The candidates of one pinned split: every (grouping of that many stages, count) where it fits."""
    out = []
    b = np.concatenate([[0], np.cumsum(sizes)])
    for grouping, M, cost, rc in tensors:
        if grouping.num_stages != len(sizes):
            continue
        times = [cost[s, b[s], b[s + 1]] for s in range(len(sizes))]
        if all(np.isfinite(times)):
            out.append(_candidate(grouping, M, cost, rc, sizes, split_objective(times, M)))
    return out


def _shortlist(candidates: list[_Candidate]) -> list[_Candidate]:
    """The ``_TOP_K`` best by estimate and the best of every grouping, best estimate first."""
    candidates = sorted(candidates, key=lambda c: c.estimate_s)
    out = candidates[:_TOP_K]
    best_per_grouping = {}
    for c in candidates:
        best_per_grouping.setdefault(c.grouping.name, c)
    out += [c for c in best_per_grouping.values() if c not in out]
    return sorted(out, key=lambda c: c.estimate_s)


def _score(ctx: PipelineContext, shortlist: list[_Candidate], names, sims: dict, prune: bool) -> list[_Scored]:
    """The simulated prediction of each shortlisted candidate under each schedule that fits in memory
    (``sims`` caches them by candidate). ``prune``: skip an estimate ``_ESTIMATE_SLACK`` above the
    best simulated step (the estimate leaves out the all-reduce and the optimizer, so one well
    above cannot win; it is no bound, so the exact split search simulates without it)."""
    scored: list[_Scored] = []
    for cand in shortlist:
        if prune and scored and cand.estimate_s > min(x.step_time_s for x in scored) * _ESTIMATE_SLACK:
            continue
        key = (cand.grouping.stages, cand.sizes, cand.num_micro)
        if key not in sims:
            got = []
            stages = _build_stages(ctx, cand.grouping, cand.sizes, cand.num_micro, cand.recompute)
            for name in names:
                mem = stage_memory_bytes(ctx.costs, stages, name, ctx.zero_stage)
                if any(v > ctx.cap_bytes(r) for r, v in mem.items()):
                    continue
                probe = _make_plan(ctx, "pp", name, stages, 0.0, {}, mem, ())
                timeline, step = plan_timeline(probe, ctx.costs, ctx.cluster)
                got.append(_Scored(step, cand, name, stages, timeline, mem))
            sims[key] = got
        scored += sims[key]
    return scored


def _compositions(n: int, parts: int):
    for cuts in itertools.combinations(range(1, n), parts - 1):
        b = (0, *cuts, n)
        yield tuple(b[i + 1] - b[i] for i in range(parts))


def _best_split(ctx: PipelineContext, tensors, names, sims: dict, scored: list[_Scored], n: int) -> list[_Scored]:
    """Make the chosen split the best under the simulated prediction, not only under the split DP's
    estimate (which prices a stage's forward and backward as one and each transfer once, and so can
    pick a 13/1 split the simulator prices slower than 12/2). Where a stage count has at most
    ``_EXHAUSTIVE_SPLITS`` splits, every split is evaluated exactly as a pinned split is (the same
    shortlist and pruning), so the search equals the brute force over pinned splits; elsewhere, up to
    ``_CLIMB_MAX_STAGES`` stages, the best plan's boundaries move one block at a time (at its
    grouping, micro-batch count and schedule) while the prediction improves."""
    out = list(scored)
    for S in sorted({g.num_stages for g, _, _, _ in tensors}):
        if math.comb(n - 1, S - 1) <= _EXHAUSTIVE_SPLITS:
            for sizes in _compositions(n, S):
                out += _score(ctx, _shortlist(_split_candidates(tensors, sizes)), names, sims, prune=True)
    if not out:
        return out
    best = min(out, key=lambda x: x.step_time_s)
    S = len(best.candidate.sizes)
    if math.comb(n - 1, S - 1) <= _EXHAUSTIVE_SPLITS or S > _CLIMB_MAX_STAGES:
        return out
    cand = best.candidate
    grouping, M, cost, rc = next(x for x in tensors if x[0] == cand.grouping and x[1] == cand.num_micro)
    climb: dict = {}      # the moves' predictions (at the best plan's schedule only)
    for _ in range(_CLIMB_ROUNDS):
        sizes, improved = best.candidate.sizes, False
        for i in range(len(sizes) - 1):
            for d in (-1, 1):
                moved = list(sizes)
                moved[i] += d
                moved[i + 1] -= d
                b = np.concatenate([[0], np.cumsum(moved)])
                times = [cost[s, b[s], b[s + 1]] for s in range(len(moved))]
                if min(moved) < 1 or not all(np.isfinite(times)):
                    continue
                estimate = split_objective(times, M)
                if estimate > cand.estimate_s * _CLIMB_SLACK:
                    continue
                got = _score(ctx, [_candidate(grouping, M, cost, rc, moved, estimate)],
                             (best.schedule,), climb, prune=False)
                out += got
                for x in got:
                    if x.step_time_s < best.step_time_s * (1 - 1e-9):
                        best, improved = x, True
        if not improved:
            break
    return out

def _describe(x: _Scored) -> str:
    members = "/".join(str(len(st.groups)) for st in x.stages)
    rc = [s for s, st in enumerate(x.stages) if st.recompute]
    v = f" V={x.virtual_stages}" if x.virtual_stages > 1 else ""
    return (f"{x.candidate.grouping.name} S={len(x.stages)}{v} M={x.candidate.num_micro} {x.schedule} "
            f"layers={[st.num_layers for st in x.stages]} members={members}{f' recompute={rc}' if rc else ''}: "
            f"{x.step_time_s:.4g} s "
            f"(estimate {x.candidate.estimate_s:.4g} s, bubble {x.timeline.bubble_fraction:.1%})")


def save_plan_timeline(plan: Plan, costs: ModelCosts, cluster: "Cluster", path) -> Timeline:
    """Simulate a pipeline plan and save its Gantt chart (``autopar.ir.timeline.plot_timeline``) to
    ``path``: one row per stage, labelled with its ranks and device types. Returns the timeline."""
    from autopar.ir.timeline import plot_timeline

    timeline, _ = plan_timeline(plan, costs, cluster)
    labels = []
    R = plan.rank_stages
    for s, st in enumerate(plan.stages[:R]):   # one row per rank stage (its chunks: every R-th stage)
        types = dict.fromkeys(cluster.devices[r].spec.name for r in st.ranks)
        rs = st.ranks
        shown = f"{rs[0]}" if len(rs) == 1 else f"{rs[0]}..{rs[-1]}" if list(rs) == list(range(rs[0], rs[-1] + 1)) \
            else ",".join(map(str, rs[:4])) + ("..." if len(rs) > 4 else "")
        spans = " ".join(f"[{c.block_start}:{c.block_stop})" for c in plan.stages[s::R])
        labels.append(f"stage {s} {spans} r{shown} {'/'.join(types)}")
    plot_timeline(timeline, path, labels=labels)
    return timeline


def _make_plan(ctx: PipelineContext, strategy: str, schedule: str, stages, step_s: float, breakdown: dict,
               memory: dict, notes: tuple, virtual_stages: int = 1) -> Plan:
    sps = ctx.global_batch / step_s if step_s > 0 else 0.0
    predicted = Predicted(step_time_s=step_s, samples_per_s=sps, memory_bytes=dict(memory),
                          breakdown=dict(breakdown))
    return Plan(strategy=strategy, global_batch_size=ctx.global_batch, zero_stage=ctx.zero_stage,
                schedule=schedule, stages=tuple(stages), predicted=predicted,
                block_names=tuple(ctx.costs.block_names), notes=notes, virtual_stages=virtual_stages)
