"""The one data-parallel sync (``autopar.runtime.dp_sync``) in the engines besides the data-parallel
one, exact against the one-device oracle with AdamW on threaded ranks:

- a 2-stage pipeline whose stages have two one-rank members each, at ZeRO-1 (1F1B and zb-h1) and at
  ZeRO-3 (uneven ``zero_shares`` in the first stage), and a checkpoint of the ZeRO-3 run resumed under ZeRO-0;
- TP 2 x DP 2 (two tensor-parallel members of equal head shares) at ZeRO-2, and at ZeRO-3 (the
  member's local parameters gathered for the step) with its checkpoint resumed at ZeRO-2.

The data-parallel engine's ZeRO 0-3 on 3 uneven ranks: ``tests/test_dp_engine.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import tempfile
import threading
from pathlib import Path

import torch
from torch.testing._internal.common_utils import run_tests

from autopar.api import Compiled
from autopar.ir.plan import Plan, Predicted
from autopar.lowering import lower
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs
from autopar.runtime.pipeline import PipelineEngine
from autopar.runtime.tp import TensorParallelEngine
from oracle import (RTOL, assert_state_close, batches, optimizer_factory, prepared_case, single_device_run,
                    stages_of, threaded_ranks)

B, STEPS = 12, 2
_LOCK = threading.Lock()


def _pp_plan(zero: int, zero_shares=(), schedule: str = "1f1b") -> Plan:
    stages = stages_of([(3, {0: (3, 2), 1: (3, 4)}), (6, {2: (2, 3), 3: (4, 3)})])
    if zero_shares:
        stages = (dataclasses.replace(stages[0], zero_shares=zero_shares), *stages[1:])
    return Plan(strategy="pp", global_batch_size=B, zero_stage=zero, schedule=schedule, stages=stages,
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def _tp_plan(zero: int, num_blocks: int) -> Plan:
    stages = stages_of([(num_blocks, {(0, 1): (4, 3), (2, 3): (2, 3)}, ((1, 1), (1, 1)))])
    return Plan(strategy="tp", global_batch_size=B, zero_stage=zero, schedule="none", stages=stages,
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def _inputs(plan: Plan, rank: int, world_size: int):
    with _LOCK:
        model, gm, loss_fn, _ = prepared_case("gpt-tiny")
        model, gm = copy.deepcopy((model, gm))
    return EngineInputs(gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory("adamw"),
                        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=NullClock()), gm


def _pipeline(plan: Plan, rank: int, world_size: int) -> PipelineEngine:
    inputs, gm = _inputs(plan, rank, world_size)
    return PipelineEngine(inputs, lower(plan, gm, rank))


def _train_and_check(engine, data, ref_state, ref_losses) -> None:
    losses = [engine.step(inputs, targets) for inputs, targets in data]
    assert_state_close(engine.state_dict(), ref_state, RTOL["adamw"])
    for got, want in zip(losses, ref_losses):
        assert math.isclose(got, want, rel_tol=1e-5), (losses, ref_losses)


class FourRanks(threaded_ranks(4)):
    def _data(self, steps: int):
        with _LOCK:
            return batches("gpt-tiny", B, steps), single_device_run("gpt-tiny", B, steps, "adamw")

    def test_pipeline_stages_with_replicas_at_zero_1_and_zero_3(self):
        data, ref = self._data(2 * STEPS)
        with _LOCK:
            half = single_device_run("gpt-tiny", B, STEPS, "adamw")
        # zb-h1's weight half sets .grad itself (no accumulation hook): the ZeRO-1 sync takes it too
        for zero, shares, schedule in ((1, (), "1f1b"), (1, (), "zb-h1"), (3, (2.0, 1.0), "1f1b")):
            engine = _pipeline(_pp_plan(zero, shares, schedule), self.rank, self.world_size)
            assert engine.zero_stage_applied == zero and engine.sync is not None
            # ZeRO-1's weight gradients accumulate inside their GEMMs (passes.grad_fusion), but under
            # zb-h1; ZeRO-3 keeps no full gradient to accumulate into
            if zero == 1:
                assert (engine.fused_linears > 0) == (schedule != "zb-h1"), engine.fused_linears
            _train_and_check(engine, data[:STEPS], half.state, half.losses)
        # ZeRO-3: between steps (state_dict() gathered and freed them again) a rank holds only its
        # shard of its stage's parameters, by the stage's zero_shares
        assert all(p.untyped_storage().nbytes() == 0 for p in engine.sync.params)
        held = sum(sp.numel() for sp, _, _ in engine.sync.shard_params)
        total = sum(p.numel() for p in engine.sync.params)
        expect = total * (2 / 3 if self.rank == 0 else 1 / 3 if self.rank == 1 else 1 / 2)
        assert abs(held - expect) <= 2, (held, expect)
        # the ZeRO-3 run's checkpoint (the shards are its masters) resumed by a ZeRO-0 pipeline
        root = Path(tempfile.gettempdir()) / f"autopar-sync-{os.getpid()}"
        Compiled(plan=engine.plan, engine=engine, rank=self.rank).save(root / "ck")
        resumed = _pipeline(_pp_plan(0), self.rank, self.world_size)
        Compiled(plan=resumed.plan, engine=resumed, rank=self.rank).load(root / "ck")
        _train_and_check(resumed, data[STEPS:], ref.state, ref.losses[STEPS:])

    def test_tp_2_by_dp_2_at_zero_2_and_zero_3(self):
        data, ref = self._data(2 * STEPS)
        with _LOCK:
            num_blocks = prepared_case("gpt-tiny")[3]
            half = single_device_run("gpt-tiny", B, STEPS, "adamw")

        def engine_at(zero):
            plan = _tp_plan(zero, num_blocks)
            inputs, gm = _inputs(plan, self.rank, self.world_size)
            return TensorParallelEngine(inputs, lower(plan, gm, self.rank))

        engine = engine_at(2)
        assert engine.zero_stage_applied == 2 and engine.sync.shard_grads is not None
        _train_and_check(engine, data[:STEPS], half.state, half.losses)
        assert all(p.grad is None for p in engine.sync.params), "ZeRO-2 keeps the step's full gradient"
        # ZeRO-3: the member's local parameters gathered for the step, only the shard held between steps
        engine = engine_at(3)
        assert engine.zero_stage_applied == 3
        _train_and_check(engine, data[:STEPS], half.state, half.losses)
        assert all(p.untyped_storage().nbytes() == 0 for p in engine.sync.params)
        # its checkpoint (the shards are its masters) resumed at ZeRO-2
        root = Path(tempfile.gettempdir()) / f"autopar-tp-sync-{os.getpid()}"
        Compiled(plan=engine.plan, engine=engine, rank=self.rank).save(root / "ck")
        resumed = engine_at(2)
        Compiled(plan=resumed.plan, engine=resumed, rank=self.rank).load(root / "ck")
        _train_and_check(resumed, data[STEPS:], ref.state, ref.losses[STEPS:])


if __name__ == "__main__":
    run_tests()
