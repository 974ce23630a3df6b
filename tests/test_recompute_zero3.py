"""Recomputation under ZeRO-3 (FSDP with activation checkpointing, torchtitan's standard recipe), as a
pinned plan and as the engine runs it, block by block: 3 threaded ranks of uneven shares and micro-step counts,
AdamW, exact against one device on the whole global batch; and the planner meets
``Pin(zero_stage=3, recompute=True)``."""

from __future__ import annotations

import dataclasses
import math
import threading

import torch
from torch.testing._internal.common_utils import run_tests

from autopar.config import Pin, PlanConfig
from autopar.planner.pins import pin_violation, plan_pinned
from oracle import RTOL, assert_state_close, batches, optimizer_factory, prepared_case, single_device_run, threaded_ranks
from test_pipeline_engine import B, STEPS, pp_plan

_LOCK = threading.Lock()
# one stage over every block of gpt-tiny; members: 2+2, 3 and 1+2 rows of a global batch of 10
PLAN = dataclasses.replace(pp_plan([(6, {0: (2, 2), 1: (3,), 2: (1, 2)})]), zero_stage=3)
PLAN = dataclasses.replace(PLAN, stages=tuple(dataclasses.replace(st, recompute=True) for st in PLAN.stages))


class ThreeRanks(threaded_ranks(3)):
    def test_zero3_recompute_uneven_adamw(self):
        import copy

        from autopar.lowering import lower
        from autopar.runtime.emulate import NullClock
        from autopar.runtime.engine import EngineInputs, select_engine

        with _LOCK:
            model, gm, loss_fn, _ = prepared_case("gpt-tiny")
            model, gm = copy.deepcopy((model, gm))
        engine = select_engine(PLAN)(EngineInputs(
            gm=gm, model=model, plan=PLAN, loss_fn=loss_fn, optimizer_factory=optimizer_factory("adamw"),
            rank=self.rank, world_size=self.world_size, device=torch.device("cpu"), clock=NullClock()),
            lower(PLAN, gm, self.rank, params=[p for p in model.parameters() if p.requires_grad]))
        assert engine.recompute and engine.zero_stage == 3
        # block by block, as FSDP with activation checkpointing: each recomputed block gathers its unit
        assert engine.zero3_granularity == "block" and len(engine.units) > 2
        with _LOCK:
            data = batches("gpt-tiny", B, STEPS)
            ref = single_device_run("gpt-tiny", B, STEPS, "adamw")
        seen: list[int] = []                       # units gathered at once, at every gather
        gather = engine.sync.gather

        def counting(u):
            gather(u)
            seen.append(sum(engine.sync.gathered))
        engine.sync.gather = counting
        losses = [engine.step(inputs, targets) for inputs, targets in data]
        assert not any(engine.sync.gathered)       # between steps: shards only
        assert seen and max(seen) <= 3, seen       # the root, the block and the prefetched next one
        assert_state_close(engine.state_dict(), ref.state, RTOL["adamw"])
        for got, want in zip(losses, ref.losses):
            assert math.isclose(got, want, rel_tol=1e-5), (losses, ref.losses)


def test_planner_meets_a_zero3_recompute_pin_on_uneven_devices():
    from test_pins import _cluster, _costs

    cluster, pin = _cluster(), Pin(zero_stage=3, recompute=True)
    for strategy in ("auto", "dp", "uniform-dp"):
        plan = plan_pinned(_costs(), cluster, 16, PlanConfig(num_heads=8, pin=pin, strategy=strategy))
        assert pin_violation(plan, pin, cluster) is None, strategy
        assert plan.zero_stage == 3 and all(st.recompute for st in plan.stages)


if __name__ == "__main__":
    run_tests()
