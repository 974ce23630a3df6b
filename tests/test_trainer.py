"""The measured timeline of a real pipeline run: engine traces -> timeline.Timeline -> Gantt PNG."""

from autopar.cluster.model import Cluster
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.ir.timeline import plot_timeline
from autopar.cli.trainer import StrategyResult, measured_timeline

TWO = Cluster.from_yaml("benchmarks/clusters/two-emulated.yaml")


def test_traces_become_a_timeline_per_stage(tmp_path):
    plan = Plan(strategy="pp", global_batch_size=4, zero_stage=0, schedule="1f1b",
                stages=(Stage(0, 8, ((0,),), ((2, 2),)), Stage(8, 12, ((1,),), ((2, 2),))),
                predicted=Predicted(step_time_s=1.0, samples_per_s=4.0, memory_bytes={0: 0, 1: 0}))
    traces = (
        (("F", 0, 0.0, 0.1), ("SEND_F", 0, 0.1, 0.1), ("F", 1, 0.1, 0.2), ("RECV_B", 0, 0.2, 0.35),
         ("B", 0, 0.35, 0.55), ("B", 1, 0.6, 0.8)),
        (("RECV_F", 0, 0.0, 0.1), ("F", 0, 0.1, 0.15), ("B", 0, 0.15, 0.25), ("F", 1, 0.25, 0.3),
         ("B", 1, 0.3, 0.4)),
    )
    r = StrategyResult("pp", plan.to_json(), (1.0,), (1.0,), 1.0, traces=traces)
    tl, labels = measured_timeline(r, TWO)
    assert [len(ev) for ev in tl.events] == [4, 4]          # compute actions only
    assert [len(tr) for tr in tl.transfers] == [1, 1]       # the receives, drawn as communication
    assert tl.step_time_s == 0.8 and tl.busy_s[1] == 0.05 + 0.1 + 0.05 + 0.1
    assert labels == ["stage 0: rank 0 (fast)", "stage 1: rank 1 (slow)"]
    out = tmp_path / "t.png"
    plot_timeline(tl, out, labels=labels)
    assert out.stat().st_size > 1000


# -- measured steps: warm-up excluded, medians with their spread (structure only, no timing) ----------

def _result(strategy, times, predicted, warmup=(9.0, 9.0)):
    plan = Plan(strategy="dp", global_batch_size=4, zero_stage=0, schedule="none",
                stages=(Stage(0, 12, ((0,), (1,)), ((2,), (2,))),),
                predicted=Predicted(step_time_s=predicted, samples_per_s=4 / predicted, memory_bytes={0: 0, 1: 0}))
    return StrategyResult(strategy, plan.to_json(), tuple(1.0 for _ in times), tuple(times), predicted,
                          warmup_times_s=warmup)


def test_spread_and_paired_speedup():
    from autopar.cli.trainer import paired_speedup, spread

    s = spread([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (s.median, s.q1, s.q3, s.min, s.max, s.num) == (3.0, 2.0, 4.0, 1.0, 5.0, 5)
    assert spread([2.0]).as_dict() == dict(median=2.0, q1=2.0, q3=2.0, min=2.0, max=2.0, num=1)
    p = paired_speedup([1.0, 2.0, 1.0], [2.0, 2.0, 3.0])      # base / fast, step by step
    assert (p.median, p.min, p.max, p.num) == (2.0, 1.0, 3.0, 3)


def test_print_run_reports_medians_spreads_and_the_paired_speedup_without_warmup(capsys):
    import json

    from autopar.cli.main import _print_run

    fast = _result("auto", [1.0, 1.2, 1.1], predicted=1.0)
    base = _result("uniform-dp", [2.0, 3.0, 2.2], predicted=2.0)
    summary = _print_run([fast, base], TWO, "uniform-dp")
    out = capsys.readouterr().out
    assert "warm-up steps, excluded: 9000.0, 9000.0 ms" in out
    assert "over 3 steps: 1100.0 ms median (IQR 1050.0-1150.0, range 1000.0-1200.0)" in out
    assert "measured/predicted step time 1.10 (IQR 1.05-1.15)" in out
    assert "2.00x, median over 3 paired steps (IQR 2.00-2.25x, range 2.00-2.50x" in out
    assert summary["auto"]["step_time_s"]["median"] == 1.1 and summary["auto"]["step_time_s"]["num"] == 3
    assert summary["auto"]["warmup_times_s"] == [9.0, 9.0]
    assert 9.0 not in summary["auto"]["step_times_s"]                 # warm-up never enters a figure
    assert summary["speedup"]["measured"] == 2.0 and summary["speedup"]["spread"]["max"] == 2.5
    assert summary["speedup"]["predicted"] == 2.0
    json.dumps(summary)                                               # --json writes it as it is


def test_run_spec_rejects_no_measured_steps():
    import pytest

    from autopar.cli.trainer import RunSpec

    with pytest.raises(ValueError, match="steps"):
        RunSpec(model="gpt-tiny", cluster_dict={}, global_batch=4, steps=0, strategies=("dp",))
    with pytest.raises(ValueError, match="warmup_steps"):
        RunSpec(model="gpt-tiny", cluster_dict={}, global_batch=4, steps=1, strategies=("dp",), warmup_steps=-1)


def test_turns_interleave_step_by_step_in_runs_of_k_or_one_strategy_after_the_other():
    from autopar.cli.trainer import turns

    def order(k, start=0, stop=4):
        return [(step, run) for step, run in turns(["A", "B"], start, stop, k)]

    # step by step, the order reversed on every other step: the pairs of the old loop
    assert order(1) == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B"), (3, "B"), (3, "A")]
    assert order(2) == [(0, "A"), (1, "A"), (0, "B"), (1, "B"), (2, "B"), (3, "B"), (2, "A"), (3, "A")]
    # 0: every step of a strategy back to back, one strategy after the other
    assert order(0) == [(0, "A"), (1, "A"), (2, "A"), (3, "A"), (0, "B"), (1, "B"), (2, "B"), (3, "B")]
    # resumed at step 3 of 4: what is left, in one run each
    assert order(0, start=3) == [(3, "A"), (3, "B")]
    # every (step, strategy) exactly once, whatever k
    for k in range(0, 6):
        assert sorted(order(k, stop=5)) == sorted((s, r) for s in range(5) for r in "AB")


def test_run_spec_rejects_a_negative_consecutive():
    import pytest

    from autopar.cli.trainer import RunSpec

    with pytest.raises(ValueError, match="consecutive"):
        RunSpec(model="gpt-tiny", cluster_dict={}, global_batch=4, steps=1, strategies=("dp",), consecutive=-1)
