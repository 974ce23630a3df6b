"""The measured link between emulated CPU ranks (autopar.cluster.links.EmulatedLink): measured with
threads over gloo, cached per machine and core layout, used only between emulate: cpu devices of a node
whose cluster file declares no link, never for GPU or native-CPU links."""

import pytest

from autopar.cluster.emulation import LinkedCluster, emulated_link_nodes, link_layout, with_emulated_link
from autopar.cluster.links import LINK_OPS, EmulatedLink
from autopar.cluster.model import Cluster, builtin
from autopar.cost import comm
from autopar.errors import ClusterError

SLOW = EmulatedLink(tuple((op, 1e-4 * (i + 1)) for i, op in enumerate(LINK_OPS)),
                    tuple((op, 50e6 * (i + 1)) for i, op in enumerate(LINK_OPS)))


def _emulated(declared_GBps=None, extra_gpu=False):
    node = {"device": {"name": "e", "emulate": "cpu", "speed": 0.5, "memory_GB": 1}, "count": 3}
    if declared_GBps is not None:
        node["intra_bandwidth_GBps"] = declared_GBps
    nodes = [node] + ([{"device": "A100-80GB", "count": 2}] if extra_gpu else [])
    return Cluster.from_dict({"nodes": nodes})


def test_the_link_prices_each_operation_with_its_own_bandwidth_between_emulated_ranks():
    c = with_emulated_link(_emulated(extra_gpu=True), SLOW)
    assert isinstance(c, LinkedCluster) and c == _emulated(extra_gpu=True)
    assert c.to_dict() == _emulated(extra_gpu=True).to_dict()
    assert c.signature() != _emulated(extra_gpu=True).signature()      # the plan cache tells them apart
    n, nb = 3, 30e6
    bw, lat = dict(SLOW.bandwidth_Bps), dict(SLOW.latency_s)
    assert comm.allreduce_time_s(c, [0, 1, 2], nb) == pytest.approx(
        2 * (n - 1) * (lat["all_reduce"] + nb / n / bw["all_reduce"]))
    assert comm.allgather_time_s(c, [0, 1, 2], nb) == pytest.approx(
        (n - 1) * (lat["all_gather"] + nb / n / bw["all_gather"]))
    assert comm.reduce_scatter_time_s(c, [0, 1, 2], nb) == pytest.approx(
        (n - 1) * (lat["reduce_scatter"] + nb / n / bw["reduce_scatter"]))
    assert comm.broadcast_time_s(c, [0, 1, 2], nb) == pytest.approx((n - 1) * lat["broadcast"] + nb / bw["broadcast"])
    assert comm.p2p_time_s(c, 0, 2, nb) == pytest.approx(lat["p2p"] + nb / bw["p2p"])
    # GPU links, and rings that reach a GPU, keep the nominal model
    plain = _emulated(extra_gpu=True)
    assert comm.allreduce_time_s(c, [3, 4], nb) == comm.allreduce_time_s(plain, [3, 4], nb)
    assert comm.p2p_time_s(c, 0, 3, nb) == comm.p2p_time_s(plain, 0, 3, nb)


def test_a_declared_intra_link_wins_and_gpu_clusters_carry_no_link():
    declared = _emulated(declared_GBps=2)
    assert emulated_link_nodes(declared) == ()
    assert with_emulated_link(declared, SLOW) is declared
    gpus = Cluster.homogeneous("A100-80GB", 4)
    assert with_emulated_link(gpus, SLOW) is gpus
    assert emulated_link_nodes(builtin("demo")) == (0,)


def test_the_layout_follows_the_runs_cpu_shares():
    demo = builtin("demo")                   # speeds 1 / 0.5 / 0.25 on two cores: the 1.0 rank alone
    assert link_layout(demo, 0, [0, 1]) == (0, 1, 1)
    assert link_layout(demo, 0, [0, 1, 2, 3]) == (0, 1, 2)


def test_a_link_needs_every_operation_and_round_trips():
    with pytest.raises(ClusterError, match="reduce_scatter"):
        EmulatedLink(1e-3, (("all_reduce", 1e9),))
    with pytest.raises(ClusterError, match="latency_s.*broadcast"):
        EmulatedLink({**dict(SLOW.latency_s), "broadcast": -1.0}, SLOW.bandwidth_Bps)
    assert EmulatedLink.from_json(SLOW.to_json(), (0,)) == EmulatedLink(SLOW.latency_s, SLOW.bandwidth_Bps, (0,))
    one = EmulatedLink(2e-4, SLOW.bandwidth_Bps)              # a number: the same latency for every op
    assert [one.latency(op) for op in LINK_OPS] == [2e-4] * len(LINK_OPS)
    # a comm factor multiplies every time priced on the link: latencies and bandwidths alike
    c, slow = with_emulated_link(_emulated(), SLOW), with_emulated_link(_emulated(), SLOW.scaled(3.0))
    for nb in (4e3, 3e7):
        assert comm.allreduce_time_s(slow, [0, 1, 2], nb) == pytest.approx(3 * comm.allreduce_time_s(c, [0, 1, 2], nb))
        assert comm.p2p_time_s(slow, 0, 1, nb) == pytest.approx(3 * comm.p2p_time_s(c, 0, 1, nb))


def test_alpha_beta_fit_recovers_each_operations_latency_and_bandwidth():
    from autopar.measure.links import fit_alpha_beta, link_shape

    sizes = (4096, 262144, 4 << 20, 16 << 20)
    for op, lat, bw in (("all_reduce", 1e-3, 1e9), ("broadcast", 5e-5, 2e9), ("p2p", 0.0, 4e9)):
        steps, moved = link_shape(op, 3)
        points = [(b, steps * lat + moved * b / bw) for b in sizes]
        a, w = fit_alpha_beta(points, steps, moved)
        assert a == pytest.approx(lat, abs=1e-9) and w == pytest.approx(bw, rel=1e-6)
    # noise on one small point moves the latency, not the bandwidth of the large messages much
    steps, moved = link_shape("all_gather", 3)
    points = [(b, (steps * 2e-4 + moved * b / 5e8) * (1.3 if b == 4096 else 1.0)) for b in sizes]
    a, w = fit_alpha_beta(points, steps, moved)
    assert 2e-4 < a < 2.7e-4 and w == pytest.approx(5e8, rel=0.1)
    # times that fall with size (all noise): no negative latency, a positive bandwidth
    a, w = fit_alpha_beta([(4096, 3e-3), (1 << 20, 1e-3)], 2, 1.0)
    assert a >= 0 and w > 0


def test_measured_once_per_machine_and_layout_then_read_from_the_cache(tmp_path, monkeypatch):
    from autopar.cost import calibrate
    from autopar.measure import links as link_measure, cache as measure_cache
    from autopar.measure.machine import machine_cluster

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOPAR_NUM_CORES", "2")
    link = link_measure.measure_emulated_link((0, 1), repeats=1, sizes=(4096, 1 << 16))
    assert all(x >= 0 for _, x in link.latency_s) and all(bw > 0 for _, bw in link.bandwidth_Bps)
    assert link.layout == "0|1"
    threads = link_measure.measure_emulated_link((0, 1), repeats=1, sizes=(4096, 1 << 16), processes=False)
    assert all(bw > 0 for _, bw in threads.bandwidth_Bps)
    calls = []
    monkeypatch.setattr(link_measure, "measure_emulated_link", lambda layout: calls.append(layout) or link)
    demo = builtin("demo")
    first = link_measure.emulated_link_for(demo)
    again = link_measure.emulated_link_for(demo)
    assert calls == [(0, 1, 1)] and first == again and first.nodes == (0,)
    assert measure_cache.load_link(f"v{link_measure.LINK_VERSION}|ranks 3|cores 0|1|1 of 2") is not None
    # an entry measured the old way (one latency, no version in its key) is not read: measured again
    measure_cache.save_link("ranks 3|cores 0|1|1 of 2", {"latency_s": 1.0, "bandwidth_Bps": {}})
    assert link_measure.emulated_link_for(demo) == first and calls == [(0, 1, 1)]
    planned = machine_cluster(demo)
    assert planned.emulated_link == first
    assert comm.allgather_time_s(planned, [0, 1, 2], 1e7) != comm.allgather_time_s(demo, [0, 1, 2], 1e7)
    # a comm factor divides the measured link's bandwidths
    key = calibrate.device_key(demo.devices[0].spec, 3.0)
    measure_cache.save_calibration({key: {"comm": 2.0}})
    slowed = machine_cluster(demo)
    assert slowed.emulated_link.bandwidth("all_gather") == pytest.approx(first.bandwidth("all_gather") / 2)
    assert slowed.emulated_link.latency("all_gather") == pytest.approx(first.latency("all_gather") * 2)
    monkeypatch.setenv("AUTOPAR_EMULATED_LINK", "nominal")
    assert link_measure.emulated_link_for(demo) is None


def test_ranks_planning_at_once_measure_the_link_once(tmp_path, monkeypatch):
    import threading
    import time

    from autopar.measure import links as link_measure

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOPAR_NUM_CORES", "2")
    calls = []

    def measure(layout):
        calls.append(layout)
        time.sleep(0.2)                  # long enough for the other ranks to find no link yet
        return SLOW

    monkeypatch.setattr(link_measure, "measure_emulated_link", measure)
    got = []
    threads = [threading.Thread(target=lambda: got.append(link_measure.emulated_link_for(builtin("demo"))))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 3 and len(set(got)) == 1


def test_the_link_lock_is_waited_for_with_a_deadline(tmp_path, monkeypatch):
    import fcntl

    from autopar.errors import LaunchError
    from autopar.measure.cache import links_path
    from autopar.measure.links import _link_lock

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    path = links_path().with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as holder:       # another process measuring, hung
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(LaunchError, match="stayed locked for 0.2 s"):
            with _link_lock(wait_s=0.2):
                pass
        fcntl.flock(holder, fcntl.LOCK_UN)
    with _link_lock(wait_s=0.2):          # free again: taken at once
        pass
