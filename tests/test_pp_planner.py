"""Heterogeneous pipeline planner: the split DP against brute force, the classic fast/slow case, pinned
splits, impossible requests, and the plan's internal consistency."""

import itertools

import numpy as np
import pytest

from autopar.cluster.model import Cluster
from autopar.cost.comm import p2p_time_s
from autopar.ir.costs import ModelCosts
from autopar.errors import PlanError
from autopar.ir.plan import Plan
from autopar.planner.pp import (
    PipelineContext, StageGrouping, member_shares, micro_candidates, micro_sizes, pipeline_cost_tensor,
    plan_pipeline, plan_timeline, save_plan_timeline, split_blocks, split_objective, stage_groupings,
)
from autopar.planner.bounds import with_all_bounds

GiB = 1 << 30


def _emulated(name, speed, memory_GB=4):
    return {"name": name, "emulate": "cpu", "speed": speed, "memory_GB": memory_GB}


def _cluster(*devices, per_node=1):
    """One node per device by default; ``per_node`` > 1 puts that many consecutive entries in a node."""
    nodes = []
    for i in range(0, len(devices), per_node):
        nodes.append({"devices": [{"device": d, "count": 1} for d in devices[i:i + per_node]]})
    return Cluster.from_dict({"nodes": nodes})


def _fast_slow():
    cluster = _cluster(_emulated("fast", 1.0), _emulated("slow", 0.5))
    costs = ModelCosts.synthetic({"fast": [0.01] * 12, "slow": [0.02] * 12})
    return cluster, costs


def _brute_force(cost, num_micro):
    S, n1, _ = cost.shape
    n = n1 - 1
    best = (np.inf, None)
    for cuts in itertools.combinations(range(1, n), S - 1):
        b = (0, *cuts, n)
        times = [cost[s, b[s], b[s + 1]] for s in range(S)]
        if all(np.isfinite(times)):
            value = split_objective(times, num_micro)
            if value < best[0] - 1e-12:
                best = (value, tuple(b[s + 1] - b[s] for s in range(S)))
    return best


def test_split_dp_equals_brute_force_on_random_tensors():
    rng = np.random.default_rng(1)
    infeasible = 0
    for case in range(80):
        n, S, M = int(rng.integers(4, 10)), int(rng.integers(2, 5)), int(rng.integers(1, 9))
        # Stage-dependent speeds and additive block times, plus a per-stage overhead; random
        # memory-style holes (a stage may not hold too many blocks).
        blocks = rng.uniform(0.1, 1.0, n)
        speed = rng.uniform(0.3, 1.0, S)
        pre = np.concatenate([[0.0], np.cumsum(blocks)])
        cost = (pre[None, None, :] - pre[None, :, None]) / speed[:, None, None] + rng.uniform(0, 0.3, (S, 1, 1))
        if case % 3 == 0:   # arbitrary (non-additive) costs too
            cost = rng.uniform(0.1, 3.0, (S, n + 1, n + 1))
        limit = rng.integers(1, n + 1, S)
        span = np.arange(n + 1)[None, :] - np.arange(n + 1)[:, None]
        cost = np.where(span[None] <= limit[:, None, None], cost, np.inf)
        want_value, want_sizes = _brute_force(cost, M)
        got = split_blocks(cost, M)
        if want_sizes is None:
            assert got is None
            infeasible += 1
            continue
        sizes, value = got
        assert value == pytest.approx(want_value, rel=1e-12)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        times = [cost[s, bounds[s], bounds[s + 1]] for s in range(S)]
        assert sum(sizes) == n and min(sizes) >= 1
        assert split_objective(times, M) == pytest.approx(want_value, rel=1e-12)
    assert 0 < infeasible < 40   # both branches were exercised


def test_stage_cost_tensor_matches_direct_costs_and_memory():
    """The DP input, built vectorised, equals t_s and the memory check computed directly from the
    cost tables and the comm model, on random per-device pipelines; and the DP's split equals brute
    force over those directly computed costs."""
    rng = np.random.default_rng(7)
    for case in range(12):
        n, S = int(rng.integers(4, 9)), int(rng.integers(2, 4))
        speeds = rng.uniform(0.25, 1.0, S)
        mem_GB = rng.uniform(0.05, 0.4, S)
        cluster = _cluster(*[_emulated(f"d{s}", float(speeds[s]), float(mem_GB[s])) for s in range(S)])
        base = rng.uniform(1e-3, 5e-3, n)
        costs = ModelCosts.synthetic({f"d{s}": base / speeds[s] for s in range(S)},
                                     param_bytes=rng.uniform(2e6, 8e6, n), act_bytes=rng.uniform(1e5, 2e6, n),
                                     out_bytes=rng.uniform(1e4, 1e6, n), overhead_s=1e-4)
        B, M, zero = int(rng.integers(4, 40)), int(rng.integers(1, 6)), int(rng.integers(0, 4))
        schedule = ("gpipe", "1f1b")[case % 2]
        ctx = PipelineContext(costs, cluster, B, zero, 0.9)
        grouping = StageGrouping("per-device", tuple(((s,),) for s in range(S)))
        tensor = pipeline_cost_tensor(ctx, grouping.stages, M, schedule, recompute=False)[0]
        b = micro_sizes(B, M)[0]
        direct = np.full_like(tensor, np.inf)
        for s in range(S):
            for i in range(n):
                for j in range(i + 1, n + 1):
                    blocks = slice(i, j)
                    fly = M if schedule == "gpipe" else min(M, S - s)
                    need = costs.state_bytes(blocks, zero) + costs.act_bytes[blocks].sum() * b * fly
                    if need > cluster.devices[s].spec.memory_bytes * 0.9:
                        continue
                    t = costs.step_time(f"d{s}", b, blocks)
                    if s < S - 1:
                        t += p2p_time_s(cluster, s, s + 1, float(costs.out_bytes[j - 1] * b))
                    direct[s, i, j] = t
        finite = np.isfinite(direct)
        assert np.array_equal(finite, np.isfinite(tensor))
        assert np.allclose(tensor[finite], direct[finite], rtol=1e-9)
        want_value, want_sizes = _brute_force(direct, M)
        got = split_blocks(tensor, M)
        assert (got is None) == (want_sizes is None)
        if got is not None:
            assert got[1] == pytest.approx(want_value, rel=1e-9)


def test_fast_slow_split_and_speedup_over_uniform():
    cluster, costs = _fast_slow()
    plan = plan_pipeline(costs, cluster, 32)
    assert plan.strategy == "pp" and plan.num_stages == 2
    assert plan.schedule == "1f1b"   # GPipe is no faster here and holds more activations
    assert [s.ranks for s in plan.stages] == [(0,), (1,)]
    assert abs(plan.stages[0].num_layers - 8) <= 1 and abs(plan.stages[1].num_layers - 4) <= 1
    uniform = plan_pipeline(costs, cluster, 32, uniform=True)
    assert uniform.strategy == "uniform-pp" and [s.num_layers for s in uniform.stages] == [6, 6]
    ratio = plan.predicted.samples_per_s / uniform.predicted.samples_per_s
    assert 1.35 < ratio < 1.6
    # The same micro-batch count on both sides gives the same ratio up to bubbles.
    fixed = plan_pipeline(costs, cluster, 32, num_micro=32).predicted.samples_per_s
    assert fixed / plan_pipeline(costs, cluster, 32, num_micro=32, uniform=True).predicted.samples_per_s == \
        pytest.approx(1.5, rel=0.05)


def test_plan_is_consistent_and_prediction_is_the_simulation():
    cluster, costs = _fast_slow()
    plan = with_all_bounds(plan_pipeline(costs, cluster, 30, num_micro=7), costs, cluster)
    assert plan.num_micro_batches == 7
    for st in plan.stages:
        totals = [sum(mb[m] for mb in st.micro_batches) for m in range(7)]
        assert totals == list(micro_sizes(30, 7)) == [5, 5, 4, 4, 4, 4, 4]
    assert plan.rank_batch == {0: 30, 1: 30}
    timeline, step = plan_timeline(plan, costs, cluster)
    assert plan.predicted.step_time_s == pytest.approx(step)
    assert plan.predicted.samples_per_s == pytest.approx(30 / step)
    assert plan.predicted.breakdown["bubble_fraction"] == pytest.approx(timeline.bubble_fraction)
    # Upper bound: each type alone runs the whole model (linear costs: 0.36 s and 0.72 s per sample).
    assert plan.predicted.upper_bound_samples_per_s == pytest.approx(1 / 0.36 + 1 / 0.72)
    assert plan.predicted.efficiency == pytest.approx(plan.predicted.samples_per_s / (1 / 0.36 + 1 / 0.72))
    assert 0.5 < plan.predicted.efficiency < 1
    assert plan.predicted.compute_bound_samples_per_s >= plan.predicted.samples_per_s
    assert plan.notes[0].startswith("chosen:") and any(n.startswith("runner-up:") for n in plan.notes)
    assert all(v <= 4 * GiB * 0.9 for v in plan.predicted.memory_bytes.values())
    assert Plan.from_json(plan.to_json()) == plan
    bare = plan_pipeline(costs, cluster, 30, num_micro=7)      # the planner leaves the bounds to bounds.py
    assert bare.predicted.upper_bound_samples_per_s == bare.predicted.compute_bound_samples_per_s == 0.0


def test_one_f_one_b_holds_less_memory_than_gpipe():
    cluster = _cluster(*[_emulated(f"d{i}", 1.0) for i in range(4)])
    costs = ModelCosts.synthetic({f"d{i}": [0.01] * 8 for i in range(4)}, act_bytes=np.full(8, 5e6))
    kw = dict(pp_layers=[2, 2, 2, 2], num_micro=8)
    g = plan_pipeline(costs, cluster, 32, schedule="gpipe", **kw)
    f = plan_pipeline(costs, cluster, 32, schedule="1f1b", **kw)
    assert (g.schedule, f.schedule) == ("gpipe", "1f1b")
    act = 2 * 5e6 * 4   # two blocks, 4 samples per micro-batch
    assert g.predicted.memory_bytes[0] - f.predicted.memory_bytes[0] == pytest.approx(act * (8 - 4), abs=1)
    assert g.predicted.memory_bytes[3] - f.predicted.memory_bytes[3] == pytest.approx(act * (8 - 1), abs=1)


def test_node_members_share_micro_batches_by_speed():
    # Two nodes, each a fast and a slow device: the per-node grouping makes them stage members.
    cluster = _cluster(_emulated("fast", 1.0), _emulated("slow", 0.5), _emulated("fast", 1.0),
                       _emulated("slow", 0.5), per_node=2)
    groupings = stage_groupings(cluster)
    assert [g.name for g in groupings] == ["per-device", "per-node", "per-type"]
    assert groupings[1].stages == (((0,), (1,)), ((2,), (3,)))
    assert groupings[2].stages == (((0,), (2,)), ((1,), (3,)))
    costs = ModelCosts.synthetic({"fast": [0.01] * 6, "slow": [0.02] * 6})
    plan = plan_pipeline(costs, cluster, 60, pp_layers=[3, 3], num_micro=4)
    node = [st for st in plan.stages if len(st.groups) == 2]
    assert node, plan
    for st in plan.stages:
        for m in range(4):
            assert sum(mb[m] for mb in st.micro_batches) == 15
    rb = plan.rank_batch
    assert rb[0] + rb[1] == 60 and rb[0] == pytest.approx(40, abs=4)


def test_member_shares_and_micro_helpers():
    assert member_shares(10, [2.0, 1.0, 1.0]) == (5, 3, 2)
    assert member_shares(3, [1.0, 1.0], rotate=1) == (1, 2)
    assert member_shares(0, [1.0, 3.0]) == (0, 0)
    assert micro_sizes(10, 4) == (3, 3, 2, 2) and micro_sizes(8, 8) == (1,) * 8
    cands = micro_candidates(48, 3)
    assert cands[0] == 1 and max(cands) <= 48 and 48 in cands and 12 in cands
    assert max(micro_candidates(5, 2)) == 5
    # A large batch over few members per stage reaches micro-batches of about a sample per member.
    assert max(micro_candidates(1024, 8)) == 64 and max(micro_candidates(1024, 8, 32)) == 64
    assert max(micro_candidates(1024, 8, 2)) == 512 and max(micro_candidates(1024, 8, 1)) == 1024
    assert {256, 512} <= set(micro_candidates(1024, 8, 2))


def test_pinned_split_and_errors():
    cluster, costs = _fast_slow()
    plan = plan_pipeline(costs, cluster, 16, pp_layers=[5, 7])
    assert [s.num_layers for s in plan.stages] == [5, 7]
    assert [(s.block_start, s.block_stop) for s in plan.stages] == [(0, 5), (5, 12)]
    with pytest.raises(PlanError, match=r"covers 11 blocks, the model has 12"):
        plan_pipeline(costs, cluster, 16, pp_layers=[6, 5])
    with pytest.raises(PlanError, match="positive"):
        plan_pipeline(costs, cluster, 16, pp_layers=[0, 12])
    with pytest.raises(PlanError, match="3 stages need at least 3 devices, 2 given"):
        plan_pipeline(costs, cluster, 16, pp_layers=[4, 4, 4])
    # One pinned stage over two devices: a chunk grouping (both devices members of the stage).
    one = plan_pipeline(costs, cluster, 16, pp_layers=[12])
    assert one.num_stages == 1 and one.stages[0].ranks == (0, 1)
    with pytest.raises(PlanError, match="global_batch"):
        plan_pipeline(costs, cluster, 0)
    with pytest.raises(PlanError, match="schedule"):
        plan_pipeline(costs, cluster, 8, schedule="zigzag")
    with pytest.raises(PlanError, match="num_micro"):
        plan_pipeline(costs, cluster, 8, num_micro=9)
    with pytest.raises(PlanError, match=r"no time table for device type\(s\) \['slow'\]"):
        plan_pipeline(ModelCosts.synthetic({"fast": [0.01] * 12}), cluster, 8)


def test_nothing_fits_names_needed_and_available():
    cluster = _cluster(_emulated("fast", 1.0, 0.01), _emulated("slow", 0.5, 0.01))
    costs = ModelCosts.synthetic({"fast": [0.01] * 4, "slow": [0.02] * 4}, param_bytes=np.full(4, 1e7))
    with pytest.raises(PlanError) as err:
        plan_pipeline(costs, cluster, 8)
    msg = str(err.value)
    assert "needs 0.149 GiB" in msg and "fast: 1 x 0.009 GiB" in msg and "slow: 1 x 0.009 GiB" in msg
    with pytest.raises(PlanError, match="no pipeline plan fits"):
        plan_pipeline(costs, cluster, 8, uniform=True)


def test_uniform_with_more_devices_than_blocks_leaves_ranks_unused():
    cluster = _cluster(*[_emulated("d", 1.0) for _ in range(5)])
    costs = ModelCosts.synthetic({"d": [0.01] * 3})
    plan = plan_pipeline(costs, cluster, 12, uniform=True)
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (2,)]
    assert "unused ranks (more devices than blocks): [3, 4]" in plan.notes
    assert plan_pipeline(costs, cluster, 12, uniform=True, pp_layers=[2, 1]).stages[1].ranks == (1,)


def test_mixed_cluster_plan_is_valid():
    """24 devices of three types, 50 blocks: a valid plan whose stages cover the model, each rank
    within its memory, and at least as fast as the uniform baseline."""
    cluster = Cluster.from_dict({"nodes": [{"device": "H100-80GB", "count": 8}, {"device": "A100-40GB", "count": 8},
                                           {"device": "V100-16GB", "count": 8}],
                                 "network": {"bandwidth_GBps": 12.5, "latency_us": 10}})
    n = 50
    layer = np.full(n, 0.16e-3)
    speed = {"H100-80GB": 1.0, "A100-40GB": 0.32, "V100-16GB": 0.127}
    costs = ModelCosts.synthetic({k: layer / v for k, v in speed.items()}, param_bytes=np.full(n, 123e6),
                                 act_bytes=np.full(n, 60e6), out_bytes=np.full(n, 6.5e6), overhead_s=2e-4)
    plan = plan_pipeline(costs, cluster, 512)
    assert plan.stages[0].block_start == 0 and plan.stages[-1].block_stop == n
    assert all(a.block_stop == b.block_start for a, b in zip(plan.stages, plan.stages[1:]))
    assert sorted(plan.ranks) == list(range(24))
    for r, need in plan.predicted.memory_bytes.items():
        assert need <= cluster.devices[r].spec.memory_bytes * 0.9
    uniform = plan_pipeline(costs, cluster, 512, uniform=True)
    assert plan.predicted.samples_per_s > uniform.predicted.samples_per_s


def test_save_plan_timeline_writes_png(tmp_path):
    cluster, costs = _fast_slow()
    plan = plan_pipeline(costs, cluster, 16, num_micro=4)
    out = tmp_path / "plan.png"
    timeline = save_plan_timeline(plan, costs, cluster, out)
    assert out.read_bytes()[:4] == b"\x89PNG"
    from autopar.cost.pipeline import pipeline_loss_allreduce_s

    # the schedule's timeline, then the step's loss all-reduce over every rank (cost.pipeline._finish_s)
    assert timeline.step_time_s + pipeline_loss_allreduce_s(plan, cluster) == pytest.approx(plan.predicted.step_time_s)
