"""What-if pins (autopar.Pin): validated once with errors naming the field; a pinned plan equals the pin
in every pinned dimension, or the planner raises PlanError naming the pin; the CLI's --pin and --explain."""

from dataclasses import replace

import pytest

from autopar.cluster.model import Cluster
from autopar.config import Pin, PlanConfig
from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts
from autopar.planner.entry import plan_with_config
from autopar.planner.joint import plan_auto
from autopar.planner.pins import pin_violation, plan_dims, plan_pinned


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))


def _cluster(memory_GB=4):
    """Two nodes of four emulated devices: a fast node and a slow one."""
    dev = [{"name": "fast", "emulate": "cpu", "speed": 1.0, "memory_GB": memory_GB},
           {"name": "slow", "emulate": "cpu", "speed": 0.5, "memory_GB": memory_GB}]
    return Cluster.from_dict({"nodes": [{"device": d, "count": 4} for d in dev]})


def _costs(n=6):
    return ModelCosts.synthetic({"fast": [0.01] * n, "slow": [0.02] * n}, param_bytes=[2e8] * n,
                                act_bytes=[5e7] * n, out_bytes=[1e6] * n, overhead_s=1e-4)


def _plan(pin, memory_GB=4, batch=16, **kw):
    """The pinned search alone (``plan_with_config`` adds the bounds: one test checks that)."""
    cluster = _cluster(memory_GB)
    if pin is None:
        return cluster, plan_auto(_costs(), cluster, batch, num_heads=8, **kw)
    return cluster, plan_pinned(_costs(), cluster, batch, PlanConfig(num_heads=8, pin=pin, **kw))


def test_pin_is_validated_once_naming_the_field():
    for kw, field in [(dict(tp=0), "pin.tp"), (dict(pp=-1), "pin.pp"), (dict(dp=1.5), "pin.dp"),
                      (dict(num_micro_batches=0), "pin.num_micro_batches"), (dict(recompute=2), "pin.recompute"),
                      (dict(zero_stage=4), "pin.zero_stage"), (dict(schedule="zb"), "pin.schedule"),
                      (dict(virtual_stages=2, schedule="1f1b"), "pin.virtual_stages"),
                      (dict(tp={"fast": 0}), "pin.tp[fast]")]:
        with pytest.raises(PlanError, match=field.replace("[", r"\[").replace("]", r"\]")):
            Pin(**kw)
    with pytest.raises(PlanError, match="pin:"):
        PlanConfig(pin={"tp": 2})
    assert Pin.parse("tp=8, pp=8,recompute=1") == Pin(tp=8, pp=8, recompute=True)
    assert Pin.parse("tp=fast:2/slow:4,schedule=gpipe") == Pin(tp={"slow": 4, "fast": 2}, schedule="gpipe")
    assert str(Pin(tp=2, dp=3)) == "tp=2, dp=3"
    for bad in ("tp", "foo=1", "pp=x", "tp=fast:x"):
        with pytest.raises(PlanError, match="pin"):
            Pin.parse(bad)


PINS = [Pin(tp=2), Pin(pp=2), Pin(dp=2), Pin(tp=2, pp=2), Pin(pp=3, dp=2), Pin(num_micro_batches=4),
        Pin(recompute=True), Pin(recompute=False, pp=2), Pin(zero_stage=1), Pin(schedule="gpipe", pp=2),
        Pin(tp={"fast": 4}), Pin(tp=1, pp=4, dp=1, num_micro_batches=8, schedule="1f1b", zero_stage=0),
        Pin(schedule="zb-h1"), Pin(virtual_stages=2),
        # published layouts: interleaving with TP, recomputation under ZeRO-3 and under data parallelism
        Pin(tp=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2), Pin(tp=2, pp=2, virtual_stages=3),
        Pin(tp=2, schedule="interleaved-1f1b"), Pin(dp=8, zero_stage=3, recompute=True),
        Pin(dp=4, tp=2, recompute=True),
        # FSDP with TP and with pipelining (torchtitan's 2D and 3D layouts)
        Pin(tp=2, dp=2, zero_stage=3), Pin(tp=2, pp=2, zero_stage=3), Pin(pp=2, dp=2, zero_stage=3)]


@pytest.mark.parametrize("pin", [Pin(tp=2, dp=2), Pin(tp=2, pp=2, dp=2), Pin(pp=2, dp=2)], ids=str)
def test_zero_3_on_tp_and_pipeline_stages_is_priced_as_zero_1(pin):
    """A TP or pipeline stage's ZeRO-3 gathers the member's whole stage for the step: the peak and
    the bytes of ZeRO-1 (``planner.joint._as_zero3``), so the plans differ only in the stage named."""
    cluster, one = _plan(replace(pin, zero_stage=1))
    _, three = _plan(replace(pin, zero_stage=3))
    assert (one.zero_stage, three.zero_stage) == (1, 3)
    assert three.stages == one.stages and three.predicted.step_time_s == one.predicted.step_time_s
    assert three.predicted.memory_bytes == one.predicted.memory_bytes


@pytest.mark.parametrize("pin", PINS, ids=str)
def test_pinned_plan_equals_the_pin(pin):
    cluster, plan = _plan(pin)
    assert pin_violation(plan, pin, cluster) is None
    d = plan_dims(plan, cluster)
    # the same, spelled out: the pin's dimensions read off the plan's stages
    if pin.pp is not None:
        assert plan.rank_stages == pin.pp
    if pin.dp is not None:
        assert all(len(st.groups) == pin.dp for st in plan.stages)
    for st in plan.stages:
        for g in st.groups:
            deg = pin.tp_of(cluster.devices[g[0]].spec.name)
            assert deg is None or len(g) == deg
    if pin.num_micro_batches is not None:
        assert plan.num_micro_batches == pin.num_micro_batches
    if pin.recompute is not None:
        assert all(st.recompute == pin.recompute for st in plan.stages)
    for name in ("zero_stage", "schedule"):
        if getattr(pin, name) is not None:
            assert d[name] == getattr(pin, name) == getattr(plan, name)
    assert plan.notes[0].startswith(f"pinned: {pin}")


@pytest.mark.parametrize("pp_layers", [None, [3, 3]])
def test_a_pipeline_strategy_meets_a_pinned_micro_batch_count(pp_layers):
    """strategy="pp" (with or without pinned layers) plans the pinned count of micro-batches, as
    strategy="auto" does; it used to plan its own count and refuse the pin."""
    pin = Pin(pp=2, num_micro_batches=8, schedule="1f1b")
    cluster, plan = _plan(pin, strategy="pp", pp_layers=pp_layers)
    assert pin_violation(plan, pin, cluster) is None
    assert plan.num_micro_batches == 8 and plan.schedule == "1f1b" and plan.rank_stages == 2
    if pp_layers:
        assert [st.num_layers for st in plan.stages] == pp_layers


@pytest.mark.parametrize("pin", [Pin(tp=2), Pin(tp=2, dp=2), Pin(tp=2, virtual_stages=2)], ids=str)
def test_pinned_layers_together_with_tp_and_dp_pins(pin):
    """``pp_layers`` with a TP or DP pin plans jointly (it used to mean the pipeline planner alone,
    whose members are single devices, and refuse the pin)."""
    cluster, plan = _plan(pin, pp_layers=[2, 4])
    assert pin_violation(plan, pin, cluster) is None
    R = plan.rank_stages
    assert [sum(st.num_layers for st in plan.stages[r::R]) for r in range(R)] == [2, 4]


def test_plan_with_config_routes_a_pin_and_attaches_the_bounds():
    cluster = _cluster()
    pin = Pin(pp=2)
    plan = plan_with_config(_costs(), cluster, 16, PlanConfig(num_heads=8, pin=pin))
    assert pin_violation(plan, pin, cluster) is None and plan.rank_stages == 2
    assert plan.predicted.compute_bound_samples_per_s > 0 and plan.predicted.mfu > 0


def test_a_pin_that_cannot_be_met_names_the_pin():
    cases = [(Pin(tp=8), "pin.tp"), (Pin(tp={"other": 2}), "pin.tp"), (Pin(pp=7), "pin.pp"),
             (Pin(num_micro_batches=17), "pin.num_micro_batches"), (Pin(tp=4, pp=2, dp=2), "pin: tp x pp x dp"),
             (Pin(schedule="zb-h1", tp=2), "pin.schedule"), (Pin(virtual_stages=2, pp=1), "pin.virtual_stages")]
    for pin, match in cases:
        with pytest.raises(PlanError, match=match.replace(".", r"\.")):
            _plan(pin)
    with pytest.raises(PlanError, match=r"pin\.dp"):
        _plan(Pin(dp=8), batch=4)
    # memory: at 1 GB per device no plan of one-device members keeping its activations fits, while the
    # unpinned search plans (an unpinned recompute is searched: that pin plans)
    with pytest.raises(PlanError, match=r"pin: no plan meets tp=1, dp=1, recompute=False .*does not fit in memory"):
        _plan(Pin(tp=1, dp=1, recompute=False), memory_GB=1)
    assert _plan(Pin(tp=1, dp=1), memory_GB=1)[1].predicted.step_time_s > 0
    with pytest.raises(PlanError, match=r"pin: no plan meets tp=1, dp=1 "):    # recompute=False: the user's "never"
        _plan(Pin(tp=1, dp=1), memory_GB=1, recompute=False)
    assert _plan(None, memory_GB=1)[1].predicted.step_time_s > 0


def test_pinned_zero_stage_that_clashes_with_the_config():
    with pytest.raises(PlanError, match="pin.zero_stage"):
        _plan(Pin(zero_stage=1), zero_stage=0)


@pytest.mark.slow
def test_cli_pin_and_explain(capsys, shared_cache):
    from autopar.cli.main import main

    assert main(["plan", "--model", "gpt-tiny", "--cluster", "demo", "--global-batch", "24",
                 "--pin", "pp=2,tp=1", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "pinned: tp=1, pp=2" in out
    for col in ("compute", "p2p", "bubble", "sync", "optimizer", "memory"):
        assert col in out
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "demo", "--global-batch", "24",
                 "--pin", "pp=99"]) == 2
    assert "pin.pp" in capsys.readouterr().err


def test_explain_prices_a_one_stage_tensor_parallel_plan():
    from autopar.planner.entry import plan_with_config
    from autopar.planner.explain import explain_stages

    cluster = Cluster.from_dict({"nodes": [{"device": {"name": "fast", "emulate": "cpu", "speed": 1.0,
                                                        "memory_GB": 4}, "count": 2}]})
    costs = ModelCosts.synthetic({"fast": [0.01] * 6}, param_bytes=[2e6] * 6, act_bytes=[1e5] * 6,
                                 out_bytes=[1e4] * 6)
    plan = plan_with_config(costs, cluster, 8, PlanConfig(strategy="tp", num_heads=8))
    assert plan.schedule == "none" and any(len(g) > 1 for g in plan.stages[0].groups)
    (row,) = explain_stages(plan, costs, cluster)
    assert row.compute_s > 0 and row.sync_s > 0               # was all zeros: a TP plan has no compute_s
    assert row.compute_s + row.sync_s + row.optimizer_s <= plan.predicted.step_time_s * 1.001
