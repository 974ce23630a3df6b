"""Step-time terms beyond the block tables (``autopar.cost.step``): the optimizer step and the fixed
cost of a compute call, their measurement and roofline, and how ``plan_dp`` and the pipeline
timeline add them (exact sums on synthetic costs)."""

import dataclasses

import numpy as np
import pytest

import autopar.models as zoo
from autopar.cluster.model import Cluster
from autopar.cost.comm import allreduce_time_s
from autopar.ir.costs import ModelCosts
from autopar.cluster.devices import PRESETS
from autopar.planner.dp import optimizer_step_s, plan_dp
from autopar.ir.plan import Stage
from autopar.planner.pp import plan_pipeline, plan_timeline, stage_durations, stage_optimizer_s
from autopar.cost.pipeline import pipeline_loss_allreduce_s
from autopar.runtime.emulate import emulation_time_scale
from autopar.cost.step import OPTIMIZER_BANDWIDTH_EFFICIENCY, optimizer_roofline_s_per_param
from autopar.measure.step import measure_call_overhead, measure_optimizer, flat_shard_numel, step_concurrency, step_terms
from autopar.passes.analyze import analyze


def _emulated(name, speed):
    return {"name": name, "emulate": "cpu", "speed": speed, "memory_GB": 4}


def _two(speed_a=1.0, speed_b=0.5):
    return Cluster.from_dict({"nodes": [{"devices": [{"device": _emulated("a", speed_a), "count": 1},
                                                     {"device": _emulated("b", speed_b), "count": 1}]}]})


def _costs(opt=None, call=None, n=8):
    c = ModelCosts.synthetic({"a": [0.01] * n, "b": [0.02] * n})
    return dataclasses.replace(c, optimizer_s_per_param=dict(opt or {}), call_overhead_s=dict(call or {}), _cache={})


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    import os

    old = os.environ.get("AUTOPAR_CACHE_DIR")
    os.environ["AUTOPAR_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        os.environ.pop("AUTOPAR_CACHE_DIR", None)
    else:
        os.environ["AUTOPAR_CACHE_DIR"] = old


# -- the terms ------------------------------------------------------------------------------------------
def test_defaults_cost_nothing_and_helpers_scale():
    c = ModelCosts.synthetic({"a": [0.01] * 3})
    assert c.optimizer_time("a", 1e6) == 0.0 and c.call_overhead("a") == 0.0
    c = _costs({"a": 2e-9}, {"a": 1e-3})
    assert c.optimizer_time("a", 5e5) == pytest.approx(1e-3)
    assert c.optimizer_time("a", 5e5, flat=True) == pytest.approx(1e-3)        # no flat rate: the same
    c = dataclasses.replace(c, optimizer_flat_s_per_param={"a": 1e-9}, _cache={})
    assert c.optimizer_time("a", 5e5, flat=True) == pytest.approx(5e-4)
    assert c.call_overhead("a") == 1e-3 and c.call_overhead("b") == 0.0


def test_gpu_optimizer_roofline_moves_28_bytes_per_adamw_parameter():
    spec = PRESETS["H100-80GB"]
    bw = spec.mem_bandwidth_Bps * OPTIMIZER_BANDWIDTH_EFFICIENCY
    assert optimizer_roofline_s_per_param(spec, "adamw") == pytest.approx(28 / bw)
    assert optimizer_roofline_s_per_param(spec, "sgd") == pytest.approx(20 / bw)        # state 4 + master 4
    assert optimizer_roofline_s_per_param(spec, "adamw", mixed_precision=False) == pytest.approx(28 / bw)
    # a 7B model steps in tens of milliseconds on one H100
    assert 0.03 < 7e9 * optimizer_roofline_s_per_param(spec) < 0.2


def test_measured_optimizer_and_call_overhead_are_cached(cache):
    s = measure_optimizer("adamw", [(64, 64), (64,)], repeats=3)
    assert 0 < s < 1e-6
    assert measure_optimizer("adamw", [(64, 64), (64,)], repeats=3) == s   # from the cache
    assert 0 < measure_optimizer("sgd", repeats=3) < 1e-6
    case = zoo.build("gpt-tiny", num_layers=1)
    a = analyze(case.model, case.example_inputs)
    call = measure_call_overhead(a, case.example_inputs, gap_s=0.002, repeats=3)
    assert 0 <= call < 0.05
    assert measure_call_overhead(a, case.example_inputs, gap_s=0.002, repeats=3) == call
    assert all(p.grad is None for p in case.model.parameters())


def test_step_terms_scale_emulated_types_like_their_tables(cache):
    case = zoo.build("gpt-tiny", num_layers=1)
    a = analyze(case.model, case.example_inputs)
    cluster = _two(1.0, 0.25)
    terms = step_terms(a, cluster, model=case.model, example_inputs=case.example_inputs, measured=True)
    opt, flat, call = (terms[k] for k in ("optimizer_s_per_param", "optimizer_flat_s_per_param", "call_overhead_s"))
    scale = emulation_time_scale(2)
    shapes = [tuple(p.shape) for p in case.model.parameters()]
    k = step_concurrency(cluster)          # the two ranks step at once on this machine's cores
    cpu = measure_optimizer("adamw", shapes, concurrent=k)
    assert opt["a"] == pytest.approx(cpu * scale) and opt["b"] == pytest.approx(4 * cpu * scale)
    assert flat["b"] == pytest.approx(4 * measure_optimizer("adamw", [(flat_shard_numel(a, cluster),)],
                                                            concurrent=k) * scale)
    assert call["b"] == pytest.approx(4 * call["a"])
    gpu = Cluster.from_dict({"nodes": [{"device": "H100-80GB", "count": 2}]})
    terms = step_terms(a, gpu)
    assert terms["call_overhead_s"] == {"H100-80GB": 0.0}
    roof = optimizer_roofline_s_per_param(PRESETS["H100-80GB"])
    assert terms["optimizer_s_per_param"]["H100-80GB"] == pytest.approx(roof)
    costs = ModelCosts(**{**_fields(ModelCosts.synthetic({"H100-80GB": [1.0]})), **terms})
    assert costs.optimizer_time("H100-80GB", 1e9, flat=True) == pytest.approx(1e9 * roof)


def _fields(c):
    return {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "_cache"}


# -- data parallelism -------------------------------------------------------------------------------------
@pytest.mark.parametrize("zero", [0, 1])
def test_plan_dp_adds_the_slowest_ranks_optimizer_step(zero):
    cluster = _two()
    base = plan_dp(_costs(), cluster, 32, strategy="uniform-dp", zero_stage=zero)
    c = dataclasses.replace(_costs({"a": 1e-9, "b": 3e-9}, {"a": 1e-4, "b": 2e-4}),
                            optimizer_flat_s_per_param={"a": 0.5e-9, "b": 1e-9}, _cache={})
    p = plan_dp(c, cluster, 32, strategy="uniform-dp", zero_stage=zero)
    params = c.total_params / (2 if zero else 1)
    rate = (0.5e-9, 1e-9) if zero else (1e-9, 3e-9)       # ZeRO >= 1 steps one flat shard
    opt = max(rate[0] * params + 1e-4, rate[1] * params + 2e-4)
    assert optimizer_step_s(c, cluster, (0, 1), zero) == pytest.approx(opt)
    assert p.predicted.breakdown["optimizer_s"] == pytest.approx(opt)
    # uniform-dp: the same micro-batches; the slow rank pays one call overhead per micro-step
    assert p.stages[0].micro_batches == base.stages[0].micro_batches
    steps = len(p.stages[0].micro_batches[1])
    assert p.predicted.step_time_s == pytest.approx(base.predicted.step_time_s + opt + steps * 2e-4, rel=1e-6)


# -- pipelines -------------------------------------------------------------------------------------------
def test_stage_durations_add_one_call_per_forward_and_backward():
    cluster = _two()
    plan = plan_pipeline(_costs(), cluster, 16, pp_layers=[5, 3], num_micro=4, schedule="1f1b")
    f0, b0, c0 = stage_durations(_costs(), cluster, plan.stages)
    f1, b1, c1 = stage_durations(_costs(call={"a": 1e-3, "b": 3e-3}), cluster, plan.stages)
    np.testing.assert_allclose(f1 - f0, [[1e-3] * 4, [3e-3] * 4])
    np.testing.assert_allclose(b1 - b0, [[1e-3] * 4, [3e-3] * 4])
    np.testing.assert_allclose(c1, c0)


def test_timeline_ends_with_each_stages_optimizer_step():
    cluster = _two()
    c0 = _costs()
    plan = plan_pipeline(c0, cluster, 16, pp_layers=[5, 3], num_micro=4, schedule="1f1b")
    timeline, step0 = plan_timeline(plan, c0, cluster)
    c = _costs({"a": 1e-8, "b": 1e-7})
    _, step = plan_timeline(plan, c, cluster)
    ends = timeline.stage_end_s
    opt = [stage_optimizer_s(c, cluster, st, 0) for st in plan.stages]
    assert opt[1] == pytest.approx(1e-7 * float(c.params[5:].sum()))
    loss = pipeline_loss_allreduce_s(plan, cluster)      # then the loss sum over every rank
    assert loss > 0
    assert step == pytest.approx(max(e + o for e, o in zip(ends, opt)) + loss)
    assert step > step0


def test_zero1_stage_members_step_a_share_and_gather():
    three = Cluster.from_dict({"nodes": [{"devices": [{"device": _emulated("a", 1.0), "count": 2},
                                                      {"device": _emulated("b", 0.5), "count": 1}]}]})
    c = _costs({"a": 1e-8, "b": 1e-8})
    st = Stage(0, 5, groups=((0,), (1,)), micro_batches=((2, 2), (2, 2)))
    p = float(c.params[:5].sum())
    assert stage_optimizer_s(c, three, st, 0) == pytest.approx(1e-8 * p)
    assert stage_optimizer_s(c, three, st, 1) == pytest.approx(1e-8 * p / 2)


def test_tied_weight_waits_for_both_stages():
    cluster = _two()
    c = dataclasses.replace(_costs(), tied_groups=((0, 7),), _cache={})
    plan = plan_pipeline(c, cluster, 16, pp_layers=[5, 3], num_micro=4, schedule="1f1b")
    timeline, step = plan_timeline(plan, c, cluster)
    tied = allreduce_time_s(cluster, [0, 1], float(c.params[0]) * c.grad_bytes_per_param)
    assert step == pytest.approx(max(timeline.stage_end_s) + tied + pipeline_loss_allreduce_s(plan, cluster))
