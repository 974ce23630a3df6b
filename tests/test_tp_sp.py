"""Sequence parallelism (Megatron-SP) in the TP rewrite: plan field, analysis, exactness against the oracle."""

from __future__ import annotations

import dataclasses
import json

from autopar.ir.plan import Plan, Predicted, Stage


def _plan(sp: bool) -> Plan:
    st = Stage(0, 2, ((0, 1),), ((4,),), tp_shares=((1, 1),), sequence_parallel=sp)
    return Plan("tp", 4, 0, "none", (st,), Predicted(1.0, 4.0, {0: 1, 1: 1}))


def test_stage_sequence_parallel_round_trip_and_old_json():
    plan = _plan(True)
    assert Plan.from_json(plan.to_json()) == plan
    assert "sequence_parallel=True" in repr(plan.stages[0])
    d = json.loads(_plan(False).to_json())
    del d["stages"][0]["sequence_parallel"]          # JSON saved before the field existed
    old = Plan.from_dict(d)
    assert old.stages[0].sequence_parallel is False
    assert dataclasses.replace(old.stages[0], sequence_parallel=True) == plan.stages[0]


# ------------------------------------------------------------------------------------------------
# Distributed: the TP engine with SP on threaded ranks, against the single-device oracle

import copy
import math
import threading

import numpy as np
import torch
import torch.fx as fx
from torch import nn
from torch.testing._internal.common_utils import run_tests

from autopar.lowering import lower
from autopar.passes.tp_sp import SP_META_KEY, sp_block_analysis, sp_supported_blocks
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs, select_engine
from autopar.runtime.tp import TensorParallelEngine
from oracle import RTOL, assert_state_close, batches, optimizer_factory, prepared_case, single_device_run, \
    threaded_ranks

_LOCK = threading.Lock()
ONE_MEMBER = ((9, 8, 6),)


def sp_plan(groups, tp_shares, micro, num_blocks) -> Plan:
    return Plan(strategy="tp", global_batch_size=sum(map(sum, micro)), zero_stage=0, schedule="none",
                stages=(Stage(0, num_blocks, groups=groups, micro_batches=micro, tp_shares=tp_shares,
                              sequence_parallel=True),),
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def make_engine(name, groups, tp_shares, micro, optimizer, rank, world_size):
    with _LOCK:
        model, gm, loss_fn, num_blocks = prepared_case(name)
        model, gm = copy.deepcopy((model, gm))
    plan = sp_plan(groups, tp_shares, micro, num_blocks)
    assert select_engine(plan) is TensorParallelEngine
    return TensorParallelEngine(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory(optimizer),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=NullClock()),
        lower(plan, gm, rank))


def train_and_check(engine, name, optimizer, steps=2):
    B = engine.plan.global_batch_size
    with _LOCK:
        data = batches(name, B, steps)
        ref = single_device_run(name, B, steps, optimizer)
    losses = [engine.step(inputs, targets) for inputs, targets in data]
    assert_state_close(engine.state_dict(), ref.state, RTOL[optimizer])
    for got, want in zip(losses, ref.losses):
        assert math.isclose(got, want, rel_tol=1e-5), (losses, ref.losses)


class TwoRanksSP(threaded_ranks(2)):
    def test_gpt_tiny_shares_3_1_sgd_and_adamw(self):
        for opt in ("sgd", "adamw"):
            engine = make_engine("gpt-tiny", ((0, 1),), ((3, 1),), ONE_MEMBER, opt, self.rank, self.world_size)
            assert engine.gm.meta[SP_META_KEY].blocks == (1, 2, 3, 4)
            train_and_check(engine, "gpt-tiny", opt)


if __name__ == "__main__":
    run_tests()
