"""ZeRO-1 and ZeRO-3 inside the tensor-parallel stages of a pipeline (``autopar.runtime.pipeline`` with
the data-parallel sync ``autopar.runtime.dp_sync``): exact against the one-device oracle on threaded ranks, and each TP
rank's optimizer state is its chunk of its shard, as ``autopar.cost.tp`` prices it.

Plan: gpt-tiny (4 heads, 6 blocks), stage 0 = blocks 0-3 on two TP members (0, 1) and (2, 3), stage 1
= blocks 4-5 on rank 4; 1F1B, micro-batches (3, 2) / (2, 3) in stage 0 and (5, 5) in stage 1.
"""

from __future__ import annotations

import copy
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
from oracle import RTOL, assert_state_close, batches, optimizer_factory, prepared_case, single_device_run, stages_of, threaded_ranks

B, STEPS = 10, 2
_LOCK = threading.Lock()


def _plan(shares, zero) -> Plan:
    stages = stages_of([(4, {(0, 1): (3, 2), (2, 3): (2, 3)}, shares), (6, {4: (5, 5)})])
    return Plan(strategy="pp", global_batch_size=B, zero_stage=zero, schedule="1f1b", stages=stages,
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def _engine(rank, world_size, shares, zero, optimizer) -> PipelineEngine:
    with _LOCK:
        model, gm, loss_fn, _ = prepared_case("gpt-tiny")
        model, gm = copy.deepcopy((model, gm))
    plan = _plan(shares, zero)
    return PipelineEngine(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory(optimizer),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=NullClock()), lower(plan, gm, rank))


def _run(rank, world_size, shares, zero, optimizer) -> PipelineEngine:
    engine = _engine(rank, world_size, shares, zero, optimizer)
    with _LOCK:
        data = batches("gpt-tiny", B, STEPS)
        ref = single_device_run("gpt-tiny", B, STEPS, optimizer)
    losses = [engine.step(inputs, targets) for inputs, targets in data]
    assert_state_close(engine.state_dict(), ref.state, RTOL[optimizer])
    for got, want in zip(losses, ref.losses):
        assert math.isclose(got, want, rel_tol=1e-5), (losses, ref.losses)
    return engine


class FiveRanks(threaded_ranks(5)):
    def test_tp_members_shard_their_optimizer_state_sgd_and_adamw(self):
        for optimizer in ("sgd", "adamw"):
            engine = _run(self.rank, self.world_size, ((3, 1), (3, 1)), 1, optimizer)
            assert engine.zero_stage_applied == (1 if self.rank < 4 else 0)
            if self.rank < 4:
                z = engine.sync
                shards = [sp for sp, _, _ in z.shard_params]
                local = sum(p.numel() for p in z.params)
                # the chunk: half of this rank's local (shard + replicated) parameters
                assert abs(sum(s.numel() for s in shards) - local / 2) <= 1
                # the stage's own gradients left the all-reduce groups (no double sum)
                ranks = tuple(sorted(engine.plan.stages[0].ranks))
                assert all(g is None or g.ranks != ranks for g, _ in engine._grad_groups)
                if optimizer == "adamw":
                    state = sum(t.numel() * t.element_size() for sp in shards
                                for t in z.optimizer.state[sp].values() if isinstance(t, torch.Tensor))
                    moments = state - 4 * len(shards)
                    assert moments == 2 * 4 * sum(s.numel() for s in shards)
        # its TP ranks' optimizer chunks are checkpoint pieces: saved after 2 AdamW steps, loaded into a
        # fresh ZeRO-0 engine and a fresh ZeRO-1 one, 2 more steps each equal the 4-step oracle
        root = Path(tempfile.gettempdir()) / f"autopar-tpz-{os.getpid()}"
        Compiled(plan=engine.plan, engine=engine, rank=self.rank).save(root / "ck")
        with _LOCK:
            data = batches("gpt-tiny", B, 2 * STEPS)
            ref = single_device_run("gpt-tiny", B, 2 * STEPS, "adamw")
        for zero in (0, 1):
            resumed = _engine(self.rank, self.world_size, ((3, 1), (3, 1)), zero, "adamw")
            Compiled(plan=resumed.plan, engine=resumed, rank=self.rank).load(root / "ck")
            losses = [resumed.step(inputs, targets) for inputs, targets in data[STEPS:]]
            assert_state_close(resumed.state_dict(), ref.state, RTOL["adamw"])
            for got, want in zip(losses, ref.losses[STEPS:]):
                assert math.isclose(got, want, rel_tol=1e-5), (zero, losses, ref.losses)

    def test_tp_members_at_zero_3_hold_only_their_shard_between_steps(self):
        engine = _run(self.rank, self.world_size, ((3, 1), (3, 1)), 3, "adamw")
        assert engine.zero_stage_applied == (3 if self.rank < 4 else 0)
        if self.rank < 4:       # the local parameters are freed between steps (state_dict() gathered them)
            z = engine.sync
            assert all(p.untyped_storage().nbytes() == 0 for p in z.params)
            held, local = sum(sp.numel() for sp, _, _ in z.shard_params), sum(p.numel() for p in z.params)
            assert abs(held - local / 2) <= 1
        # the ZeRO-3 run's checkpoint (the shards are its masters) resumed at ZeRO-1
        root = Path(tempfile.gettempdir()) / f"autopar-tpz3-{os.getpid()}"
        Compiled(plan=engine.plan, engine=engine, rank=self.rank).save(root / "ck")
        with _LOCK:
            data = batches("gpt-tiny", B, 2 * STEPS)
            ref = single_device_run("gpt-tiny", B, 2 * STEPS, "adamw")
        resumed = _engine(self.rank, self.world_size, ((3, 1), (3, 1)), 1, "adamw")
        Compiled(plan=resumed.plan, engine=resumed, rank=self.rank).load(root / "ck")
        losses = [resumed.step(inputs, targets) for inputs, targets in data[STEPS:]]
        assert_state_close(resumed.state_dict(), ref.state, RTOL["adamw"])
        for got, want in zip(losses, ref.losses[STEPS:]):
            assert math.isclose(got, want, rel_tol=1e-5), (losses, ref.losses)

    def test_different_shardings_fall_back_to_zero_0(self):
        engine = _run(self.rank, self.world_size, ((3, 1), (2, 2)), 1, "sgd")
        assert engine.zero_stage_applied == 0 and engine.sync is None


if __name__ == "__main__":
    run_tests()
