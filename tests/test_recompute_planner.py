"""Activation recomputation as a planner choice (``Stage.recompute``): a recompute stage's memory (its
input per in-flight micro-batch plus one micro-batch's activations) and time (one more forward in the
backward) in the pipeline and joint planners, exact per-stage choice in the split DP, and that a
memory-bound case picks recompute while an unconstrained one does not."""

import math
from dataclasses import replace

import numpy as np
import pytest

from autopar.planner import joint as jp
from autopar.cluster.model import Cluster
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Stage
from autopar.planner.pp import (
    PipelineContext, StageGrouping, micro_sizes, pipeline_cost_tensor, plan_pipeline, plan_timeline,
    stage_durations, stage_input_bytes,
)
from autopar.cost.memory import stage_memory_bytes

GB = 1e9


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))


def _cluster(num, memory_GB):
    dev = {"name": "dev", "emulate": "cpu", "speed": 1.0, "memory_GB": memory_GB}
    return Cluster.from_dict({"nodes": [{"devices": [{"device": dev, "count": 1}]} for _ in range(num)]})


def _costs(n=6, act=2e8, out=1e7, param=1e8):
    return ModelCosts.synthetic({"dev": [0.01] * n}, param_bytes=[param] * n, act_bytes=[act] * n,
                                out_bytes=[out] * n, overhead_s=0.0)


def _stage(start, stop, rank, micro, recompute):
    return Stage(block_start=start, block_stop=stop, groups=((rank,),), micro_batches=(tuple(micro),),
                 recompute=recompute)


def test_stage_input_bytes():
    costs = _costs(out=3e6)
    assert stage_input_bytes(costs, _stage(0, 2, 0, [1], True)) == 0.0       # the graph input
    assert stage_input_bytes(costs, _stage(2, 4, 0, [1], True)) == 3e6       # output of block 1


def test_recompute_stage_time_adds_one_forward():
    cluster, costs = _cluster(2, 80), _costs()
    call = costs.call_overhead("dev")
    for rc in (False, True):
        stages = (_stage(0, 3, 0, [4, 4], rc), _stage(3, 6, 1, [4, 4], False))
        fwd, bwd, _ = stage_durations(costs, cluster, stages)
        f = float(costs.fwd_time("dev", 4)[0:3].sum()) + call
        b = float(costs.bwd_time("dev", 4)[0:3].sum()) + call
        assert fwd[0] == pytest.approx([f, f])
        assert bwd[0] == pytest.approx([b + f, b + f] if rc else [b, b])
        assert bwd[1] == pytest.approx(bwd[0] if not rc else [b, b])   # the other stage is untouched


def test_recompute_stage_memory():
    costs = _costs(act=2e8, out=1e7, param=1e8)
    state = 3 * costs.state_bytes(slice(0, 1), 0)
    M, x = 4, 2
    for sched in ("1f1b", "gpipe"):
        fly0 = M if sched == "gpipe" else min(M, 2)
        keep = (_stage(0, 3, 0, [x] * M, False), _stage(3, 6, 1, [x] * M, False))
        rc = (_stage(0, 3, 0, [x] * M, True), _stage(3, 6, 1, [x] * M, True))
        mk, mr = stage_memory_bytes(costs, keep, sched, 0), stage_memory_bytes(costs, rc, sched, 0)
        assert mk[0] == math.ceil(state + 3 * 2e8 * x * fly0)
        assert mr[0] == math.ceil(state + 3 * 2e8 * x + 0.0 * x * fly0)          # input of stage 0: ~0
        fly1 = M if sched == "gpipe" else 1
        assert mr[1] == math.ceil(state + 3 * 2e8 * x + 1e7 * x * fly1)          # input: block 2's output
        # Members written as one-rank TP groups (as the joint planner builds them): work factor 1, same bytes.
        as_tp = lambda stages: tuple(replace(st, tp_shares=((8,),)) for st in stages)  # noqa: E731
        assert stage_memory_bytes(costs, as_tp(rc), sched, 0, 0.3) == mr
        assert stage_memory_bytes(costs, as_tp(keep), sched, 0, 0.3) == mk


def test_split_cost_tensor_recomputes_only_where_keeping_does_not_fit():
    """Entry by entry: keep if it fits (same time as without recompute), else recompute if that fits
    (one more forward and call), else inf."""
    costs = _costs(n=6, act=2e8, out=1e7, param=1e8)
    cluster = _cluster(2, 4)       # 3.6 GB usable: states 1.6 GB per block, activations 0.4 GB per block at 2
    ctx = PipelineContext(costs, cluster, 8, 0, 0.9)
    grouping = StageGrouping("per-device", (((0,),), ((1,),)))
    M = 4
    b = micro_sizes(8, M)[0]
    keep = pipeline_cost_tensor(ctx, grouping.stages, M, "1f1b", recompute=False)[0]
    both, rc = pipeline_cost_tensor(ctx, grouping.stages, M, "1f1b")
    call = costs.call_overhead("dev")
    cap = 4e9 * 0.9
    seen = set()
    for s in range(2):
        fly = min(M, 2 - s)
        for i in range(6):
            for j in range(i + 1, 7):
                state = costs.state_bytes(slice(i, j), 0)
                act = float(costs.act_bytes[i:j].sum()) * b
                held = (float(costs.out_bytes[i - 1]) if i else 0.0) * b * fly
                f = float(costs.fwd_time("dev", b)[i:j].sum()) + call
                bw = float(costs.bwd_time("dev", b)[i:j].sum()) + call
                p2p = both[s, i, j] - (2 * f + bw if rc[s, i, j] else f + bw)
                if state + act * fly <= cap:
                    assert not rc[s, i, j] and both[s, i, j] == keep[s, i, j]
                    seen.add("keep")
                elif state + act + held <= cap:
                    assert rc[s, i, j] and np.isinf(keep[s, i, j])
                    assert both[s, i, j] - p2p == pytest.approx(2 * f + bw)
                    seen.add("recompute")
                else:
                    assert np.isinf(both[s, i, j]) and not rc[s, i, j]
                    seen.add("none")
    assert seen == {"keep", "recompute", "none"}


def test_memory_bound_pipeline_picks_recompute_and_unbound_does_not():
    costs = _costs(n=6, act=2e8, out=1e7, param=1e8)
    # Memory-bound: 6 blocks on 2 devices keeping 1F1B's in-flight activations does not fit at any
    # micro-batch count (2.4 GB at the best split, 2.16 usable); recomputing stage 0 needs 1.8.
    tight = _cluster(2, 2.4)
    with pytest.raises(Exception):
        plan_pipeline(costs, tight, 16, schedule="1f1b")
    plan = plan_pipeline(costs, tight, 16, schedule="1f1b", recompute=True)
    assert any(st.recompute for st in plan.stages)
    assert all(v <= 2.4e9 * 0.9 for v in plan.predicted.memory_bytes.values())
    _, step = plan_timeline(plan, costs, tight)
    assert step == pytest.approx(plan.predicted.step_time_s)
    # Unconstrained: recompute is never chosen, and the plan is the one without it.
    roomy = _cluster(2, 80)
    a = plan_pipeline(costs, roomy, 16, recompute=True)
    b = plan_pipeline(costs, roomy, 16)
    assert not any(st.recompute for st in a.stages)
    assert a.stages == b.stages and a.predicted.step_time_s == b.predicted.step_time_s


def test_joint_planner_recompute_choice():
    """Without tensor parallelism or ZeRO, the joint search on the memory-bound pair must recompute;
    on roomy devices it never does, and plan_auto is unchanged by offering it."""
    costs = _costs(n=6, act=2e8, out=1e7, param=1e8)
    tight = _cluster(2, 2.4)
    kw = dict(num_heads=4, degrees=(1,), zero_stage=0, schedule="1f1b")
    assert jp.plan_hybrid(costs, tight, 16, **kw) == []
    scored = jp.plan_hybrid(costs, tight, 16, recompute=True, **kw)
    plan = scored[0].plan
    assert any(st.recompute for st in plan.stages)
    assert all(v <= 2.4e9 * 0.9 for v in plan.predicted.memory_bytes.values())
    _, step = plan_timeline(plan, costs, tight)
    assert step == pytest.approx(plan.predicted.step_time_s)
    best = jp.plan_auto(costs, tight, 16, num_heads=4, recompute=True)
    assert best.predicted.step_time_s <= plan.predicted.step_time_s * (1 + 1e-9)
    roomy = _cluster(2, 80)
    a = jp.plan_auto(costs, roomy, 16, num_heads=4, recompute=True)
    b = jp.plan_auto(costs, roomy, 16, num_heads=4)
    assert not any(st.recompute for st in a.stages)
    assert a.predicted.step_time_s == pytest.approx(b.predicted.step_time_s)
