"""The forward overlap (``passes.tp_fwd_overlap``) on a torch.export graph of HF-style code
(``hf-llama-tiny``: ``aten.linear`` on ``get_attr`` weights): three threaded ranks in group order
(2, 0, 1) with shares 2/1/1, chunked f and row nodes, train equal to the single-device oracle."""

from __future__ import annotations

import copy
import math
import threading

import torch
from torch.testing._internal.common_utils import run_tests

from autopar.ir.plan import Plan, Predicted, Stage
from autopar.lowering import lower
from autopar.passes.tp_fwd_overlap import FusedRowScatter
from autopar.passes.tp_sp_comm import SPModule
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs
from autopar.runtime.tp import TensorParallelEngine
from autopar.runtime.tp_comm import GroupAllGather
from oracle import RTOL, assert_state_close, batches, optimizer_factory, prepared_case, single_device_run, \
    threaded_ranks

_LOCK = threading.Lock()
NAME = "hf-llama-tiny"
MICRO = ((5, 4),)


class ThreeRanks(threaded_ranks(3)):
    def test_export_captured_hf_llama_chunked_trains_as_the_oracle(self):
        with _LOCK:
            model, gm, loss_fn, num_blocks = prepared_case(NAME)
            model, gm = copy.deepcopy((model, gm))
        plan = Plan(strategy="tp", global_batch_size=sum(map(sum, MICRO)), zero_stage=0, schedule="none",
                    stages=(Stage(0, num_blocks, groups=((2, 0, 1),), micro_batches=MICRO, tp_shares=((2, 1, 1),),
                                  sequence_parallel=True),),
                    predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))
        engine = TensorParallelEngine(EngineInputs(
            gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory("adamw"),
            rank=self.rank, world_size=self.world_size, device=torch.device("cpu"), clock=NullClock()),
            lower(plan, gm, self.rank, tp_overlap_forward=True))
        assert sum(isinstance(m, FusedRowScatter) for m in engine.gm.modules()) == 8
        for m in engine.gm.modules():
            if isinstance(m, SPModule):
                m.sp.all_gather = GroupAllGather(m.sp.reduce_scatter_into.group)
        B = plan.global_batch_size
        with _LOCK:
            data = batches(NAME, B, 2)
            ref = single_device_run(NAME, B, 2, "adamw")
        losses = [engine.step(inputs, targets) for inputs, targets in data]
        assert_state_close(engine.state_dict(), ref.state, RTOL["adamw"])
        for got, want in zip(losses, ref.losses):
            assert math.isclose(got, want, rel_tol=1e-5), (losses, ref.losses)


if __name__ == "__main__":
    run_tests()
