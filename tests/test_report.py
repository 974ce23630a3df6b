import dataclasses

from autopar.cluster.model import Cluster
from autopar.ir.plan import Plan, Predicted, Stage


def test_alike_members_are_one_row_and_others_stay_apart():
    cl = Cluster.homogeneous("A100-80GB", count=6, per_node=6)
    stage = Stage(0, 4, ((0,), (1,), (2,), (3,), (4,), (5,)), ((4,), (4,), (4,), (4,), (2, 2), (3,)))
    plan = Plan(strategy="dp", global_batch_size=27, zero_stage=0, schedule="none", stages=(stage,),
                predicted=Predicted(step_time_s=1.0, samples_per_s=27.0, memory_bytes={r: 1 << 30 for r in range(6)}))
    text = plan.summary(cl)
    assert "4 members x 1: 0-3" in text
    rows = [line for line in text.splitlines() if line.startswith("│ 0")]
    assert len(rows) == 3      # ranks 0-3 alike; rank 4 (2 micro-batches) and rank 5 (3 samples) apart
    assert "upper bound" not in text      # a plan without bounds prints none
    above = dataclasses.replace(plan, predicted=dataclasses.replace(
        plan.predicted, upper_bound_samples_per_s=25.0, efficiency=27.0 / 25.0))
    text = above.summary(cl)
    assert "efficiency vs upper bound 108.0%" in text and "pools memory" in text
    assert "MFU" not in text             # no figures against the limit: none printed


def test_summary_leads_with_mfu_and_compute_efficiency():
    """The figures against the physical limit come first, each saying what it is measured against."""
    cl = Cluster.homogeneous("A100-80GB", count=2, per_node=2)
    stage = Stage(0, 4, ((0,), (1,)), ((4,), (4,)))
    pred = Predicted(step_time_s=1.0, samples_per_s=8.0, memory_bytes={0: 1, 1: 1}, upper_bound_samples_per_s=10.0,
                     compute_bound_samples_per_s=16.0, efficiency=0.8, compute_efficiency=0.5, mfu=0.25,
                     homogeneous_mfu=0.3)
    plan = Plan(strategy="dp", global_batch_size=8, zero_stage=0, schedule="none", stages=(stage,), predicted=pred)
    lines = plan.summary(cl).splitlines()
    assert lines[0].startswith("MFU 25.0% (model FLOP/s over the cluster's summed peak)")
    assert "homogeneous MFU 30.0%" in lines[0]
    assert lines[1].startswith("efficiency vs compute bound 50.0% (no communication, no bubbles")
    text = "\n".join(lines)
    assert text.index("efficiency vs upper bound 80.0%") > text.index("pred. memory")


def test_old_plan_json_without_the_new_figures_loads():
    cl_plan = Plan(strategy="dp", global_batch_size=8, zero_stage=0, schedule="none",
                   stages=(Stage(0, 4, ((0,),), ((8,),)),),
                   predicted=Predicted(step_time_s=1.0, samples_per_s=8.0, memory_bytes={0: 1}, mfu=0.4,
                                       homogeneous_mfu=0.5, compute_efficiency=0.6))
    assert Plan.from_json(cl_plan.to_json()) == cl_plan
    d = cl_plan.to_dict()
    for k in ("mfu", "homogeneous_mfu", "compute_efficiency"):
        del d["predicted"][k]
    old = Plan.from_dict(d)
    assert (old.predicted.mfu, old.predicted.homogeneous_mfu, old.predicted.compute_efficiency) == (0.0, 0.0, 0.0)


def test_engine_selection_by_plan_shape():
    from autopar.runtime.dp import DataParallelEngine
    from autopar.runtime.engine import select_engine
    from autopar.runtime.pipeline import PipelineEngine
    from autopar.runtime.tp import TensorParallelEngine

    pred = Predicted(step_time_s=1.0, samples_per_s=1.0, memory_bytes={})

    def plan(*stages):
        return Plan(strategy="x", global_batch_size=4, zero_stage=0, schedule="1f1b", stages=stages, predicted=pred)

    assert select_engine(plan(Stage(0, 4, ((0,), (1,)), ((2,), (2,))))) is DataParallelEngine
    tp = dict(groups=((0, 1),), micro_batches=((4,),), tp_shares=((1, 1),))
    assert select_engine(plan(Stage(0, 4, **tp))) is TensorParallelEngine
    # The TP engine does not recompute; the pipeline engine runs a one-stage plan that does (exact:
    # checked by a launch of gpt-tiny, heads 2/1/1, against the oracle).
    assert select_engine(plan(Stage(0, 4, **tp, recompute=True))) is PipelineEngine
    assert select_engine(plan(Stage(0, 2, ((0,),), ((4,),)), Stage(2, 4, ((1,),), ((4,),)))) is PipelineEngine


def test_train_prints_each_ranks_peak_memory_beside_its_prediction():
    from autopar.cli.trainer import gap_lines
    from autopar.ir.profile import RankInfo, StepProfile

    mib = 1 << 20
    ranks = (RankInfo(0, "cpu-full", predicted_memory_bytes=200 * mib, measured_memory_bytes=220 * mib),
             RankInfo(1, "cpu-half", predicted_memory_bytes=100 * mib))
    prof = StepProfile("dp", 1.0, ranks, ())
    (line,) = [x for x in gap_lines(prof) if "peak memory" in x]
    assert line.endswith("rank 0 cpu-full 220 / 200 (1.10)")     # a rank nothing measured is left out
