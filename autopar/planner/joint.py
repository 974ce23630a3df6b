"""The joint planner (``strategy="auto"``): pipeline stages x tensor-parallel groups x data-parallel
members with uneven batch shares x ZeRO stage x micro-batches, searched together.
This module searches; ``autopar.cost.joint`` prices a grouping (the stage cost tensor, its lower
bound), ``autopar.cost.memory`` a built candidate's memory.

Terms
- TP layout: how every node's devices are cut into tensor-parallel groups: a degree per device type
  (1, 2, 4 or 8 devices, consecutive ranks of one node; a node mixing types uses the least degree of
  its types; a node whose size the degree does not divide keeps a smaller last group). Each group's
  head shares are the exact min-max of ``autopar.cost.tp.best_shares``. The groups are the *members*.
- grouping: the members arranged into pipeline stages (``pp_planner.StageGrouping`` with TP groups as
  members). Families, all in rank order inside a type: per member, per node, per type, *type-major*
  (each type's members cut into S_t stages, types one after another, S_t chosen so that stages
  of different types are of similar speed) and *lockstep* (every type's members cut into S
  slices, stage s = slice s of every type). Stage counts are not only divisors of the member count
  (``layouts.stage_counts``: a prime count of nodes must plan too); a count that does not divide the
  members cuts them into runs of q and q + 1, and also into equal runs of q with the rest *idle*
  (grouping name ``...-idle``): equal stages may beat using every device.
- member kind: the device types, shares and all-reduce link of a member (``tp_cost.GroupKind``);
  members of one kind share every cost (identical blocks already share one row of the cost tables).
- candidate: a (layout, grouping, micro-batch count). Its stage cost tensor (TP-aware times, memory
  per rank, p2p transfers; see ``autopar.cost.joint.joint_cost_tensor``) goes to ``pp_planner.split_blocks``, the exact split
  DP; the best candidates by the split estimate are simulated (``pp_planner.plan_timeline``).
- ZeRO inside a pipeline stage shards states over the stage's members. ZeRO-1 moves the same bytes
  as the all-reduce it replaces (optimizer state sharded, the gradient accumulated whole over the
  micro-batches and reduced once). ZeRO-2 shards the gradient too, so it must be reduced after every
  micro-batch: it is offered only to candidates of one micro-batch (M = 1), where it moves the same
  bytes as ZeRO-1 (DeepSpeed refuses ZeRO-2 with pipeline parallelism for this reason).
  ``zero_stage="auto"`` searches with the memory of the highest stage a candidate may take and
  reports the least stage the chosen plan fits with. ZeRO-3 (``zero_stage=3`` only, never "auto")
  holds each member's whole stage for the step, gathered at its start: searched and priced as
  ZeRO-1, whose peak and bytes it has (``_as_zero3``); pure data parallelism's planner prices its
  block-by-block gathers.
- search: every (grouping, micro-batch count) gets a cheap lower bound of its split estimate
  (``autopar.cost.joint.split_lower_bound``) and they are visited best-first; the search stops once the bound exceeds
  the best estimate found (x ``ESTIMATE_SLACK``, so near-ties still reach the simulator), and the
  split DP's own bottleneck bound (M x least bottleneck) prunes again after the cost tensor. Layouts
  whose load-balance bound (batch / summed member speed) cannot beat the best single strategy are
  dropped, and so are the counts M >= S of a grouping that cannot hold the model at its largest count. The ``_SHORTLIST`` best
  estimates are built and simulated (GPipe and 1F1B, the least ZeRO stage that fits).
- activation recomputation (``recompute=True``, off by default): a stage whose in-flight activations
  do not fit may keep per micro-batch in flight only its input (the previous block's output, whole on
  every TP rank) plus one micro-batch's full activations, for one more forward in its backward
  (``Stage.recompute``; priced by ``pp_planner.stage_durations``). Keeping is never slower, so the
  split DP takes it per stage exactly: an entry recomputes only where keeping does not fit. Off by
  default: it more than doubles planning time on large clusters for the same plan there (llama-140b
  on hethub-768: its bubble binds, not its memory). The bound then lets each type alone recompute too.
- single-dimension strategies (dp, uniform-dp, proportional-dp, pp, uniform-pp, tp) are candidates too.
- interleaving: the best 1F1B plans are tried at 2-4 chunks per rank stage (``pp_virtual.interleave_hybrid``).
- cache: a ``PlanStore`` handed in (``cache=``), keyed by the cost tables, cluster and arguments; the
  API layer hands the files under ``$AUTOPAR_CACHE_DIR/plans/`` (``autopar.planning.plan_cache``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from autopar.config import DP_STRATEGIES, MEMORY_FRACTION, PP_STRATEGIES, PlanConfig
from autopar.cost import tp as tp_cost
from autopar.cost.joint import JointContext, joint_cost_tensor, prepare_stages
from autopar.cost.memory import check_zero_stage, fits_memory, stage_memory_bytes
from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan, Predicted, Stage, zero3_by_block
from autopar.ir.schedule import ALL_SCHEDULES, PIPELINE_SCHEDULES
from autopar.planner.cache import PlanStore, cache_key
from autopar.planner.dp import plan_dp
from autopar.planner.layouts import TP_DEGREES, Member, MemberLayout, member_groupings, member_layouts
from autopar.planner.joint_search import ESTIMATE_SLACK, GroupingState, search
from autopar.planner.pp_virtual import interleave_hybrid
from autopar.planner.pp import StageGrouping, member_shares, micro_sizes, plan_pipeline, plan_timeline, stage_durations

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = [
    "TP_DEGREES", "SINGLE_STRATEGIES", "Member", "MemberLayout", "member_layouts", "member_groupings",
    "plan_auto", "plan_tp", "tp_share_caps", "plan_strategy", "plan_hybrid", "best_split_estimate", "cache_key",
]

SINGLE_STRATEGIES: tuple[str, ...] = DP_STRATEGIES + PP_STRATEGIES + ("tp",)
_SHORTLIST = 8          # candidates per layout (by split estimate) that the simulator ranks
_TIE = 1e-3             # relative step-time difference below which 1F1B wins (less memory)
_EXACT_SPLITS = 24      # a shortlisted (grouping, M) with at most this many splits has each one simulated


# -- building and predicting a candidate --------------------------------------------------------------

def _build(ctx: JointContext, stages: Sequence[Sequence[Member]], sizes: Sequence[int], num_micro: int,
           recompute: Sequence[bool] = ()) -> tuple[Stage, ...]:
    micro = micro_sizes(ctx.global_batch, num_micro)
    tp = any(len(m.ranks) > 1 for st in stages for m in st)
    out, start = [], 0
    recompute = tuple(recompute) or (False,) * len(stages)
    split: dict = {}   # (samples, speeds, rotation) -> shares: stages of equal members split alike
    for members, k, rc in zip(stages, sizes, recompute):
        speeds = tuple(ctx.kind_speed(m.kind) for m in members)
        per_micro, rotate = [], 0
        for b in micro:
            key = (b, speeds, rotate % len(speeds))
            if key not in split:
                split[key] = member_shares(b, speeds, rotate)
            per_micro.append(split[key])
            rotate += b
        out.append(Stage(
            block_start=start, block_stop=start + k, groups=tuple(m.ranks for m in members),
            micro_batches=tuple(tuple(pm[g] for pm in per_micro) for g in range(len(members))),
            tp_shares=tuple(m.shares for m in members) if tp else (), recompute=bool(rc)))
        start += k
    # where SP is priced no slower, or wherever it can run when the pin asks for it
    return tp_cost.with_sequence_parallel(ctx.costs, out, stages, ctx.rho, force=ctx.force_sp)


def _make_plan(ctx: JointContext, strategy: str, schedule: str, stages, step_s: float, memory: dict,
               breakdown: dict, notes=(), zero_stage: int | None = None) -> Plan:
    sps = ctx.global_batch / step_s if step_s > 0 else 0.0
    return Plan(strategy=strategy, global_batch_size=ctx.global_batch,
                zero_stage=ctx.zero_stage if zero_stage is None else zero_stage, schedule=schedule,
                stages=tuple(stages), predicted=Predicted(step_time_s=step_s, samples_per_s=sps,
                                                          memory_bytes=dict(memory), breakdown=dict(breakdown)),
                block_names=tuple(ctx.costs.block_names), notes=tuple(notes))


@dataclass(frozen=True, slots=True)
class _Scored:
    step_time_s: float
    plan: Plan
    label: str


def _predict(ctx: JointContext, stages: tuple[Stage, ...], schedules: Sequence[str], label: str,
             zero_choices: Sequence[int]) -> list[_Scored]:
    out = []
    top = ctx.zero_for(len(stages[0].micro_batches[0]))   # ZeRO-2 only at one micro-batch
    zero_choices = [z for z in zero_choices if z <= top]
    durations = None   # the same stages' durations under every schedule: priced once
    for name in schedules:
        zero, memory = None, None
        for z in zero_choices:   # the least ZeRO stage that fits
            memory = stage_memory_bytes(ctx.costs, stages, name, z, ctx.rho)
            if fits_memory(ctx.cluster, memory, ctx.memory_fraction):
                zero = z
                break
        if zero is None:
            continue
        if durations is None:
            durations = stage_durations(ctx.costs, ctx.cluster, stages, replicated_fraction=ctx.rho,
                                        kinds=ctx.cache.setdefault("group_kinds", {}))
        out.append(_scored(ctx, stages, name, zero, memory, durations, label))
    return out


def _scored(ctx: JointContext, stages: tuple[Stage, ...], schedule: str, zero: int, memory: dict, durations,
            label: str) -> _Scored:
    """The plan of ``stages`` under ``schedule`` at ZeRO ``zero`` with its simulated step."""
    probe = _make_plan(ctx, "auto", schedule, stages, 1.0, memory, {"tp_replicated_fraction": ctx.rho},
                       zero_stage=zero)
    timeline, step = plan_timeline(probe, ctx.costs, ctx.cluster, durations=durations)
    breakdown = {
        "tp_replicated_fraction": ctx.rho, "bubble_fraction": timeline.bubble_fraction,
        "pipeline_s": timeline.step_time_s, "allreduce_s": step - timeline.step_time_s,
        "num_micro": float(len(stages[0].micro_batches[0])), "num_stages": float(len(stages)),
    }
    plan = _make_plan(ctx, "auto", schedule, stages, step, memory, breakdown, zero_stage=zero)
    return _Scored(step, plan, f"{label} {schedule} zero-{zero}")


def _zero3_block_plans(ctx: JointContext, layouts: Sequence[MemberLayout], groupings, schedule: str,
                       num_micro: int | None, pp_layers) -> list[_Scored]:
    """One recomputing stage of every layout's TP members (the same shares in each) at ZeRO-3 block by
    block (``ir.plan.zero3_by_block``): priced with its own memory (the shards, a few blocks gathered,
    one block's activations and the blocks' inputs; ``cost.memory.stage_memory_bytes``) and its rounds
    of collectives (``cost.pipeline``), not as ZeRO-1. At the fewest micro-batches that fit
    (``num_micro``: those), since every round gathers every block again. ``groupings`` (a pin's):
    only where they hold the one stage of all the layout's members."""
    if pp_layers is not None and len(pp_layers) != 1:
        return []
    n, B = ctx.costs.num_blocks, ctx.global_batch
    out = []
    for lay in layouts:
        members = list(lay.members)
        if len(members) < 2 or len({m.shares for m in members}) != 1 or len(members[0].ranks) < 2:
            continue
        if groupings is not None and not any(g.num_stages == 1 and len(g.stages[0]) == len(members)
                                             for g in groupings):
            continue
        counts = [num_micro] if num_micro else sorted({min(B, 1 << k) for k in range(B.bit_length() + 1)})
        for M in counts:
            built = _build(ctx, [members], (n,), M, (True,))
            if not zero3_by_block(built, 3):
                break
            memory = stage_memory_bytes(ctx.costs, built, schedule, 3, ctx.rho)
            if not fits_memory(ctx.cluster, memory, ctx.memory_fraction):
                continue
            durations = stage_durations(ctx.costs, ctx.cluster, built, replicated_fraction=ctx.rho,
                                        kinds=ctx.cache.setdefault("group_kinds", {}))
            label = f"{lay.name} S=1 M={M} layers=[{n}] recompute=[0] zero-3 by block"
            out.append(_scored(ctx, built, schedule, 3, memory, durations, label))
            break
    return out


def _entries(ctx: JointContext, cluster, layouts, groupings, best_s: float) -> list[GroupingState]:
    n = ctx.costs.num_blocks
    entries: list[GroupingState] = []
    for lay in layouts:
        for m in lay.members:
            ctx.members[m.ranks] = m
        speed = {m.kind: ctx.kind_speed(m.kind) for m in lay.members}
        if ctx.global_batch / sum(speed[m.kind] for m in lay.members) >= best_s:
            continue   # not even perfect balance on this layout beats what is known
        grs = groupings if groupings is not None else member_groupings(cluster, lay, n, speed)
        member = ctx.members.__getitem__
        # ``member_groupings`` puts the members' own rank tuples in its stages: found by identity,
        # not by hashing each tuple (2M lookups for 16k devices)
        same = {id(m.ranks): m for m in lay.members}.__getitem__
        for gr in grs:
            if gr.num_stages > n:
                continue
            try:
                stages = [list(map(same, map(id, st))) for st in gr.stages]
            except KeyError:
                try:
                    stages = [list(map(member, st)) for st in gr.stages]
                except KeyError:
                    continue   # a grouping of members that are not the layout's
            entries.append(GroupingState(lay, gr, prepare_stages(ctx, stages)))
    return entries


def best_split_estimate(costs: ModelCosts, cluster: "Cluster", global_batch: int, *,
                        num_heads: int | None = None, zero_stage: int = 2, memory_fraction: float = MEMORY_FRACTION,
                        replicated_fraction: float = tp_cost.DEFAULT_REPLICATED_FRACTION,
                        degrees: Sequence[int] = TP_DEGREES,
                        recompute: bool = False) -> tuple[float, str, int, tuple[int, ...]] | None:
    """The least split estimate of the hybrid search (1F1B) and its (grouping, M, sizes), or None
    when nothing fits: what the search optimises before the simulator ranks its shortlist."""
    B = _check_batch(global_batch)
    layouts = member_layouts(costs, cluster, num_heads=num_heads, degrees=degrees,
                             replicated_fraction=replicated_fraction)
    ctx = JointContext(costs, cluster, B, zero_stage, memory_fraction, replicated_fraction, {}, {}, recompute)
    entries = _entries(ctx, cluster, layouts, None, math.inf)
    found, _ = search(ctx, entries, "1f1b", None, math.inf, keep=1)
    if not found:
        return None
    est, e, M, sizes, _flags = found[0]
    return est, f"{entries[e].layout.name} {entries[e].grouping.name}", M, sizes


def plan_hybrid(costs: ModelCosts, cluster: "Cluster", global_batch: int, *, num_heads: int | None = None,
                zero_stage: int | Literal["auto"] = "auto", schedule: str = "auto",
                memory_fraction: float = MEMORY_FRACTION, ranks: Sequence[int] | None = None,
                replicated_fraction: float = tp_cost.DEFAULT_REPLICATED_FRACTION,
                degrees: Sequence[int] = TP_DEGREES, layouts: Sequence[MemberLayout] | None = None,
                groupings: Sequence[StageGrouping] | None = None, num_micro: int | None = None,
                best_s: float = math.inf,
                shortlist: int = _SHORTLIST, recompute: bool = False,
                force_recompute: bool = False, virtual_counts: Sequence[int] | None = None,
                pp_layers: Sequence[int] | None = None, force_sequence_parallel: bool = False,
                stats: dict | None = None) -> list[_Scored]:
    """The predicted plans of the hybrid search (best first; see the module docstring). ``layouts`` and
    ``groupings`` restrict the search (tests, the "tp" strategy); ``best_s`` is a step time already
    reached elsewhere (pruning); ``shortlist``:
    how many candidates (best split estimates) the simulator predicts; ``recompute=True`` lets a stage
    whose in-flight activations do not fit recompute them (see ``joint_cost_tensor``);
    ``force_recompute=True`` (a pinned recompute) makes every stage recompute; ``virtual_counts`` (a
    pinned interleaving) returns only the interleaved variants, at those chunk counts, of every 1F1B
    plan found, faster than its flat plan or not; ``pp_layers`` (pinned blocks per stage) predicts only
    that split, on the groupings of as many stages; ``force_sequence_parallel`` (a pinned SP) sets SP on
    every TP stage that can run it, priced slower or not. ``stats``, when given, receives how much was
    searched: ``layouts`` (TP member layouts), ``groupings`` (their stage groupings searched), the
    search's counts (``joint_search.search``) and ``predicted`` (plans the simulator priced)."""
    B = _check_batch(global_batch)
    ranks = tuple(range(len(cluster))) if ranks is None else tuple(ranks)
    zero3 = zero_stage == 3      # whole-stage ZeRO-3: searched and priced as ZeRO-1 (``_as_zero3``)
    zero_choices, z_search = _zero_choices(1 if zero3 else zero_stage)
    if z_search is None:
        return []
    schedules = PIPELINE_SCHEDULES if schedule == "auto" else (schedule,)
    split_schedule = "1f1b" if schedule == "auto" else schedule
    if layouts is None:
        layouts = member_layouts(costs, cluster, ranks, num_heads=num_heads, degrees=degrees,
                                 replicated_fraction=replicated_fraction)
    ctx = JointContext(costs, cluster, B, z_search, memory_fraction, replicated_fraction, {}, {},
                       recompute or force_recompute, force_recompute, force_sequence_parallel)
    entries = _entries(ctx, cluster, layouts, groupings, best_s)
    found, _ = search(ctx, entries, split_schedule, num_micro, best_s, keep=shortlist, stats=stats)
    if stats is not None:
        stats.update(layouts=len(layouts), groupings=len(entries),
                     layouts_pruned=len(layouts) - len({id(e.layout) for e in entries}))
    scored: list[_Scored] = []
    best = best_s
    for est, e, M, sizes, flags in found[:shortlist]:
        if est > best * ESTIMATE_SLACK:
            break
        entry = entries[e]
        stages = [[ctx.members[g] for g in st] for st in entry.grouping.stages]
        splits = (_splits_to_predict(ctx, entry, M, split_schedule, sizes, flags) if pp_layers is None
                  else _pinned_split(ctx, entry, M, split_schedule, pp_layers))
        for sizes, flags in splits:
            built = _build(ctx, stages, sizes, M, flags)
            label = f"{entry.layout.name} {entry.grouping.name} S={len(built)} M={M} layers={list(sizes)}"
            if any(flags):
                label += f" recompute={[s for s, x in enumerate(flags) if x]}"
            for x in _predict(ctx, built, schedules, label, zero_choices):
                scored.append(x)
                best = min(best, x.step_time_s)
    if zero3 and ctx.recompute and virtual_counts is None:   # one TP stage gathering block by block
        scored += _zero3_block_plans(ctx, layouts, groupings, split_schedule, num_micro, pp_layers)
    if stats is not None:
        stats["predicted"] = len(scored)
    if virtual_counts is not None:
        return _as_zero3(zero3, sorted((_Scored(*x) for x in interleave_hybrid(
            costs, cluster, [(x.step_time_s, x.plan, x.label) for x in scored], memory_fraction, virtual_counts,
            top=len(scored), kinds=ctx.cache.setdefault("group_kinds", {}), require_faster=False)),
            key=lambda x: x.step_time_s))
    if schedule in ("auto", "interleaved-1f1b"):   # the best few interleaved where that fits and pays
        scored += [_Scored(*x) for x in interleave_hybrid(costs, cluster, [(x.step_time_s, x.plan, x.label)
                                                                          for x in scored], memory_fraction,
                                                          kinds=ctx.cache.setdefault("group_kinds", {}),
                                                          stats=stats)]
    fastest = min((x.step_time_s for x in scored), default=math.inf)
    scored.sort(key=lambda x: (x.step_time_s > fastest * (1 + _TIE), x.plan.schedule != "1f1b", x.step_time_s))
    return _as_zero3(zero3, scored)


def _fits_request(plan: Plan, num_ranks: int, global_batch: int, num_blocks: int) -> bool:
    """Whether a cached plan is one for this request (a file edited or planted under the key's name is
    not: it is planned again): its ranks in the cluster, its batch and every block."""
    return (plan.global_batch_size == global_batch and plan.stages[-1].block_stop == num_blocks
            and all(0 <= r < num_ranks for r in plan.ranks))


def _as_zero3(zero3: bool, scored: list[_Scored]) -> list[_Scored]:
    """The ZeRO-1 plans of a ZeRO-3 search, as ZeRO-3 (``zero3``; else ``scored`` as is). The stages of
    a hybrid plan run ZeRO-3 with one unit per member, its whole stage, gathered for the whole step
    (``runtime.tp``, ``runtime.pipeline``), as torchtitan's FSDP does under pipelining: its peak and
    its bytes are ZeRO-1's (the full gradient held through the step, one reduce-scatter and one
    all-gather), so it is priced as ZeRO-1. A single stage of single devices is left to the
    data-parallel planner, whose ZeRO-3 gathers block by block, and one recomputing stage of TP members
    runs block by block too (``ir.plan.zero3_by_block``): such plans come priced from
    ``_zero3_block_plans``, and their ZeRO-1 pricing is dropped here."""
    if not zero3:
        return scored
    return [x if x.plan.zero_stage == 3 else
            _Scored(x.step_time_s, replace(x.plan, zero_stage=3), x.label.replace("zero-1", "zero-3"))
            for x in scored if (len(x.plan.stages) > 1 or any(len(m) > 1 for m in x.plan.stages[0].groups))
            and (x.plan.zero_stage == 3 or not zero3_by_block(x.plan.stages, 3))]


def _splits_to_predict(ctx: JointContext, entry: GroupingState, M: int, schedule: str, sizes, flags) -> list:
    """The splits of a shortlisted (grouping, M) the simulator predicts: the split DP's (it minimises
    the estimate, which is no bound of the simulated step), or every split that fits when there are
    at most ``_EXACT_SPLITS`` of them, so the choice equals brute force over pinned splits there."""
    n, S = ctx.costs.num_blocks, len(entry.prep)
    if S < 2 or math.comb(n - 1, S - 1) > _EXACT_SPLITS:
        return [(tuple(sizes), tuple(flags))]
    cost, rc = joint_cost_tensor(ctx, entry.prep, M, schedule, ctx.recompute)
    fitting = (_fitting_split(cost, rc, (0, *cuts, n)) for cuts in itertools.combinations(range(1, n), S - 1))
    return [x for x in fitting if x is not None] or [(tuple(sizes), tuple(flags))]


def _fitting_split(cost, rc, bounds: Sequence[int]) -> tuple | None:
    """(blocks per stage, recompute flags) of the split at block ``bounds`` where every stage fits
    (a finite entry of the joint cost tensor), else None."""
    stages = range(len(bounds) - 1)
    if not all(math.isfinite(cost[s, bounds[s], bounds[s + 1]]) for s in stages):
        return None
    return (tuple(bounds[s + 1] - bounds[s] for s in stages), tuple(bool(rc[s, bounds[s], bounds[s + 1]]) for s in stages))


def _pinned_split(ctx: JointContext, entry: GroupingState, M: int, schedule: str, layers: Sequence[int]) -> list:
    """``[(layers, recompute flags)]`` where the pinned split fits this grouping at M micro-batches,
    else ``[]``."""
    if len(entry.prep) != len(layers) or sum(layers) != ctx.costs.num_blocks:
        return []
    cost, rc = joint_cost_tensor(ctx, entry.prep, M, schedule, ctx.recompute)
    got = _fitting_split(cost, rc, (0, *itertools.accumulate(layers)))
    return [got] if got is not None else []


def searched_note(stats: dict, predictions: int) -> str:
    """One line of how much the hybrid search covered and why it left the rest (``plan_hybrid(stats=)``)."""
    if "candidates" not in stats:
        return f"searched {predictions} hybrid predictions"
    c, unfit, solved = stats["candidates"], stats["unfit"], stats["solved"]
    return (f"searched {stats['layouts']} TP layouts ({stats['layouts_pruned']} pruned whole: even perfect balance "
            f"is no faster than the best single strategy), {stats['groupings']} stage groupings: {c} (grouping, "
            f"micro-batch count) candidates; {unfit} do not fit, {c - unfit - solved} pruned by their lower "
            f"bound (no better than the best estimate x {ESTIMATE_SLACK}), {solved} split exactly, "
            f"{stats.get('predicted', 0)} simulated, {predictions} hybrid predictions"
            + (f"; interleaving: {stats['interleave_flat']} flat plans tried at 2-4 chunks per stage "
               f"({stats['interleave_priced']} chunk splits priced, {stats['interleave_kept']} faster), "
               f"{stats['interleave_bound']} skipped by their bubble-free bound" if "interleave_flat" in stats else ""))


def _zero_choices(zero_stage) -> tuple[tuple[int, ...], int | None]:
    """(ZeRO stages to report, in preference order; the stage whose memory the search assumes)."""
    if zero_stage == "auto":
        return (0, 1, 2), 2
    check_zero_stage(zero_stage)
    if zero_stage == 3:
        return (), None
    return (int(zero_stage),), int(zero_stage)


def _check_batch(global_batch) -> int:
    if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
        raise PlanError(f"global_batch: {global_batch!r} must be an integer >= 1")
    return int(global_batch)


# -- single-dimension strategies ----------------------------------------------------------------------

def tp_share_caps(costs: ModelCosts, cluster: "Cluster", ranks: Sequence[int], num_units: int,
                  memory_fraction: float = MEMORY_FRACTION,
                  replicated_fraction: float = tp_cost.DEFAULT_REPLICATED_FRACTION,
                  recompute: bool = False) -> tuple[int, ...]:
    """Per rank of one TP group over ``ranks`` holding every block, the most of ``num_units`` head units
    it can hold and still fit its memory at one sample per micro-batch (``stage_memory_bytes``; 0: not
    even one). A rank's peak grows with its own share alone (its work factors), so each cap is a
    bisection over that share, the other ranks given the rest."""
    ranks = tuple(ranks)
    n = len(ranks)
    if n < 2:
        return (num_units,) * n

    def fits(i: int, share: int) -> bool:
        rest = num_units - share
        shares = [rest // (n - 1) + (1 if k < rest % (n - 1) else 0) for k in range(n - 1)]
        shares.insert(i, share)
        st = Stage(block_start=0, block_stop=costs.num_blocks, groups=(ranks,), micro_batches=((1,),),
                   tp_shares=(tuple(shares),), recompute=recompute)
        peak = stage_memory_bytes(costs, [st], "1f1b", 0, replicated_fraction)[ranks[i]]
        return fits_memory(cluster, {ranks[i]: peak}, memory_fraction)

    caps = []
    for i in range(n):
        lo, hi = 0, num_units - (n - 1)      # fits(lo) holds (0: nothing), fits(hi + 1) is not asked
        if fits(i, hi):
            caps.append(hi)
            continue
        while hi - lo > 1:                   # fits(lo), not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(i, mid) else (lo, mid)
        caps.append(lo)
    return tuple(caps)


def plan_tp(costs: ModelCosts, cluster: "Cluster", global_batch: int, *, num_heads: int | None = None,
            memory_fraction: float = MEMORY_FRACTION, ranks: Sequence[int] | None = None,
            replicated_fraction: float = tp_cost.DEFAULT_REPLICATED_FRACTION, recompute: bool = False) -> Plan:
    """Heterogeneous tensor parallelism: one TP group of every rank (uneven head shares, exact
    min-max under each rank's memory: ``tp_share_caps``), one stage, the micro-batch count that fits
    and is fastest. Where the fastest shares do not fit, the fastest ones that do; ``PlanError`` only
    when no shares fit."""
    B = _check_batch(global_batch)
    ranks = tuple(range(len(cluster))) if ranks is None else tuple(ranks)
    units = num_heads if num_heads is not None else tp_cost.DEFAULT_NUM_UNITS
    if units < len(ranks) <= tp_cost.DEFAULT_NUM_UNITS:
        # More ranks than heads (under grouped-query attention, than key/value groups): shares in finer
        # units. A pair that some member would own none of stays whole on every rank
        # (``passes.tp.tp_rewrite``); the others (the MLP's, the vocabulary's) are shared out.
        units *= -(-len(ranks) // units)
    if len(ranks) > units:     # one group of thousands (``plan_auto`` asks on every cluster): refused at once
        raise PlanError(f"tp: {len(ranks)} ranks cannot share {units} heads (num_heads); a single TP group "
                        f"needs at least one head per rank")
    whole = [costs.step_time(cluster.devices[r].spec.name, 1.0) for r in ranks]
    caps = tp_share_caps(costs, cluster, ranks, units, memory_fraction, replicated_fraction, recompute)
    shares = tp_cost.best_shares(whole, units, replicated_fraction, caps) if len(ranks) > 1 else (units,)
    member = Member(ranks, shares, tp_cost.group_kind(cluster, ranks, shares), cluster.devices[ranks[0]].node)
    layout = MemberLayout("tp-all", (), (member,))
    grouping = StageGrouping("one-group", ((ranks,),))
    scored = plan_hybrid(costs, cluster, B, num_heads=units, zero_stage=0, schedule="1f1b",
                         memory_fraction=memory_fraction, ranks=ranks, replicated_fraction=replicated_fraction,
                         layouts=[layout], groupings=[grouping], recompute=recompute)
    if not scored:
        raise PlanError(f"tp: the model does not fit on one TP group of {len(ranks)} ranks even at 1 sample "
                        f"per micro-batch ({costs.state_bytes() / 2**30:.3g} GiB of states)")
    best = scored[0].plan
    return replace(best, strategy="tp", schedule="none",
                   notes=(f"one TP group of {len(ranks)} ranks, head shares {list(shares)}",))


def plan_strategy(costs: ModelCosts, cluster: "Cluster", global_batch: int, strategy: str, *,
                  num_heads: int | None = None, zero_stage: int | Literal["auto"] = "auto",
                  schedule: str = "auto", memory_fraction: float = MEMORY_FRACTION, ranks: Sequence[int] | None = None,
                  replicated_fraction: float = tp_cost.DEFAULT_REPLICATED_FRACTION, recompute: bool = False,
                  pp_layers: Sequence[int] | None = None, schedules: Sequence[str] | None = None,
                  num_micro: int | None = None, force_recompute: bool = False) -> Plan:
    """The plan of one single-dimension strategy (``SINGLE_STRATEGIES``) with the same arguments
    (``recompute``: whether pipeline stages and the ``dp`` strategy may recompute activations; the
    uniform baselines never do; ``force_recompute``: data-parallel plans, the baselines too, recompute; ``pp_layers`` and ``num_micro`` pin the blocks per stage and the
    micro-batch count of "pp" and "uniform-pp"; ``schedules``: what "pp" picks among when
    ``schedule="auto"``, None for its default)."""
    if strategy in DP_STRATEGIES:
        return plan_dp(costs, cluster, global_batch, strategy=strategy, zero_stage=zero_stage, ranks=ranks,
                       memory_fraction=memory_fraction, recompute=recompute, force_recompute=force_recompute)
    if strategy in PP_STRATEGIES:
        # uniform-pp has one device per stage: a ZeRO stage would shard over one member, no change.
        zs = ((0,) if strategy == "uniform-pp" else (0, 1)) if zero_stage == "auto" else (zero_stage,)
        best, err = None, None
        for z in zs:
            try:
                p = plan_pipeline(costs, cluster, global_batch, schedule=schedule, zero_stage=z,
                                  uniform=strategy == "uniform-pp", memory_fraction=memory_fraction, ranks=ranks,
                                  recompute=recompute, pp_layers=pp_layers, num_micro=num_micro,
                                  schedules=schedules if strategy == "pp" else None)
            except PlanError as e:
                err = e
                continue
            if best is None or p.predicted.step_time_s < best.predicted.step_time_s * (1 - 1e-9):
                best = p
        if best is None:
            raise err
        return best
    if strategy == "tp":
        return plan_tp(costs, cluster, global_batch, num_heads=num_heads, memory_fraction=memory_fraction,
                       ranks=ranks, replicated_fraction=replicated_fraction, recompute=recompute)
    raise PlanError(f"strategy: {strategy!r} is not one of {SINGLE_STRATEGIES}")


# -- the joint planner ----------------------------------------------------------------------------------

def plan_auto(costs: ModelCosts, cluster: "Cluster", global_batch: int, *, num_heads: int | None = None,
              zero_stage: int | Literal["auto"] = "auto", schedule: str = "auto", memory_fraction: float = MEMORY_FRACTION,
              ranks: Sequence[int] | None = None,
              replicated_fraction: float | None = None, degrees: Sequence[int] = TP_DEGREES,
              cache: PlanStore | None = None, recompute: bool = False) -> Plan:
    """The fastest predicted plan over every dimension (see the module docstring).

    ``num_heads``: the model's attention heads (TP shard units; ``tp_cost.DEFAULT_NUM_UNITS`` when
    None). ``cache``: where plans are kept by ``cache_key`` (``autopar.planner.cache.PlanStore``; None:
    nowhere), so that the same call again returns the plan it made. ``replicated_fraction``: the part of every block each TP rank computes whole
    (``tp_cost.DEFAULT_REPLICATED_FRACTION`` when None). ``Plan.notes`` lists the runner-ups with their
    predicted step times. ``recompute``: whether pipeline stages whose memory binds may recompute
    their activations (``Stage.recompute``). Upper bound and efficiency are left at 0: see
    ``autopar.planner.bounds``.
    Raises ``PlanError`` when nothing fits."""
    B = _check_batch(global_batch)
    config = PlanConfig(zero_stage=zero_stage, schedule=schedule, recompute=recompute,
                        memory_fraction=memory_fraction, num_heads=num_heads,
                        replicated_fraction=replicated_fraction)   # the arguments' one check
    ranks = tuple(range(len(cluster))) if ranks is None else tuple(sorted(int(r) for r in ranks))
    missing = sorted({cluster.devices[r].spec.name for r in ranks} - set(costs.fwd_table))
    if missing:
        raise PlanError(f"costs: no time table for device type(s) {missing} (tables for {list(costs.fwd_table)})")
    rho = tp_cost.DEFAULT_REPLICATED_FRACTION if replicated_fraction is None else float(replicated_fraction)
    args = {"config": config.with_(replicated_fraction=rho).key(), "global_batch": B,
            "ranks": list(ranks), "degrees": list(degrees)}
    key = cache_key(costs, cluster, args) if cache is not None else None
    if key is not None:
        hit = cache.get(key)
        if hit is not None and _fits_request(hit, len(cluster), B, costs.num_blocks):
            return hit

    scored: list[_Scored] = []
    failed: list[str] = []
    for strategy in SINGLE_STRATEGIES:
        try:
            # the pipeline planner also plans interleaved-1f1b and zb-h1 (the hybrid search not yet)
            p = plan_strategy(costs, cluster, B, strategy, num_heads=num_heads, zero_stage=zero_stage,
                              schedule=schedule, memory_fraction=memory_fraction, ranks=ranks,
                              replicated_fraction=rho, recompute=recompute,
                              schedules=ALL_SCHEDULES if strategy == "pp" and schedule == "auto" else None)
        except PlanError as e:
            failed.append(f"{strategy}: does not fit or applies not: {str(e)[:160]}")
            continue
        scored.append(_Scored(p.predicted.step_time_s, p, f"{strategy} (zero-{p.zero_stage}, {p.schedule})"))
    best_single = min((x.step_time_s for x in scored), default=math.inf)
    stats: dict = {}
    hybrids = plan_hybrid(costs, cluster, B, num_heads=num_heads, zero_stage=zero_stage, schedule=schedule,
                          memory_fraction=memory_fraction, ranks=ranks, replicated_fraction=rho,
                          degrees=degrees, best_s=best_single, recompute=recompute, stats=stats)
    scored += hybrids
    if not scored:
        raise PlanError("auto: no plan fits: " + "; ".join(failed))
    scored.sort(key=lambda x: x.step_time_s)
    best = scored[0]
    notes = [f"chosen: {best.label}: {best.step_time_s:.6g} s/step, {B / best.step_time_s:.6g} samples/s"]
    seen = {best.label}
    for x in scored[1:]:
        if x.label in seen or len(seen) > 8:
            continue
        seen.add(x.label)
        notes.append(f"runner-up: {x.label}: {x.step_time_s:.6g} s/step "
                     f"({x.step_time_s / best.step_time_s:.4g}x the chosen)")
    notes += failed
    notes.append(searched_note(stats, len(hybrids)))
    plan = replace(best.plan, strategy="auto", notes=tuple(notes) + tuple(best.plan.notes))
    if key is not None:
        cache.put(key, plan)
    return plan
