"""The joint search's memos and vectorised pricing give the floats the member-by-member code gave
(issue 14: plan_auto faster, plans bit for bit): ``stage_durations`` pricing members of one kind as one
matrix against the per-member loop it replaced, one-kind ``StagePrep.shares`` against the general
largest-remainder rule, ``stage_optimizer_s`` / ``stage_sync_time_s`` with and without their memos
against the per-rank loop, the cost tensor and feasibility memo against fresh contexts. Pure
functions on small synthetic clusters."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from autopar.cluster.model import Cluster
from autopar.cost import comm
from autopar.cost import tp as tp_cost
from autopar.cost.comm import allgather_time_s, p2p_time_s
from autopar.cost.joint import StagePrep, joint_cost_tensor, joint_split_feasible, prepare_stages
from autopar.cost.pipeline import stage_durations, stage_optimizer_s
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Stage
from autopar.planner.layouts import member_groupings, member_layouts
from autopar.planner.pp import member_shares, micro_candidates, min_bottleneck
from test_planner_speed_search import _entries

TYPES = ("A100-80GB", "V100-16GB")


def _cluster() -> Cluster:
    return Cluster.from_dict({"nodes": [{"device": "A100-80GB", "count": 4}, {"device": "A100-80GB", "count": 4},
                                        {"device": "V100-16GB", "count": 4}],
                              "network": {"bandwidth_GBps": 10, "latency_us": 10}})


def _costs(seed: int, n: int = 8) -> ModelCosts:
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.002, 0.02, n)
    c = ModelCosts.synthetic({"A100-80GB": base, "V100-16GB": base * 2.5}, param_bytes=rng.uniform(2e7, 8e7, n),
                             act_bytes=rng.uniform(1e6, 6e6, n), out_bytes=rng.uniform(1e5, 3e6, n),
                             overhead_s=1e-4)
    c.call_overhead_s.update({"A100-80GB": 3e-5, "V100-16GB": 5e-5})
    return c


# -- the code the memos replaced, kept as the oracle ----------------------------------------------------

def _durations_member_by_member(costs, cluster, stages, rho):
    S = len(stages)
    M = max(len(mb) for st in stages for mb in st.micro_batches)
    fwd, bwd, comm = np.zeros((S, M)), np.zeros((S, M)), np.zeros((max(S - 1, 0), M))
    tp_seen, tp_ids = {}, {}
    for s, st in enumerate(stages):
        blocks = slice(st.block_start, st.block_stop)
        seen, done = {}, set()
        for g, members in enumerate(st.groups):
            t = cluster.devices[members[0]].spec.name
            kind = None
            if len(members) > 1 and st.tp_shares:
                kind = tp_cost.group_kind(cluster, members, st.tp_shares[g])
                t = tp_ids.setdefault(kind, len(tp_ids))
            call = max(costs.call_overhead(cluster.devices[r].spec.name) for r in members)
            xs = st.micro_batches[g]
            if (t, call, xs) in done:
                continue
            done.add((t, call, xs))
            arr = np.asarray(xs)
            for x in dict.fromkeys(xs):
                if (t, x) not in seen:
                    if kind is None:
                        seen[(t, x)] = (float(costs.fwd_time(t, x)[blocks].sum()),
                                        float(costs.bwd_time(t, x)[blocks].sum()))
                    else:
                        seen[(t, x)] = tp_cost.kind_times(costs, cluster, kind, x, blocks, rho, tp_seen)
                f, b = seen[(t, x)]
                if x > 0:
                    f, b = f + call, b + call
                    if st.recompute:
                        b = b + f
                at = np.flatnonzero(arr == x)
                fwd[s, at] = np.maximum(fwd[s, at], f)
                bwd[s, at] = np.maximum(bwd[s, at], b)
        if s < S - 1:
            nxt = stages[s + 1]
            links = min(len(st.groups), len(nxt.groups))
            per_sample = float(costs.out_bytes[st.block_stop - 1])
            sizes = [sum(col) for col in itertools.zip_longest(*st.micro_batches, fillvalue=0)]
            t = len(st.groups[0]) if st.tp_shares else 1        # TP ranks send a copy each to their peers,
            u = len(nxt.groups[0]) if nxt.tp_shares else 1      # or a chunk each between equal degrees
            for m, size in enumerate(sizes + [0] * (M - len(sizes))):
                nbytes = per_sample * math.ceil(size / links)
                if t == u > 1:
                    comm[s, m] = p2p_time_s(cluster, st.groups[0][0], nxt.groups[0][0], nbytes / t) + (
                        allgather_time_s(cluster, nxt.groups[0], nbytes) if nbytes > 0 else 0.0)
                else:
                    comm[s, m] = p2p_time_s(cluster, st.groups[0][0], nxt.groups[0][0], nbytes * -(-u // t))
    return fwd, bwd, comm


def _optimizer_rank_by_rank(costs, cluster, stage, zero_stage, rho):
    p = float(costs.params[stage.block_start:stage.block_stop].sum())
    k = costs.block_tensors(slice(stage.block_start, stage.block_stop))
    nm = len(stage.groups)
    tp = bool(stage.tp_shares) and any(len(g) > 1 for g in stage.groups)
    worst, seen = 0.0, set()
    tp_zero = bool(tp_cost.tp_zero_stage(stage, zero_stage)) if tp else False
    for g, members in enumerate(stage.groups):
        held = None
        if tp and len(members) > 1:
            shares = np.asarray(stage.tp_shares[g], dtype=np.float64)
            held = tp_cost.tp_rank_params(costs, slice(stage.block_start, stage.block_stop),
                                          shares / max(shares.sum(), 1.0), rho)
            if tp_zero:
                held = held / nm
        for i, r in enumerate(members):
            n, tensors, flat = p, k, False
            if held is not None:
                n, flat = float(held[i]), tp_zero
            elif zero_stage >= 1 and nm > 1 and not tp:
                n, tensors = p / nm, (None if k is None else k / nm)
            t = cluster.devices[r].spec.name
            if (t, n) in seen:
                continue
            seen.add((t, n))
            worst = max(worst, costs.optimizer_time(t, n, flat=flat, tensors=tensors)
                        + (costs.call_overhead(t) if n > 0 else 0.0))
    return worst


def _shares_general(prep: StagePrep, samples: int) -> tuple[int, ...]:
    counts = prep.counts or (1,) * len(prep.kinds)
    exact = [samples * f for _, f, _, _ in prep.kinds]
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


# -- random stages --------------------------------------------------------------------------------------

def _random_stages(rng, costs, cluster, tp: bool) -> list[Stage]:
    """Pipeline stages over a random cut of the blocks, each of random members: TP groups of 2 or 4
    consecutive ranks of one node (uneven head shares) or single ranks, with rotated micro-batch shares."""
    n = costs.num_blocks
    S = int(rng.integers(1, 4))
    cuts = sorted(rng.choice(np.arange(1, n), size=S - 1, replace=False).tolist()) if S > 1 else []
    bounds = [0, *cuts, n]
    M = int(rng.integers(1, 7))
    micro = [int(x) for x in rng.integers(0, 9, size=M)]
    out = []
    free = set(range(len(cluster)))   # every rank in at most one member
    for s in range(S):
        groups, shares = [], []
        for _ in range(int(rng.integers(1, 4))):
            node = int(rng.integers(0, 3))
            size = int(rng.choice([2, 4])) if rng.random() < (0.6 if tp else 0.2) else 1   # untyped: no shares
            first = node * 4 + (0 if size == 4 else size * int(rng.integers(0, 4 // size)))
            g = tuple(range(first, first + size))
            if not free.issuperset(g):
                continue
            free -= set(g)
            sh = tuple(int(x) for x in rng.integers(1, 5, size=size)) if size > 1 else (1,)
            groups.append(g)
            shares.append(sh)
        if not groups:
            break
        speeds = [float(rng.choice([1.0, 1.0, 0.4])) for _ in groups]
        per_micro = [member_shares(b, speeds, i) for i, b in enumerate(micro)]
        mbs = tuple(tuple(pm[g] for pm in per_micro) for g in range(len(groups)))
        out.append(Stage(block_start=bounds[s], block_stop=bounds[s + 1], groups=tuple(groups), micro_batches=mbs,
                         tp_shares=tuple(shares) if tp else (), recompute=bool(rng.random() < 0.3)))
    if len(out) < S:   # out of free ranks: the stages made, over all the blocks
        out[-1] = Stage(block_start=out[-1].block_start, block_stop=n, groups=out[-1].groups,
                        micro_batches=out[-1].micro_batches, tp_shares=out[-1].tp_shares,
                        recompute=out[-1].recompute)
    return out


@pytest.mark.parametrize("tp", [False, True])
def test_stage_durations_equal_the_member_by_member_prices(tp):
    cluster = _cluster()
    kinds: dict = {}
    rng = np.random.default_rng(5 + tp)
    for case in range(40):
        costs = _costs(case % 5)
        stages = _random_stages(rng, costs, cluster, tp)
        want = _durations_member_by_member(costs, cluster, stages, 0.1)
        for memo in (None, kinds):   # a kind memo kept across calls changes nothing
            got = stage_durations(costs, cluster, stages, replicated_fraction=0.1, kinds=memo)
            for a, b in zip(got, want):
                assert a.shape == b.shape and np.array_equal(a, b), (case, stages)


def test_stage_optimizer_and_sync_memos_equal_the_rank_by_rank_prices():
    cluster = _cluster()
    rng = np.random.default_rng(11)
    types = {}
    for case in range(60):
        costs = _costs(case % 3)
        for st in _random_stages(rng, costs, cluster, tp=bool(case % 2)):
            for zero in (0, 1, 2):
                want = _optimizer_rank_by_rank(costs, cluster, st, zero, 0.1)
                assert stage_optimizer_s(costs, cluster, st, zero, 0.1) == want
                assert stage_optimizer_s(costs, cluster, st, zero, 0.1, types=types) == want
            plain = tp_cost.stage_sync_time_s(costs, cluster, st, 0.1)
            assert tp_cost.stage_sync_time_s(costs, cluster, st, 0.1) == plain   # its rings remembered
            if len(st.groups) > 1 and len({len(g) for g in st.groups}) == 1:
                # the distinct rings price as every position's ring does
                every = [list(r) for r in zip(*st.groups)]
                distinct = comm.distinct_rings(cluster, st.groups)
                assert {tuple(r) for r in distinct} <= {tuple(r) for r in every}
                assert max(comm.allreduce_time_s(cluster, r, 1e6, algorithm="auto") for r in distinct) == \
                    max(comm.allreduce_time_s(cluster, r, 1e6, algorithm="auto") for r in every)


def test_one_kind_shares_are_the_general_rule():
    rng = np.random.default_rng(3)
    for _ in range(400):
        n = int(rng.integers(2, 40))
        speed = float(rng.uniform(0.1, 3.0))
        f = speed / sum([speed] * n) if rng.random() < 0.7 else float(rng.uniform(0.01, 1.0))
        prep = StagePrep(n, ((0, f, 1.0, ((1.0, 1.0),)),), None, (n,))
        for samples in range(0, 130):
            assert prep.shares(samples) == _shares_general(prep, samples), (n, f, samples)


def _joint_entries(costs, cluster, batch):
    ctx, states = _entries(costs, cluster, batch)
    return ctx, [st.prep for st in states]


def test_prepared_stages_tensors_and_feasibility_are_those_of_fresh_contexts():
    costs, cluster = _costs(2, 10), _cluster()
    ctx, entries = _joint_entries(costs, cluster, 96)
    assert entries
    again = [prepare_stages(ctx, [[ctx.members[g] for g in st] for st in gr.stages])
             for lay in member_layouts(costs, cluster, num_heads=8, degrees=(4,), replicated_fraction=0.1)
             for gr in member_groupings(cluster, lay, costs.num_blocks,
                                        {m.kind: ctx.kind_speed(m.kind) for m in lay.members})
             if all(g in ctx.members for st in gr.stages for g in st)][:3]
    assert all(isinstance(p, StagePrep) for prep in again for p in prep)
    repeats = 0
    for e, prep in enumerate(entries[:40]):
        for M in micro_candidates(96, len(prep)):
            fresh_ctx, fresh = _joint_entries(costs, cluster, 96)
            assert fresh[e] == prep   # the memoised preps are the values a fresh context builds
            seen_before = ("tensors" in ctx.cache and any(k[0] == id(prep) for k in ctx.cache["tensors"]))
            repeats += seen_before
            cost, rc = joint_cost_tensor(ctx, prep, M, "1f1b", False)
            want, want_rc = joint_cost_tensor(fresh_ctx, fresh[e], M, "1f1b", False)
            assert np.array_equal(cost, want) and np.array_equal(rc, want_rc)
            feasible = joint_split_feasible(ctx, prep, M, "1f1b", False)
            assert feasible == joint_split_feasible(fresh_ctx, fresh[e], M, "1f1b", False)
            assert feasible == math.isfinite(min_bottleneck(cost))
            if e > 4:
                break
    assert repeats > 0   # counts of one micro-batch size and in-flight depth met the memo


def test_kind_times_from_distinct_ranks_are_the_slowest_rank_of_all():
    """``kind_block_times`` prices each distinct (device type, share) rank once: the same block times
    as the slowest of every rank (``rank_block_times``) plus the collectives."""
    cluster, rng = _cluster(), np.random.default_rng(9)
    for case in range(30):
        costs = _costs(case % 4)
        ranks = [(0, 1), (0, 1, 2, 3), (8, 9), (8, 9, 10, 11), (2, 3)][case % 5]
        shares = tuple(int(x) for x in rng.choice([2, 3, 3, 5], size=len(ranks)))
        kind = tp_cost.group_kind(cluster, ranks, shares)
        for mb in (1.0, 3.0, 7.0):
            for sp in (False, True):
                f, b = tp_cost.rank_block_times(costs, kind.types, kind.shares, mb, 0.1, sp)
                cf, cb = tp_cost.tp_block_comm_s(costs, kind.alpha_s, kind.beta_s_per_byte, mb, kind.types,
                                                 kind.shares, sp, kind.sp_link, kind.hides_comm, True)
                got = tp_cost.kind_block_times(costs, kind, mb, 0.1, sequence_parallel=sp, overlap=True)
                assert np.array_equal(got[0], f.max(axis=0) + cf) and np.array_equal(got[1], b.max(axis=0) + cb)
