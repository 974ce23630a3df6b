"""The engine-call probe's figure per call kind (autopar.measure.engine_call.EngineCalls) and how the cost
model prices each kind (ModelCosts.call_overhead with a kind)."""

import pytest

from autopar.measure.engine_call import KIND_OUTLIER, EngineCalls
from autopar.ir.costs import CALL_KINDS, ModelCosts


def _calls(micro, fwd, bwd):
    return EngineCalls(micro_step_s=micro, forward_s=fwd, backward_s=bwd, hot_s=1e-3, gap_s=0.04, micro_batch=2)


def test_per_call_is_the_median_kind_and_each_kind_keeps_its_own_figure():
    c = _calls(1.2e-3, 0.8e-3, 0.9e-3)
    assert c.per_call_s == pytest.approx(0.9e-3)
    k = c.kinds()
    assert set(k) == set(CALL_KINDS)
    assert k["micro_step"] * c.per_call_s == pytest.approx(1.2e-3)
    assert k["forward"] * c.per_call_s == pytest.approx(0.8e-3)
    assert k["backward"] == pytest.approx(1.0)


def test_one_disturbed_kind_is_capped_and_does_not_move_the_call():
    c = _calls(0.935e-3, 0.676e-3, 5.812e-3)       # a planning process's figures, the backward's burst
    assert c.per_call_s == pytest.approx(0.935e-3)
    assert c.kinds()["backward"] == pytest.approx(KIND_OUTLIER)
    assert _calls(0.0, 0.0, 0.0).kinds() == {}


def test_model_costs_price_each_kind_on_the_type_figure():
    costs = ModelCosts.synthetic({"cpu": [1e-3, 1e-3]})
    costs.call_overhead_s = {"cpu": 2e-3}
    assert costs.call_overhead("cpu") == pytest.approx(2e-3)
    assert costs.call_overhead("cpu", "micro_step") == pytest.approx(2e-3)    # no kinds: the figure
    costs.call_kinds = {"micro_step": 1.25, "forward": 0.8, "backward": 1.0}
    assert costs.call_overhead("cpu", "micro_step") == pytest.approx(2.5e-3)
    assert costs.call_overhead("cpu", "forward") == pytest.approx(1.6e-3)
    assert costs.call_overhead("cpu") == pytest.approx(2e-3)
    assert costs.call_overhead("gpu", "forward") == 0.0
