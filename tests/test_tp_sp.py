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
