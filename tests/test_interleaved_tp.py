"""Interleaved 1F1B on tensor-parallel pipeline members (``autopar.runtime.pipeline`` with
``Plan.virtual_stages`` > 1 and ``RankProgram.local_chunks``): exact against the one-device oracle on
threaded ranks.

Plans (4 threaded ranks, global batch 10, micro-batches 4+3+3, 2 rank stages x 2 chunks): rank stage 0
is the TP member (0, 1), rank stage 1 the TP member (2, 3) (or, in one plan, two one-rank members 2 and
3); chunk sizes are uneven (blocks 0-1 | 2 | 3 | 4-5) and each chunk has its own uneven TP shares, so the
two chunks of one rank hold different shards; one plan turns on sequence parallelism on some chunks
(``Stage.sequence_parallel``), one recomputes a chunk, one computes in bf16. The backward overlap (``passes.tp_overlap``)
is on, as lowering applies it by default. SGD with momentum and AdamW (eps 1e-6).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading

import pytest
import torch
from torch.testing._internal.common_utils import run_tests

from autopar.errors import PlanError
from autopar.ir.plan import Plan, Predicted
from autopar.lowering import lower
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs
from autopar.runtime.pipeline import PipelineEngine
from oracle import RTOL, assert_state_close, batches, optimizer_factory, prepared_case, single_device_run, stages_of, threaded_ranks

B, STEPS = 10, 2
MB = (4, 3, 3)
_LOCK = threading.Lock()


def _plan(stages, V=2, sp=(), recompute=()) -> Plan:
    st = stages_of(stages)
    st = tuple(dataclasses.replace(s, sequence_parallel=i in sp, recompute=i in recompute) for i, s in enumerate(st))
    return Plan(strategy="pp", global_batch_size=B, zero_stage=0, schedule="interleaved-1f1b", stages=st,
                virtual_stages=V, predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def _tp_tp(sp=(), recompute=()) -> Plan:
    return _plan([(2, {(0, 1): MB}, ((3, 1),)), (3, {(2, 3): MB}, ((1, 1),)),
                  (4, {(0, 1): MB}, ((1, 3),)), (6, {(2, 3): MB}, ((2, 2),))], sp=sp, recompute=recompute)


def _tp_dp() -> Plan:
    """Rank stage 1: two one-rank data-parallel members (rows 2+1+1 / 2+2+2) under the TP member's chunks."""
    half = ((2, 1, 1), (2, 2, 2))
    return _plan([(1, {(0, 1): MB}, ((3, 1),)), (3, {2: half[0], 3: half[1]}),
                  (5, {(0, 1): MB}, ((1, 3),)), (6, {2: half[0], 3: half[1]})])


def _run(case, rank, world_size, plan, optimizer) -> PipelineEngine:
    with _LOCK:
        model, gm, loss_fn, _ = prepared_case(case)
        model, gm = copy.deepcopy((model, gm))
    engine = PipelineEngine(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory(optimizer),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=NullClock()), lower(plan, gm, rank))
    with _LOCK:
        data = batches(case, B, STEPS)
        ref = single_device_run(case, B, STEPS, optimizer)
    losses = [engine.step(inputs, targets) for inputs, targets in data]
    assert_state_close(engine.state_dict(), ref.state, RTOL[optimizer])
    for got, want in zip(losses, ref.losses):
        assert math.isclose(got, want, rel_tol=1e-5), (losses, ref.losses)
    return engine


class FourRanks(threaded_ranks(4)):
    def test_tp_chunks_gpt_adamw(self):
        engine = _run("gpt-tiny", self.rank, self.world_size, _tp_tp(), "adamw")   # SGD: the llama tests
        assert engine.chunks == ((0, 2) if self.rank < 2 else (1, 3))
        assert set(engine._locals) == set(engine.chunks)      # both chunks run their TP shard

    def test_tp_chunks_llama_sequence_parallel_and_recompute(self):
        _run("llama-tiny", self.rank, self.world_size, _tp_tp(sp=(0, 2, 3), recompute=(1,)), "adamw")

    def test_tp_chunks_next_to_data_parallel_members(self):
        _run("llama-tiny", self.rank, self.world_size, _tp_dp(), "sgd")

    def test_tp_chunks_bf16(self):
        """Every chunk's TP module computes under autocast (the later ones: the engine's
        ``_chunk_precision``), as the one-device bf16 autocast run does (tests/test_precision.py)."""
        from test_precision import make_engine, train_and_check

        engine = make_engine("gpt-tiny", _tp_tp(), "sgd", self.rank, self.world_size, "bf16")
        # a later chunk's input may be fp32 (a LayerNorm's output), so the check of the run alone would
        # pass with that chunk in fp32 too: its module must be autocast
        assert all(getattr(engine._prog(s).gm, "_autopar_precision", None) for s in engine.chunks)
        train_and_check(engine, "gpt-tiny", "sgd", "bf16")


def test_chunks_of_a_rank_stage_must_share_its_members():
    with pytest.raises(PlanError, match="virtual_stages: stage 2"):
        _plan([(2, {(0, 1): MB}), (3, {(2, 3): MB}), (4, {(1, 0): MB}), (6, {(2, 3): MB})])


if __name__ == "__main__":
    run_tests()
