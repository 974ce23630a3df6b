"""Even pipeline splits: for a uniform model on identical stages with memory to spare, the pinned
pipeline's bottleneck stage holds as many blocks as the exact min-max split's (``ceil(blocks /
stages)`` for identical blocks), for many (blocks, stages) pairs up to 130 x 64; and Megatron's 1T GPT
(128 layers, 130 blocks) pinned to TP 8 x PP 64 on 512 A100 is split that evenly too."""

from __future__ import annotations

import math

import pytest

from autopar.cluster.model import Cluster
from autopar.config import Pin, PlanConfig
from autopar.ir.costs import ModelCosts
from autopar.planner.pins import plan_pinned

ROOMY = {"name": "roomy", "tflops": 300, "memory_GB": 4000, "mem_bandwidth_GBps": 2000}
PAIRS = [(8, 4), (12, 5), (30, 30), (31, 30), (64, 7), (96, 8), (97, 13), (130, 64)]


@pytest.mark.parametrize("blocks,stages", PAIRS)
def test_uniform_blocks_split_as_evenly_as_min_max(blocks, stages):
    costs = ModelCosts.synthetic({"roomy": [0.01] * blocks}, param_bytes=[1e8] * blocks, act_bytes=[1e6] * blocks,
                                 out_bytes=[1e5] * blocks)
    cluster = Cluster.from_dict({"nodes": [{"device": ROOMY, "count": 8, "repeat": math.ceil(stages / 8)}]})
    plan = plan_pinned(costs, cluster, 4 * stages, PlanConfig(pin=Pin(pp=stages, tp=1, dp=1, schedule="1f1b")))
    sizes = [st.num_layers for st in plan.stages]
    assert len(sizes) == stages and sum(sizes) == blocks
    assert max(sizes) == math.ceil(blocks / stages), sizes


def test_megatron_1t_on_64_stages_is_split_evenly():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import published

    run = next(r for r in published.RUNS if r.name == "korthikanti-1t-full-recompute")
    plan, _ = published.plan_run(run)
    sizes = [st.num_layers for st in plan.stages]
    assert len(sizes) == 64 and sum(sizes) == 130
    assert max(sizes) == 3 and sizes.count(3) == 2       # 130 blocks: two stages of 3, the rest of 2
