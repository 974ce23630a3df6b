"""The engines' per-call cost after the emulation clock's sleep (autopar.measure.engine_call): its form, its
cache key (another machine measures its own), and that the cost model prices it once per call, in the
phase the recorder measures it in. Pure / in-process: no launch."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from autopar.cluster.model import Cluster
from autopar.measure import engine_call
from autopar.measure.engine_call import (BUCKET_GAP_RANGE_S, CALL_GAP_RANGE_S, EngineCalls, bucket_gap_s, call_gap_s,
                                      measure_engine_calls)
from autopar.measure.cache import load_json, measure_cache_path
from autopar.cost.step import predicted_phases
from autopar.measure.step import step_terms
from autopar.ir.costs import ModelCosts
from autopar.passes.analyze import analyze
from autopar.planner.dp import plan_dp
from autopar.planner.pp import plan_pipeline


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    return tmp_path


class _Case:
    def __init__(self):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        self.example_inputs = (torch.randn(4, 16),)
        self.loss_fn = nn.functional.mse_loss


@pytest.fixture(scope="module")
def tiny():
    case = _Case()
    return case, analyze(case.model, case.example_inputs), torch.randn(4, 4)


def _three():
    dev = lambda name, speed: {"name": name, "emulate": "cpu", "speed": speed, "memory_GB": 4}  # noqa: E731
    return Cluster.from_dict({"nodes": [{"devices": [{"device": dev("a", 1.0), "count": 2},
                                                     {"device": dev("b", 0.5), "count": 1}]}]})


def _entries(prefix: str = "engine-call|"):
    return sorted(k for k in load_json(measure_cache_path()) if k.startswith(prefix))


def test_the_gap_is_the_clocks_sleep_within_its_range():
    lo, hi = CALL_GAP_RANGE_S
    assert call_gap_s(0.015, 3.0) == pytest.approx(0.045)        # 3x the call: time_scale / speed = 4
    assert call_gap_s(1e-4, 3.0) == lo and call_gap_s(1.0, 3.0) == hi
    lo, hi = BUCKET_GAP_RANGE_S                  # a bucket launch settles about half the backward
    assert bucket_gap_s(0.01, 3.0) == pytest.approx(0.015)
    assert bucket_gap_s(1e-5, 3.0) == lo and bucket_gap_s(1.0, 3.0) == hi


def test_calls_are_measured_in_form_cached_and_per_machine(cache, tiny, monkeypatch):
    case, a, targets = tiny
    got = measure_engine_calls(a, case.example_inputs, sleep_factor=1.0, loss_fn=case.loss_fn,
                               example_targets=targets, micro_batch=2, repeats=3)
    assert isinstance(got, EngineCalls) and got.micro_batch == 2
    lo, hi = CALL_GAP_RANGE_S
    assert lo <= got.gap_s <= hi and 0 < got.hot_s < 1
    for v in (got.micro_step_s, got.forward_s, got.backward_s, got.bucket_s):   # cold minus hot, clamped: >= 0
        assert math.isfinite(v) and 0 <= v < 1
    assert all(p.grad is None for p in case.model.parameters()), "the probe leaves no gradients behind"
    assert all(not p._post_accumulate_grad_hooks for p in a.captured.gm.parameters()), "nor its pause hook"
    assert "bucket_s" in load_json(measure_cache_path())[_entries()[0]], "one entry holds every figure"
    assert EngineCalls(**{k: v for k, v in got.to_dict().items() if k != "bucket_s"}).bucket_s == 0.0
    assert measure_engine_calls(a, case.example_inputs, sleep_factor=1.0, loss_fn=case.loss_fn,
                                example_targets=targets, micro_batch=2, repeats=3) == got     # from the cache
    assert len(_entries()) == 1
    monkeypatch.setattr(engine_call, "machine_id", lambda: "another-host|other cpu|2 cores|torch x")
    measure_engine_calls(a, case.example_inputs, sleep_factor=1.0, loss_fn=case.loss_fn,
                         example_targets=targets, micro_batch=2, repeats=3)
    keys = _entries()
    assert len(keys) == 2 and any("another-host" in k for k in keys), "another machine measures its own"
    with pytest.raises(ValueError, match="sleep_factor"):
        measure_engine_calls(a, case.example_inputs, sleep_factor=0.0, use_cache=False)


def test_step_terms_use_the_machine_probe_on_emulated_clusters(cache, tiny, monkeypatch):
    case, a, _targets = tiny
    seen = []

    def spy(**kw):               # what the probe measured (its timing is the next test's)
        seen.append(kw)
        return EngineCalls(1e-3, 8e-4, 1.2e-3, 3e-3, 0.04, 2)

    monkeypatch.setattr(engine_call, "measure_machine_calls", spy)
    cluster = _three()
    terms = step_terms(a, cluster, model=case.model, example_inputs=case.example_inputs, measured=True)
    (kw,) = seen
    from autopar.cluster.emulation import emulation_time_scale

    assert kw == {"sleep_factor": pytest.approx(emulation_time_scale(3) / 1.0 - 1)}   # the fastest type's sleep
    call = terms["call_overhead_s"]
    assert call["a"] == pytest.approx(1e-3 * emulation_time_scale(3))     # the median kind, stretched like the
    assert call["b"] == pytest.approx(2 * call["a"])                       # tables (speed 1, then 0.5)
    assert terms["call_kinds"]["backward"] == pytest.approx(1.2)


def test_the_machine_probe_is_one_figure_per_machine_whatever_the_model(cache, monkeypatch):
    import torch

    state = torch.random.get_rng_state()
    got = engine_call.measure_machine_calls(sleep_factor=1.0, repeats=2)
    assert torch.equal(torch.random.get_rng_state(), state), "the probe leaves the global RNG alone"
    assert isinstance(got, EngineCalls) and got.micro_batch == 2 and 0 < got.hot_s < 1
    assert engine_call.measure_machine_calls(sleep_factor=1.0, repeats=2) == got      # from the cache
    assert len(_entries("engine-call-machine|")) == 1 and not _entries(), "no model graph was timed"
    monkeypatch.setattr(engine_call, "machine_id", lambda: "another-host|other cpu|2 cores|torch x")
    engine_call.measure_machine_calls(sleep_factor=1.0, repeats=2)
    assert len(_entries("engine-call-machine|")) == 2, "another machine measures its own"


def _with_call(c: ModelCosts, call: float) -> ModelCosts:
    return dataclasses.replace(c, call_overhead_s={"a": call, "b": 2 * call}, _cache={})


def _costs(n=6):
    return ModelCosts.synthetic({"a": [0.01] * n, "b": [0.02] * n})


def test_a_micro_step_pays_its_call_once_in_forward():
    cluster, c0 = _three(), _costs()
    call = 3e-3
    c1 = _with_call(c0, call)
    plan = plan_dp(c1, cluster, 24, strategy="uniform-dp", zero_stage=0)
    st = plan.stages[0]
    p0, p1 = predicted_phases(plan, c0, cluster), predicted_phases(plan, c1, cluster)
    for g, members in enumerate(st.groups):
        r = members[0]
        t = cluster.devices[r].spec.name
        n = sum(1 for x in st.micro_batches[g] if x > 0)
        assert n >= 1
        assert p1[r]["forward"] - p0[r]["forward"] == pytest.approx(n * c1.call_overhead(t))
        assert p1[r]["backward"] == pytest.approx(p0[r]["backward"])       # not twice: not in backward
        assert p1[r].get("optimizer", 0.0) - p0[r].get("optimizer", 0.0) == pytest.approx(c1.call_overhead(t))  # own call


def test_a_pipeline_pays_one_call_per_forward_and_per_backward():
    cluster, c0 = _three(), _costs()
    call = 3e-3
    c1 = _with_call(c0, call)
    plan = plan_pipeline(c1, cluster, 12, pp_layers=[2, 2, 2], num_micro=4, schedule="1f1b")
    assert plan.num_stages > 1
    p0, p1 = predicted_phases(plan, c0, cluster), predicted_phases(plan, c1, cluster)
    for st in plan.stages:
        for g, members in enumerate(st.groups):
            r = members[0]
            t = cluster.devices[r].spec.name
            n = sum(1 for x in st.micro_batches[g] if x > 0)
            assert p1[r]["forward"] - p0[r]["forward"] == pytest.approx(n * c1.call_overhead(t))
            assert p1[r]["backward"] - p0[r]["backward"] == pytest.approx(n * c1.call_overhead(t))
