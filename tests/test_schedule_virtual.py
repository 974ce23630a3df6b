"""The new schedules as data: interleaved-1f1b (virtual stages) and zb-h1 (split backwards).

- the simulator against an independent brute-force timeline (every action's start relaxed to the
  latest of its worker's previous end and its dependencies plus transfers, until nothing moves) and
  against closed forms on uniform cases;
- generated schedules are valid: every F before its B, BW after its BI, dependencies across stages,
  in-flight counts within 1F1B's peak for zb-h1;
- plans with virtual stages: JSON round trip and the checks naming the field;
- the planner may choose them, and its prediction is ``plan_timeline``'s.
"""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import PlanError
from autopar.ir.plan import Plan, Predicted
from autopar.ir.schedule import (
    ALL_SCHEDULES, Action, PipelineSchedule, ScheduleError, in_flight_micro_batches, make_schedule, with_comm,
)
from autopar.ir.timeline import dry_run, simulate
from oracle import stages_of


def _brute_force(sched, fwd, bwd, comm, wgrad):
    """Start times by relaxation to a fixpoint (no queue, no order of visiting): a reference for
    ``simulate`` on compute-only schedules."""
    S, M = sched.num_stages, sched.num_micro
    dur = {}
    for s in range(S):
        for m in range(M):
            dur[(s, "F", m)], dur[(s, "B", m)] = fwd[s][m], bwd[s][m]
            dur[(s, "BW", m)], dur[(s, "BI", m)] = wgrad[s][m], bwd[s][m] - wgrad[s][m]
    start = {(a.stage, a.kind, a.micro): 0.0 for acts in sched.actions for a in acts}
    end = {k: dur[k] for k in start}
    grad = {(s, m): ("BI" if (s, "BI", m) in start else "B") for s in range(S) for m in range(M)}
    for _ in range(10 * len(start)):
        moved = False
        for acts in sched.actions:
            prev = 0.0
            for a in acts:
                k = (a.stage, a.kind, a.micro)
                s, kind, m = k
                t = prev
                if kind == "F" and s > 0:
                    t = max(t, end[(s - 1, "F", m)] + comm[s - 1][m])
                if kind in ("B", "BI"):
                    t = max(t, end[(s, "F", m)])
                    if s < S - 1:
                        t = max(t, end[(s + 1, grad[(s + 1, m)], m)] + comm[s][m])
                if kind == "BW":
                    t = max(t, end[(s, "BI", m)])
                if t > start[k] + 1e-12:
                    start[k], end[k], moved = t, t + dur[k], True
                prev = end[k]
        if not moved:
            break
    else:
        raise AssertionError("no fixpoint: the schedule deadlocks")
    return start, end


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(["interleaved-1f1b", "zb-h1", "1f1b"]), workers=st.integers(1, 4),
       virtual=st.integers(1, 3), num_micro=st.integers(1, 7), seed=st.integers(0, 2**31 - 1))
def test_simulator_equals_brute_force_timeline(name, workers, virtual, num_micro, seed):
    V = virtual if name == "interleaved-1f1b" else 1
    S = workers * V
    rng = np.random.default_rng(seed)
    fwd, bwd = rng.uniform(0.5, 2, (S, num_micro)), rng.uniform(1, 3, (S, num_micro))
    comm, wgrad = rng.uniform(0, 0.5, (max(S - 1, 0), num_micro)), rng.uniform(0.2, 0.9, (S, num_micro)) * bwd
    sched = make_schedule(name, S, num_micro, V)
    tl = simulate(sched, fwd, bwd, comm, wgrad_time_s=wgrad)
    start, end = _brute_force(sched, fwd, bwd, comm, wgrad)
    assert tl.step_time_s == pytest.approx(max(end.values()))
    for ev in tl.events:
        for a, t0, t1 in ev:
            assert t0 == pytest.approx(start[(a.stage, a.kind, a.micro)]), a
    # validity: every stage computes every micro-batch's F and backward once, F before its backward,
    # BW after its BI (the brute force's constraints hold in the simulated times too)
    seen = {(a.stage, a.kind, a.micro): (t0, t1) for ev in tl.events for a, t0, t1 in ev}
    for s in range(S):
        for m in range(num_micro):
            f = seen[(s, "F", m)]
            g = seen.get((s, "B", m)) or seen[(s, "BI", m)]
            assert g[0] >= f[1] - 1e-9
            if (s, "BW", m) in seen:
                assert seen[(s, "BW", m)][0] >= g[1] - 1e-9
    # the lowered schedule runs to the same step (sends free, receives wait for the data)
    assert simulate(with_comm(sched), fwd, bwd, comm, wgrad_time_s=wgrad).step_time_s == pytest.approx(tl.step_time_s)


def test_closed_forms_on_uniform_pipelines():
    S, M = 4, 8
    ones = np.ones((S, M))
    # 1F1B: (M + S - 1)(F + B); ZB-H1 with F = I = W: M(F + B) + (S - 1)(F + I - W), a third of the bubble
    assert simulate(make_schedule("1f1b", S, M), ones, 2 * ones).step_time_s == pytest.approx(33)
    assert simulate(make_schedule("zb-h1", S, M), ones, 2 * ones, wgrad_time_s=ones).step_time_s == pytest.approx(27)
    # interleaved with V chunks of 1/V the time each: M(F + B) + (W - 1)(F + B) / V
    for V, want in ((1, 21.0), (2, 16.5), (4, 14.25)):
        f = np.ones((S * V, 4)) / V
        assert simulate(make_schedule("interleaved-1f1b", S * V, 4, V), f, 2 * f).step_time_s == pytest.approx(want)


def test_interleaved_order_and_memory():
    sched = make_schedule("interleaved-1f1b", 4, 4, 2)
    # Megatron's order on worker 0: rounds of W=2 micro-batches through chunks 0 (stage 0) then 1 (stage 2)
    assert [repr(a) for a in sched.actions[0][:6]] == ["0F0", "0F1", "2F0", "2F1", "0F2", "2B0"]
    assert all(a.stage % 2 == w for w, acts in enumerate(sched.actions) for a in acts)
    assert PipelineSchedule.from_json(sched.to_json()) == sched
    assert [in_flight_micro_batches("interleaved-1f1b", s, 4, 4, 2) for s in range(4)] == [4, 3, 2, 1]
    # a partial last round that Megatron's warm-up would deadlock on takes more warm-up instead
    for W, V, M in ((4, 3, 5), (5, 2, 7), (5, 4, 11)):
        dry_run(with_comm(make_schedule("interleaved-1f1b", W * V, M, V)))
    with pytest.raises(ScheduleError, match="virtual_stages"):
        make_schedule("interleaved-1f1b", 5, 4, 2)
    with pytest.raises(ScheduleError, match="virtual_stages"):
        make_schedule("zb-h1", 4, 4, 2)


def test_zb_h1_order_memory_and_validation():
    sched = make_schedule("zb-h1", 3, 4)
    assert [repr(a) for a in sched.actions[2]] == ["2F0", "2BI0", "2F1", "2BI1", "2F2", "2BI2", "2BW0", "2F3",
                                                   "2BI3", "2BW1", "2BW2", "2BW3"]
    # stage s defers s weight gradients: at most S in flight, 1F1B's peak (stage 0's)
    peaks = [in_flight_micro_batches("zb-h1", s, 4, 8) for s in range(4)]
    assert max(peaks) == in_flight_micro_batches("1f1b", 0, 4, 8) == 4
    low = with_comm(sched)
    assert [repr(a) for a in low.actions[1][:4]] == ["1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1"]
    assert "1SEND_B0" == repr(low.actions[1][low.actions[1].index(Action(1, "BI", 0)) + 1])
    A = Action.parse
    with pytest.raises(ScheduleError, match="both a B and"):
        dry_run(PipelineSchedule("mixed", 1, ((A("0F0"), A("0B0"), A("0BW0")),)))
    with pytest.raises(ScheduleError, match="deadlocks"):
        dry_run(PipelineSchedule("w-first", 1, ((A("0F0"), A("0BW0"), A("0BI0")),)))
    with pytest.raises(ScheduleError, match="missing"):
        dry_run(PipelineSchedule("no-w", 1, ((A("0F0"), A("0BI0")),)))
    assert Action.parse("3BW12") == Action(3, "BW", 12) and set(ALL_SCHEDULES) >= {"interleaved-1f1b", "zb-h1"}


def _vplan(V=2):
    mb = (2, 2)
    return Plan(strategy="pp", global_batch_size=4, zero_stage=0, schedule="interleaved-1f1b",
                stages=stages_of([(2, {0: mb}), (3, {1: mb}), (5, {0: mb}), (6, {1: mb})]), virtual_stages=V,
                predicted=Predicted(step_time_s=1.0, samples_per_s=4.0, memory_bytes={0: 1, 1: 2}))


def test_plan_with_virtual_stages_round_trips_and_is_checked():
    plan = _vplan()
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["virtual_stages"] == 2
    assert plan.rank_stages == 2 and plan.chunks_of(0) == (0, 2) and plan.chunks_of(1) == (1, 3)
    old = json.loads(plan.to_json())
    del old["virtual_stages"]
    with pytest.raises(PlanError, match=r"plan.stages\[2\].groups\[0\]\[0\]: 0 is a rank of stage 0 too"):
        Plan.from_dict(old)                            # chunks of one rank without the field: not a flat plan
    flat = json.loads(Plan(strategy="pp", global_batch_size=4, zero_stage=0, schedule="1f1b",
                           stages=stages_of([(2, {0: (2, 2)}), (3, {1: (2, 2)})]),
                           predicted=Predicted(step_time_s=1.0, samples_per_s=4.0, memory_bytes={})).to_json())
    del flat["virtual_stages"]
    assert Plan.from_dict(flat).virtual_stages == 1    # plans saved before the field
    with pytest.raises(PlanError, match="virtual_stages"):
        _vplan(V=3)
    with pytest.raises(PlanError, match="virtual_stages: stage 2"):
        Plan(strategy="pp", global_batch_size=4, zero_stage=0, schedule="interleaved-1f1b", virtual_stages=2,
             stages=stages_of([(2, {0: (2, 2)}), (3, {1: (2, 2)}), (5, {1: (2, 2)}), (6, {0: (2, 2)})]),
             predicted=Predicted(step_time_s=1.0, samples_per_s=4.0, memory_bytes={}))


def _bubble_case():
    from test_pp_exact import _cluster, _costs

    speeds = (1.0, 0.5, 1.0, 0.75)
    rng = np.random.default_rng(0)
    n = 12
    return _cluster(*speeds), _costs(rng.uniform(0.01, 0.03, n), speeds, 0.001, rng.uniform(1e4, 1e5, n),
                                     rng.uniform(1e5, 1e6, n))


def test_planner_chooses_the_new_schedules_and_predicts_with_plan_timeline():
    from autopar.cost.pipeline import pipeline_memory_bytes, plan_timeline
    from autopar.planner.pp import plan_pipeline

    cluster, costs = _bubble_case()
    flat = plan_pipeline(costs, cluster, 8, num_micro=4)                  # default: gpipe / 1f1b
    auto = plan_pipeline(costs, cluster, 8, num_micro=4, schedules=ALL_SCHEDULES)
    assert flat.schedule in ("gpipe", "1f1b") and auto.schedule in ("zb-h1", "interleaved-1f1b")
    assert auto.predicted.step_time_s < flat.predicted.step_time_s
    for sch in ("zb-h1", "interleaved-1f1b"):
        p = plan_pipeline(costs, cluster, 8, num_micro=4, schedule=sch)
        assert p.schedule == sch and auto.predicted.step_time_s <= p.predicted.step_time_s * (1 + 1e-9)
        assert plan_timeline(p, costs, cluster)[1] == pytest.approx(p.predicted.step_time_s, rel=1e-12)
        assert Plan.from_json(p.to_json()) == p
    il = plan_pipeline(costs, cluster, 8, num_micro=4, schedule="interleaved-1f1b")
    assert il.virtual_stages >= 2 and il.num_stages == 4 * il.virtual_stages
    # a rank's memory is the sum over its chunks
    mem = pipeline_memory_bytes(costs, il.stages, "interleaved-1f1b", 0, il.virtual_stages)
    assert mem == il.predicted.memory_bytes and sorted(mem) == [0, 1, 2, 3]
    pinned = plan_pipeline(costs, cluster, 8, num_micro=4, schedule="interleaved-1f1b", virtual_stages=3)
    assert pinned.virtual_stages == 3
    with pytest.raises(PlanError, match="virtual_stages"):
        plan_pipeline(costs, cluster, 8, schedule="zb-h1", virtual_stages=2)


def _fewest_extra_by_trying_each(W: int, M: int, V: int):
    """The interleaved order with the fewest extra warm-up forwards that runs, found by trying every
    count in turn (the generator gallops and bisects past its first few)."""
    from autopar.ir.schedule import interleaved_order

    return next((s for e in range(V * M + 1) if (s := interleaved_order(W, M, V, e)) is not None), None)


@pytest.mark.parametrize("one_by_one", [1, 8])
def test_interleaved_order_takes_the_fewest_extra_warm_up_forwards(monkeypatch, one_by_one):
    """Galloping and bisecting over the extra warm-up forwards (after the first ``one_by_one`` counts,
    tried in turn) finds the count trying each one does (a deadlock-free order stays so with more
    warm-up), for every small size; these need up to 4 extra forwards."""
    from autopar.ir import schedule
    from autopar.ir.schedule import _interleaved

    monkeypatch.setattr(schedule, "_TRIED_ONE_BY_ONE", one_by_one)
    for W in range(2, 6):
        for V in (2, 3):
            for M in range(1, 3 * W + 2):
                want = _fewest_extra_by_trying_each(W, M, V)
                got = _interleaved.__wrapped__(W, M, V)
                assert want is not None and got.actions == want.actions, (W, M, V)
