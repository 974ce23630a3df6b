"""compiled.save / compiled.load with resharding (api.md "Checkpoints"; autopar.runtime.checkpointing):
each row saves at step N under plan A, loads under plan B (other strategy, ranks, TP shares, ZeRO stage or
pipeline cut), trains N more steps, and must end at the one-device oracle after 2N steps, with the loss
of every step equal to the uninterrupted run's. Damaged checkpoints fail through compiled.load with one
error naming the file and nothing loaded. Threaded ranks (tests/oracle.py), tiny models."""

from __future__ import annotations

import copy
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from oracle import RTOL, assert_state_close, optimizer_factory, stages_of, threaded_ranks, train_one_device

from autopar.api import Compiled
from autopar.checkpoint.store import CheckpointError
from autopar.ir.plan import Plan, Predicted
from autopar.lowering import lower
from autopar.runtime.communicator import pg_barrier, pg_broadcast_objects
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs, build_engine

N = 2                 # steps before the save, and after the load
B = 12                # global batch
GPT = dict(num_layers=10, hidden_size=24, num_heads=3, vocab_size=32, seq_len=8)   # 12 blocks; 3 heads
_LOCK = threading.Lock()
_CASES: dict = {}


def _case(name: str, overrides: dict):
    key = (name, tuple(sorted(overrides.items())))
    with _LOCK:
        if key not in _CASES:
            from autopar.models import build
            from autopar.passes.analyze import analyze

            case = build(name, seed=0, **overrides)
            gm = analyze(case.model, case.example_inputs).captured.gm
            _CASES[key] = (case, gm)
        case, gm = _CASES[key]
        model, gm = copy.deepcopy((case.model, gm))     # one memo: gm keeps sharing the model's params
    return case, model, gm


def _plan(stages, zero_stage=0, schedule="1f1b", strategy="pp") -> Plan:
    return Plan(strategy=strategy, global_batch_size=sum(sum(m) for m in stages[0].micro_batches),
                zero_stage=zero_stage, schedule=schedule, stages=stages,
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def compiled_for(plan: Plan, rank: int, world_size: int, name="gpt-tiny", optimizer="adamw",
                 precision="fp32", overrides=GPT) -> Compiled:
    case, model, gm = _case(name, overrides)
    engine = build_engine(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=case.loss_fn, optimizer_factory=optimizer_factory(optimizer),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=NullClock(), precision=precision),
        lower(plan, gm, rank, params=[p for p in model.parameters() if p.requires_grad]))
    return Compiled(plan=plan, engine=engine, rank=rank)


def oracle(name="gpt-tiny", optimizer="adamw", overrides=GPT, steps=2 * N):
    from autopar.models import build

    with _LOCK:
        case = build(name, seed=0, **overrides)
        data = [case.batch(B, seed=1 + s) for s in range(steps)]
        run = train_one_device(case.model, case.loss_fn, data, optimizer)
    return data, run


def shared_dir(rank: int) -> Path:
    """One temporary directory for every rank of the test (rank 0 makes it)."""
    box = [tempfile.mkdtemp(prefix="autopar-reshard-") if rank == 0 else None]
    pg_broadcast_objects(box, src=0)
    return Path(box[0])


def resharded_run(rank: int, world_size: int, plan_a: Plan, plan_b: Plan, *, name="gpt-tiny",
                  optimizer="adamw", precision="fp32", overrides=GPT, rtol=None):
    """Train N steps under plan_a, save, load under plan_b, train N more; compare with the oracle."""
    data, run = oracle(name, optimizer, overrides)
    root = shared_dir(rank)
    try:
        a = compiled_for(plan_a, rank, world_size, name, optimizer, precision, overrides)
        losses = [a.step(*batch) for batch in data[:N]]
        manifest = a.save(root / "ckpt")
        assert manifest.step == N and manifest.meta["step_count"] == N
        del a
        b = compiled_for(plan_b, rank, world_size, name, optimizer, precision, overrides)
        b.load(root / "ckpt")
        assert b.step_count == N
        losses += [b.step(*batch) for batch in data[N:]]
        state = b.state_dict()
        if precision == "fp32":
            for got, want in zip(losses, run.losses):
                assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (losses, run.losses)
            assert_state_close(state, run.state, rtol or RTOL[optimizer])
        return losses, state, run
    finally:
        pg_barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def _dp_stage(shares, micro, blocks=12):
    import dataclasses

    (stage,) = stages_of([(blocks, micro)])
    return dataclasses.replace(stage, zero_shares=tuple(shares))


class ThreeRanks(threaded_ranks(3)):
    def test_dp_zero3_on_three_ranks_then_pp_on_two(self):
        """ZeRO-3 with uneven shares 3:2:1 on three ranks, then a 2-stage pipeline on ranks 0 and 1
        (rank 2 left out): a different strategy, number of ranks and ZeRO stage."""
        a = _plan((_dp_stage((3, 2, 1), {0: [3, 3], 1: [4], 2: [2]}),), zero_stage=3, schedule="none",
                  strategy="dp")
        b = _plan(stages_of([(6, {0: [3, 3, 3, 3]}), (12, {1: [3, 3, 3, 3]})]))
        resharded_run(self.rank, self.world_size, a, b)
