"""Stage counts of a one-type cluster (issue 14, the homogeneous MFU): besides the divisors of the member
count and the ladder (``layouts.stage_counts``), the joint search tries every count at which the
slowest stage's blocks drop by one (``layouts.granular_counts``). Without them, llama-140b on 89 nodes
of accel-a (178 TP-4 members, prime node count) planned 10 stages of up to 9 blocks (45.95 s a step)
where 11 stages of up to 8 (16 replicas, 8 devices idle) step in 43.37 s."""

import dataclasses

import pytest

from autopar.planner import joint as jp
from autopar.planner import layouts
from autopar.planner.layouts import granular_counts, member_groupings, member_layouts, stage_counts
from test_device_counts import _cluster
from test_joint_planner import _llama_costs


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))


def _fp32_llama(cluster):
    """The roofline llama-140b of ``test_joint_planner`` with fp32 states (weights and gradients 4 bytes,
    two Adam moments 8): the memory that makes stage granularity bind, as in ``autopar plan``."""
    c = _llama_costs(cluster)
    return dataclasses.replace(c, param_bytes=2 * c.param_bytes, grad_bytes_per_param=4,
                               optimizer_bytes_per_param=8, _cache={})


def test_granular_counts_are_the_least_count_for_every_blocks_per_stage():
    for n in range(1, 41):
        for top in (1, 3, 7, n, 2 * n):
            got = granular_counts(n, top)
            assert got == sorted(set(got)) and all(1 <= s <= top for s in got)
            for k in range(1, n + 1):
                least = min(s for s in range(1, n + 1) if -(-n // s) <= k)   # brute force
                assert (least in got) == (least <= top), (n, top, k)
            # nothing else: every count listed is the least for its own blocks per stage
            assert all(-(-n // (s - 1)) > -(-n // s) for s in got if s > 1), (n, got)
    assert granular_counts(82, 178) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 17, 21, 28, 41, 82]
    assert 11 not in stage_counts(178, 82) and 21 not in stage_counts(178, 82)   # what the ladder misses


def test_one_type_groupings_take_the_granular_counts():
    cluster = _cluster(89, False)
    costs = _fp32_llama(cluster)
    lay = next(x for x in member_layouts(costs, cluster, num_heads=96, degrees=(4,)))
    names = {g.name for g in member_groupings(cluster, lay, costs.num_blocks)}
    assert len(lay.members) == 178
    assert {"chunks-11", "chunks-11-idle", "chunks-21", "chunks-21-idle", "chunks-17"} <= names
    assert all(len(g.stages) <= costs.num_blocks for g in member_groupings(cluster, lay, costs.num_blocks))


def test_granular_count_plans_strictly_faster_on_a_prime_node_count(monkeypatch):
    # 89 nodes of accel-a, TP 4: 21 stages of at most 4 blocks (ceil(82 / 4)), 8 replicas, beat
    # every count of ``stage_counts`` (40 stages of 2-3 blocks was the best of those: 73.17 s).
    cluster = _cluster(89, False)
    costs = _fp32_llama(cluster)
    new = jp.plan_auto(costs, cluster, 1024, num_heads=96, degrees=(4,))
    monkeypatch.setattr(layouts, "granular_counts", lambda num_blocks, top: [])
    old = jp.plan_auto(costs, cluster, 1024, num_heads=96, degrees=(4,))
    assert new.predicted.step_time_s < old.predicted.step_time_s * (1 - 0.03), \
        (new.predicted.step_time_s, old.predicted.step_time_s)
    S = len(new.stages)
    assert S in granular_counts(costs.num_blocks, 178) and S not in stage_counts(178, costs.num_blocks)
    assert max(st.num_layers for st in new.stages) == -(-costs.num_blocks // S)
    assert all(v <= 0.9 * cluster.devices[r].spec.memory_bytes for r, v in new.predicted.memory_bytes.items())
