"""The measured timeline of a real pipeline run: engine traces -> schedule.Timeline -> Gantt PNG."""

from autopar.cluster.model import Cluster
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.ir.schedule import plot_timeline
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
