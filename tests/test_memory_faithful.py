"""Memory-faithful data-parallel engines (issue 11, Build item 3): each rank's tracked peak
(``autopar.runtime.memory.TrackedMeter``) is within 15% of what the cost model prices for it
(``autopar.cost.memory``), on uneven ZeRO shards, where a rank with a small shard used to hold
buffers padded to the largest (2-3.8x its prediction in ``benchmarks/bench_memory.py``).

Three ranks on the threaded process group, gpt-tiny, a hand-written plan: shards 0.55 / 0.3 / 0.15,
rank 2 computes nothing (as the planner gives a slow device a shard and no samples). The engines stay
exact (``tests/test_dp_engine.py``); here only their memory is checked. No timing.
"""

from __future__ import annotations

import copy
import threading

import numpy as np
import torch
from torch.testing._internal.common_utils import run_tests

from autopar.cost import memory as cost_memory
from autopar.config import GRAD_BUCKET_BYTES
from autopar.ir.costs import ModelCosts, zero_chunk_numel, zero_staging_numel
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.lowering import lower
from autopar.runtime.dp import DataParallelEngine
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs
from autopar.runtime.memory import TrackedMeter, module_tensors
from oracle import batches, optimizer_factory, prepared_case, threaded_ranks

MODEL, MICRO, SHARES, STEPS, BAND = "gpt-tiny", ((8,), (4,), ()), (0.55, 0.3, 0.15), 2, 0.15
_LOCK = threading.Lock()
_COSTS: dict = {}


def _cluster():
    from autopar.cluster.model import Cluster

    return Cluster.from_dict({"nodes": [{"device": {"name": "cpu-e", "emulate": "cpu", "speed": 1.0,
                                                    "memory_GB": 1}, "count": 1}]})


def _costs() -> ModelCosts:
    """gpt-tiny's cost tables (bytes only matter here; roofline times, nothing measured)."""
    with _LOCK:
        if MODEL not in _COSTS:
            from autopar.api import prepare
            from autopar.models import build

            case = build(MODEL, seed=0)
            _COSTS[MODEL] = prepare(case.model, _cluster(), case.example_inputs, measure=False).costs
        return _COSTS[MODEL]


def _predicted(costs: ModelCosts, zero_stage: int, rank: int) -> int:
    """What the data-parallel planner prices for this rank (``planner.dp.shard_memory`` at its share)."""
    from autopar.planner.dp import shard_memory

    m = shard_memory(costs, _cluster().devices[0].spec, zero_stage, SHARES[rank])
    return m.peak_bytes(max(MICRO[rank], default=0))


class ThreeRanks(threaded_ranks(3)):
    def _measured(self, zero_stage: int) -> int:
        with _LOCK:
            model, gm, loss_fn, num_blocks = prepared_case(MODEL)
            model, gm = copy.deepcopy((model, gm))
            data = batches(MODEL, sum(map(sum, MICRO)), STEPS)
        plan = Plan(strategy="dp", global_batch_size=sum(map(sum, MICRO)), zero_stage=zero_stage, schedule="none",
                    stages=(Stage(0, num_blocks, groups=((0,), (1,), (2,)), micro_batches=MICRO,
                                  zero_shares=SHARES),),
                    predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))
        meter = TrackedMeter(self.rank)
        meter.track(module_tensors(model))
        with meter:
            engine = DataParallelEngine(EngineInputs(
                gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory("adamw"),
                rank=self.rank, world_size=self.world_size, device=torch.device("cpu"), clock=NullClock()),
                lower(plan, gm, self.rank, params=[p for p in model.parameters() if p.requires_grad]))
            meter.reset_peak()
            for inputs, targets in data:
                engine.step(inputs, targets)
        return meter.peak_bytes

    def _check(self, zero_stage: int) -> None:
        measured = self._measured(zero_stage)
        predicted = _predicted(_costs(), zero_stage, self.rank)
        ratio = measured / predicted
        assert abs(ratio - 1) <= BAND, (f"ZeRO-{zero_stage} rank {self.rank}: measured {measured} bytes, "
                                        f"predicted {predicted}, ratio {ratio:.3f}")

    def test_zero1_uneven_shards_within_15_percent(self):
        self._check(1)

    def test_zero2_uneven_shards_within_15_percent(self):
        self._check(2)

    def test_zero3_by_block_uneven_shards_within_15_percent(self):
        self._check(3)


def test_staging_buffer_is_a_bucket_at_most_and_priced():
    # gpt-tiny-sized unit (234880 elements, fp32) on 3 ranks: a round stages the even shard of every
    # position (the whole unit, one collective); a unit larger than a gradient bucket stages one bucket
    # per round; the cost model prices the same buffer for ZeRO-2/3 only.
    assert zero_chunk_numel(234880, 4) == 14680
    assert zero_staging_numel(234880, 3, 4) == 78294
    assert zero_staging_numel(100, 3, 4) == 34
    assert zero_staging_numel(10**8, 4, 4) == GRAD_BUCKET_BYTES // 4 // 4
    costs = ModelCosts.synthetic({"d": [1e-3] * 2}, param_bytes=[4e6, 4e6], act_bytes=[1e6, 1e6])
    assert cost_memory.zero_staging_bytes(costs, 1, 3) == 0.0
    assert cost_memory.zero_staging_bytes(costs, 2, 3) == 3 * (GRAD_BUCKET_BYTES // 4 // 3) * 4


def test_pricing_counts_the_loss_and_the_transient_gradient():
    costs = ModelCosts.synthetic({"d": [1e-3] * 3}, param_bytes=[4e6] * 3, act_bytes=[1e6] * 3)
    costs.output_bytes = 2e5
    spec = _cluster().devices[0].spec
    z1, z2 = (cost_memory.rank_memory(costs, spec, z, 3) for z in (1, 2))
    assert z1.act_bytes_per_sample == 3e6 + cost_memory.LOSS_OUTPUT_COPIES * 2e5
    assert z1.transient_bytes == 0.0 and z2.transient_bytes == 12e6      # the full gradient, fp32
    # A rank without a micro-step holds no activations and no transient gradient; one with a small
    # micro-batch holds the full gradient (the activations are freed as backward makes it).
    assert z2.peak_bytes(0) == int(np.ceil(z2.fixed_bytes))
    assert z2.peak_bytes(1) == int(np.ceil(z2.fixed_bytes + 12e6))
    # the staging buffer lives after backward: beside the full gradient, not beside the activations
    assert z2.peak_bytes(10) == int(np.ceil(z2.fixed_bytes - z2.staging_bytes + 10 * z2.act_bytes_per_sample))
    # Pipelines: the loss only on the last stage.
    stages = (Stage(0, 2, groups=((0,),), micro_batches=((4,),)), Stage(2, 3, groups=((1,),), micro_batches=((4,),)))
    with_loss = cost_memory.stage_memory_bytes(costs, stages, "1f1b", 0)
    costs.output_bytes = 0.0
    without = cost_memory.stage_memory_bytes(costs, stages, "1f1b", 0)
    assert with_loss[0] == without[0]
    assert with_loss[1] - without[1] == cost_memory.LOSS_OUTPUT_COPIES * 2e5 * 4


if __name__ == "__main__":
    run_tests()
