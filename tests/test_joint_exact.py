"""The joint planner is optimal under its own model on small instances: for a fixed grouping and
micro-batch count its chosen split equals brute force over every pinned split (each priced
independently by the pipeline planner's ``pp_layers`` path through the same simulator), over random
block counts up to 16 (hypothesis). Also the held-out case of issue 14: 14 blocks over two devices at
speeds 1 / 0.5, where the split estimate alone picked 13/1."""

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.cluster.model import Cluster
from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts
from autopar.planner import joint as jp
from autopar.planner.pp import StageGrouping, plan_pipeline


def _cluster(speeds, memory_GB=4):
    return Cluster.from_dict({"nodes": [{"device": {"name": f"d{i}", "emulate": "cpu", "speed": s,
                                                    "memory_GB": memory_GB}, "count": 1}
                                        for i, s in enumerate(speeds)]})


def _brute_force(costs, cluster, batch, num_stages, num_micro):
    best = math.inf
    for cuts in itertools.combinations(range(1, costs.num_blocks), num_stages - 1):
        b = (0, *cuts, costs.num_blocks)
        layers = [b[s + 1] - b[s] for s in range(num_stages)]
        try:
            p = plan_pipeline(costs, cluster, batch, schedule="1f1b", pp_layers=layers, num_micro=num_micro,
                              zero_stage=0)
        except PlanError:
            continue
        best = min(best, p.predicted.step_time_s)
    return best


def _joint(costs, cluster, batch, num_micro):
    n = len(cluster)
    lay = jp.member_layouts(costs, cluster, degrees=(1,))[0]
    gr = StageGrouping("per-member", tuple(((r,),) for r in range(n)))
    scored = jp.plan_hybrid(costs, cluster, batch, zero_stage=0, schedule="1f1b", layouts=[lay], groupings=[gr],
                            num_micro=num_micro)
    return min((x.step_time_s for x in scored), default=math.inf)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_joint_split_equals_brute_force_over_pinned_splits(data):
    num_devices = data.draw(st.sampled_from([2, 2, 3]))
    n = data.draw(st.integers(num_devices, 16 if num_devices == 2 else 7), label="blocks")
    speeds = [1.0] + [data.draw(st.sampled_from([0.25, 0.5, 0.8, 1.0])) for _ in range(num_devices - 1)]
    base = [data.draw(st.floats(0.002, 0.02)) for _ in range(n)]
    out = [data.draw(st.floats(1e4, 3e6)) for _ in range(n)]
    costs = ModelCosts.synthetic({f"d{i}": [x / s for x in base] for i, s in enumerate(speeds)},
                                 param_bytes=[4e6] * n, act_bytes=[1e6] * n, out_bytes=out, overhead_s=1e-4)
    cluster = _cluster(speeds)
    batch = data.draw(st.integers(1, 8))
    M = data.draw(st.integers(1, batch))
    want = _brute_force(costs, cluster, batch, num_devices, M)
    got = _joint(costs, cluster, batch, M)
    assert got == pytest.approx(want, rel=1e-9)


def test_held_out_fourteen_blocks_over_speeds_one_and_half():
    n = 14
    costs = ModelCosts.synthetic({"d0": [0.01] * n, "d1": [0.02] * n}, param_bytes=[4e6] * n,
                                 act_bytes=[1e6] * n, out_bytes=[1e6] * n, overhead_s=1e-4)
    cluster = _cluster([1.0, 0.5])
    for M in (1, 2, 4):
        assert _joint(costs, cluster, 4, M) == pytest.approx(_brute_force(costs, cluster, 4, 2, M), rel=1e-9)
