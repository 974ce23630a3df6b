from autopar.cluster import Cluster
from autopar.plan import Plan, Predicted, Stage


def test_alike_members_are_one_row_and_others_stay_apart():
    cl = Cluster.homogeneous("A100-80GB", count=6, per_node=6)
    stage = Stage(0, 4, ((0,), (1,), (2,), (3,), (4,), (5,)), ((4,), (4,), (4,), (4,), (2, 2), (3,)))
    plan = Plan(strategy="dp", global_batch_size=27, zero_stage=0, schedule="none", stages=(stage,),
                predicted=Predicted(step_time_s=1.0, samples_per_s=27.0, memory_bytes={r: 1 << 30 for r in range(6)}))
    text = plan.summary(cl)
    assert "4 members x 1: 0-3" in text
    rows = [line for line in text.splitlines() if line.startswith("│ 0")]
    assert len(rows) == 3      # ranks 0-3 alike; rank 4 (2 micro-batches) and rank 5 (3 samples) apart
