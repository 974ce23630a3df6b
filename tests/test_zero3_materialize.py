"""ZeRO-3 shard-only materialisation: a data-parallel rank at ZeRO-3 given a meta model materialises
one unit at a time (``DataParallelEngine(materialize=...)``), keeps its shard and frees the rest, and
trains to the state of ``autopar.materialize`` + one device (three threaded ranks, uneven shards)."""

from __future__ import annotations

import functools
import math
import threading

import pytest
import torch
from torch import nn

import autopar
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.lowering import lower
from autopar.lowering import materialize as mat
from autopar.passes.analyze import analyze
from autopar.passes.capture import retarget_device
from autopar.runtime.dp import DataParallelEngine, defers_materialization
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs, compute_loss
from oracle import RTOL, assert_state_close, batches, optimizer_factory, threaded_ranks

MICRO = ((10, 7), (6,), (4,))       # 27 samples; 2 / 1 / 1 micro-steps
SHARES = (0.6, 0.25, 0.15)
SEED, STEPS = 5, 2
_LOCK = threading.Lock()


def _plan(num_blocks: int) -> Plan:
    return Plan(strategy="dp", global_batch_size=sum(map(sum, MICRO)), zero_stage=3, schedule="none",
                stages=(Stage(0, num_blocks, groups=((0,), (1,), (2,)), micro_batches=MICRO, zero_shares=SHARES),),
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


@functools.cache
def _oracle():
    case = autopar.models.build("gpt-tiny", device="meta")
    model = autopar.materialize(case.model, seed=SEED)
    opt = optimizer_factory("adamw")([p for p in model.parameters() if p.requires_grad])
    losses = []
    for inputs, targets in batches("gpt-tiny", sum(map(sum, MICRO)), STEPS):
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(model(*inputs), targets, case.loss_fn)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model.state_dict(), losses


def _engine(rank: int, world_size: int) -> DataParallelEngine:
    """What ``compile`` does for a meta model at ZeRO-3: everything but the trainable parameters now,
    those by the engine, unit by unit. Under the lock: materialisation seeds torch's generator, which
    the threads of a test share (building the engine issues no collective here)."""
    with _LOCK:
        return _build_engine(rank, world_size)


def _build_engine(rank: int, world_size: int) -> DataParallelEngine:
    device = torch.device("cpu")
    case = autopar.models.build("gpt-tiny", device="meta")
    analysis = analyze(case.model, case.example_inputs)
    model, gm = case.model, analysis.captured.gm
    plan = _plan(len(analysis.blocks))
    assert defers_materialization(plan)
    retarget_device(gm, "meta", device)
    now = [t for t in mat.rank_tensors(plan, gm, rank, model)
           if not (isinstance(t, nn.Parameter) and t.requires_grad)]
    mat.materialize_tensors(model, now, seed=SEED, device=device, roots=(gm,))
    mat.mark_deterministic(model)
    program = lower(plan, gm, rank, params=[p for p in model.parameters() if p.requires_grad])

    def materialize(tensors, roots):
        return mat.materialize_tensors(model, tensors, seed=SEED, device=device, roots=(gm, *roots))

    return DataParallelEngine(EngineInputs(
        gm=program.gm, model=model, plan=plan, loss_fn=case.loss_fn, optimizer_factory=optimizer_factory("adamw"),
        rank=rank, world_size=world_size, device=device, clock=NullClock()), program, materialize=materialize)


class ThreeRanksMeta(threaded_ranks(3)):
    def test_zero3_materialises_unit_by_unit_and_trains_like_the_oracle(self):
        engine = _engine(self.rank, self.world_size)
        total = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
        # one unit at a time: every unit once, none holding the whole model
        assert len(engine.materialized_numels) == len(engine.units) > 2
        assert sum(engine.materialized_numels) == total
        assert max(engine.materialized_numels) < total / 2
        # between steps a rank holds its shard only: every unit's full buffer is freed
        assert all(f.untyped_storage().nbytes() == 0 for f in engine.sync.full_buffers)
        held = sum(sp.numel() for sp, _, _ in engine.sync.shard_params)
        lo_hi = [u.shard(self.rank) for u in engine.units]
        assert held == sum(b - a for a, b in lo_hi) < total
        with _LOCK:
            data = batches("gpt-tiny", engine.plan.global_batch_size, STEPS)
            ref_state, ref_losses = _oracle()
        losses = [engine.step(x, y) for x, y in data]
        assert_state_close(engine.state_dict(), ref_state, RTOL["adamw"])
        for got, want in zip(losses, ref_losses):
            assert math.isclose(got, want, rel_tol=1e-5), (losses, ref_losses)


@pytest.mark.slow
def test_compile_of_a_meta_model_at_zero3_defers_to_the_engine(tmp_path, monkeypatch):
    from importlib import import_module

    from autopar.cluster.model import Cluster

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    one = Cluster.from_dict({"nodes": [{"device": {"name": "cpu", "emulate": "cpu", "speed": 1.0, "memory_GB": 2},
                                        "count": 1}]})
    case, cpu = autopar.models.build("gpt-tiny", device="meta"), autopar.models.build("gpt-tiny", device="cpu")
    try:
        compiled = autopar.compile(case.model, one, cpu.example_inputs, sum(map(sum, MICRO)), case.loss_fn,
                                   optimizer=optimizer_factory("adamw"), strategy="dp", zero_stage=3, seed=SEED)
        engine = compiled.engine
        assert len(engine.materialized_numels) == len(engine.units) > 2
        losses = [compiled.step(x, y) for x, y in batches("gpt-tiny", sum(map(sum, MICRO)), STEPS)]
        ref_state, ref_losses = _oracle()
        assert_state_close(compiled.state_dict(), ref_state, RTOL["adamw"])
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    finally:
        import_module("autopar.runtime.launcher").shutdown()
