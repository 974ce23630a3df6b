"""``ModelCosts`` as the join of its three parts (``autopar.ir.tables``): the model's facts from the
graph, the device types' time tables and the tensor-parallel tables, each with a JSON round trip, and
the same plan from tables read back as from the tables they were written from."""

from __future__ import annotations

import numpy as np
import pytest

from autopar.cluster.model import Cluster, builtin
from autopar.config import PlanConfig
from autopar.ir.costs import ModelCosts
from autopar.ir.tables import FACT_FIELDS, TIME_FIELDS, TP_FIELDS, ModelFacts, TimeTables, TpTables
from autopar.planner.entry import plan_with_config


@pytest.fixture(scope="module")
def gpt_tiny_costs():
    import autopar.models as zoo
    from autopar.measure.tables import model_costs
    from autopar.passes.analyze import analyze

    case = zoo.build("gpt-tiny", device="meta")
    cluster = Cluster.from_yaml("benchmarks/clusters/mixed-3.yaml")
    return cluster, model_costs(analyze(case.model, case.example_inputs), cluster, model=case.model, calibration=None)


def test_the_parts_hold_every_field_once():
    names = FACT_FIELDS + TIME_FIELDS + TP_FIELDS
    assert len(names) == len(set(names))
    from dataclasses import fields

    assert set(names) == {f.name for f in fields(ModelCosts)} - {"_cache"}


def test_json_round_trip_gives_equal_tables_and_the_same_plan(gpt_tiny_costs):
    cluster, costs = gpt_tiny_costs
    assert costs.tp.tp_pairs is not None and costs.times.sources     # a graph with TP pairs, timed tables
    back = ModelCosts.from_json(costs.to_json())
    assert back.to_json() == costs.to_json()          # every number as it was (a float's repr round-trips)
    assert isinstance(back.params, np.ndarray) and isinstance(back.fwd_table["H100-80GB"], np.ndarray)
    assert back.tied_groups == costs.tied_groups and back.block_names == costs.block_names
    for part in (ModelFacts, TimeTables, TpTables):
        one = {ModelFacts: costs.facts, TimeTables: costs.times, TpTables: costs.tp}[part]
        again = part.from_json(one.to_json())
        assert again.to_dict() == one.to_dict()
    config = PlanConfig(num_heads=4)
    assert plan_with_config(back, cluster, 64, config).to_json() == plan_with_config(costs, cluster, 64, config).to_json()


def test_of_joins_the_parts_it_is_given():
    costs = ModelCosts.synthetic({"a": [0.01] * 3, "b": [0.02] * 3})
    joined = ModelCosts.of(costs.facts, costs.times)          # no TP tables: none known
    assert joined.tp.to_dict() == TpTables().to_dict()
    assert joined.to_json() == costs.to_json()
    with pytest.raises(ValueError, match="unknown field"):
        TimeTables.from_dict({**costs.times.to_dict(), "speed": 1.0})


def test_a_demo_plan_from_saved_tables_is_the_plan():
    import autopar.models as zoo
    from autopar.measure.tables import model_costs
    from autopar.passes.analyze import analyze

    case = zoo.build("gpt-tiny", device="meta")
    demo = builtin("demo")
    costs = model_costs(analyze(case.model, case.example_inputs), demo, model=case.model, calibration=None)
    back = ModelCosts.from_json(costs.to_json())
    config = PlanConfig(num_heads=4)
    assert plan_with_config(back, demo, 96, config).to_json() == plan_with_config(costs, demo, 96, config).to_json()
