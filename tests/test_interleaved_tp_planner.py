"""The hybrid (TP + PP + DP) search's plans interleaved (``autopar.planner.pp_virtual.interleave_hybrid``):
kept only where they fit and are predicted faster, priced by the same simulator; their memory
(``interleaved_memory_bytes``) follows the interleaved schedule's live activations.

Case: 8 synthetic blocks on 4 devices paired into two TP members (degree 2), a few micro-batches (the
bubble matters) and cheap transfers, so interleaving pays; with little memory it must not be kept.
"""

import dataclasses

import pytest

from autopar.cluster.model import Cluster
from autopar.config import MEMORY_FRACTION
from autopar.cost.memory import fits_memory, stage_memory_bytes
from autopar.cost.pipeline import pipeline_memory_bytes, plan_timeline
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan, Stage
from autopar.planner import joint as jp
from autopar.planner.pp import StageGrouping
from autopar.planner.pp_virtual import chunk_sizes, chunked_stages, interleave_hybrid, interleaved_memory_bytes

N = 8


def _case(memory_GB=4.0, act=1e6):
    speeds = (1.0, 0.5)   # two nodes of two devices each
    cluster = Cluster.from_dict({"nodes": [{"device": {"name": f"d{i}", "emulate": "cpu", "speed": s,
                                                       "memory_GB": memory_GB}, "count": 2}
                                           for i, s in enumerate(speeds)]})
    costs = ModelCosts.synthetic({f"d{i}": [0.01 / s] * N for i, s in enumerate(speeds)}, param_bytes=[4e6] * N,
                                 act_bytes=[act] * N, out_bytes=[1e4] * N, overhead_s=1e-4)
    return costs, cluster


def _hybrid(costs, cluster, num_micro=2):
    lay = next(x for x in jp.member_layouts(costs, cluster, num_heads=4, degrees=(2,)) if all(len(m.ranks) == 2 for m in x.members))
    gr = StageGrouping("two", tuple((m.ranks,) for m in lay.members))   # one TP member per stage
    scored = jp.plan_hybrid(costs, cluster, 8, zero_stage=0, schedule="1f1b", layouts=[lay], groupings=[gr],
                            num_micro=num_micro)
    return [(x.step_time_s, x.plan, x.label) for x in scored]


def test_interleaving_tp_members_pays_and_is_priced_by_the_simulator():
    costs, cluster = _case()
    flat = _hybrid(costs, cluster)
    assert flat and all(len(g) == 2 for st in flat[0][1].stages for g in st.groups)
    got = interleave_hybrid(costs, cluster, flat, MEMORY_FRACTION)
    assert got
    best_flat = min(x[0] for x in flat)
    for step, plan, label in got:
        assert plan.schedule == "interleaved-1f1b" and plan.virtual_stages >= 2 and "interleaved" in label
        assert step < best_flat and step == pytest.approx(plan.predicted.step_time_s, rel=1e-12)
        assert plan_timeline(plan, costs, cluster)[1] == pytest.approx(step, rel=1e-12)
        assert fits_memory(cluster, plan.predicted.memory_bytes, MEMORY_FRACTION)
        R = plan.rank_stages
        for s, st in enumerate(plan.stages):     # chunks keep their rank stage's members and shares
            assert st.groups == plan.stages[s % R].groups and st.tp_shares == plan.stages[s % R].tp_shares
        assert Plan.from_json(plan.to_json()) == plan


def test_interleaving_is_dropped_where_its_activations_do_not_fit():
    costs, cluster = _case()
    flat = _hybrid(costs, cluster, num_micro=4)
    plan = flat[0][1]
    need_flat = max(stage_memory_bytes(costs, plan.stages, "1f1b", 0).values())
    need_il = max(interleaved_memory_bytes(costs, chunked_stages(plan.stages, chunk_sizes(
        [st.num_layers for st in plan.stages], 2)), 0, 2).values())
    assert need_il > need_flat                    # more micro-batches in flight on the first rank stage
    for gb in (x / 1000 for x in range(1, 4000)):    # the least memory the flat plan fits in
        _, tight = _case(memory_GB=gb)
        if fits_memory(tight, plan.predicted.memory_bytes, MEMORY_FRACTION):
            break
    assert not fits_memory(tight, {0: need_il}, MEMORY_FRACTION)
    assert interleave_hybrid(costs, cluster, flat, MEMORY_FRACTION, virtual_counts=(2,))   # pays where it fits
    assert interleave_hybrid(costs, tight, flat, MEMORY_FRACTION, virtual_counts=(2,)) == []


def test_interleaved_memory_follows_the_schedule():
    costs, cluster = _case()
    plan = _hybrid(costs, cluster, num_micro=4)[0][1]
    flat = stage_memory_bytes(costs, plan.stages, "1f1b", 0)
    for V in (2, 4):
        stages = chunked_stages(plan.stages, chunk_sizes([st.num_layers for st in plan.stages], V))
        exact = interleaved_memory_bytes(costs, stages, 0, V)
        low = interleaved_memory_bytes(costs, stages, 0, V, exact=False)
        assert sorted(exact) == sorted(flat) == [0, 1, 2, 3]
        for r in exact:
            assert low[r] <= exact[r]
            # the same blocks per rank (V = 2 keeps the 6 / 2 split): interleaving holds more in flight
            assert V != 2 or exact[r] >= flat[r]
        # one-rank members: no more than the sum of every chunk's own peak (pipeline_memory_bytes)
        one = tuple(dataclasses.replace(st, groups=tuple((g[0],) for g in st.groups), tp_shares=()) for st in stages)
        mine, summed = interleaved_memory_bytes(costs, one, 0, V), pipeline_memory_bytes(costs, one, "interleaved-1f1b", 0, V)
        assert all(mine[r] <= summed[r] for r in mine)


def test_recompute_fits_an_over_memory_variant_and_the_bound_is_below_the_simulated_step():
    from autopar.planner.pp_virtual import _fit_and_price, busiest_rank_stage_s

    costs, cluster = _case()
    plan = _hybrid(costs, cluster, num_micro=4)[0][1]
    stages = chunked_stages(plan.stages, chunk_sizes([st.num_layers for st in plan.stages], 2))
    for flags in ((), (0,), (0, 1, 2, 3)):   # the bound holds with and without recomputing chunks
        chunks = tuple(dataclasses.replace(st, recompute=s in flags) for s, st in enumerate(stages))
        probe = dataclasses.replace(plan, schedule="interleaved-1f1b", stages=chunks, virtual_stages=2)
        assert busiest_rank_stage_s(costs, cluster, chunks, 2) <= plan_timeline(probe, costs, cluster)[1] * (1 + 1e-9)
    need = max(interleaved_memory_bytes(costs, stages, 0, 2).values())
    for gb in (x / 1000 for x in range(1, 4000)):    # the least memory the flat plan fits in
        _, tight = _case(memory_GB=gb)
        if fits_memory(tight, plan.predicted.memory_bytes, MEMORY_FRACTION):
            break
    assert not fits_memory(tight, {0: need}, MEMORY_FRACTION)
    got = _fit_and_price(costs, tight, plan, stages, 2, MEMORY_FRACTION, float("inf"))
    assert got is not None
    fitted, _, step = got
    assert any(st.recompute for st in fitted.stages) and fits_memory(tight, fitted.predicted.memory_bytes, MEMORY_FRACTION)
    assert fitted.predicted.memory_bytes == interleaved_memory_bytes(costs, fitted.stages, 0, 2)
    assert step == pytest.approx(plan_timeline(fitted, costs, cluster)[1], rel=1e-12)


def _stages(sizes, ranks):
    out, start = [], 0
    for k, r in zip(sizes, ranks):
        out.append(Stage(start, start + k, groups=((r,),), micro_batches=((0, 1),)))
        start += k
    return tuple(out)


def test_chunk_splits_add_the_flat_split_evened_within_each_kind_of_rank_stage():
    from autopar.planner.pp_virtual import _chunk_splits

    one = Cluster.from_dict({"nodes": [{"device": {"name": "a", "emulate": "cpu", "speed": 1.0, "memory_GB": 1}, "count": 4}]})
    # a flat split shaped by 1F1B's memory (fewer blocks where more micro-batches are in flight)
    got = _chunk_splits(one, _stages([3, 4, 4, 5], range(4)), 2)
    assert got == [chunk_sizes([3, 4, 4, 5], 2), chunk_sizes([4, 4, 4, 4], 2)]
    assert _chunk_splits(one, _stages([4, 4, 4, 4], range(4)), 2) == [chunk_sizes([4, 4, 4, 4], 2)]
    # two kinds (ranks 0, 1 of type a; 2, 3 of type b): each keeps its blocks, the extra one on its later stage
    two = Cluster.from_dict({"nodes": [{"device": {"name": n, "emulate": "cpu", "speed": s, "memory_GB": 1}, "count": 2}
                                       for n, s in (("a", 1.0), ("b", 0.5))]})
    got = _chunk_splits(two, _stages([6, 2, 5, 3], (0, 2, 1, 3)), 2)
    assert got[1] == chunk_sizes([5, 2, 6, 3], 2)


def test_the_flat_bound_is_below_every_interleaving_and_prunes_flat_plans_that_cannot_win():
    from autopar.planner.pp_virtual import _flat_bound

    costs, cluster = _case()
    flat = _hybrid(costs, cluster)
    got = interleave_hybrid(costs, cluster, flat, MEMORY_FRACTION)
    assert got
    for step, plan, _ in got:
        assert _flat_bound(costs, cluster, flat[0][1], {}) <= step * (1 + 1e-9)
    # a plan already known to be faster than any interleaving's bound: nothing is tried, nothing kept
    bound = min(_flat_bound(costs, cluster, p, {}) for _, p, _ in flat)
    faster = (bound * 0.5, flat[0][1], "elsewhere")
    assert interleave_hybrid(costs, cluster, [*flat, faster], MEMORY_FRACTION) == []
