"""The batch allocator against brute force: every composition of the batch, every split of a share."""

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.planner.allocate import Allocation, allocate, balanced_split, rank_time_table
from autopar.errors import PlanError


# -- an independent oracle -------------------------------------------------------------------------
def _brute_rank_time(fn, m, s):
    """Least summed time over every k and its even split (sizes differ by <= 1, each <= m)."""
    if s == 0:
        return 0.0
    best = float("inf")
    for k in range(1, s + 1):
        sizes = [s // k + (1 if i < s % k else 0) for i in range(k)]
        if max(sizes) <= m:
            best = min(best, sum(fn(b) for b in sizes))
    return best


def _compositions(total, parts):
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        prev, out = -1, []
        for c in cuts + (total + parts - 1,):
            out.append(c - prev - 1)
            prev = c
        yield out


def _brute_force(fns, caps, batch, fixed=None):
    fixed = fixed or {}
    best = float("inf")
    for shares in _compositions(batch, len(fns)):
        if any(shares[r] != s for r, s in fixed.items()):
            continue
        best = min(best, max(_brute_rank_time(f, m, s) for f, m, s in zip(fns, caps, shares)))
    return best


def _random_fn(rng: random.Random):
    kind = rng.choice(["affine", "convex", "concave", "steps", "random", "padded"])
    a, b, c = rng.uniform(0, 2), rng.uniform(0.1, 3), rng.uniform(0, 0.5)
    if kind == "affine":
        return lambda x: a + b * x
    if kind == "convex":
        return lambda x: a + b * x + c * x * x
    if kind == "concave":
        return lambda x: a + b * x ** 0.5
    if kind == "steps":  # non-convex, non-decreasing
        return lambda x: a + b * (1 + (x - 1) // 3)
    if kind == "padded":  # non-monotone: sizes padded to a multiple of 4 are fast
        return lambda x: a + b * ((x + 3) // 4) * 4 - (1.5 * b if x % 4 == 0 else 0.0)
    table = [rng.uniform(0.05, 5) for _ in range(16)]  # arbitrary, usually non-monotone
    return lambda x: table[x]


def _check_allocation(alloc: Allocation, fns, caps, batch):
    assert sum(alloc.shares) == batch
    for r, (mb, s) in enumerate(zip(alloc.micro_batches, alloc.shares)):
        assert sum(mb) == s
        assert all(1 <= b <= caps[r] for b in mb)
        if mb:
            assert max(mb) - min(mb) <= 1
        assert alloc.rank_time_s[r] == pytest.approx(sum(fns[r](b) for b in mb), rel=1e-12, abs=1e-12)
    assert alloc.step_time_s == max(alloc.rank_time_s)


# -- the optimality check ----------------------------------------------------------------------------
def test_matches_brute_force_on_random_cases():
    rng = random.Random(12345)
    checked = 0
    while checked < 300:
        n = rng.randint(2, 4)
        batch = rng.randint(1, 12)
        caps = [rng.randint(0, 6) for _ in range(n)]
        if not any(caps):
            continue
        fns = [_random_fn(rng) for _ in range(n)]
        alloc = allocate(fns, caps, batch)
        _check_allocation(alloc, fns, caps, batch)
        want = _brute_force(fns, caps, batch)
        assert alloc.step_time_s == pytest.approx(want, rel=1e-12, abs=1e-12), (caps, batch)
        checked += 1


def test_matches_brute_force_with_fixed_shares():
    rng = random.Random(7)
    checked = 0
    while checked < 100:
        n = rng.randint(2, 4)
        batch = rng.randint(1, 12)
        caps = [rng.randint(1, 6) for _ in range(n)]
        fns = [_random_fn(rng) for _ in range(n)]
        pinned = rng.randrange(n)
        fixed = {pinned: rng.randint(0, batch)}
        if fixed[pinned] < batch and n == 1:
            continue
        alloc = allocate(fns, caps, batch, fixed_shares=fixed)
        _check_allocation(alloc, fns, caps, batch)
        assert alloc.shares[pinned] == fixed[pinned]
        want = _brute_force(fns, caps, batch, fixed)
        assert alloc.step_time_s == pytest.approx(want, rel=1e-12, abs=1e-12)
        checked += 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 2), st.floats(0.01, 3), st.integers(0, 5)), min_size=2, max_size=4),
    st.integers(1, 10),
)
def test_hypothesis_affine_ranks(ranks, batch):
    """Affine micro-step times (a per-step overhead plus a per-sample cost): the planner's usual case."""
    caps = [m for _, _, m in ranks]
    if not any(caps):
        with pytest.raises(PlanError, match="does not fit"):
            allocate([lambda b: 1.0] * len(caps), caps, batch)
        return
    fns = [(lambda b, a=a, c=c: a + c * b) for a, c, _ in ranks]
    alloc = allocate(fns, caps, batch)
    _check_allocation(alloc, fns, caps, batch)
    assert alloc.step_time_s == pytest.approx(_brute_force(fns, caps, batch), rel=1e-12, abs=1e-12)


# -- behaviour -----------------------------------------------------------------------------------------
def test_faster_rank_gets_more_and_indivisible_batch_is_covered():
    fast, slow = (lambda b: 0.1 * b), (lambda b: 0.3 * b)
    alloc = allocate([fast, slow, slow], [64, 64, 64], 47)
    assert sum(alloc.shares) == 47
    assert alloc.shares[0] > alloc.shares[1]
    # 3:1:1 speed ratio -> about 28/9.5/9.5
    assert alloc.shares[0] in (27, 28, 29)


def test_fewest_micro_steps_with_overhead():
    alloc = allocate([lambda b: 1.0 + b], [4], 10)
    assert alloc.micro_batches == ((4, 3, 3),)
    assert alloc.rank_time_s[0] == pytest.approx(3 * 1.0 + 10)


def test_rank_may_get_zero_samples():
    alloc = allocate([lambda b: 0.01 * b, lambda b: 100.0 * b], [8, 8], 4)
    assert alloc.shares == (4, 0)
    assert alloc.micro_batches[1] == ()
    assert alloc.rank_time_s[1] == 0.0


def test_memory_cap_zero_rank_gets_nothing():
    alloc = allocate([lambda b: 1.0 * b, lambda b: 0.001 * b], [3, 0], 7)
    assert alloc.shares == (7, 0)
    assert alloc.micro_batches[0] == (3, 2, 2)


def test_balanced_split():
    assert balanced_split(10, 3) == (4, 3, 3)
    assert balanced_split(0, 0) == ()
    with pytest.raises(ValueError):
        balanced_split(3, 0)


def test_rank_time_table_prefers_fewer_steps_on_ties():
    T, K = rank_time_table(lambda b: 2.0 * b, 4, 9)
    assert T[9] == pytest.approx(18.0)
    assert K[9] == 3 and K[4] == 1 and K[0] == 0


def test_errors_say_needed_and_available():
    with pytest.raises(PlanError, match="does not fit"):
        allocate([lambda b: 1.0, lambda b: 1.0], [0, 0], 4)
    with pytest.raises(PlanError, match="pin 9 samples, more than global_batch = 8"):
        allocate([lambda b: 1.0] * 2, [4, 4], 8, fixed_shares={0: 9})
    with pytest.raises(PlanError, match="remaining 3"):
        allocate([lambda b: 1.0] * 2, [4, 0], 8, fixed_shares={0: 5})
    with pytest.raises(PlanError, match="rank 5 does not exist"):
        allocate([lambda b: 1.0] * 2, [4, 4], 8, fixed_shares={5: 1})
    with pytest.raises(PlanError, match="cannot hold"):
        allocate([lambda b: 1.0] * 2, [4, 0], 8, fixed_shares={1: 1})
    with pytest.raises(PlanError, match="global_batch"):
        allocate([lambda b: 1.0], [4], 0)
    with pytest.raises(ValueError, match="max_micro has 1 entries"):
        allocate([lambda b: 1.0] * 2, [4], 3)
    with pytest.raises(ValueError, match="finite"):
        allocate([lambda b: float("nan")], [4], 3)


def test_larger_batch_is_fast_enough_and_optimal_against_lp_bound():
    """B = 1000 over 8 ranks of affine times: the optimum lies between the continuous bound and it + 1 step."""
    rng = np.random.default_rng(0)
    per_sample = rng.uniform(0.01, 0.05, size=8)
    fns = [(lambda b, c=c: 0.002 + c * b) for c in per_sample]
    alloc = allocate(fns, [32] * 8, 1000)
    assert sum(alloc.shares) == 1000
    lp = 1000 / np.sum(1 / per_sample)  # no overheads, fractional samples
    assert lp <= alloc.step_time_s <= lp + per_sample.max() + 0.002 * (1000 / 32 + 1)
