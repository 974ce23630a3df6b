"""ZeRO-3 block by block in one recomputing stage of tensor-parallel members (``ir.plan.zero3_by_block``:
the pipeline engine with the data-parallel sync over each TP index's ranks), as FSDP with activation
checkpointing runs inside a TP mesh: exact against the one-device oracle on threaded ranks with AdamW,
never more than a root unit and two block units gathered at once, and nothing but the shards held
between steps. The checkpoint of such a run resumes at ZeRO-1.

Plan: one stage of every block of gpt-tiny (tied embedding: the root unit) and of llama-tiny (also with
sequence parallelism), two TP members (0, 1) and (2, 3) of head shares (3, 1), micro-batches (3, 2) /
(2, 3) of a batch of 10.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tempfile
import threading
from pathlib import Path

import torch
from torch.testing._internal.common_utils import run_tests

from autopar.api import Compiled
from autopar.ir.plan import Plan, Predicted, zero3_by_block
from autopar.lowering import lower
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs
from autopar.runtime.pipeline import PipelineEngine
from oracle import RTOL, assert_state_close, batches, optimizer_factory, prepared_case, single_device_run, stages_of, threaded_ranks

B, STEPS = 10, 2
_LOCK = threading.Lock()
_ROOT = Path(tempfile.mkdtemp(prefix="autopar-tpz3b-"))    # one per process: its ranks are threads


def _plan(name: str, zero: int, recompute: bool = True, sp: bool = False) -> Plan:
    n = prepared_case(name)[3]
    (stage,) = stages_of([(n, {(0, 1): (3, 2), (2, 3): (2, 3)}, ((3, 1), (3, 1)))])
    return Plan(strategy="tp", global_batch_size=B, zero_stage=zero, schedule="1f1b",
                stages=(dataclasses.replace(stage, recompute=recompute, sequence_parallel=sp),),
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def _engine(name: str, rank: int, world_size: int, zero: int, sp: bool = False) -> PipelineEngine:
    with _LOCK:
        model, gm, loss_fn, _ = prepared_case(name)
        model, gm = copy.deepcopy((model, gm))
    plan = _plan(name, zero, sp=sp)
    return PipelineEngine(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory("adamw"),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=NullClock()), lower(plan, gm, rank))


def _check(engine: PipelineEngine, name: str, first: int, steps: int, seen: list | None = None) -> None:
    """Steps ``first`` to ``first + steps`` equal the oracle's (``seen``: the gather counts of the steps,
    left out of ``state_dict()``'s)."""
    with _LOCK:
        data = batches(name, B, first + steps)
        ref = single_device_run(name, B, first + steps, "adamw")
    losses = [engine.step(inputs, targets) for inputs, targets in data[first:]]
    counted = list(seen or ())
    assert_state_close(engine.state_dict(), ref.state, RTOL["adamw"])
    if seen is not None:
        seen[:] = counted
    for got, want in zip(losses, ref.losses[first:]):
        assert math.isclose(got, want, rel_tol=1e-5), (losses, ref.losses)


def _count_gathers(engine: PipelineEngine) -> list[int]:
    """Wrap the sync's gather: the number of units gathered right after each gather."""
    sync, seen = engine.sync, []
    gather = sync.gather

    def counted(u):
        gather(u)
        seen.append(sum(sync._gathered))
    sync.gather = counted
    return seen


class FourRanks(threaded_ranks(4)):
    def test_zero3_goes_block_by_block_exactly(self):
        for name, sp in (("gpt-tiny", False), ("llama-tiny", False), ("llama-tiny", True)):
            engine = _engine(name, self.rank, self.world_size, 3, sp)
            assert zero3_by_block(engine.plan.stages, 3) and engine.zero_stage_applied == 3
            assert len(engine.rank_program.local_blocks) == prepared_case(name)[3]
            assert set(engine._unit_of_block) == set(range(prepared_case(name)[3]))
            assert bool(engine.sync.unit_params[0]) == (name == "gpt-tiny"), (name, engine.sync.unit_params[0])
            seen = _count_gathers(engine)
            _check(engine, name, 0, STEPS, seen)
            assert seen and max(seen) <= 3, seen      # the root, the block, the prefetched neighbour
            sync = engine.sync      # between steps only the shards (state_dict() gathered and freed)
            assert all(p.untyped_storage().nbytes() == 0 for p in sync.params)

    def test_its_checkpoint_resumes_at_zero_1(self):
        engine = _engine("llama-tiny", self.rank, self.world_size, 3)
        _check(engine, "llama-tiny", 0, STEPS)
        Compiled(plan=engine.plan, engine=engine, rank=self.rank).save(_ROOT / "ck")
        resumed = _engine("llama-tiny", self.rank, self.world_size, 1)
        assert not resumed._unit_of_block
        Compiled(plan=resumed.plan, engine=resumed, rank=self.rank).load(_ROOT / "ck")
        _check(resumed, "llama-tiny", STEPS, STEPS)


def test_the_rule():
    plan = _plan("gpt-tiny", 3)
    assert zero3_by_block(plan.stages, 3)
    assert not zero3_by_block(plan.stages, 1)
    assert not zero3_by_block(_plan("gpt-tiny", 3, recompute=False).stages, 3)
    uneven = dataclasses.replace(plan.stages[0], tp_shares=((3, 1), (2, 2)))
    assert not zero3_by_block((uneven,), 3)


if __name__ == "__main__":
    run_tests()
