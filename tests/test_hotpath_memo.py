"""The planner's hot-path shortcuts (issue 14) give what the plain code gives: generated schedules equal
their definitions built action by action, trusted or remembered schedules skip the structural check
but a malformed one still fails every time, a ring checked once is not checked again while any other
ranks still are, a TP group's GEMM seconds price each distinct rank once, and the in-flight cap's
shortcut equals the three-step rounding it replaces (pure; small synthetic inputs)."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from autopar.cluster.model import Cluster
from autopar.cost import comm, tp_fwd
from autopar.cost.stage import _FITS_ANY, _in_flight_cap
from autopar.errors import ClusterError
from autopar.ir import timeline as tl
from autopar.ir.costs import ModelCosts
from autopar.ir.schedule import Action, PipelineSchedule, ScheduleError, make_schedule
from autopar.ir.timeline import simulate

A = Action


def _ref_1f1b(S: int, M: int) -> tuple:
    out = []
    for s in range(S):
        warmup = min(S - 1 - s, M)
        acts = [A(s, "F", m) for m in range(warmup)]
        f, b = warmup, 0
        while f < M:
            acts += [A(s, "F", f), A(s, "B", b)]
            f, b = f + 1, b + 1
        acts += [A(s, "B", m) for m in range(b, M)]
        out.append(tuple(acts))
    return tuple(out)


def _ref_zb(S: int, M: int) -> tuple:
    out = []
    for s in range(S):
        warmup = min(S - 1 - s, M)
        acts = [A(s, "F", m) for m in range(warmup)]
        f, pending = warmup, deque()
        for m in range(M):
            if f < M:
                acts.append(A(s, "F", f))
                f += 1
            acts.append(A(s, "BI", m))
            pending.append(m)
            while len(pending) > s:
                acts.append(A(s, "BW", pending.popleft()))
        acts += [A(s, "BW", m) for m in pending]
        out.append(tuple(acts))
    return tuple(out)


@pytest.mark.parametrize("S,M", [(1, 1), (1, 5), (3, 2), (4, 4), (5, 9), (8, 3)])
def test_generated_schedules_equal_their_definitions(S, M):
    # rows of another length first, so the shared rows are grown and sliced
    make_schedule("1f1b", S + 1, M + 3)
    assert make_schedule("1f1b", S, M).actions == _ref_1f1b(S, M)
    assert make_schedule("zb-h1", S, M).actions == _ref_zb(S, M)
    g = make_schedule("gpipe", S, M).actions
    assert g == tuple(tuple(A(s, "F", m) for m in range(M)) + tuple(A(s, "B", m) for m in range(M))
                      for s in range(S))
    assert make_schedule("interleaved-1f1b", S, M).actions == _ref_1f1b(S, M)


def test_make_schedule_is_remembered_and_normalises_its_numbers():
    a = make_schedule("1f1b", 4, 6)
    assert make_schedule("1f1b", np.int64(4), 6) is a
    assert a.to_json() == PipelineSchedule("1f1b", 6, _ref_1f1b(4, 6)).to_json()
    with pytest.raises(TypeError):
        make_schedule("1f1b", 4.0, 6)
    with pytest.raises(ScheduleError, match="unknown"):
        make_schedule("nope", 4, 6)
    with pytest.raises(ScheduleError, match="divide"):
        make_schedule("interleaved-1f1b", 6, 4, 4)


def test_trusted_schedules_skip_the_check_and_malformed_ones_still_fail(monkeypatch):
    S, M = 3, 4
    ones = np.ones((S, M))
    gen = make_schedule("1f1b", S, M)
    user = PipelineSchedule("1f1b", M, _ref_1f1b(S, M))
    want = simulate(user, ones, 2 * ones)        # checked once, then remembered by identity
    calls = []
    real = tl._check_structure
    monkeypatch.setattr(tl, "_check_structure", lambda *a: calls.append(a) or real(*a))
    assert simulate(gen, ones, 2 * ones) == want
    assert simulate(user, ones, 2 * ones) == want
    assert calls == []
    fresh = PipelineSchedule("1f1b", M, _ref_1f1b(S, M))
    assert simulate(fresh, ones, 2 * ones) == want
    assert len(calls) == 1
    # a duplicate action: fails every time (a failure is not remembered)
    bad = PipelineSchedule("1f1b", M, (_ref_1f1b(S, M)[0] + (A(0, "F", 0),),) + _ref_1f1b(S, M)[1:])
    for _ in range(2):
        with pytest.raises(ScheduleError, match="twice"):
            simulate(bad, ones, 2 * ones)
    # lists (mutable) are checked every time
    listed = PipelineSchedule("1f1b", M, [list(a) for a in _ref_1f1b(S, M)])
    simulate(listed, ones, 2 * ones)
    simulate(listed, ones, 2 * ones)
    assert len(calls) == 5


def test_implied_transfers_name_the_receives():
    S, M = 3, 2
    t = simulate(make_schedule("1f1b", S, M), np.ones((S, M)), 2 * np.ones((S, M)), np.full((S - 1, M), 0.5))
    kinds = {(a.stage, a.kind) for row in t.transfers for a, _, _ in row}
    assert kinds == {(1, "RECV_F"), (2, "RECV_F"), (0, "RECV_B"), (1, "RECV_B")}
    assert all(a == A(a.stage, a.kind, a.micro) for row in t.transfers for a, _, _ in row)


def _cluster(n=4):
    dev = {"name": "cpu", "emulate": "cpu", "speed": 1.0, "memory_GB": 4}
    return Cluster.from_dict({"nodes": [{"device": dev, "count": n}],
                              "network": {"bandwidth_GBps": 10, "latency_us": 10}})


def test_ring_checked_once_still_rejects_bad_ranks():
    cl = _cluster()
    t = comm.allreduce_time_s(cl, (0, 1, 2), 1e6)
    assert comm.allreduce_time_s(cl, [0, 1, 2], 1e6) == t
    assert (0, 1, 2) in comm._ring_memo_entry(cl)[2]
    for bad in [(True, 1, 2), (np.int64(0), 1, 2), (0, 1, 1), (0, 1, 7), ()]:
        with pytest.raises(ClusterError):
            comm.allreduce_time_s(cl, bad, 1e6)
    with pytest.raises(ClusterError):
        comm.allreduce_time_s(_cluster(2), (0, 1, 2), 1e6)   # another cluster: checked on its own


def test_group_gemm_prices_each_distinct_rank_once():
    rng = np.random.default_rng(3)
    n = 5
    costs = ModelCosts.synthetic({"a": rng.uniform(0.01, 0.02, n), "b": rng.uniform(0.01, 0.03, n)})
    share = rng.uniform(0, 0.5, (n, 3))
    groups = [(["a"] * 4, [1] * 4), (["a", "a"], [3, 1]), (["a", "b", "a", "b"], [2, 1, 2, 1]), (["b", "a"], [1, 3])]
    for types, shares in groups:
        for backward in (False, True):
            time = costs.bwd_time if backward else costs.fwd_time
            f = np.asarray(shares, float) / sum(shares)
            want = share * np.stack([time(t, 4.0) * k for t, k in zip(types, f)]).min(axis=0)[:, None]
            got = tp_fwd.group_gemm_s(costs, types, shares, 4.0, share, backward=backward)
            assert np.array_equal(got, want)


def _cap_three_steps(holds, num, per):
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(per > 0, np.floor(num / np.where(per > 0, per, 1.0)), np.where(num >= 0, _FITS_ANY, -1.0))
    q = np.clip(np.nan_to_num(q, nan=-1.0, posinf=_FITS_ANY, neginf=-1.0), -1.0, _FITS_ANY)
    exact = q < _FITS_ANY
    q = np.where(exact & holds(q + 1), q + 1, q)
    for _ in range(2):
        q = np.where(exact & (q >= 0) & ~holds(np.maximum(q, 0.0)), q - 1, q)
    return q


def test_in_flight_cap_equals_the_three_step_rounding():
    rng = np.random.default_rng(0)
    shape = (6, 6)
    seen_round = False
    for trial in range(400):
        cap = float(rng.choice([1e9, 3.3e8, np.inf, 0.0, 1e-300]) * rng.uniform(0.5, 2))
        state = rng.uniform(0, 2e9, shape)
        state[rng.random(shape) < 0.1] = np.inf
        per = float(rng.choice([1e7, 1e-310, 0.0, -1.0, np.inf])) * rng.uniform(0, 1, shape)
        per[rng.random(shape) < 0.05] = np.nan
        if trial % 3 == 0:   # sums of tenths: the quotient's floor is off by one in places
            per = np.full(shape, 0.1) * rng.integers(1, 5, shape)
            state = np.zeros(shape)
            cap = 0.1 * int(rng.integers(1, 40)) * 3
        holds = lambda f: state + per * f <= cap          # noqa: E731
        with np.errstate(all="ignore"):
            want = _cap_three_steps(holds, cap - state, per)
            got = _in_flight_cap(holds, cap - state, per)
            q0 = np.floor((cap - state) / np.where(per > 0, per, 1.0))
        seen_round |= bool(np.any((per > 0) & np.isfinite(q0) & (want != q0)))
        assert np.array_equal(got, want)
    assert seen_round   # the cases exercise the rounding steps


def _mixed_cluster():
    return Cluster.from_dict({"nodes": [{"device": {"name": n, "emulate": "cpu", "speed": s, "memory_GB": m},
                                         "count": 4, "repeat": 2}
                                        for n, s, m in (("a", 1.0, 1.0), ("b", 0.5, 2.0))]})


@pytest.mark.parametrize("groups", [
    [(0, 1), (2, 3), (4, 5), (6, 7)],          # pairs on the a nodes
    [(0, 8), (1, 9), (4, 12), (5, 13)],        # a with b: positions differ in type
    [(0, 1, 2, 3), (8, 9, 10, 11)],            # across types: every position alike
    [(3, 4), (11, 12), (2, 5)],                # members across node boundaries
])
def test_distinct_rings_equal_their_definition(groups):
    cluster = _mixed_cluster()

    def brute():
        of: dict = {}
        for j in range(len(groups[0])):
            ring = [g[j] for g in groups]
            key = tuple((cluster.devices[r].spec.name, cluster.devices[r].node - cluster.devices[ring[0]].node)
                        for r in ring)
            of.setdefault(key, ring)
        return list(of.values())

    assert comm.distinct_rings(cluster, groups) == brute()
    assert comm.distinct_rings(cluster, groups) == brute()   # remembered


def test_fits_memory_over_arrays_equals_the_rank_by_rank_check():
    from autopar.cost.memory import fits_memory, usable_bytes

    cluster = _mixed_cluster()
    big = Cluster.from_dict({"nodes": [{"device": {"name": "a", "emulate": "cpu", "speed": 1.0, "memory_GB": 1.0},
                                        "count": 8, "repeat": 10}]})
    rng = np.random.default_rng(0)
    for c in (cluster, big):
        for _ in range(50):
            mem = {r: int(x) for r, x in zip(range(len(c)), rng.uniform(0.5, 1.05, len(c)) * 0.9e9)}
            want = all(v <= usable_bytes(c.devices[r].spec, 0.9) for r, v in mem.items())
            assert fits_memory(c, mem, 0.9) == want
