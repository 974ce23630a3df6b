"""Selective recomputation (``Pin(recompute="selective")``, ``Stage.recompute_attention``): the
attention cores run under checkpoint and again in backward (``passes.attention_recompute``), priced as
one more attention forward in every block's backward (``cost.selective``); exact against one device."""

from __future__ import annotations

import copy
import dataclasses
import threading

import numpy as np
import pytest
import torch
from torch.testing._internal.common_utils import run_tests

from autopar.config import Pin, PlanConfig
from autopar.cost.selective import attention_recompute_costs, attention_share
from autopar.errors import PlanError
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.lowering import lower
from autopar.passes.attention_recompute import attention_calls, checkpoint_attention
from autopar.planner.pins import pin_violation, plan_pinned
from autopar.runtime.emulate import NullClock
from autopar.runtime.engine import EngineInputs, select_engine
from autopar.runtime.tp import tp_layout
from oracle import batches, optimizer_factory, prepared_case, threaded_ranks, train_and_check

B, STEPS = 8, 2
_LOCK = threading.Lock()


def _plan(groups, tp_shares=(), sp=False, strategy="tp") -> Plan:
    micro = tuple((B // len(groups),) for _ in groups)
    return Plan(strategy=strategy, global_batch_size=B, zero_stage=0, schedule="none",
                stages=(Stage(0, 6, groups=groups, micro_batches=micro, tp_shares=tp_shares,
                              sequence_parallel=sp, recompute_attention=True),),
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))


def _train(name, plan, rank, world_size, optimizer="adamw"):
    with _LOCK:
        model, gm, loss_fn, _ = prepared_case(name)
        model, gm = copy.deepcopy((model, gm))
    program = lower(plan, gm, rank)
    engine = select_engine(plan)(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=loss_fn, optimizer_factory=optimizer_factory(optimizer),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=NullClock()), program)
    train_and_check(engine, name, optimizer, STEPS, lock=_LOCK)
    return program


def test_pass_wraps_every_attention_call_and_leaves_the_graph():
    for name in ("llama-gqa-tiny", "hf-llama-gqa-tiny"):
        model, gm, _, _ = prepared_case(name)
        before = gm.code
        wrapped = checkpoint_attention(gm)
        assert gm.code == before and len(attention_calls(gm)) == 4 and not attention_calls(wrapped)
        x = batches(name, 2, 1)[0][0]
        torch.testing.assert_close(wrapped(*x), gm(*x))


def test_pricing_adds_the_attention_forward_to_backward():
    from autopar.ir.costs import ModelCosts

    costs = ModelCosts.synthetic({"a": [0.01, 0.02]}, param_bytes=[1e6] * 2, act_bytes=[1e6] * 2,
                                 out_bytes=[1e3] * 2)
    with pytest.raises(PlanError, match="pin.recompute: 'selective'"):
        attention_recompute_costs(costs)        # no attention counted
    costs = dataclasses.replace(costs, attn_fwd_flops=np.asarray(costs.fwd_flops) * [0.0, 0.25])
    sel = attention_recompute_costs(costs)
    np.testing.assert_allclose(attention_share(costs), [0.0, 0.25])
    np.testing.assert_allclose(sel.bwd_time("a", 4) - costs.bwd_time("a", 4), costs.fwd_time("a", 4) * [0.0, 0.25])


def test_planner_meets_a_selective_pin_and_the_plan_round_trips():
    from autopar.models import build
    from autopar.measure.tables import model_costs
    from autopar.passes.analyze import analyze
    from test_pins import _cluster

    case = build("llama-gqa-tiny")
    cluster = _cluster()
    costs = model_costs(analyze(case.model, case.example_inputs), cluster)
    assert costs.attn_fwd_flops is not None and costs.attn_fwd_flops[1] > 0
    for pin in (Pin(recompute="selective"), Pin(tp=2, pp=2, recompute="selective"), Pin(dp=8, recompute="selective")):
        plan = plan_pinned(costs, cluster, 16, PlanConfig(num_heads=2, pin=pin))
        assert pin_violation(plan, pin, cluster) is None, pin
        assert all(st.recompute_attention and not st.recompute for st in plan.stages)
        assert Plan.from_json(plan.to_json()) == plan
        keep = plan_pinned(costs, cluster, 16, PlanConfig(num_heads=2, pin=dataclasses.replace(pin, recompute=False)))
        assert plan.predicted.step_time_s >= keep.predicted.step_time_s * (1 - 1e-9)
    assert PlanConfig(recompute="selective").pin == Pin(recompute="selective")
    assert PlanConfig(recompute="full").recompute is True


class TwoRanks(threaded_ranks(2)):
    def test_tp_2_sequence_parallel_and_selective_recompute_on_grouped_query_hf_llama(self):
        program = _train("hf-llama-gqa-tiny", _plan(((0, 1),), ((1, 1),), sp=True), self.rank, self.world_size)
        assert len(attention_calls(program.tp_module)) == 0
        assert sum(1 for n in program.tp_module.graph.nodes if "checkpointed" in str(n.target)) == 4
        assert len(tp_layout(program.tp_module).pairs) == 8      # attention still sharded by key/value group

    def test_data_parallel_selective_recompute(self):
        _train("llama-gqa-tiny", _plan(((0,), (1,)), strategy="dp"), self.rank, self.world_size)


if __name__ == "__main__":
    run_tests()
