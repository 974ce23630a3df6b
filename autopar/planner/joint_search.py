"""The joint planner's best-first search over (grouping, micro-batch count) items and the bounds it
orders them by (``autopar.planner.joint`` builds the items and predicts what this returns).

Terms
- item: a (grouping, micro-batch count M) of ``GroupingState`` entries; its cheap bound is the split
  bound (``autopar.cost.joint.split_lower_bound``), its costly part the tail bound
  (``tail_lower_bound``: the slowest stage's gradient all-reduce, optimizer step and ZeRO gather).
- estimate: the split DP's value of an item plus its tail (``stage_tail_s`` on the chosen split).
- limit: an item whose bound exceeds the best estimate found x ``ESTIMATE_SLACK`` is not solved.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopar.cost import tp as tp_cost
from autopar.cost.comm import allgather_time_s
from autopar.cost.joint import JointContext, joint_cost_tensor, joint_split_feasible, split_lower_bounds
from autopar.cost.pipeline import stage_optimizer_s
from autopar.ir.plan import Stage
from autopar.planner.layouts import MemberLayout
from autopar.planner.order import best_first
from autopar.planner.pp import StageGrouping, micro_candidates, min_bottleneck, split_blocks

__all__ = ["ESTIMATE_SLACK", "GroupingState", "search", "stage_tail_s", "tail_lower_bound", "tail_signature",
           "tail_zero"]

ESTIMATE_SLACK = 1.1   # a split estimate this much above the best prediction is not simulated


def tail_signature(ctx: JointContext, groups: Sequence[tuple[int, ...]]) -> tuple:
    """Stages of one signature (member kinds in order, members per node) have the same tail."""
    key = ("tail_sig", id(groups))
    hit = ctx.cache.get(key)
    if hit is not None and hit[0] is groups:
        return hit[1]
    # rank tuple -> (kind id, node) of its member: ``ctx.members`` is complete once ``_entries`` ran
    of = ctx.cache.setdefault("member_of", {})
    try:
        kinds = tuple([of[g][0] for g in groups])
    except KeyError:
        for g in groups:
            if g not in of:
                of[g] = (ctx.member_kind_id(ctx.members[g]), ctx.members[g].node)
        kinds = tuple([of[g][0] for g in groups])
    sig = kinds, tuple(sorted(Counter([of[g][1] for g in groups]).values()))
    ctx.cache[key] = (groups, sig)   # keeps ``groups`` alive, so its id is not reused
    return sig


def stage_tail_s(ctx: JointContext, groups: Sequence[tuple[int, ...]], start: int, stop: int, zero: int) -> float:
    """Gradient all-reduce + optimizer step + ZeRO gather of a stage of ``groups`` on blocks [start, stop)
    (what ``cost.pipeline`` adds after the schedule), cached by the stage's ``tail_signature`` and the
    span's parameter count and bytes (all the tail depends on: spans of as many identical blocks share it)."""
    seen = ctx.cache.setdefault("tail_at", {})   # (groups object, span, zero) -> seconds: before the key
    at = (id(groups), start, stop, tail_zero(zero))
    hit = seen.get(at)
    if hit is not None and hit[0] is groups:
        return hit[1]
    c = ctx.costs
    cum_p, cum_w = ctx.cache.get("cum_params") or ctx.cache.setdefault(
        "cum_params", (np.concatenate([[0.0], np.cumsum(c.params)]), np.concatenate([[0.0], np.cumsum(c.param_bytes)])))
    key = ("tail", tail_signature(ctx, groups), float(cum_p[stop] - cum_p[start]),
           float(cum_w[stop] - cum_w[start]), tail_zero(zero))
    if key not in ctx.cache:
        ctx.cache[key] = stage_tail_uncached(ctx, groups, start, stop, zero)
    seen[at] = (groups, ctx.cache[key])   # keeps ``groups`` alive, so its id is not reused
    return ctx.cache[key]


def tail_zero(zero: int) -> int:
    """The ZeRO stage as far as a stage's tail depends on it: ZeRO-1 and ZeRO-2 shard the optimizer
    step and gather the parameters alike (``stage_tail_uncached``: ZeRO-2's per-micro-batch reduce
    moves ZeRO-1's bytes), so they share one cache entry. A tail that comes to differ between them
    (ZeRO in tensor-parallel stages) returns ``zero`` here."""
    return min(zero, 1)


def tail_lower_bound(ctx: JointContext, entry: "GroupingState", num_micro: int) -> float:
    """A bound below the tail ``max_s tail_s`` of every split of ``entry``: with tail_s ~ a_s + b_s P_s
    affine in the stage's parameters P_s (rings, optimizer steps and gathers are), and sum_s P_s = P,
    max_s >= max(max_s a'_s, P / sum_s 1 / b_s); a'_s is the stage's tail on the lightest block,
    and x 0.95 leaves room for the part that is not exactly affine."""
    z = ctx.zero_for(num_micro)
    key = ("tail_lb", id(entry), z)
    if key not in ctx.cache:
        c = ctx.costs
        n = c.num_blocks
        light = int(np.argmin(c.params))
        p_light, p_all = float(c.params[light]), float(c.params.sum())
        top, inv = 0.0, 0.0
        for groups in entry.grouping.stages:
            t1 = stage_tail_s(ctx, groups, light, light + 1, z)
            t2 = stage_tail_s(ctx, groups, 0, n, z)
            top = max(top, t1)
            b = (t2 - t1) / (p_all - p_light) if p_all > p_light else 0.0
            inv = inv + 1.0 / b if b > 0 and inv != math.inf else math.inf
        spread = p_all / inv if 0 < inv < math.inf else 0.0
        ctx.cache[key] = 0.95 * max(top, spread)
    return ctx.cache[key]


def stage_tail_uncached(ctx: JointContext, groups, start: int, stop: int, zero: int) -> float:
    members = [ctx.members[g] for g in groups]
    tp = any(len(m.ranks) > 1 for m in members)
    stage = Stage(block_start=start, block_stop=stop, groups=tuple(groups), micro_batches=((1,),) * len(groups),
                  tp_shares=tuple(m.shares for m in members) if tp else ())
    out = tp_cost.stage_sync_time_s(ctx.costs, ctx.cluster, stage, ctx.rho, zero_stage=zero)
    out += stage_optimizer_s(ctx.costs, ctx.cluster, stage, zero, ctx.rho,
                             types=ctx.cache.setdefault("rank_types", {}))
    if zero >= 1 and len(groups) > 1 and not tp:
        out += allgather_time_s(ctx.cluster, [g[0] for g in groups],
                                float(ctx.costs.param_bytes[start:stop].sum()))
    return out


@dataclass
class GroupingState:
    layout: MemberLayout
    grouping: StageGrouping
    prep: list
    feasible: bool | None = None


def _search_items(ctx: JointContext, entries: list[GroupingState], num_micro: int | None) -> tuple[list, list]:
    """((split lower bound, entry index, M) of every (grouping, micro-batch count), per entry its largest count)."""
    items = []
    largest = []
    for e, entry in enumerate(entries):
        S = len(entry.prep)
        counts = ((num_micro,) if num_micro is not None else
                  micro_candidates(ctx.global_batch, S, entry.grouping.max_members))
        largest.append(counts[-1])
        items += [(bound, e, M) for bound, M in zip(split_lower_bounds(ctx, entry.prep, counts), counts)]
    return items, largest


def _tail(ctx: JointContext, tails: dict, e: int, entry: GroupingState, M: int, sizes) -> float:
    """What follows the schedule (``cost.pipeline`` ``_finish_s``: gradient all-reduce, optimizer
    step, ZeRO gather) on the slowest stage: the split estimate leaves it out, so ranking by the
    estimate alone would favour many members per stage (whose all-reduce it ignores). ``tails``: the
    stages' tails priced so far in this search."""
    z = ctx.zero_for(M)
    out, start = 0.0, 0
    for s, k in enumerate(sizes):
        key = (e, s, start, start + k, z)
        if key not in tails:
            tails[key] = stage_tail_s(ctx, entry.grouping.stages[s], start, start + k, z)
        out = max(out, tails[key])
        start += k
    return out


def _solve(ctx: JointContext, entry: GroupingState, M: int, schedule: str, limit):
    """The exact split of ``entry`` at M micro-batches: (sizes, estimate, recompute flags); "infeasible"
    where no split fits, None where its bound exceeds ``limit()`` or no split is found."""
    if not joint_split_feasible(ctx, entry.prep, M, schedule, ctx.recompute):
        return "infeasible"   # most (grouping, M) of a large model: no tensor needed to know
    cost, rc = joint_cost_tensor(ctx, entry.prep, M, schedule, ctx.recompute)
    floor = min_bottleneck(cost)
    if not math.isfinite(floor):
        return "infeasible"
    if M * floor > limit():
        return None
    got = split_blocks(cost, M)
    if got is None:
        return None
    bounds = np.concatenate([[0], np.cumsum(got[0])])
    flags = tuple(bool(rc[s, bounds[s], bounds[s + 1]]) for s in range(len(got[0])))
    return got[0], got[1], flags


def search(ctx: JointContext, entries: list[GroupingState], schedule: str, num_micro: int | None,
           best_s: float, keep: int | None = None, stats: dict | None = None) -> tuple[list[tuple[float, int, int, tuple[int, ...],
                                                                       tuple[bool, ...]]], int]:
    """Best-first over every (grouping, micro-batch count) by ``split_lower_bound`` + ``tail_lower_bound``
    (a heap keyed by the split bound alone until an item comes first: the costly tail bound is only
    computed for what the split bound does not prune, in the same order as sorting by both), each
    solved by the exact split DP unless its bound (or the tensor's bottleneck bound M x floor)
    exceeds the best estimate found x ``ESTIMATE_SLACK``. A grouping that cannot hold the model at
    its largest count (the least activation memory once 1F1B is full) is not tried at any count >= S.
    Returns (estimate, entry index, M, sizes, recompute per stage) of every solved candidate, and how
    many were solved.

    ``keep``: only the first ``keep`` of the returned list are wanted (the caller's shortlist); an item
    whose bound exceeds the ``keep``-th least estimate found so far cannot be among them (its estimate
    is at least its bound; the list is sorted stably, so a later item that ties comes after), so the
    limit is the lesser of that and the slack limit. The first ``keep`` entries are the same as
    without it, in the same order; only fewer of the rest are solved.

    ``stats``, when given, receives ``candidates`` (every (grouping, micro-batch count)), ``unfit``
    (those skipped because their grouping cannot hold the model) and ``solved`` (the split DP ran);
    the others were pruned by their lower bounds."""
    items, largest = _search_items(ctx, entries, num_micro)
    best_est = best_s
    found = []
    solved = 0
    kept: list[float] = []    # max-heap (negated) of the ``keep`` least estimates found

    def limit() -> float:
        slack = best_est * ESTIMATE_SLACK
        return min(slack, -kept[0]) if keep is not None and len(kept) >= keep else slack

    tails: dict = {}

    # the tail bound is costly: only for what the split bound alone does not prune
    order = best_first(items, lambda e, M: tail_lower_bound(ctx, entries[e], M), limit)
    unfit = 0
    for bound, e, M in order:
        entry = entries[e]
        S = len(entry.prep)
        if schedule != "gpipe" and M >= S:
            # From M = S on, every stage has its full 1F1B depth in flight and shares only shrink as
            # M grows: the largest count needs the least memory, so if it does not fit none does.
            if entry.feasible is None:
                top = largest[e]
                entry.feasible = top < S or _solve(ctx, entry, top, schedule, limit) != "infeasible"
            if not entry.feasible:
                unfit += 1
                continue
        got = _solve(ctx, entry, M, schedule, limit)
        solved += 1
        if got is None or got == "infeasible":
            continue
        sizes, est, flags = got
        est += _tail(ctx, tails, e, entry, M, sizes)
        found.append((est, e, M, sizes, flags))
        best_est = min(best_est, est)
        if keep is not None:
            if len(kept) < keep:
                heapq.heappush(kept, -est)
            elif est < -kept[0]:
                heapq.heapreplace(kept, -est)
    found.sort(key=lambda x: x[0])
    if stats is not None:
        stats.update(candidates=len(items), unfit=unfit, solved=solved)
    return found, solved
