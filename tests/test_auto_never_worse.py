"""``auto`` is never predicted slower than any pinned plan (autopar.Pin) or single-strategy plan on the
scenario clusters (shared/spec/scenarios.md; benchmarks/clusters/*.yaml), on small Llama-shaped cost
tables so that the whole sample stays cheap: every pinned search is a restriction of auto's."""

from pathlib import Path

import pytest

from autopar.cluster.model import load
from autopar.config import Pin, PlanConfig
from autopar.errors import PlanError
from autopar.planner.joint import SINGLE_STRATEGIES, plan_auto, plan_strategy
from autopar.planner.pins import plan_pinned

from test_joint_planner import _llama_costs

CLUSTERS = Path(__file__).resolve().parents[1] / "benchmarks" / "clusters"


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))


def _alternatives(costs, cluster, batch, pins, heads):
    """(name, predicted step seconds) of every single strategy and every pin that plans."""
    out = []
    for s in SINGLE_STRATEGIES:
        try:
            out.append((s, plan_strategy(costs, cluster, batch, s, num_heads=heads).predicted.step_time_s))
        except PlanError:
            pass
    for pin in pins:
        try:
            p = plan_pinned(costs, cluster, batch, PlanConfig(num_heads=heads, pin=pin))
        except PlanError:
            continue
        out.append((str(pin), p.predicted.step_time_s))
    return out


def _check(name, pins, batch=64, layers=6):
    cluster = load(str(CLUSTERS / f"{name}.yaml"))
    costs = _llama_costs(cluster, num_layers=layers, hidden=1024, ffn=2816, seq=512)
    auto = plan_auto(costs, cluster, batch, num_heads=16).predicted.step_time_s
    alts = _alternatives(costs, cluster, batch, pins, 16)
    assert len(alts) >= 3, alts          # the comparison has something to compare with
    slower = [(n, t / auto) for n, t in alts if t < auto * (1 - 1e-9)]
    assert not slower, f"{name}: auto ({auto:.6g} s) is slower than {slower}"


def test_auto_never_worse_on_the_demo_cluster():
    pins = [Pin(pp=1), Pin(pp=3), Pin(dp=1), Pin(num_micro_batches=8), Pin(recompute=True)]
    _check("demo", pins, batch=24, layers=4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["poplar-a100", "poplar-v100-t4", "poplar-a800-v100s", "mixed-3"])
def test_auto_never_worse_on_the_scenario_clusters(name):
    # one pin per dimension (the suite's time budget; benchmarks/bench_planner_limit.py and --pin try more)
    pins = [Pin(tp=2), Pin(pp=2), Pin(dp=1), Pin(num_micro_batches=4), Pin(zero_stage=1), Pin(schedule="zb-h1")]
    _check(name, pins, batch=32, layers=4)
