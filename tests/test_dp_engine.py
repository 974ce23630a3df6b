"""The data-parallel engine (ZeRO 0-3) against the single-device oracle (``tests/oracle.py``).

Most tests run three ranks as threads on the threaded process group (NullClock: emulation changes
timing only); one real ``autopar.launch`` run on the emulated demo cluster (speeds 1, 0.5, 0.25)
checks ZeRO-3 over gloo and that ``launch`` returns every rank's state_dict.

The main split: a global batch of 47 as rank shares 27/13/7 in micro-batches (10,10,7)/(7,6)/(7,),
so ranks have different micro-step counts; other cases give one rank 0 samples.
"""

from __future__ import annotations

import copy
import math
import random
import threading

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests

from autopar.ir.plan import Plan, Predicted, Stage
from autopar.runtime.dp import DataParallelEngine, DataParallelError, FlatLayout, shard_bounds
from autopar.runtime.emulate import NullClock
from autopar.lowering import RankProgram, lower
from autopar.runtime.engine import EngineInputs, select_engine
from oracle import (prepared_case, RTOL, assert_state_close, batches, optimizer_factory, single_device_run,
                    threaded_ranks)

UNEVEN = ((10, 10, 7), (7, 6), (7,))          # 27 / 13 / 7 samples, 3 / 2 / 1 micro-steps
ZERO_RANK = ((20, 20), (), (7,))              # rank 1 computes nothing
STEPS = 3

# Model builds (global RNG), fx tracing and the oracle run once per process, under a lock: the
# threads of a test share this process's RNG.
_LOCK = threading.Lock()
_prepared = prepared_case   # the zoo model analysed once per process (tests/oracle.py)


def dp_plan(micro, zero_stage: int, zero_shares=(), num_blocks: int = 1, ranks=None) -> Plan:
    ranks = range(len(micro)) if ranks is None else ranks
    return Plan(strategy="dp", global_batch_size=sum(map(sum, micro)), zero_stage=zero_stage,
                schedule="none",
                stages=(Stage(0, num_blocks, groups=tuple((r,) for r in ranks),
                              micro_batches=tuple(tuple(m) for m in micro), zero_shares=tuple(zero_shares)),),
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def make_engine(name, micro, zero_stage, optimizer, rank, world_size, zero_shares=(), clock=None,
                cls=DataParallelEngine, ranks=None, **engine_kwargs):
    with _LOCK:
        model, gm, loss_fn, num_blocks = _prepared(name)
        model, gm = copy.deepcopy((model, gm))       # one memo: gm keeps sharing the model's params
    plan = dp_plan(micro, zero_stage, zero_shares, num_blocks, ranks)
    assert select_engine(plan) is DataParallelEngine
    return cls(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory(optimizer),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=clock or NullClock()),
        lower(plan, gm, rank, params=[p for p in model.parameters() if p.requires_grad]), **engine_kwargs)


def train(engine, name, steps=STEPS):
    B = engine.plan.global_batch_size
    with _LOCK:
        data = batches(name, B, steps)
    return [engine.step(inputs, targets) for inputs, targets in data]


def oracle(name, B, optimizer, steps=STEPS):
    with _LOCK:
        return single_device_run(name, B, steps, optimizer)


class ThreeRanks(threaded_ranks(3)):
    def check_exact(self, name, micro, zero_stage, optimizer, zero_shares=(), ranks=None, **engine_kwargs):
        engine = make_engine(name, micro, zero_stage, optimizer, self.rank, self.world_size, zero_shares,
                             ranks=ranks, **engine_kwargs)
        losses = train(engine, name)
        ref = oracle(name, engine.plan.global_batch_size, optimizer)
        assert_state_close(engine.state_dict(), ref.state, RTOL[optimizer])
        for got, want in zip(losses, ref.losses):
            assert math.isclose(got, want, rel_tol=1e-5), (losses, ref.losses)
        everyone = [torch.zeros(STEPS, dtype=torch.float64) for _ in range(self.world_size)]
        dist.all_gather(everyone, torch.tensor(losses, dtype=torch.float64))
        assert all(torch.equal(e, everyone[0]) for e in everyone), "ranks returned different losses"
        return engine

    # -- exactness: gpt-tiny (tied embedding / head) with SGD + momentum, every ZeRO stage --------
    def test_gpt_tiny_sgd_zero0_uneven(self):
        engine = self.check_exact("gpt-tiny", UNEVEN, 0, "sgd")
        # ranks of several micro-steps accumulate their linears' weight gradients inside the GEMMs
        # (passes.grad_fusion); the rank of one micro-step leaves them to autograd
        assert (engine.fused_linears > 0) == (len(UNEVEN[self.rank]) > 1), engine.fused_linears

    def test_gpt_tiny_sgd_zero1_uneven(self):
        engine = self.check_exact("gpt-tiny", UNEVEN, 1, "sgd")
        # Optimizer state is shard-sized: momentum buffers cover exactly this rank's shard.
        lo, hi = engine.layout.shard(self.rank)
        state = [s["momentum_buffer"] for s in engine.optimizer.state.values()]
        assert sum(t.numel() for t in state) == hi - lo < engine.layout.total_numel

    def test_gpt_tiny_sgd_zero2_uneven_memory_shares(self):
        engine = self.check_exact("gpt-tiny", UNEVEN, 2, "sgd", zero_shares=(80.0, 40.0, 16.0))
        sizes = [b - a for a, b in map(engine.layout.shard, range(3))]
        assert sizes[0] > sizes[1] > sizes[2] > 0
        assert all(p.grad is None for p in engine.model.parameters()), "ZeRO-2 keeps full gradients"

    def test_gpt_tiny_sgd_zero3_uneven_per_block(self):
        engine = self.check_exact("gpt-tiny", UNEVEN, 3, "sgd")
        # Units: the root (the tied embedding / head) and one per block (embed, 4 layers, head).
        assert engine.zero3_granularity == "block" and len(engine.units) == 7
        sync = engine.sync
        assert len(sync.unit_params[0]) == 1 and sync.params[sync.unit_params[0][0]].dim() == 2
        # Between steps every full parameter's storage is freed; the shards hold 1/3 of each unit.
        assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
        mine = sum(b - a for a, b in (u.shard(self.rank) for u in engine.units))
        assert sum(sp.numel() for sp, _, _ in sync.shard_params) == mine
        assert abs(mine - sum(u.total_numel for u in engine.units) / 3) <= len(engine.units)

    def test_gpt_tiny_sgd_zero3_uneven_per_micro_step(self):
        engine = self.check_exact("gpt-tiny", UNEVEN, 3, "sgd", zero3_granularity="micro_step")
        assert engine.zero3_granularity == "micro_step" and len(engine.units) == 1
        assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())

    def test_zero3_per_block_frees_blocks_during_forward_and_backward(self):
        engine = make_engine("gpt-tiny", UNEVEN, 3, "sgd", self.rank, self.world_size)
        peak = []
        sync = engine.sync
        gather, free = sync.gather, sync.free

        def record(fn):
            def wrapped(u):
                fn(u)
                peak.append(sum(sync.gathered))
            return wrapped

        sync.gather, sync.free = record(gather), record(free)
        train(engine, "gpt-tiny", steps=1)
        # At most the root, the block in use and one neighbour in backward are gathered at once.
        assert peak and max(peak) <= 3, max(peak)

    def test_gpt_tiny_sgd_zero3_rank_with_no_samples_memory_shares(self):
        self.check_exact("gpt-tiny", ZERO_RANK, 3, "sgd", zero_shares=(0.5, 0.3, 0.2))

    def test_members_out_of_rank_order_and_a_rank_left_out_of_the_plan(self):
        # Members listed as ranks 2, 0, 1: shares follow member order, shards follow group rank.
        engine = self.check_exact("gpt-tiny", ((7,), (10, 10, 7), (7, 6)), 2, "sgd", (1.0, 2.0, 3.0),
                                  ranks=(2, 0, 1))
        assert engine._share == {2: slice(0, 7), 0: slice(7, 34), 1: slice(34, 47)}[self.rank]
        sizes = [b - a for a, b in map(engine.layout.shard, range(3))]
        assert sizes[2] < sizes[0] < sizes[1]
        # A plan over ranks 0 and 2 only: rank 1 is idle but joins every collective (ZeRO-3 rounds too).
        for zero_stage in (0, 3):
            engine = self.check_exact("gpt-tiny", ((10, 10, 7), (20,)), zero_stage, "sgd", ranks=(0, 2))
            if zero_stage == 3 and self.rank == 1:
                assert all(u.shard(1)[0] == u.shard(1)[1] for u in engine.units)

    # -- exactness: AdamW (eps 1e-6) ---------------------------------------------------------------
    def test_mlp_tiny_adamw_zero0_to_3(self):
        for zero_stage in (0, 1, 2, 3):
            self.check_exact("mlp-tiny", UNEVEN, zero_stage, "adamw")

    def test_mlp_tiny_sgd_rank_with_no_samples_zero1_and_2(self):
        for zero_stage in (1, 2):
            self.check_exact("mlp-tiny", ZERO_RANK, zero_stage, "sgd", zero_shares=(3.0, 1.0, 2.0))

    def test_gpt_tiny_adamw_zero3_and_zero1(self):
        self.check_exact("gpt-tiny", UNEVEN, 3, "adamw", zero_shares=(2.0, 1.0, 1.0))
        self.check_exact("gpt-tiny", ZERO_RANK, 1, "adamw")

    def test_hf_style_model_whose_output_carries_the_loss(self):
        # torch.export-captured graph, dict output with "loss", loss_fn=None
        self.check_exact("hf-gpt-tiny", UNEVEN, 2, "adamw")

    # -- optimizers --------------------------------------------------------------------------------
    def test_param_groups_keep_their_hyperparameters_under_zero2(self):
        def groups(params):
            decay = [p for p in params if p.dim() >= 2]
            rest = [p for p in params if p.dim() < 2]
            return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                      {"params": rest, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-3, eps=1e-6)

        engine = make_engine("mlp-tiny", UNEVEN, 2, groups, self.rank, self.world_size, (1.0, 2.0, 3.0))
        train(engine, "mlp-tiny")
        ref = oracle("mlp-tiny", 47, groups)
        assert_state_close(engine.state_dict(), ref.state, RTOL["adamw"])

    def test_coupled_optimizer_is_refused_under_zero_1_not_0(self):
        class Lamb(torch.optim.SGD):      # stands for any optimizer outside the elementwise list
            pass

        with pytest.raises(DataParallelError, match="Lamb.*ZeRO-1"):
            make_engine("mlp-tiny", UNEVEN, 1, lambda ps: Lamb(ps, lr=0.1), self.rank, self.world_size)
        make_engine("mlp-tiny", UNEVEN, 0, lambda ps: Lamb(ps, lr=0.1), self.rank, self.world_size)

    def test_per_rank_mean_weighting_is_caught(self):
        # Plain DDP averaging (each rank's mean loss weighted 1/num_ranks) is wrong for uneven shares:
        # the oracle comparison must see it.
        engine = make_engine("mlp-tiny", UNEVEN, 1, "sgd", self.rank, self.world_size, cls=_PerRankMean)
        train(engine, "mlp-tiny")
        with pytest.raises(AssertionError, match="differ by more than"):
            assert_state_close(engine.state_dict(), oracle("mlp-tiny", 47, "sgd").state, RTOL["sgd"])


class _PerRankMean(DataParallelEngine):
    def _micro_step(self, inputs, targets, rows):
        from autopar.runtime.engine import compute_loss

        n, share = rows.stop - rows.start, self._share.stop - self._share.start
        out = self.gm(*(self._take(x, rows) for x in inputs))
        loss = compute_loss(out, self._take(targets, rows), self.loss_fn) * (n / share / 3)
        loss.backward()
        return loss.detach()


# -- plain logic (no process group) ------------------------------------------------------------------
def test_shard_bounds_are_proportional_contiguous_and_cover_the_buffer():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randrange(0, 200)
        shares = [rng.choice([0.0, 0.5, 1.0, 3.0, rng.random() * 10]) for _ in range(rng.randrange(1, 6))]
        if sum(shares) == 0:
            shares[0] = 1.0
        b = shard_bounds(n, shares)
        assert b[0] == 0 and b[-1] == n and all(x <= y for x, y in zip(b, b[1:]))
        for i, s in enumerate(shares):
            exact = n * s / sum(shares)
            assert math.floor(exact) <= b[i + 1] - b[i] <= math.ceil(exact)
        # largest remainder = the rounding that minimises the largest error (brute force over
        # every choice of floor/ceil with the right total, small cases)
        if len(shares) <= 4:
            import itertools
            exact = [n * s / sum(shares) for s in shares]
            best = min(max(abs(c - e) for c, e in zip(choice, exact))
                       for choice in itertools.product(*[(math.floor(e), math.ceil(e)) for e in exact])
                       if sum(choice) == n)
            got = max(abs((b[i + 1] - b[i]) - e) for i, e in enumerate(exact))
            assert got <= best + 1e-9
    assert shard_bounds(10, [1, 1, 1]) == (0, 4, 7, 10)
    assert shard_bounds(10, [0, 1]) == (0, 0, 10)


def test_shard_bounds_reject_bad_shares():
    for shares in ([], [0, 0], [-1, 2], [math.inf, 1], [math.nan]):
        with pytest.raises(DataParallelError, match="share"):
            shard_bounds(10, shares)


def test_flat_layout_padding():
    layout = FlatLayout(numels=(3, 4), offsets=(0, 3), group_bounds=(0, 7), bounds=(0, 4, 5, 7))
    assert (layout.total_numel, layout.num_shards, layout.max_shard_numel, layout.padded_numel) == (7, 3, 4, 12)


def test_plan_errors_name_the_field():
    model, gm, loss_fn, _ = _prepared("mlp-tiny")

    def inputs(plan):
        return EngineInputs(gm=gm, model=model, plan=plan, loss_fn=loss_fn,
                            optimizer_factory=optimizer_factory("sgd"), rank=0, world_size=2,
                            device=torch.device("cpu"), clock=NullClock()), \
            RankProgram(plan=plan, rank=0, kind="dp", gm=gm)    # nothing lowered: the checks come first

    two_stages = Plan(strategy="pp", global_batch_size=4, zero_stage=0, schedule="gpipe",
                      stages=(Stage(0, 1, ((0,),), ((4,),)), Stage(1, 2, ((1,),), ((4,),))),
                      predicted=Predicted(0.0, 0.0, {}))
    with pytest.raises(DataParallelError, match="plan.stages"):
        DataParallelEngine(*inputs(two_stages))
    tp = Plan(strategy="tp", global_batch_size=4, zero_stage=0, schedule="none",
              stages=(Stage(0, 1, ((0, 1),), ((4,),)),), predicted=Predicted(0.0, 0.0, {}))
    with pytest.raises(DataParallelError, match="groups"):
        DataParallelEngine(*inputs(tp))
    bad_sum = dp_plan(((2,), (2,)), 0)
    object.__setattr__(bad_sum, "global_batch_size", 5)
    with pytest.raises(DataParallelError, match="global_batch_size"):
        DataParallelEngine(*inputs(bad_sum))
    with pytest.raises(DataParallelError, match="zero_stage"):
        DataParallelEngine(*inputs(dp_plan(((2,), (2,)), 4)))
    with pytest.raises(DataParallelError, match="zero_shares"):
        DataParallelEngine(*inputs(dp_plan(((2,), (2,)), 1, zero_shares=(1.0,))))


# -- one real multi-process run on the emulated demo cluster ------------------------------------------
def _launch_rank(rank: int, micro, zero_stage: int, zero_shares):
    import autopar.runtime as rt

    ctx = rt.context()
    engine = make_engine("gpt-tiny", micro, zero_stage, "sgd", rank, ctx.world_size, zero_shares,
                         clock=rt.clock_for(ctx.cluster.devices[rank],
                                            time_scale=rt.oversubscription(ctx.world_size)))
    losses = train(engine, "gpt-tiny")
    return {"state": engine.state_dict(), "losses": losses, "compute_s": engine.clock.stats().compute_s}


@pytest.mark.launch
def test_launch_zero3_on_the_emulated_demo_cluster_returns_exact_state_dicts():
    import autopar
    from autopar.cluster.model import builtin

    cluster = builtin("demo")
    assert [d.spec.speed for d in cluster.devices] == [1.0, 0.5, 0.25]
    results = autopar.launch(_launch_rank, cluster, UNEVEN, 3, (2.0, 1.0, 1.0), timeout_s=240)
    ref = oracle("gpt-tiny", 47, "sgd")
    assert len(results) == 3
    for r, res in enumerate(results):
        assert all(isinstance(v, torch.Tensor) for v in res["state"].values())
        assert_state_close(res["state"], ref.state, RTOL["sgd"])
        assert res["losses"] == results[0]["losses"]
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(res["losses"], ref.losses))
        assert res["compute_s"] > 0


if __name__ == "__main__":
    run_tests()
