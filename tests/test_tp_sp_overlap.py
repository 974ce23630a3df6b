"""Sequence parallelism's f overlaps its backward reduce-scatter with the columns' weight gradients
(``passes.tp_sp_comm.SeqContext.start_reduce_scatter``, ``autopar.runtime.tp_comm.GroupReduceScatter``,
``passes.tp_overlap.FusedColumns``), against the single-device oracle (``tests/oracle.py``).

Threaded ranks: the asynchronous padded reduce-scatter (uneven shards, and the all-reduce fallback)
equals the blocking one bitwise and holds the sum only once waited on; on an SP TP-2 llama-tiny rank
(shares 3/1: padded shards) every fused f starts its reduce-scatter after its input gradient, its
columns' weight gradients run while it is in flight, and the wait comes after them; the same engine
then trains equal to the oracle.
"""

from __future__ import annotations

import copy
import functools
import math
import threading

import torch
from torch.testing._internal.common_utils import run_tests

from autopar.ir.plan import Plan, Predicted, Stage
from autopar.lowering import lower
from autopar.passes.tp_overlap import FusedColumns
from autopar.passes.tp_sp_comm import SeqContext, SeqGatherToGroup
from autopar.runtime.communicator import pg_all_gather
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs
from autopar.runtime.tp import TensorParallelEngine
from autopar.runtime.tp_comm import GroupAllReduce, GroupReduceScatter
from oracle import MatmulLog, RTOL, assert_state_close, batches, optimizer_factory, prepared_case, single_device_run, \
    threaded_ranks

_LOCK = threading.Lock()
NAME = "llama-tiny"
SHARES = (3, 1)
MICRO = ((9, 8, 6),)


class _Logged:
    """A bound collective (``GroupReduceScatter``) whose ``start`` and wait are written to a log."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def __call__(self, output, tensor):
        self.inner(output, tensor)

    def start(self, output, tensor):
        self.log.append(("start", tuple(tensor.shape)))
        wait = self.inner.start(output, tensor)

        def logged() -> None:
            wait()
            self.log.append(("wait", tuple(tensor.shape)))
        return logged


def _sp_engine(rank, world_size):
    with _LOCK:
        model, gm, loss_fn, num_blocks = prepared_case(NAME)
        model, gm = copy.deepcopy((model, gm))
    plan = Plan(strategy="tp", global_batch_size=sum(map(sum, MICRO)), zero_stage=0, schedule="none",
                stages=(Stage(0, num_blocks, groups=((0, 1),), micro_batches=MICRO, tp_shares=(SHARES,),
                              sequence_parallel=True),),
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))
    engine = TensorParallelEngine(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory("adamw"),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=NullClock()), lower(plan, gm, rank))
    return engine, loss_fn


class TwoRanks(threaded_ranks(2)):
    def test_async_padded_reduce_scatter_and_all_reduce_fallback_equal_the_blocking_one(self):
        torch.manual_seed(self.rank)
        x = torch.randn(2, 7, 5)                          # 7 tokens, shares 3/1: shards of 5 and 2
        sums = [torch.empty_like(x) for _ in range(2)]
        pg_all_gather(sums, x)
        a, b = ((0, 5), (5, 7))[self.rank]
        want = (sums[0] + sums[1])[:, a:b]
        gather = functools.partial(pg_all_gather, group=None)
        for rs in (GroupReduceScatter(None), None):        # None: only the all-reduce is bound
            sp = SeqContext(SHARES, self.rank)
            sp.all_reduce, sp.all_gather, sp.reduce_scatter_into = GroupAllReduce(None), gather, rs
            blocking = sp.reduce_scatter(x, 1)
            got, wait = sp.start_reduce_scatter(x, 1)
            assert got.shape == want.shape and got.is_contiguous()
            wait()
            assert torch.equal(got, blocking) and torch.allclose(got, want, rtol=1e-6, atol=1e-6), rs

    def test_sp_f_reduce_scatter_runs_during_the_weight_gradients_and_training_equals_the_oracle(self):
        engine, loss_fn = _sp_engine(self.rank, self.world_size)
        fused = [m for m in engine.gm.modules() if isinstance(m, FusedColumns) and isinstance(m.f, SeqGatherToGroup)]
        sp = fused[0].f.sp
        assert len(fused) >= 2 and all(m.f.sp is sp for m in fused)
        assert isinstance(sp.reduce_scatter_into, GroupReduceScatter)
        log: list = []
        sp.reduce_scatter_into = _Logged(sp.reduce_scatter_into, log)
        with _LOCK:
            (inputs, targets), = batches(NAME, 5, 1)        # 5 x 32 rows: no weight has that shape
        weight_shapes = {tuple(p.shape) for m in fused for p in m.parameters()} | {
            tuple(engine.gm.get_parameter(n).shape) for n, _ in engine.gm.named_parameters()}
        loss = loss_fn(engine.gm(*inputs), targets)
        with MatmulLog(log):
            loss.backward()
        starts = [i for i, e in enumerate(log) if e[0] == "start"]
        waits = [i for i, e in enumerate(log) if e[0] == "wait"]
        assert len(starts) == len(waits) == len(fused), log
        rows = inputs[0].numel()
        for s, w in zip(starts, waits):
            assert s < w and not any(e[0] == "start" for e in log[s + 1:w])       # one in flight at a time
            between = [e[1] for e in log[s + 1:w] if e[0] == "mm"]
            assert between and all(shape in weight_shapes for shape in between), log[s:w + 1]
            before = [e[1] for e in log[:s] if e[0] == "mm"]
            assert before[-1][0] == rows and before[-1] not in weight_shapes, log[:s + 1]   # input grad first
        for p in engine.gm.parameters():
            p.grad = None
        # the same engine (the logged collective still bound) trains as the oracle does
        B = engine.plan.global_batch_size
        with _LOCK:
            data = batches(NAME, B, 2)
            ref = single_device_run(NAME, B, 2, "adamw")
        n = len(log)
        losses = [engine.step(inp, tgt) for inp, tgt in data]
        assert sum(e[0] == "start" for e in log[n:]) == 2 * len(MICRO[0]) * len(fused)
        assert_state_close(engine.state_dict(), ref.state, RTOL["adamw"])
        for got, want in zip(losses, ref.losses):
            assert math.isclose(got, want, rel_tol=1e-5), (losses, ref.losses)


if __name__ == "__main__":
    run_tests()
