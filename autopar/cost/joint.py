"""The joint planner's cost model: what a stage grouping of tensor-parallel members costs at every
split (its member loads for the one stage cost tensor, ``autopar.cost.stage``, and a cheap lower
bound of the split estimate). A built candidate's memory is ``autopar.cost.memory.stage_memory_bytes``.
The search over layouts, groupings and micro-batch counts lives in ``autopar.planner.joint``.

Terms
- context (``JointContext``): the fixed inputs of one joint planning call (model costs, cluster, global
  batch, the ZeRO stage searched with, the usable ``memory_fraction`` of each device, the TP
  replicated fraction ``rho``, the members by rank tuple, whether stages may recompute) and a cache
  of what candidates share: kind ids, span times per (kind, samples), state bytes per span, each
  member's room.
- kind id: the index of a member kind (``tp_cost.GroupKind``: device types, head shares, all-reduce
  link) in the order first seen; members of one kind share every cost.
- span: blocks [i, j); ``[i, j]`` arrays over n + 1 block boundaries hold a span's sum (seconds,
  parameters, bytes) and are zero below the diagonal.
- room: the usable bytes of a member's tightest rank (reports).
- rank caps: the distinct (usable bytes, share fraction) of a member's ranks. The rows price each
  rank's state and activations with their own work factors (``cost.memory.tp_span_factors``, from the
  TP layout's per-block replicated fractions: a llama layer's parameters are all but whole sharded,
  22% of its activations are whole on every TP rank), exactly as ``stage_memory_bytes`` prices the
  built stage, with the flat gradient copy of the stage's all-reduce after backward and the last
  stage's loss (``cost.memory.loss_bytes_per_sample``) too: a plan the search accepts passes its
  final memory check.
- stage prep (``StagePrep``, ``prepare_stages``): what the cost tensor needs of one stage, independent of
  the micro-batch count: its member count, its distinct kinds (speed fraction of the stage, room, rank
  caps) and the alpha-beta p2p link to the next stage.
- cost tensor (``joint_cost_tensor``): ``autopar.cost.stage.stage_cost_tensor`` with one member load
  per kind: its speed's share of the largest micro-batch (``StagePrep.shares``: largest remainder, as
  the built plan splits it), the kind's span times
  (slowest rank at its share, TP all-reduces; no per-call overhead, which the simulated prediction
  adds), its room and rank caps.
- split lower bound (``split_lower_bound``): a bound of the split estimate
  ``sum_s t_s + (M - 1) max_s t_s`` of a grouping over every split, without the cost tensor.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopar.cost import tp as tp_cost
from autopar.cost.memory import loss_bytes_per_sample, sync_reduce_bytes, tp_span_factors, usable_bytes
from autopar.cost.stage import MemberLoad, RowParts, StageLink, micro_sizes, p2p_alpha_beta, span_sums, \
    stage_cost_tensor, stage_row_parts, stage_split_feasible
from autopar.cost.tp import Member
from autopar.ir.costs import ModelCosts, sharded_state_bytes
from autopar.ir.schedule import in_flight_micro_batches

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["JointContext", "StagePrep", "prepare_stages", "joint_cost_tensor", "joint_split_feasible",
           "split_lower_bound", "split_lower_bounds"]

_ROW_CACHE = 512   # stage row parts kept per search (~0.2 MB each at 82 blocks)
_TENSOR_CACHE = 32  # cost tensors kept per search (S x 0.06 MB each at 82 blocks)
_RANKS = operator.attrgetter("ranks")


# -- the cost tensor of one grouping -----------------------------------------------------------------

@dataclass
class JointContext:
    """The fixed inputs of one joint planning call and the cache of what its candidates share (see the
    module docstring); mutable only through that cache."""

    costs: ModelCosts
    cluster: "Cluster"
    global_batch: int
    zero_stage: int
    memory_fraction: float
    rho: float
    members: dict                  # rank tuple -> Member
    cache: dict
    recompute: bool = False        # offer activation recomputation to stages whose memory binds
    force_recompute: bool = False  # every stage recomputes (a pinned ``recompute=True``)
    force_sp: bool = False         # every TP stage whose blocks can runs SP (a pinned ``sequence_parallel=True``)

    def kind_id(self, kind) -> int:
        ids = self.cache.setdefault("kind_ids", {})
        if kind not in ids:
            ids[kind] = len(ids)
            self.cache.setdefault("kind_list", []).append(kind)
        return ids[kind]

    def member_kind_id(self, member: Member) -> int:
        """``kind_id`` of a member's kind, cached by its ranks (hashing a kind is slow)."""
        ids = self.cache.setdefault("member_kind_ids", {})
        hit = ids.get(member.ranks)
        if hit is None or hit[0] is not member:
            hit = ids[member.ranks] = (member, self.kind_id(member.kind))
        return hit[1]

    def upper(self) -> np.ndarray:
        if "upper" not in self.cache:
            n = self.costs.num_blocks
            self.cache["upper"] = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
        return self.cache["upper"]

    def out_bytes0(self) -> np.ndarray:
        if "out0" not in self.cache:
            self.cache["out0"] = np.concatenate([[0.0], self.costs.out_bytes])
        return self.cache["out0"]

    def cap(self, r: int) -> float:
        return usable_bytes(self.cluster.devices[r].spec, self.memory_fraction)

    def ratio(self, kid: int, k: int) -> float:
        """``T_p`` x min over blocks of (time of kind ``kid`` at ``k`` samples) / (reference time
        ``p``: kind 0 at 1 sample), for ``split_lower_bound``."""
        key = ("ratio", kid, k)
        if key not in self.cache:
            ref = self.span_time(0, 1)[0]
            steps = np.diff(ref)
            mine = np.diff(self.span_time(kid, k)[0])
            ok = steps > 0
            self.cache[key] = float(ref[-1] * np.min(mine[ok] / steps[ok])) if ok.any() else 0.0
        return self.cache[key]

    def kind_speed(self, kind) -> float:
        key = ("speed", self.kind_id(kind))
        if key not in self.cache:
            f, b = tp_cost.kind_block_times(self.costs, kind, 1.0, self.rho)
            self.cache[key] = 1.0 / max(float(f.sum() + b.sum()), 1e-30)
        return self.cache[key]

    def span_time(self, kid: int, k: int, recompute: bool = False) -> np.ndarray:
        """[i, j] = forward + backward seconds of blocks [i, j) on kind ``kid`` at ``k`` samples; with
        ``recompute`` the backward reruns the forward (one more forward)."""
        key = ("span", kid, k, recompute)
        if key not in self.cache:
            kind = self.cache["kind_list"][kid]
            f, b = tp_cost.kind_block_times(self.costs, kind, float(k), self.rho)
            self.cache[key] = span_sums((2 * f if recompute else f) + b)
        return self.cache[key]

    def spans(self):
        if "spans" not in self.cache:
            c = self.costs
            self.cache["spans"] = (span_sums(c.params), span_sums(c.param_bytes), span_sums(c.act_bytes))
        return self.cache["spans"]

    def shares(self, prep: "StagePrep", samples: int) -> tuple[int, ...]:
        """``prep.shares(samples)``, cached: by the prep's share id (``prepare_stages``: stages of the same
        member count, kind ids, speed fractions and counts, all ``StagePrep.shares`` reads, share it), else
        by the prep (it lives as long as its grouping's entry)."""
        if prep.share_id >= 0:
            key = ("shares", prep.share_id, samples)
            hit = self.cache.get(key)
            if hit is None:
                hit = self.cache[key] = prep.shares(samples)
            return hit
        key = ("shares", id(prep), samples)
        hit = self.cache.get(key)
        if hit is None or hit[0] is not prep:
            hit = self.cache[key] = (prep, prep.shares(samples))
        return hit[1]

    def zero_for(self, num_micro: int) -> int:
        """The ZeRO stage whose memory a candidate of ``num_micro`` micro-batches is searched with:
        ZeRO-2 only at one micro-batch (see the module docstring)."""
        return self.zero_stage if num_micro <= 1 else min(self.zero_stage, 1)

    def state(self, num_members: int, zero_stage: int | None = None) -> np.ndarray:
        z = self.zero_stage if zero_stage is None else zero_stage
        key = ("state", num_members, z)
        if key not in self.cache:
            c = self.costs
            params, wbytes, _ = self.spans()
            self.cache[key] = sharded_state_bytes(wbytes, params, c.grad_bytes_per_param,
                                                  c.optimizer_bytes_per_param, z, 1.0 / num_members)
        return self.cache[key]

    def rank_caps(self, member: Member) -> tuple[tuple[float, float], ...]:
        """Distinct (usable bytes, share fraction) of the member's ranks (fraction 1 for one rank)."""
        key = ("caps", member.ranks)
        if key in self.cache:
            return self.cache[key]
        n = len(member.ranks)
        fracs = np.asarray(member.shares, float) / sum(member.shares) if n > 1 else np.ones(1)
        self.cache[key] = tuple(sorted({(self.cap(r), float(f)) for r, f in zip(member.ranks, fracs)}))
        return self.cache[key]

    def span_factors(self, fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """([i, j] state, [i, j] activation) work factors of a TP rank holding ``fraction`` of its
        group's units (``cost.memory.tp_span_factors``: what ``stage_memory_bytes`` prices a built
        stage's ranks with, so a plan the search accepts passes its final check)."""
        key = ("span_factors", fraction)
        if key not in self.cache:
            self.cache[key] = tp_span_factors(self.costs, self.rho, fraction)
        return self.cache[key]

    def room(self, member: Member) -> float:
        """The usable bytes of the member's tightest rank (for reports; the rows price every rank)."""
        key = ("room", member.ranks)
        if key not in self.cache:
            self.cache[key] = min(self.cap(r) for r in member.ranks)
        return self.cache[key]

    def reduce_span(self, num_members: int, synced: bool) -> np.ndarray | float:
        """[i, j] what a stage holds after backward to reduce its gradients
        (``cost.memory.stage_reduce_bytes``): none for one member; where the data-parallel sync runs
        (ZeRO >= 1 over one-rank members or TP members of equal shares) its shard sum and staging,
        else the whole gradient's flat copy."""
        if num_members < 2:
            return 0.0
        key = ("reduce", num_members, synced)
        if key not in self.cache:
            g = self.costs.grad_bytes_per_param
            numel = self.spans()[0]
            self.cache[key] = sync_reduce_bytes(numel, num_members, g) if synced else numel * g
        return self.cache[key]


@dataclass(frozen=True, slots=True)
class StagePrep:
    """What the cost tensor needs of one stage, independent of the micro-batch count."""

    num_members: int
    # distinct (kind id, speed fraction of the stage, room, distinct (cap bytes, share fraction) of its ranks)
    kinds: tuple[tuple[int, float, float, tuple[tuple[float, float], ...]], ...]
    p2p: StageLink | None                         # the link to the next stage
    counts: tuple[int, ...] = ()                  # members of each ``kinds`` entry
    tp: bool = False                              # a member is a tensor-parallel group
    load_id: int = -1                             # equal for preps of equal loads (-1: not interned)
    tp_even: bool = False                         # TP members all of the same shares (ZeRO-1 runs)
    share_id: int = -1                            # equal for preps of equal ``shares`` inputs (-1: not interned)

    def shares(self, samples: int) -> tuple[int, ...]:
        """Per ``kinds`` entry, the most samples of a micro-batch of ``samples`` any of its members
        computes when the stage splits it in proportion to speed by largest remainder (as the plan's
        ``member_shares`` does): the floor of its exact share, plus one where the remainder reaches
        it (entries of an equal remainder all count as reached, whichever the rotation serves)."""
        if self.num_members == 1:
            return tuple(samples for _ in self.kinds)
        counts = self.counts or (1,) * len(self.kinds)
        if len(self.kinds) == 1:   # the loop below with one entry
            x = samples * self.kinds[0][1]
            base = int(math.floor(x + 1e-9))
            return (base + 1,) if x - base > 1e-9 and samples - base * counts[0] > 0 else (base,)
        exact = [samples * f for _, f, _, _ in self.kinds]
        base = [int(math.floor(x + 1e-9)) for x in exact]
        rest = samples - sum(b * n for b, n in zip(base, counts))
        out = list(base)
        fracs = [x - b for x, b in zip(exact, base)]
        for frac in sorted({round(f, 9) for f in fracs if f > 1e-9}, reverse=True):
            if rest <= 0:
                break
            tied = [k for k, f in enumerate(fracs) if round(f, 9) == frac]
            for k in tied:
                out[k] += 1
            rest -= sum(counts[k] for k in tied)
        return tuple(out)


def prepare_stages(ctx: JointContext, stages: Sequence[Sequence[Member]]) -> list[StagePrep]:
    """The ``StagePrep`` of every stage of a grouping (members: ``Member``s)."""
    out = []
    links = ctx.cache.setdefault("p2p", {})            # (src, dst) -> alpha-beta terms
    made = ctx.cache.setdefault("preps", {})           # (members' ids, link) -> its (frozen) StagePrep
    last = len(stages) - 1
    for s, members in enumerate(stages):
        link = None
        if s < last:
            nxt = stages[s + 1]
            link = (members[0].ranks[0], nxt[0].ranks[0], min(len(members), len(nxt)))
        ids = tuple(map(id, members))
        key = (ids, link)   # ids stay valid: ``_stage_load`` keeps the members
        prep = made.get(key)
        if prep is None:
            num, kinds, counts, tp, load_id, tp_even, share_id = _stage_load(ctx, members, ids)
            p2p = None
            if link is not None:
                pair = link[:2]
                if pair not in links:
                    links[pair] = p2p_alpha_beta(ctx.cluster, *pair)
                p2p = StageLink(*links[pair], link[2])
            prep = made[key] = StagePrep(num, kinds, p2p, counts, tp, load_id, tp_even, share_id)
        out.append(prep)
    return out


def _stage_load(ctx: JointContext, members: Sequence[Member], key: tuple | None = None) -> tuple:
    """(member count, kinds, counts, tp, load id, tp_even, share id) of a ``StagePrep`` on ``members``: what
    depends on the members alone, computed once per stage of the search (groupings share most stages:
    22 441 stages, 6 326 distinct, llama-140b on hethub-768); keyed by the members' ids and kept with
    them, so that no id is reused while the entry lives (``key``: those ids, when the caller has them)."""
    done = ctx.cache.setdefault("stage_loads", {})
    key = tuple(map(id, members)) if key is None else key
    hit = done.get(key)
    if hit is not None:
        return hit[1]
    # member id -> its fact (sig, tp, shares), interned: one object per distinct fact, so that a stage of
    # hundreds of members is one C-level count of fact ids
    facts = ctx.cache.setdefault("member_facts", {})
    by_id = ctx.cache.setdefault("fact_by_id", {})      # id(fact) -> fact, for the distinct facts
    speed = ctx.cache.setdefault("member_speed", {})    # member id -> its speed
    try:
        per_fact = Counter(map(id, map(facts.__getitem__, key)))
    except KeyError:
        interned = ctx.cache.setdefault("member_sigs", {})  # (kind id, speed, room, rank caps), one object each
        distinct = ctx.cache.setdefault("fact_objects", {})
        keep = ctx.cache.setdefault("fact_members", [])     # the members, so that no id is reused
        for m in members:
            if id(m) not in facts:
                sig = (ctx.member_kind_id(m), ctx.kind_speed(m.kind), ctx.room(m), ctx.rank_caps(m))
                sig = interned.setdefault(sig, sig)
                fact = (sig, len(m.ranks) > 1, tuple(m.shares))
                if fact not in distinct:
                    distinct[fact] = by_id[id(fact)] = fact
                facts[id(m)] = distinct[fact]
                speed[id(m)] = sig[1]
                keep.append(m)
        per_fact = Counter(map(id, map(facts.__getitem__, key)))
    present = [(by_id[i], n) for i, n in per_fact.items()]
    total = sum(map(speed.__getitem__, key))   # member by member, as ever: the same float
    tally: dict = {}   # (kind id, speed fraction, room, caps) -> members: equal members counted at once
    for (sig, _, _), num in present:
        i, x, room, caps = sig
        k = (i, x / total, room, caps)
        tally[k] = tally.get(k, 0) + num
    kinds = tuple(sorted(tally))
    counts = tuple(tally[k] for k in kinds)
    tp = any(f[1] for f, _ in present)
    shares = {f[2] for f, _ in present}
    ids = ctx.cache.setdefault("load_ids", {})
    load_id = ids.setdefault((len(members), kinds, counts, tp), len(ids))
    tp_even = tp and len(members) > 1 and len(shares) == 1
    sids = ctx.cache.setdefault("share_ids", {})   # what ``StagePrep.shares`` and ``_stage_q`` read
    share_id = sids.setdefault((len(members), tuple((k[0], k[1]) for k in kinds), counts), len(sids))
    out = (len(members), kinds, counts, tp, load_id, tp_even, share_id)
    done[key] = (tuple(members), out)
    return out


def _tensor_key(ctx: JointContext, prep: Sequence[StagePrep], num_micro: int, schedule: str,
                recompute: bool) -> tuple:
    """All a grouping's cost tensor and its feasibility depend on at ``num_micro`` micro-batches: the
    micro-batch size, each stage's in-flight count (from M = S on, 1F1B's no longer grows with M),
    the ZeRO stage searched with and the flags; counts that agree on these get the same tensor."""
    b = micro_sizes(ctx.global_batch, num_micro)[0]
    S = len(prep)
    fly = tuple(in_flight_micro_batches(schedule, s, S, num_micro) for s in range(S))
    return id(prep), b, fly, ctx.zero_for(num_micro), schedule, bool(recompute)


def joint_cost_tensor(ctx: JointContext, prep: Sequence[StagePrep], num_micro: int, schedule: str,
                      recompute: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``autopar.cost.stage.stage_cost_tensor`` of a prepared grouping at ``num_micro`` micro-batches
    (member loads: see the module docstring); ``recompute``: whether entries that do not fit keeping
    every activation may recompute them. Stages of the same loads share one row. The last
    ``_TENSOR_CACHE`` tensors are kept by ``_tensor_key`` (read-only: callers must not write them)."""
    key = _tensor_key(ctx, prep, num_micro, schedule, recompute)
    made = ctx.cache.setdefault("tensors", {})
    hit = made.get(key)
    if hit is not None and hit[0] is prep:
        return hit[1]
    b = key[1]
    out = stage_cost_tensor(ctx.costs, [st.p2p for st in prep], num_micro, b, schedule,
                            _grouping_parts(ctx, prep, num_micro, recompute))
    if len(made) >= _TENSOR_CACHE:
        made.pop(next(iter(made)))
    made[key] = (prep, out)   # keeps ``prep`` alive, so its id is not reused
    return out


def joint_split_feasible(ctx: JointContext, prep: Sequence[StagePrep], num_micro: int, schedule: str,
                         recompute: bool = True) -> bool:
    """Whether some split of the grouping fits at ``num_micro`` micro-batches: exactly whether
    ``joint_cost_tensor``'s least bottleneck is finite, without building it
    (``autopar.cost.stage.stage_split_feasible``); remembered by ``_tensor_key``."""
    key = _tensor_key(ctx, prep, num_micro, schedule, recompute)
    done = ctx.cache.setdefault("feasible", {})
    hit = done.get(key)
    if hit is not None and hit[0] is prep:
        return hit[1]
    got = stage_split_feasible(ctx.costs, [st.p2p for st in prep], num_micro, key[1], schedule,
                               _grouping_parts(ctx, prep, num_micro, recompute))
    done[key] = (prep, got)
    return got


def _grouping_parts(ctx: JointContext, prep: Sequence[StagePrep], num_micro: int, recompute: bool):
    """``parts(s)``: the ``RowParts`` of stage s of a prepared grouping at ``num_micro`` micro-batches."""
    b = micro_sizes(ctx.global_batch, num_micro)[0]
    _, _, act = ctx.spans()
    valid = ctx.upper()
    input_bytes = ctx.out_bytes0()
    zero = ctx.zero_for(num_micro)
    rows = ctx.cache.setdefault("row_parts", {})   # shared by every grouping and count of the search
    force = recompute and ctx.force_recompute
    # the state as the engines hold it (``cost.memory.stage_state_bytes``): ZeRO-1 at most (the whole
    # gradient under ZeRO-2: the same bytes as ZeRO-1); on a stage with a TP member only where its
    # members have the same shares (``cost.tp.tp_zero_stage``), else ZeRO-0
    zs = [0 if st.tp and not st.tp_even else min(zero, 1) for st in prep]
    local: dict = {}

    last = len(prep) - 1
    loss = loss_bytes_per_sample(ctx.costs)

    def parts(s: int) -> RowParts:
        st = prep[s]
        lk = (id(st), zs[s], s == last)
        if lk in local:
            return local[lk]
        shares = tuple((i, k, room, caps) for (i, _, room, caps), k in zip(st.kinds, ctx.shares(st, b)))
        sig = (shares, st.num_members, recompute, zs[s], force, s == last, st.tp_even)
        hit = rows.get(sig)
        if hit is None:
            # per rank: its usable bytes and the state / activation work factors of its share fraction
            loads = [MemberLoad(k, ctx.span_time(kid, k), ctx.span_time(kid, k, True) if recompute else None,
                                room, tuple((cap, *ctx.span_factors(f)) for cap, f in caps))
                     for kid, k, room, caps in shares]
            if len(rows) >= _ROW_CACHE:
                rows.pop(next(iter(rows)))   # the oldest: the search moves on through the counts
            hit = rows[sig] = stage_row_parts(ctx.state(st.num_members, zs[s]), act, input_bytes, valid, loads,
                                              recompute, force, loss if s == last else 0.0,
                                              ctx.reduce_span(st.num_members, zs[s] >= 1))
        local[lk] = hit
        return hit

    return parts


def split_lower_bound(ctx: JointContext, prep: Sequence[StagePrep], num_micro: int) -> float:
    """A lower bound of the split estimate ``sum_s t_s + (M - 1) max_s t_s`` of a grouping at M micro-
    batches, over every split, without the cost tensor. With a reference profile ``p`` (the first
    kind at 1 sample), stage s holding blocks of profile fraction x_s takes at least ``x_s * q_s``,
    q_s = ``T_p`` x the least per-block ratio of its slowest kind's time at its share to ``p``. Then
    max_s x_s q_s >= c* = 1 / sum_s (1 / q_s) (as sum x_s = 1) and sum_s x_s q_s >= min_s q_s."""
    b = micro_sizes(ctx.global_batch, num_micro)[0]
    key = ("slb_ids", id(prep))
    hit = ctx.cache.get(key)
    if hit is None or hit[0] is not prep:
        lids = [st.share_id if st.share_id >= 0 else ("prep", id(st)) for st in prep]
        hit = ctx.cache[key] = (prep, lids, {})   # the last: micro-batch size -> (sum 1 / q_s, min q_s)
    terms = hit[2].get(b)
    if terms is None:
        terms = hit[2][b] = _split_bound_terms(ctx, prep, hit[1], b)
    inv, low = terms
    if inv <= 0:
        return 0.0
    return (num_micro - 1) / inv + low


def split_lower_bounds(ctx: JointContext, prep: Sequence[StagePrep], counts: Sequence[int]) -> list[float]:
    """``split_lower_bound(ctx, prep, M)`` for every M of ``counts``, the same floats: each stage's q_s
    is looked up once per distinct load and micro-batch size, and the sums sum_s 1 / q_s run in stage
    order for all the sizes at once (``np.cumsum`` adds sequentially, as the one-count loop does)."""
    B = ctx.global_batch
    key = ("slb_ids", id(prep))
    hit = ctx.cache.get(key)
    if hit is None or hit[0] is not prep:
        lids = [st.share_id if st.share_id >= 0 else ("prep", id(st)) for st in prep]
        hit = ctx.cache[key] = (prep, lids, {})
    lids, done = hit[1], hit[2]
    if not lids:
        return [0.0] * len(counts)
    sizes = [-(-B // M) for M in counts]   # micro_sizes(B, M)[0]
    todo = sorted({b for b in sizes if b not in done})
    if todo:
        first: dict = {}                     # load id -> its first stage
        for s, lid in enumerate(lids):
            first.setdefault(lid, s)
        uniq = list(first)
        pos = {lid: u for u, lid in enumerate(uniq)}
        idx = np.fromiter((pos[lid] for lid in lids), dtype=np.intp, count=len(lids))
        rows = []
        for b in todo:
            qs = ctx.cache.setdefault(("slb_q", b), {})   # ``_stage_q``'s memo, read here first
            row = list(map(qs.get, uniq))
            for u, q in enumerate(row):
                if q is None:
                    row[u] = _stage_q(ctx, prep[first[uniq[u]]], uniq[u], b)
            rows.append(row)
        q = np.array(rows, dtype=np.float64)
        bad = (q <= 0).any(axis=1)
        with np.errstate(divide="ignore"):
            inv = np.cumsum(1.0 / q[:, idx], axis=1)[:, -1]
        low = q.min(axis=1)
        for b, x, lo, z in zip(todo, inv.tolist(), low.tolist(), bad.tolist()):
            done[b] = (0.0, 0.0) if z else (x, lo)
    out = []
    for M, b in zip(counts, sizes):
        inv_b, low_b = done[b]
        out.append(0.0 if inv_b <= 0 else (M - 1) / inv_b + low_b)
    return out


def _stage_q(ctx: JointContext, st: StagePrep, lid, b: int) -> float:
    """q_s of ``split_lower_bound`` of a stage of share id ``lid`` at micro-batch size ``b`` (cached by
    share id when the stage is interned: q_s reads only the kind ids and ``StagePrep.shares``)."""
    qs = ctx.cache.setdefault(("slb_q", b), {})
    q = qs.get(lid)
    if q is None:
        q = 0.0
        for (kid, _f, _room, _caps), k in zip(st.kinds, ctx.shares(st, b)):
            if k > 0:
                q = max(q, ctx.ratio(kid, k))
        if st.share_id >= 0:
            qs[lid] = q
    return q


def _split_bound_terms(ctx: JointContext, prep: Sequence[StagePrep], lids: list, b: int) -> tuple[float, float]:
    """(sum_s 1 / q_s, min_s q_s) of ``split_lower_bound`` at micro-batch size ``b``; (0, 0) when a
    q_s is 0 (the bound is then 0)."""
    inv, low = 0.0, math.inf
    for st, lid in zip(prep, lids):
        q = _stage_q(ctx, st, lid, b)   # per share id: q_s (the same for stages of equal shares)
        if q <= 0:
            return 0.0, 0.0
        inv += 1.0 / q
        low = min(low, q)
    return inv, low
