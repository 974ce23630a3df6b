"""The data-parallel engine's collectives priced call for call (autopar.cost.comm): the gradient's
bucketed all-reduces and the step's loss all-reduce (dp_allreduces, grad_buckets), the ZeRO gathers
(one broadcast per owner of uneven shards) and reduce-scatter rounds (zero_collectives), counted
against what the engine really issues on the threaded process group."""

import threading

import numpy as np
import pytest
import torch

import autopar
from autopar.cost import comm
from autopar.ir.costs import ModelCosts
from autopar.runtime.dp_overlap import bucket_ranges

from oracle import optimizer_factory, threaded_ranks

_LOCK = threading.Lock()
BLOCK = 1056                      # mlp-tiny: 8 blocks, each one Linear of 1024 + 32 parameters


def _costs(block_params) -> ModelCosts:
    params = np.asarray(block_params, float)
    return ModelCosts.synthetic({"cpu": [1e-3] * len(params)}, param_bytes=params * 4)


def test_buckets_are_packed_from_the_blocks_as_the_engine_packs_parameters():
    numels = [1024, 32] * 8
    offsets = [sum(numels[:k]) for k in range(len(numels))]
    costs = _costs([0] + [BLOCK] * 8 + [0])
    for bucket_numel in (2500, 3 * BLOCK, 20000):
        engine = bucket_ranges(numels, offsets, bucket_numel)
        priced = comm.grad_buckets(costs, bucket_bytes=4 * bucket_numel)
        assert len(priced) == len(engine)
        assert sum(priced) == pytest.approx(4 * sum(numels))
        for b, ks in zip(priced, engine):            # launch order; sizes within one bias
            assert abs(b - 4 * sum(numels[k] for k in ks)) <= 4 * 32
    # a block larger than a bucket: its parameters cannot share one
    assert len(comm.grad_buckets(_costs([3000, 3000]), bucket_bytes=4 * 2000)) == 4
    with pytest.raises(ValueError, match="bucket_bytes"):
        comm.grad_buckets(costs, bucket_bytes=0)


def test_the_step_pays_every_buckets_latency_and_the_loss_all_reduce():
    from autopar.cluster.model import builtin

    demo = builtin("demo")
    costs = _costs([0] + [BLOCK] * 8 + [0])
    one = comm.dp_allreduces(costs, demo, [0, 1, 2], 0, overlap=False)
    three = comm.dp_allreduces(costs, demo, [0, 1, 2], 1, bucket_bytes=4 * 3 * BLOCK)
    assert one.buckets == 1 and three.buckets == 3
    assert one.grad_s == pytest.approx(comm.allreduce_time_s(demo, [0, 1, 2], 4 * 8 * BLOCK))
    lat = comm.allreduce_time_s(demo, [0, 1, 2], 0.0)
    assert three.grad_s == pytest.approx(one.grad_s + 2 * lat)       # two more buckets, two more latencies
    assert one.loss_s == three.loss_s == pytest.approx(comm.loss_allreduce_s(demo, [0, 1, 2]))
    assert three.total_s == pytest.approx(three.grad_s + three.loss_s)
    zero2 = comm.dp_allreduces(costs, demo, [0, 1, 2], 2)
    assert zero2.grad_s == 0 and zero2.loss_s == one.loss_s
    assert comm.dp_allreduces(costs, demo, [1], 0) == comm.DpAllReduces()


class ThreeRanks(threaded_ranks(3)):
    def _step_calls(self, zero_stage, shares, bucket_numel):
        from autopar.ir.plan import Plan, Predicted, Stage
        from autopar.lowering import lower
        from autopar.passes.analyze import analyze
        from autopar.runtime.communicator import pg_all_gather_objects
        from autopar.runtime.dp import DataParallelEngine
        from autopar.runtime.emulate import NullClock
        from autopar.runtime.engine import EngineInputs
        from autopar.runtime.recorder import record_engine, recorded_step

        with _LOCK:     # capture and analysis run autograd: one thread at a time
            case = autopar.models.build("mlp-tiny", seed=0)
            analysis = analyze(case.model, case.example_inputs)
        plan = Plan(strategy="dp", global_batch_size=8, zero_stage=zero_stage, schedule="none",
                    stages=(Stage(0, len(analysis.stats), groups=((0,), (1,), (2,)),
                                  micro_batches=((2, 2), (3,), (1,)), zero_shares=shares),),
                    predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))
        gm = analysis.captured.gm
        engine = DataParallelEngine(EngineInputs(
            gm=gm, model=case.model, plan=plan, loss_fn=case.loss_fn, optimizer_factory=optimizer_factory("sgd"),
            rank=self.rank, world_size=3, device=torch.device("cpu"), clock=NullClock()),
            lower(plan, gm, self.rank, params=[p for p in case.model.parameters() if p.requires_grad]),
            bucket_bytes=4 * bucket_numel)
        rec = record_engine(engine, self.rank)
        x, y = case.batch(8, seed=1)
        with recorded_step(engine.clock):
            engine.step(x, y)
        records = pg_all_gather_objects(rec.snapshot())
        # one entry per collective (an asynchronous one may be recorded at its issue and at its wait)
        calls = {}
        for ev in records[0].steps[0][3]:
            if ev[4] is not None:
                calls[ev[4]] = (ev[0], ev[3])
        costs = _costs([s.params for s in analysis.stats])
        return calls, costs

    def test_zero1_all_reduces_buckets_and_the_loss_then_broadcasts_each_owners_shard(self):
        shares = (3.0, 2.0, 1.0)
        calls, costs = self._step_calls(1, shares, 3 * BLOCK)
        reduces = sorted(n for kind, n in calls.values() if kind == "all_reduce")
        from autopar.cluster.model import builtin

        priced = comm.dp_allreduces(costs, builtin("demo"), [0, 1, 2], 1,
                                    bucket_bytes=4 * 3 * BLOCK)
        assert reduces[0] == comm.LOSS_BYTES and len(reduces) == priced.buckets + 1
        assert sorted(reduces[1:]) == sorted(round(b) for b in comm.grad_buckets(costs, bucket_bytes=4 * 3 * BLOCK))
        casts = sorted(n for kind, n in calls.values() if kind == "broadcast")
        sizes = comm.zero_shard_sizes(8 * BLOCK, 3, shares)
        assert casts == sorted(4 * s for s in sizes if s > 0) and not comm.zero_shards_even(8 * BLOCK, 3, shares)

    def test_zero2_reduce_scatters_in_the_priced_rounds(self):
        calls, costs = self._step_calls(2, (), 3 * BLOCK)
        rounds, c = comm.zero_reduce_scatter_rounds(8 * BLOCK, 3, 4)
        scatters = [n for kind, n in calls.values() if kind == "reduce_scatter"]
        assert len(scatters) == 2 * rounds                        # two micro-step rounds, each in `rounds` chunks
        assert all(n == 3 * c * 4 for n in scatters)
        assert [n for kind, n in calls.values() if kind == "all_reduce"] == [comm.LOSS_BYTES]
        gathers = [n for kind, n in calls.values() if kind == "all_gather"]
        assert gathers == [4 * 8 * BLOCK]                         # even shards: one all-gather in place
