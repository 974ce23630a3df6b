"""The joint search's speed-ups leave what it returns as it was (issue 14, Build 5; docs/planner-speed.md):
``joint_search.search(keep=k)`` returns the same first k candidates, in the same order, as the
search without the shortlist limit while solving no more; ``cost.joint.split_lower_bounds`` gives the
floats ``split_lower_bound`` gives, count by count; the pipeline planner's cost tensors are the same
whether a ``PipelineContext`` keeps its stage rows across calls or not. Small synthetic heterogeneous
clusters (emulated devices), pure functions only."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autopar.cluster.model import Cluster
from autopar.cost.joint import JointContext, prepare_stages, split_lower_bound, split_lower_bounds
from autopar.cost.pipeline import PipelineContext, pipeline_cost_tensor, pipeline_split_feasible
from autopar.ir.costs import ModelCosts
from autopar.planner.joint_search import GroupingState, search
from autopar.planner.layouts import member_groupings, member_layouts
from autopar.planner.pp import micro_candidates, min_bottleneck


def _cluster(memory_GB: float) -> Cluster:
    dev = lambda name, speed: {"name": name, "emulate": "cpu", "speed": speed, "memory_GB": memory_GB}  # noqa: E731
    return Cluster.from_dict({"nodes": [{"device": dev("fast", 1.0), "count": 4},
                                        {"device": dev("slow", 0.4), "count": 4}],
                              "network": {"bandwidth_GBps": 10, "latency_us": 10}})


def _costs(seed: int, n: int) -> ModelCosts:
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.002, 0.02, n)
    return ModelCosts.synthetic({"fast": base, "slow": base / 0.4}, param_bytes=rng.uniform(2e8, 8e8, n),
                                act_bytes=rng.uniform(1e7, 6e7, n), out_bytes=rng.uniform(1e5, 3e6, n),
                                overhead_s=1e-4)


def _entries(costs, cluster, batch):
    ctx = JointContext(costs, cluster, batch, 2, 0.9, 0.1, {}, {}, False)
    entries = []
    for lay in member_layouts(costs, cluster, num_heads=8, degrees=(1, 2, 4), replicated_fraction=0.1):
        for m in lay.members:
            ctx.members[m.ranks] = m
        speed = {m.kind: ctx.kind_speed(m.kind) for m in lay.members}
        for gr in member_groupings(cluster, lay, costs.num_blocks, speed):
            if gr.num_stages <= costs.num_blocks:
                stages = [[ctx.members[g] for g in st] for st in gr.stages]
                entries.append(GroupingState(lay, gr, prepare_stages(ctx, stages)))
    return ctx, entries


@pytest.mark.parametrize("seed,blocks,memory_GB", [(1, 12, 8), (2, 6, 4)])
def test_search_keep_returns_the_same_shortlist(seed, blocks, memory_GB):
    costs, cluster = _costs(seed, blocks), _cluster(memory_GB)
    ctx, entries = _entries(costs, cluster, 64)
    full, solved_full = search(ctx, entries, "1f1b", None, math.inf)
    assert full, "the instance should plan"
    for keep in (1, 8):
        ctx_k, entries_k = _entries(costs, cluster, 64)
        got, solved = search(ctx_k, entries_k, "1f1b", None, math.inf, keep=keep)
        assert got[:keep] == full[:keep]
        assert solved <= solved_full
    assert solved < solved_full   # the limit prunes here (what makes it worth having)


def test_split_lower_bounds_are_the_one_count_floats():
    costs, cluster = _costs(3, 10), _cluster(8)
    ctx_a, entries_a = _entries(costs, cluster, 48)
    ctx_b, entries_b = _entries(costs, cluster, 48)
    checked = 0
    for a, b in zip(entries_a, entries_b):
        counts = micro_candidates(48, len(a.prep), a.grouping.max_members)
        assert split_lower_bounds(ctx_b, b.prep, counts) == [split_lower_bound(ctx_a, a.prep, M) for M in counts]
        checked += len(counts)
    assert checked > 50


def test_pipeline_rows_kept_across_calls_price_the_same():
    costs, cluster = _costs(4, 9), _cluster(8)
    stages = [((0,), (1,)), ((4,), (5,)), ((6,),)]
    kept = PipelineContext(costs, cluster, 24, 1, 0.9)
    for schedule in ("1f1b", "gpipe"):
        for M in (1, 2, 3, 4, 6, 8, 12):
            got = pipeline_cost_tensor(kept, stages, M, schedule)
            fresh = pipeline_cost_tensor(PipelineContext(costs, cluster, 24, 1, 0.9), stages, M, schedule)
            assert all(np.array_equal(x, y) for x, y in zip(got, fresh))


def test_pipeline_split_feasible_is_a_finite_split_of_the_tensor():
    """The pipeline planner skips the tensors of (grouping, count) where this is False."""
    costs = _costs(5, 9)
    seen = set()
    for memory_GB in (1.5, 3, 6, 24):
        cluster = _cluster(memory_GB)
        ctx = PipelineContext(costs, cluster, 24, 0, 0.9)
        for stages in ([((0,),), ((4,),)], [((0,), (1,)), ((4,), (5,)), ((6,),)], [((r,),) for r in range(6)]):
            for M in (1, 2, 3, 6, 12):
                for schedule in ("1f1b", "gpipe"):
                    cost, _ = pipeline_cost_tensor(ctx, stages, M, schedule, recompute=memory_GB < 3)
                    want = bool(np.isfinite(min_bottleneck(cost)))
                    assert pipeline_split_feasible(ctx, stages, M, schedule, recompute=memory_GB < 3) == want
                    seen.add(want)
    assert seen == {True, False}
