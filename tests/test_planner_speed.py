"""What the planner does to plan faster changes nothing it plans: the windowed split DP returns what
the full-tensor DP it replaced returned (split and value, ties included), and the joint search's
lazily bounded best-first order visits what the eagerly bounded one did. No timing is asserted here
(benchmarks/bench_planner_cold.py measures the time)."""

from __future__ import annotations

import math

import numpy as np

from autopar.planner.split import min_bottleneck, split_blocks


# -- the full-tensor split DP the windowed one replaced (kept here as the reference) -----------------

def _full_dp_min_sum(cost):
    S, n1, _ = cost.shape
    best = np.full(n1, np.inf)
    best[0] = 0.0
    args = np.empty((S, n1), dtype=np.int64)
    cols = np.arange(n1)
    for s in range(S):
        total = best[:, None] + cost[s]
        args[s] = total.argmin(axis=0)
        best = total[args[s], cols]
    if not np.isfinite(best[-1]):
        return math.inf, None
    bounds = [n1 - 1]
    for s in range(S - 1, -1, -1):
        bounds.append(int(args[s, bounds[-1]]))
    return float(best[-1]), bounds[::-1]


def _full_split_blocks(stage_time_s, num_micro):
    cost = np.array(stage_time_s, dtype=np.float64)
    S, n1, _ = cost.shape
    if S < 1 or n1 - 1 < S:
        return None
    cost[:, np.tril_indices(n1)[0], np.tril_indices(n1)[1]] = np.inf
    floor = min_bottleneck(cost)
    if not np.isfinite(floor):
        return None
    best_value, best_bounds = math.inf, None
    capped = cost
    while True:
        total, bounds = _full_dp_min_sum(capped)
        if bounds is None:
            break
        top = max(cost[s, bounds[s], bounds[s + 1]] for s in range(S))
        value = total + (num_micro - 1) * top
        if value < best_value:
            best_value, best_bounds = value, bounds
        if num_micro == 1 or total + (num_micro - 1) * floor >= best_value or top <= floor:
            break
        capped = np.where(cost < top, cost, np.inf)
    return tuple(best_bounds[s + 1] - best_bounds[s] for s in range(S)), float(best_value)


def test_windowed_split_dp_equals_the_full_one():
    """Random tensors (additive and arbitrary costs, memory holes, integer-valued ones full of ties,
    S from 1 to n): the same split and the same value, bit for bit."""
    rng = np.random.default_rng(14)
    cases = 0
    for case in range(400):
        n = int(rng.integers(1, 17))
        S = int(rng.integers(1, n + 1))
        M = int(rng.choice([1, 2, 3, 8, 64]))
        if case % 3 == 0:
            cost = rng.integers(1, 4, (S, n + 1, n + 1)).astype(float)   # many ties
        else:
            pre = np.concatenate([[0.0], np.cumsum(rng.uniform(0.1, 1.0, n))])
            cost = (pre[None, None, :] - pre[None, :, None]) / rng.uniform(0.3, 1.0, (S, 1, 1))
        limit = rng.integers(1, n + 1, S)
        span = np.arange(n + 1)[None, :] - np.arange(n + 1)[:, None]
        cost = np.where(span[None] <= limit[:, None, None], cost, np.inf)
        want, got = _full_split_blocks(cost, M), split_blocks(cost, M)
        assert got == want, (case, n, S, M)
        cases += want is not None
    assert cases > 150   # most cases are feasible, so the comparison is not vacuous


def test_split_dp_at_llama_size():
    """82 blocks in 8 to 56 stages (the joint search's llama-140b groupings): the same as the full DP."""
    rng = np.random.default_rng(3)
    n = 82
    pre = np.concatenate([[0.0], np.cumsum(rng.uniform(0.5, 1.0, n))])
    for S in (8, 14, 28, 56):
        speed = np.repeat(rng.uniform(0.3, 1.0, 2), [S // 2, S - S // 2])
        cost = (pre[None, None, :] - pre[None, :, None]) / speed[:, None, None] + 0.01
        cost = np.where((pre[None, None, :] - pre[None, :, None]) <= 3 * n / S, cost, np.inf)
        for M in (1, 128, 342):
            assert split_blocks(cost, M) == _full_split_blocks(cost, M)


def test_split_dp_with_large_offsets_and_near_ties():
    """Stage times of a large common offset and tiny differences (the least sum far above the
    bottleneck spread, where rounding meets the walk's starting cut): still the full DP's answer."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(2, 14))
        S = int(rng.integers(1, n + 1))
        M = int(rng.choice([2, 5, 64, 1000]))
        cost = float(rng.choice([1e-3, 1.0, 1e6])) + rng.integers(0, 3, (S, n + 1, n + 1)) * float(
            rng.choice([1e-12, 1e-6, 1.0]))
        assert split_blocks(cost, M) == _full_split_blocks(cost, M)


def test_best_first_visits_in_the_order_of_the_full_bound():
    """The joint search's queue: the same items, in the same order (ties by key), as sorting by the
    full bound, stopping at the same limit; the costly part only for items that come first."""
    from autopar.planner.order import best_first

    rng = np.random.default_rng(7)
    for _ in range(200):
        k = int(rng.integers(0, 40))
        cheap = rng.integers(0, 6, k).astype(float)   # many ties
        extra = rng.integers(0, 4, k).astype(float)
        limit = float(rng.integers(0, 12))
        items = [(float(cheap[i]), int(i) // 3, int(i)) for i in range(k)]
        calls = []

        def more(e, i):
            calls.append(i)
            return float(extra[i])

        got = list(best_first(items, more, lambda: limit))
        full = sorted((c + float(extra[i]), e, i) for c, e, i in items)
        assert got == [x for x in full if x[0] <= limit]   # a prefix of the sorted items: stops at the limit
        assert all(cheap[i] <= limit for i in calls) and len(set(calls)) == len(calls)
