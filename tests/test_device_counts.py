"""Any device count plans: llama-140b (global batch 1024) on 1..100 nodes of 8, homogeneous (accel-a, as
in hethub-768) and mixed (a sixth of the nodes MI210-64GB), plans or refuses with a memory
``PlanError``, and refuses only below the counts that plan. Before stage groupings took counts other
than divisors, 89 nodes (prime) found no plan while 80 and 96 did."""

import pytest

from autopar.cluster.model import Cluster
from autopar.errors import PlanError
from autopar.planner import joint as jp
from autopar.planner.layouts import stage_counts
from test_joint_planner import _llama_costs

ACCEL_A = {"name": "accel-a", "tflops": 320, "memory_GB": 64, "mem_bandwidth_GBps": 1600}


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))


def _cluster(nodes: int, mixed: bool) -> Cluster:
    groups = [{"device": ACCEL_A, "count": 8, "repeat": nodes}]
    if mixed:
        mi = max(1, nodes // 6)
        groups = [{"device": "MI210-64GB", "count": 8, "repeat": mi}]
        if nodes > mi:
            groups.append({"device": ACCEL_A, "count": 8, "repeat": nodes - mi})
    return Cluster.from_dict({"nodes": groups, "network": {"bandwidth_GBps": 25, "latency_us": 10}})


def _plan_or_memory_error(nodes: int, mixed: bool, degrees):
    cluster = _cluster(nodes, mixed)
    costs = _llama_costs(cluster)
    try:
        plan = jp.plan_auto(costs, cluster, 1024, num_heads=96, degrees=degrees)
    except PlanError as e:
        msg = str(e)
        assert "fit" in msg and ("bytes" in msg or "GiB" in msg), msg[:300]
        usable = sum(0.9 * d.spec.memory_bytes for d in cluster.devices)
        return None, usable / costs.state_bytes()
    used = set(plan.ranks)
    assert used <= set(range(len(cluster))) and plan.predicted.samples_per_s > 0
    assert all(v <= 0.9 * cluster.devices[r].spec.memory_bytes for r, v in plan.predicted.memory_bytes.items())
    return plan, None


def _check(counts, mixed, degrees):
    planned_from = None
    for nodes in counts:
        plan, room = _plan_or_memory_error(nodes, mixed, degrees)
        if plan is None:
            # Refused: only below every count that plans, and only where memory is short: less than
            # 3x the model's states in the whole cluster (TP keeps a replicated part whole, pipelines
            # keep micro-batches in flight).
            assert planned_from is None, f"{nodes} nodes refused, {planned_from} planned"
            assert room < 3.0 and nodes < 16, (nodes, room)
        elif planned_from is None:
            planned_from = nodes
    assert planned_from is not None


def test_stage_counts_cover_primes_and_divisors():
    assert stage_counts(89, 82) == [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80]
    assert set(stage_counts(160, 82)) >= {1, 2, 4, 5, 8, 10, 16, 20, 32, 40, 80}
    assert stage_counts(7, 3) == [1, 2, 3] and stage_counts(1, 82) == [1]


@pytest.mark.slow   # plans llama-140b on six clusters of up to 712 devices
@pytest.mark.parametrize("mixed", [False, True], ids=["homogeneous", "mixed"])
def test_sample_of_node_counts_plans_llama_140b(mixed):
    # TP 8 inside a node: the stage groupings are what a count changes; the full degree search of
    # the same counts is the slow test below.
    _check((3, 13, 89) if not mixed else (2, 17, 53), mixed, degrees=(8,))


@pytest.mark.slow   # about half a minute: more counts (primes, 1 and 100), and a prime over every TP degree
@pytest.mark.parametrize("mixed", [False, True], ids=["homogeneous", "mixed"])
def test_wide_sample_of_node_counts_plans_llama_140b(mixed):
    # With the quick test above: 1, 2, 3, 7, 13, 17, 31, 37, 53, 61, 89 and 100 nodes.
    _check((1, 7, 61, 100) if not mixed else (1, 31, 100), mixed, degrees=(8,))
    if not mixed:
        assert _plan_or_memory_error(37, mixed, jp.TP_DEGREES)[0] is not None
