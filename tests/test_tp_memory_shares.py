"""Tensor-parallel head shares chosen under each rank's memory: the fastest shares that fit where the
fastest do not (``cost.tp.best_shares`` with caps, ``planner.joint.tp_share_caps``), checked against
brute force for random speeds and memories, and ``strategy="tp"`` planned where it was refused."""

import random

import numpy as np
import pytest

from autopar.cluster.model import Cluster
from autopar.cost import tp as tp_cost
from autopar.cost.memory import fits_memory, stage_memory_bytes
from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts
from autopar.planner import joint as jp


def _worst(times, shares, units, rho):
    return max(t * k for t, k in zip(times, tp_cost.work_factors(np.array(shares) / units, rho)))


def test_capped_shares_are_the_brute_force_optimum_and_fit_whenever_some_shares_fit():
    rng = random.Random(1)
    seen_capped = 0
    for _ in range(300):
        n = rng.randint(2, 4)
        units = rng.randint(n, 12)
        times = [rng.uniform(0.5, 4.0) for _ in range(n)]
        rho = rng.choice([0.0, 0.1, 0.3])
        caps = [rng.randint(0, units) for _ in range(n)]
        best = tp_cost.brute_force_shares(times, units, rho, caps)
        if best == float("inf"):                      # no shares within the caps: one clear refusal
            with pytest.raises(PlanError, match="no head shares fit"):
                tp_cost.best_shares(times, units, rho, caps)
            continue
        shares = tp_cost.best_shares(times, units, rho, caps)
        assert sum(shares) == units and all(1 <= s <= c for s, c in zip(shares, caps)), (shares, caps)
        assert _worst(times, shares, units, rho) == pytest.approx(best, rel=1e-12)
        seen_capped += tp_cost.best_shares(times, units, rho) != shares
    assert seen_capped > 20          # the caps bound the choice in many cases, not only in none


def _cluster(memory_GB):
    """Two fast and two slow emulated devices in one node, of ``memory_GB`` each."""
    devs = [{"device": {"name": "fast", "emulate": "cpu", "speed": 1.0, "memory_GB": memory_GB}, "count": 2},
            {"device": {"name": "slow", "emulate": "cpu", "speed": 0.5, "memory_GB": memory_GB}, "count": 2}]
    return Cluster.from_dict({"nodes": [{"devices": devs}]})


def _costs():
    n = 4
    return ModelCosts.synthetic({"fast": [0.01] * n, "slow": [0.02] * n}, param_bytes=[4e7] * n,
                                act_bytes=[1e6] * n, out_bytes=[1e5] * n, overhead_s=1e-4)


def test_tp_takes_the_fastest_shares_that_fit_where_the_fastest_do_not():
    costs, units, rho = _costs(), 16, 0.1
    roomy = jp.plan_tp(costs, _cluster(4.0), 8, num_heads=units, replicated_fraction=rho)
    fast = roomy.stages[0].tp_shares[0]
    assert fast[0] > fast[2]                          # by speed: the fast ranks take more heads
    # devices that the speed shares overflow but even shares fit
    tight = _cluster(0.28)
    st = roomy.stages[0]
    assert not fits_memory(tight, stage_memory_bytes(costs, [st], "1f1b", 0, rho))
    caps = jp.tp_share_caps(costs, tight, (0, 1, 2, 3), units, replicated_fraction=rho)
    assert min(caps) < max(fast) and sum(caps) >= units, caps
    plan = jp.plan_tp(costs, tight, 8, num_heads=units, replicated_fraction=rho)
    shares = plan.stages[0].tp_shares[0]
    assert all(s <= c for s, c in zip(shares, caps)) and shares != fast
    assert fits_memory(tight, plan.predicted.memory_bytes)
    assert shares == tp_cost.best_shares([costs.step_time(t, 1.0) for t in ("fast", "fast", "slow", "slow")],
                                         units, rho, caps)
    with pytest.raises(PlanError, match="no head shares fit"):   # none fits: refused, saying so
        jp.plan_tp(costs, _cluster(0.1), 8, num_heads=units, replicated_fraction=rho)


def test_tp_over_more_ranks_than_heads_shares_finer_units():
    # two key/value groups over four ranks (Mixtral's 2 groups on the 3-rank demo alike): the plan shares
    # out 4 units, a pair that a member would own none of stays whole (passes.tp), the rest is shared
    plan = jp.plan_tp(_costs(), _cluster(4.0), 8, num_heads=2, replicated_fraction=0.1)
    shares = plan.stages[0].tp_shares[0]
    assert len(shares) == 4 and sum(shares) == 4 and min(shares) >= 1


def test_tp_over_thousands_of_ranks_is_refused_at_once():
    # plan_auto asks every single strategy: one TP group of 128 ranks is refused, not searched
    devs = [{"device": {"name": "fast", "emulate": "cpu", "speed": 1.0, "memory_GB": 4.0}, "count": 128}]
    with pytest.raises(PlanError, match="cannot share 8 heads"):
        jp.plan_tp(_costs(), Cluster.from_dict({"nodes": [{"devices": devs}]}), 256, num_heads=8)
