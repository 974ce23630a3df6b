"""The bounds' searches in a side process (``autopar.planning.side_bounds``): the same plan and the same
figures, bit for bit, as computing them in the planning process; a side process that fails is not
trusted (the searches run again in-process); a failed main search ends it."""

import multiprocessing
import os
import threading
import time

import pytest

from autopar.cluster.model import Cluster
from autopar.config import PlanConfig
from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts
from autopar.planning import side_bounds as bound_worker
from autopar.planner.entry import plan_with_config


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))


def _case():
    cluster = Cluster.from_dict({"nodes": [{"devices": [{"device": "A100-80GB", "count": 1}]},
                                           {"devices": [{"device": "V100-16GB", "count": 1}]}]})
    costs = ModelCosts.synthetic({"A100-80GB": [0.01] * 6, "V100-16GB": [0.025] * 6}, out_bytes=[1e6] * 6)
    return costs, cluster


def test_side_process_gives_the_in_process_plan_bit_for_bit(monkeypatch, tmp_path):
    costs, cluster = _case()
    config = PlanConfig(num_heads=8)
    monkeypatch.setattr(bound_worker, "MIN_DEVICES", 10 ** 9)
    here = plan_with_config(costs, cluster, 32, config, bounds=bound_worker.start_bound_searches)
    monkeypatch.setattr(bound_worker, "MIN_DEVICES", 1)
    if not bound_worker.side_process_worthwhile(cluster):
        pytest.skip("no second CPU, no fork, or other threads alive: the side process is not used here")
    there = plan_with_config(costs, cluster, 32, config, bounds=bound_worker.start_bound_searches)
    assert there.predicted == here.predicted and there.stages == here.stages
    assert [n for n in there.notes if "searched" not in n] == [n for n in here.notes if "searched" not in n]


def test_a_failing_side_process_is_recomputed_in_process(monkeypatch):
    costs, cluster = _case()
    monkeypatch.setattr(bound_worker, "MIN_DEVICES", 1)
    if not bound_worker.side_process_worthwhile(cluster):
        pytest.skip("no side process here")
    parent = os.getpid()
    real = bound_worker.bound_searches

    def flaky(*a, **k):   # raises in the side process, works in the planning process
        if os.getpid() != parent:
            raise RuntimeError("side process failure")
        return real(*a, **k)

    monkeypatch.setattr(bound_worker, "bound_searches", flaky)
    result, _cancel, side = bound_worker.start_bound_searches(costs, cluster, 32)
    assert side and result() == real(costs, cluster, 32)


def test_a_hung_side_process_is_replaced(monkeypatch):
    costs, cluster = _case()
    monkeypatch.setattr(bound_worker, "MIN_DEVICES", 1)
    if not bound_worker.side_process_worthwhile(cluster):
        pytest.skip("no side process here")
    monkeypatch.setattr(bound_worker, "_PATIENCE_S", 0.3)
    monkeypatch.setattr(bound_worker, "_PATIENCE_X", 0.0)
    parent = os.getpid()
    real = bound_worker.bound_searches

    def stuck(*a, **k):   # never answers in the side process
        if os.getpid() != parent:
            time.sleep(60)
        return real(*a, **k)

    monkeypatch.setattr(bound_worker, "bound_searches", stuck)
    result, _cancel, side = bound_worker.start_bound_searches(costs, cluster, 32)
    assert side and result() == real(costs, cluster, 32)
    assert not multiprocessing.active_children()


def test_side_process_ends_when_the_main_search_fails(monkeypatch):
    costs, cluster = _case()
    monkeypatch.setattr(bound_worker, "MIN_DEVICES", 1)
    with pytest.raises(PlanError):
        plan_with_config(costs, cluster, 32, PlanConfig(pp_layers=(5, 5)),   # covers 10 of 6 blocks
                         bounds=bound_worker.start_bound_searches)
    assert not multiprocessing.active_children()


def test_no_side_process_from_a_thread_or_a_small_cluster(monkeypatch):
    _, cluster = _case()
    assert not bound_worker.side_process_worthwhile(cluster)   # 4 devices < MIN_DEVICES
    monkeypatch.setattr(bound_worker, "MIN_DEVICES", 1)
    seen = []
    t = threading.Thread(target=lambda: seen.append(bound_worker.side_process_worthwhile(cluster)))
    t.start()
    t.join()
    assert seen == [False]   # not the main thread: no fork
    gate = threading.Event()
    worker = threading.Thread(target=gate.wait)   # a working (non-daemon) thread alive
    worker.start()
    try:
        assert not bound_worker.side_process_worthwhile(cluster)
    finally:
        gate.set()
        worker.join()


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("side", [False, True])
def test_one_device_type_takes_its_bounds_from_the_main_search(monkeypatch, recompute, side):
    """On one device type the upper bound's and the homogeneous cluster's searches are the main one
    (``bounds.repeats_main``): the plan carries the figures and notes that searching them again gives."""
    from autopar.planner.bounds import repeats_main, with_all_bounds
    from autopar.planner.joint import plan_auto

    cluster = Cluster.homogeneous("V100-16GB", 8, per_node=4)
    costs = ModelCosts.synthetic({"V100-16GB": [0.02] * 6}, param_bytes=[1.5e9] * 6, act_bytes=[4e8] * 6,
                                 out_bytes=[1e6] * 6)
    assert repeats_main(cluster)
    monkeypatch.setattr(bound_worker, "MIN_DEVICES", 1 if side else 10 ** 9)
    config = PlanConfig(num_heads=8, recompute=recompute)
    got = plan_with_config(costs, cluster, 32, config, bounds=bound_worker.start_bound_searches)
    main = plan_auto(costs, cluster, 32, num_heads=8, recompute=recompute)
    want = with_all_bounds(main, costs, cluster, 32, num_heads=8, recompute=recompute)   # searched again
    assert got.predicted == want.predicted and got.stages == want.stages
    assert [n for n in got.notes if "searched" not in n] == [n for n in want.notes if "searched" not in n]
