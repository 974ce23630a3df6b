"""Uneven ZeRO shards chosen by the data-parallel planner (issue 12 item 6): the optimizer-balanced
shard fractions against brute force, and plans whose shards follow speed and memory."""

import dataclasses
import itertools

import pytest

from autopar.cluster.model import Cluster
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan
from autopar.planner.dp import balanced_zero_shares, optimizer_step_s, plan_dp, shard_memory

GiB = 1 << 30


def _cluster(speeds_GB):
    nodes = [{"device": {"name": f"d{i}", "vendor": "nvidia", "tflops": tf, "memory_GB": gb,
                         "mem_bandwidth_GBps": 1000}, "count": 1} for i, (tf, gb) in enumerate(speeds_GB)]
    return Cluster.from_dict({"name": "t", "nodes": nodes, "network": {"bandwidth_GBps": 12.5, "latency_us": 10}})


def _costs(rates, *, param_bytes=4e6, act_bytes=1e6, blocks=4, fwd=1e-3, overhead_s=1e-4):
    """Synthetic costs with per-device forward seconds ``fwd / speed`` and optimizer s/param ``rates``."""
    names = [f"d{i}" for i in range(len(rates))]
    base = ModelCosts.synthetic({n: [fwd * rates[i] / rates[0]] * blocks for i, n in enumerate(names)},
                                param_bytes=[param_bytes] * blocks, act_bytes=[act_bytes] * blocks,
                                overhead_s=overhead_s)
    return dataclasses.replace(base, optimizer_s_per_param=dict(zip(names, rates)),
                               optimizer_flat_s_per_param=dict(zip(names, rates)))


def test_balanced_shares_match_brute_force_min_max():
    costs = _costs([1e-8, 2e-8, 4e-8])
    cluster = _cluster([(300, 80), (150, 80), (75, 80)])
    ranks = (0, 1, 2)
    got = balanced_zero_shares(costs, cluster, ranks, 1)
    assert got is not None and abs(sum(got) - 1) < 1e-12
    best = min(optimizer_step_s(costs, cluster, ranks, 1, (a / 40, b / 40, (40 - a - b) / 40))
               for a, b in itertools.product(range(41), repeat=2) if a + b <= 40)
    ours = optimizer_step_s(costs, cluster, ranks, 1, got)
    assert ours <= best + 1e-12
    assert got[0] > got[1] > got[2]                      # faster optimizer, bigger shard
    assert got == pytest.approx((4 / 7, 2 / 7, 1 / 7), rel=1e-3)   # overheads equal: shares ~ speed
    even = optimizer_step_s(costs, cluster, ranks, 1)
    assert ours < 0.5 * even                             # 4/7 of 1/speed=1 vs 1/3 at speed 1/4


def test_memory_caps_the_fast_ranks_shard():
    # d0 is fast but small: its shard is capped so its states and one sample still fit.
    costs = _costs([1e-9, 8e-9], param_bytes=64e6, act_bytes=1e6, blocks=4)   # 256 MB of weights
    cluster = _cluster([(300, 1.2), (100, 16)])
    got = balanced_zero_shares(costs, cluster, (0, 1), 1)
    assert got is not None
    spec0 = cluster.devices[0].spec
    m = shard_memory(costs, spec0, 1, got[0])
    assert m.fixed_bytes + m.act_bytes_per_sample <= m.usable_bytes * (1 + 1e-9)
    assert got[0] < 8 / 9 - 0.01                          # below the speed-balanced 8/9


def test_dp_plans_uneven_shards_and_baselines_keep_even():
    costs = _costs([1e-8, 2e-8, 4e-8], param_bytes=40e6)
    cluster = _cluster([(300, 80), (150, 80), (75, 80)])
    plan = plan_dp(costs, cluster, 28, strategy="dp", zero_stage=1)
    (stage,) = plan.stages
    assert len(stage.zero_shares) == 3 and stage.zero_shares[0] > stage.zero_shares[2]
    assert plan.predicted.breakdown["optimizer_s"] < optimizer_step_s(costs, cluster, (0, 1, 2), 1)
    assert any("ZeRO shards" in n and "(chosen)" in n for n in plan.notes)
    assert Plan.from_json(plan.to_json()).stages[0].zero_shares == stage.zero_shares
    for base in ("uniform-dp", "proportional-dp"):
        assert plan_dp(costs, cluster, 28, strategy=base, zero_stage=1).stages[0].zero_shares == ()
    # ZeRO-0 has nothing sharded; homogeneous ranks keep even shards.
    assert plan_dp(costs, cluster, 28, strategy="dp", zero_stage=0).stages[0].zero_shares == ()
    same = _costs([1e-8, 1e-8])
    assert plan_dp(same, _cluster([(300, 80), (300, 80)]), 8, zero_stage=2).stages[0].zero_shares == ()


def test_uneven_shards_price_padded_gathers_and_overlap_hides_the_all_reduce():
    from autopar.planner.dp import zero_comm

    costs = _costs([1e-8, 2e-8, 4e-8], param_bytes=40e6)
    cluster = _cluster([(300, 80), (150, 80), (75, 80)])
    even, uneven = zero_comm(costs, cluster, (0, 1, 2), 1), zero_comm(costs, cluster, (0, 1, 2), 1,
                                                                      fractions=(0.6, 0.3, 0.1))
    assert uneven.per_step_s > even.per_step_s          # every shard travels padded to 0.6 of the model
    assert uneven.allreduce_s == even.allreduce_s > even.last_bucket_s > 0
    on = plan_dp(costs, cluster, 28, strategy="uniform-dp", zero_stage=0)
    off = plan_dp(costs, cluster, 28, strategy="uniform-dp", zero_stage=0, overlap=False)
    zc = zero_comm(costs, cluster, (0, 1, 2), 0)
    slow = 2                                            # equal shares: the slowest device is the last
    window = float(costs.bwd_time("d2", off.stages[0].micro_batches[slow][-1]).sum())
    exposed = max(zc.last_bucket_s, zc.allreduce_s - window)
    loss = zc.per_step_s - zc.allreduce_s               # the loss sum's all-reduce, once per step
    assert off.predicted.breakdown["comm_s"] == pytest.approx(zc.allreduce_s + loss)
    assert on.predicted.breakdown["comm_s"] == pytest.approx(exposed + loss)
    assert on.predicted.step_time_s < off.predicted.step_time_s
