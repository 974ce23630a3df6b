"""The data-parallel last backward's cold restarts after its gradient-bucket launches
(``autopar.measure.engine_call`` ``bucket_s``, ``autopar.cost.comm.dp_bucket_restarts_s``): charged once per
bucket, in the backward, on ranks with a micro-step, under ZeRO 0/1 only, and only on emulated types."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cluster.model import Cluster
from autopar.cost import comm
from autopar.measure import engine_call
from autopar.measure.engine_call import EngineCalls
from autopar.cost.step import predicted_phases
from autopar.measure.step import step_terms
from autopar.ir.costs import ModelCosts
from autopar.passes.analyze import analyze
from autopar.planner.dp import plan_dp


def _three():
    dev = lambda name, speed: {"name": name, "emulate": "cpu", "speed": speed, "memory_GB": 4}  # noqa: E731
    return Cluster.from_dict({"nodes": [{"devices": [{"device": dev("a", 1.0), "count": 2},
                                                     {"device": dev("b", 0.5), "count": 1}]}]})


def _costs(restart: dict | None = None, n=6):
    c = ModelCosts.synthetic({"a": [0.01] * n, "b": [0.02] * n}, param_bytes=[4e6] * n)
    return dataclasses.replace(c, bucket_restart_s=dict(restart or {}), _cache={})


def test_one_restart_per_bucket_and_none_where_no_type_pays():
    c = _costs({"a": 2e-3})
    nb = len(comm.grad_buckets(c))
    assert nb >= 2
    assert comm.dp_bucket_restarts_s(c, ["a", "b"]) == pytest.approx([nb * 2e-3, 0.0])
    assert comm.dp_bucket_restarts_s(c, ["a"], buckets=3) == pytest.approx([6e-3])
    assert comm.dp_bucket_restarts_s(_costs(), ["a", "b"]) == [0.0, 0.0]


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_the_dp_backward_pays_them_in_its_phases_and_its_step(zero):
    cluster, c0, c1 = _three(), _costs(), _costs({"a": 2e-3, "b": 4e-3})
    nb = len(comm.grad_buckets(c1))
    p0, p1 = plan_dp(c0, cluster, 24, strategy="uniform-dp", zero_stage=zero), \
        plan_dp(c1, cluster, 24, strategy="uniform-dp", zero_stage=zero)
    assert p0.stages[0].micro_batches == p1.stages[0].micro_batches
    ph0, ph1 = predicted_phases(p1, c0, cluster), predicted_phases(p1, c1, cluster)
    st = p1.stages[0]
    for g, members in enumerate(st.groups):
        r = members[0]
        t = cluster.devices[r].spec.name
        paid = nb * c1.bucket_restart(t) if zero < 2 else 0.0   # ZeRO-2/3 reduce-scatter: no buckets
        assert ph1[r]["backward"] - ph0[r]["backward"] == pytest.approx(paid)
        assert ph1[r]["forward"] == pytest.approx(ph0[r]["forward"])
    slow = nb * 4e-3 if zero < 2 else 0.0        # uniform-dp: the speed-0.5 rank is the slowest
    assert p1.predicted.step_time_s - p0.predicted.step_time_s == pytest.approx(slow)


def test_only_emulated_types_get_the_measured_figure(tmp_path, monkeypatch):
    import torch
    from torch import nn

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    inputs = (torch.randn(4, 8),)
    calls = EngineCalls(1e-4, 1e-4, 1e-4, 1e-3, 0.04, 2, bucket_s=3e-4)
    monkeypatch.setattr(engine_call, "measure_machine_calls", lambda **k: calls)   # measured elsewhere
    terms = step_terms(analyze(model, inputs), _three(), model=model, example_inputs=inputs, measured=True)
    got = terms["bucket_restart_s"]
    assert got["b"] == pytest.approx(2 * got["a"]) and got["a"] > 3e-4     # stretched as the tables are
    gpus = Cluster.from_dict({"nodes": [{"device": "H100-80GB", "count": 4}]})
    assert step_terms(analyze(model, inputs), gpus, model=model, example_inputs=inputs,
                      measured=True)["bucket_restart_s"] == {}
