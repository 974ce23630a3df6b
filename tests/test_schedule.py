"""Schedules as data: generators, the simulator's dependency model, deadlock detection, JSON, plotting."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import AutoparError
from autopar.ir.schedule import Action, PipelineSchedule, ScheduleError, gpipe, make_schedule, one_f_one_b, with_comm
from autopar.ir.timeline import dry_run, plot_timeline, simulate


def _check_timeline(tl, sched, fwd, bwd, comm):
    """Every (stage, F/B, micro) once; each stage's actions in list order without overlap; every
    dependency (plus its transfer) done before an action starts."""
    S, M = sched.num_stages, sched.num_micro
    when = {}
    for s in range(S):
        assert [a for a, _, _ in tl.events[s]] == list(sched.actions[s])
        prev_end = 0.0
        for a, t0, t1 in tl.events[s]:
            if not a.is_compute:
                continue
            assert t0 >= prev_end - 1e-12
            prev_end = t1
            assert (a.stage, a.kind, a.micro) not in when
            when[(a.stage, a.kind, a.micro)] = (t0, t1)
    compute = {k for k in when if k[1] in ("F", "B")}
    assert compute == {(s, k, m) for s in range(S) for k in "FB" for m in range(M)}
    eps = 1e-9
    for s in range(S):
        for m in range(M):
            f0, f1 = when[(s, "F", m)]
            b0, b1 = when[(s, "B", m)]
            assert f1 - f0 == pytest.approx(fwd[s][m]) and b1 - b0 == pytest.approx(bwd[s][m])
            assert b0 >= f1 - eps
            if s > 0:
                assert f0 >= when[(s - 1, "F", m)][1] + comm[s - 1][m] - eps
            if s < S - 1:
                assert b0 >= when[(s + 1, "B", m)][1] + comm[s][m] - eps
    busy = [sum(fwd[s]) + sum(bwd[s]) for s in range(S)]
    assert tl.busy_s == pytest.approx(busy)
    assert tl.step_time_s == pytest.approx(max(t1 for ev in tl.events for _, _, t1 in ev))
    assert 0 <= tl.bubble_fraction < 1


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b"]),
    num_stages=st.integers(1, 6),
    num_micro=st.integers(1, 10),
    seed=st.integers(0, 2**31 - 1),
    explicit=st.booleans(),
)
def test_generated_schedules_run_and_respect_dependencies(name, num_stages, num_micro, seed, explicit):
    rng = np.random.default_rng(seed)
    sched = make_schedule(name, num_stages, num_micro)
    fwd = rng.uniform(0.1, 2.0, (num_stages, num_micro))
    bwd = rng.uniform(0.1, 4.0, (num_stages, num_micro))
    comm = rng.uniform(0.0, 0.5, (num_stages - 1, num_micro))
    dry_run(sched)
    run = with_comm(sched) if explicit else sched
    tl = simulate(run, fwd, bwd, comm)
    _check_timeline(tl, run, fwd, bwd, comm)
    if explicit:
        # Lowering changes nothing in time: sends are free to issue, receives only wait for the data.
        implied = simulate(sched, fwd, bwd, comm)
        assert tl.step_time_s == pytest.approx(implied.step_time_s)
        ends = {a: t1 for ev in tl.events for a, _, t1 in ev if a.is_compute}
        assert ends == pytest.approx({a: t1 for ev in implied.events for a, _, t1 in ev})


def test_uniform_pipeline_matches_closed_form():
    # (M + S - 1) * (f + b) for equal durations and free transfers, for both schedules.
    for name in ("gpipe", "1f1b"):
        S, M = 4, 6
        tl = simulate(make_schedule(name, S, M), np.ones((S, M)), 2 * np.ones((S, M)), np.zeros((S - 1, M)))
        assert tl.step_time_s == pytest.approx((M + S - 1) * 3)
        assert tl.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))
    # Transfers add 2 * (S - 1) hops of latency on the critical path of a 1-micro-batch pipeline.
    tl = simulate(gpipe(3, 1), np.ones((3, 1)), np.ones((3, 1)), np.full((2, 1), 0.25))
    assert tl.step_time_s == pytest.approx(6 + 4 * 0.25)


def test_one_f_one_b_memory_and_order():
    S, M = 4, 7
    sched = one_f_one_b(S, M)
    for s, acts in enumerate(sched.actions):
        in_flight = peak = 0
        for a in acts:
            in_flight += 1 if a.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(M, S - s)
    assert [repr(a) for a in sched.actions[3][:4]] == ["3F0", "3B0", "3F1", "3B1"]
    assert max(sum(1 for a in acts if a.kind == "F") for acts in gpipe(S, M).actions) == M


def test_action_repr_parse_and_json_round_trip():
    assert repr(Action(2, "F", 0)) == "2F0"
    assert Action.parse("2F0") == Action(2, "F", 0)
    assert Action.parse("11RECV_B13") == Action(11, "RECV_B", 13)
    for text in ("F0", "2X0", "2F", "-1F0"):
        with pytest.raises(ScheduleError):
            Action.parse(text)
    with pytest.raises(ScheduleError, match="kind"):
        Action(0, "W", 0)
    for sched in (gpipe(3, 4), one_f_one_b(5, 2), with_comm(one_f_one_b(3, 5))):
        text = sched.to_json()
        assert PipelineSchedule.from_json(text) == sched
        assert json.loads(text)["actions"][0][0] == repr(sched.actions[0][0])
    assert "0F0" in repr(gpipe(2, 1))


def test_with_comm_lowering():
    low = with_comm(gpipe(2, 1))
    assert [repr(a) for a in low.actions[0]] == ["0F0", "0SEND_F0", "0RECV_B0", "0B0"]
    assert [repr(a) for a in low.actions[1]] == ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]
    with pytest.raises(ScheduleError, match="already"):
        with_comm(low)


def test_bad_schedules_raise_schedule_error():
    A = Action.parse
    # Stage 0 runs its backward of micro 0 before it has sent micro 1's forward... fine; but stage 1
    # wants micro 1 first while stage 0 waits on stage 1's backward of micro 0: a cycle.
    bad = PipelineSchedule("bad", 2, (
        tuple(map(A, ["0F0", "0B0", "0F1", "0B1"])),
        tuple(map(A, ["1F1", "1F0", "1B0", "1B1"])),
    ))
    with pytest.raises(ScheduleError, match=r"deadlocks: stuck at 0B0, 1F1"):
        dry_run(bad)
    assert issubclass(ScheduleError, AutoparError) and issubclass(ScheduleError, ValueError)
    # Explicit communication: stage 1 receives micro 1 before micro 0 and stage 0 sends in order, with
    # stage 0 blocked receiving the gradient of micro 0 before sending micro 1.
    low = with_comm(one_f_one_b(2, 2))
    acts1 = list(low.actions[1])
    acts1[0], acts1[4] = acts1[4], acts1[0]   # 1RECV_F1 first
    acts1[1], acts1[5] = acts1[5], acts1[1]
    with pytest.raises(ScheduleError, match="deadlocks"):
        dry_run(PipelineSchedule("swapped", 2, (low.actions[0], tuple(acts1))))
    with pytest.raises(ScheduleError, match="missing"):
        dry_run(PipelineSchedule("short", 2, (gpipe(1, 2).actions[0][:-1],)))
    with pytest.raises(ScheduleError, match="twice"):
        dry_run(PipelineSchedule("dup", 1, ((A("0F0"), A("0F0"), A("0B0")),)))
    with pytest.raises(ScheduleError, match="list of stage 1"):
        dry_run(PipelineSchedule("wrong", 1, ((A("0F0"), A("0B0")), (A("0F0"), A("1B0")))))
    with pytest.raises(ScheduleError, match="neighbour"):
        dry_run(PipelineSchedule("edge", 1, ((A("0RECV_F0"), A("0F0"), A("0B0")),)))
    with pytest.raises(ValueError, match="fwd_time_s"):
        simulate(gpipe(2, 3), np.ones((3, 2)), np.ones((2, 3)))


def test_plot_timeline_writes_png(tmp_path):
    S, M = 3, 4
    rng = np.random.default_rng(0)
    tl = simulate(one_f_one_b(S, M), rng.uniform(1, 2, (S, M)), rng.uniform(2, 3, (S, M)), np.full((S - 1, M), 0.2))
    out = tmp_path / "tl.png"
    plot_timeline(tl, out, labels=["rank 0", "rank 1", "rank 2"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="labels"):
        plot_timeline(tl, out, labels=["x"])
