"""Cluster model, device presets, cluster files and the alpha-beta communication model."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cost import comm
from autopar.cluster.model import Cluster, DeviceSpec, builtin, builtin_names
from autopar.cluster.devices import GiB, PRESETS, cpu_spec_detect, match_preset, preset
from autopar.errors import ClusterError

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "benchmarks" / "clusters"


def load(name: str) -> Cluster:
    return Cluster.from_yaml(CLUSTERS / f"{name}.yaml")


# -- presets -------------------------------------------------------------------------------------

REQUIRED_PRESETS = ["A100-80GB", "A100-40GB", "A800-80GB", "H100-80GB", "H200-141GB", "V100-16GB",
                    "V100S-32GB", "T4-16GB", "L4-24GB", "A10-24GB", "RTX4090-24GB", "MI210-64GB",
                    "MI250X-128GB", "MI300X-192GB"]


def test_every_required_preset_is_present_and_sane():
    for name in REQUIRED_PRESETS:
        s = PRESETS[name]
        assert s.name == name and not s.is_emulated and s.backend == "nccl"
        assert s.vendor == ("amd" if name.startswith("MI") else "nvidia")
        assert s.peak_flops_bf16 > s.peak_flops_fp32 > 0
        # The name carries the memory size in GB (binary, as vendors count device memory).
        assert s.memory_bytes == int(name.rsplit("-", 1)[1][:-2]) * GiB
        assert s.mem_bandwidth_Bps > 1e11 and s.intra_bandwidth_Bps >= 16e9


def test_datasheet_spot_checks():
    assert preset("A100-80GB").peak_flops_bf16 == 312e12
    assert preset("a100-80gb") is PRESETS["A100-80GB"]        # case-insensitive lookup
    assert preset("H100-80GB").peak_flops_bf16 == 989.5e12   # 1,979 sparse / 2
    assert preset("V100-16GB").peak_flops_bf16 == 125e12     # fp16 tensor core: V100 has no bf16
    assert preset("T4-16GB").peak_flops_fp32 == 8.1e12
    assert preset("MI300X-192GB").memory_bytes == 192 * GiB
    assert preset("A800-80GB").intra_bandwidth_Bps < preset("A100-80GB").intra_bandwidth_Bps


def test_cpu_spec_detect_reads_this_machine():
    s = cpu_spec_detect()
    assert not s.is_emulated and s.backend == "gloo" and s.vendor == "cpu" and s.speed == 1.0
    assert s.memory_bytes > 2**28


def test_device_cpu_is_native_not_emulated():
    # api.md: `device: cpu` is this machine's CPU at native speed, with no clock (as a GPU rank);
    # `emulate: cpu` stays an emulated device with a clock.
    from autopar.runtime.emulate import EmulatedClock, NullClock, clock_for

    c = Cluster.from_dict({"nodes": [{"device": "cpu", "count": 1},
                                     {"device": {"name": "slow", "emulate": "cpu", "speed": 0.5,
                                                 "memory_GB": 2}, "count": 1}]})
    native, slow = (d.spec for d in c.devices)
    assert native is PRESETS["CPU"] and native.emulate is None and not native.is_emulated
    assert native.backend == "gloo" and isinstance(clock_for(c.devices[0], time_scale=2.0), NullClock)
    assert slow.is_emulated and isinstance(clock_for(c.devices[1], time_scale=2.0), EmulatedClock)
    assert not c.is_emulated and Cluster.from_dict(c.to_dict()) == c
    assert match_preset("Intel CPU", PRESETS["CPU"].memory_bytes) is None


# -- scenario files ------------------------------------------------------------------------------

SCENARIOS = {
    # file: (devices, nodes, {type: count})
    "poplar-a100": (8, 2, {"A100-80GB": 4, "A100-40GB": 4}),
    "poplar-v100-t4": (8, 2, {"V100-16GB": 4, "T4-16GB": 4}),
    "poplar-a800-v100s": (8, 2, {"A800-80GB": 4, "V100S-32GB": 4}),
    "hethub-768": (768, 96, {"MI210-64GB": 128, "accel-a": 640}),
    "mixed-3": (24, 3, {"H100-80GB": 8, "A100-40GB": 8, "V100-16GB": 8}),
    "demo": (3, 1, {"cpu-full": 1, "cpu-half": 1, "cpu-quarter": 1}),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_file_loads_with_the_right_counts_and_types(name):
    num, nodes, types_ = SCENARIOS[name]
    c = load(name)
    assert c.name == name and len(c) == num and c.num_nodes == nodes
    assert {t: len(r) for t, r in c.device_types().items()} == types_
    assert list(c.device_types()) == list(types_)  # first-seen order
    assert Cluster.from_dict(c.to_dict()) == c


def test_scenario_files_cover_scenarios_md():
    files = {p.stem for p in CLUSTERS.glob("*.yaml")}
    assert set(SCENARIOS) <= files, set(SCENARIOS) - files
    for extra in files - set(SCENARIOS):   # extra clusters (benchmarks' own) must load too
        assert len(load(extra)) >= 1


def test_hethub_details():
    c = load("hethub-768")
    a = c.spec_of("accel-a")
    assert a.peak_flops_bf16 == 320e12 and a.memory_bytes == 64 * GiB and a.mem_bandwidth_Bps == 1600e9
    assert a.vendor == "other"
    assert c.network_bandwidth_Bps == 25e9
    assert c.device_types()["MI210-64GB"] == tuple(range(128))
    assert c.ranks_of_node(16) == tuple(range(128, 136))
    assert c.devices[767].node == 95 and c.devices[767].local_rank == 7


def test_rank_order_is_node_by_node_in_file_order():
    c = load("mixed-3")
    assert [d.rank for d in c.devices] == list(range(24))
    assert [d.node for d in c.devices] == [0] * 8 + [1] * 8 + [2] * 8
    assert [d.local_rank for d in c.devices] == list(range(8)) * 3
    assert [d.spec.name for d in c.devices[7:9]] == ["H100-80GB", "A100-40GB"]
    assert c.ranks_of_node(2) == tuple(range(16, 24))


def test_demo_is_builtin_and_identical_to_the_benchmark_file():
    assert "demo" in builtin_names()
    assert (ROOT / "autopar" / "cluster" / "builtin" / "demo.yaml").read_bytes() == (CLUSTERS / "demo.yaml").read_bytes()
    c = builtin("demo")
    assert c == load("demo")
    assert c.is_emulated and all(d.spec.backend == "gloo" for d in c.devices)
    assert [d.spec.speed for d in c.devices] == [1.0, 0.5, 0.25]
    assert all(d.spec.memory_bytes == 2 * GiB for d in c.devices)
    with pytest.raises(ClusterError, match="'nope' is not a built-in cluster"):
        builtin("nope")


# -- queries -------------------------------------------------------------------------------------

def test_bandwidth_and_latency_intra_vs_inter_node():
    c = load("poplar-a100")
    assert c.bandwidth_Bps(0, 1) == 300e9 and c.link_kind(0, 1) == "intra"
    assert c.bandwidth_Bps(0, 4) == 12.5e9 and c.link_kind(0, 4) == "network"
    assert c.latency_s(0, 4) == 10e-6 and 0 < c.latency_s(0, 1) < c.latency_s(0, 4)
    assert c.bandwidth_Bps(2, 2) == math.inf and c.latency_s(2, 2) == 0
    assert c.bandwidth_Bps(1, 0) == c.bandwidth_Bps(0, 1)
    v = load("poplar-a800-v100s")
    assert v.bandwidth_Bps(0, 1) == 200e9 and v.bandwidth_Bps(4, 5) == 16e9


def test_node_intra_bandwidth_override_and_mixed_node():
    c = Cluster.from_dict({"nodes": [
        {"device": "A100-80GB", "count": 2, "intra_bandwidth_GBps": 100},
        {"devices": [{"device": "A100-80GB", "count": 1}, {"device": "V100-16GB", "count": 1}]},
    ]})
    assert c.bandwidth_Bps(0, 1) == 100e9
    assert c.bandwidth_Bps(2, 3) == 150e9   # slowest default link of the two devices
    assert c.link_kind(0, 2) == "network"


def test_bridge_links_between_device_families():
    c = Cluster.from_dict({"nodes": [
        {"devices": [{"device": "A100-80GB", "count": 1}, {"device": "MI210-64GB", "count": 1},
                     {"device": {"name": "cpu", "emulate": "cpu", "speed": 1, "memory_GB": 1}, "count": 1}]},
        {"device": "MI210-64GB", "count": 1},
    ]})
    assert c.link_kind(0, 1) == "bridge" and c.link_kind(0, 2) == "bridge"
    assert c.link_kind(1, 3) == "network" and c.link_kind(0, 3) == "bridge"
    link = comm.DEFAULT_LINK
    assert c.bandwidth_Bps(0, 1) == link.host_link_Bps          # PCIe on both sides
    assert c.bandwidth_Bps(0, 2) == c.devices[2].spec.intra_bandwidth_Bps   # the CPU side is slower
    assert c.bandwidth_Bps(0, 3) == min(link.host_link_Bps, c.network_bandwidth_Bps)
    assert c.latency_s(0, 1) == link.intra_latency_s + link.bridge_latency_s
    assert c.latency_s(0, 3) == c.network_latency_s + link.bridge_latency_s


def test_homogeneous():
    c = Cluster.homogeneous("A100-80GB", count=8, per_node=4)
    assert len(c) == 8 and c.num_nodes == 2 and c.ranks_of_node(1) == (4, 5, 6, 7)
    assert c.device_types() == {"A100-80GB": tuple(range(8))}
    assert Cluster.homogeneous("A100-80GB", 8).num_nodes == 1
    c = Cluster.homogeneous("T4-16GB", 10, per_node=4)
    assert [len(c.ranks_of_node(n)) for n in range(c.num_nodes)] == [4, 4, 2]
    assert Cluster.from_dict(c.to_dict()) == c
    with pytest.raises(ClusterError, match="A10-80GB"):
        Cluster.homogeneous("A10-80GB", 8)
    with pytest.raises(ClusterError, match="count: 0 is not a positive integer"):
        Cluster.homogeneous("A100-80GB", 0)


def test_spec_of_and_errors():
    c = load("poplar-v100-t4")
    assert c.spec_of("T4-16GB") is PRESETS["T4-16GB"]
    with pytest.raises(ClusterError, match="'A100-80GB' is not a device type"):
        c.spec_of("A100-80GB")
    with pytest.raises(ClusterError, match="node: 2"):
        c.ranks_of_node(2)
    with pytest.raises(ClusterError, match="rank: 8"):
        c.bandwidth_Bps(0, 8)
    assert not c.is_emulated


def test_round_trip_custom_devices_and_yaml(tmp_path):
    d = {"name": "odd", "nodes": [
        {"device": {"name": "x", "tflops": 123.456, "memory_GB": 0.3, "mem_bandwidth_GBps": 777.7,
                    "fp32_tflops": 9.87, "vendor": "amd", "intra_bandwidth_GBps": 55.5}, "count": 3,
         "repeat": 2},
        {"device": {"name": "slow", "emulate": "cpu", "speed": 0.3, "memory_GB": 1.7}, "count": 1},
    ], "network": {"bandwidth_GBps": 3.3, "latency_us": 7.7}}
    c = Cluster.from_dict(d)
    assert c.devices[0].spec.peak_flops_fp32 == 9.87e12 and c.num_nodes == 3
    assert Cluster.from_dict(c.to_dict()) == c
    path = tmp_path / "c.yaml"
    path.write_text(c.to_yaml())
    assert Cluster.from_yaml(path) == c
    assert Cluster.from_dict(Cluster.detect().to_dict()) == Cluster.detect()


@settings(max_examples=60, deadline=None)
@given(tflops=st.floats(0.001, 1e4), gbps=st.floats(0.01, 1e4), lat=st.floats(0, 1e4),
       mem=st.floats(0.01, 1e3))
def test_round_trip_is_exact_for_any_figures(tflops, gbps, lat, mem):
    c = Cluster.from_dict({"nodes": [{"device": {"name": "x", "tflops": tflops, "memory_GB": mem,
                                                 "mem_bandwidth_GBps": gbps}, "count": 2}],
                           "network": {"bandwidth_GBps": gbps, "latency_us": lat}})
    assert Cluster.from_dict(c.to_dict()) == c


def test_signature_is_stable_and_sensitive():
    a, b = load("poplar-a100"), load("poplar-a100")
    assert a.signature() == b.signature() and len(a.signature()) == 16
    d = a.to_dict()
    assert Cluster.from_dict({**d, "name": "renamed"}).signature() == a.signature()
    assert Cluster.from_dict({**d, "network": {"bandwidth_GBps": 25}}).signature() != a.signature()
    assert load("poplar-v100-t4").signature() != a.signature()
    reordered = {"network": d["network"], "nodes": d["nodes"][::-1]}
    assert Cluster.from_dict(reordered).signature() != a.signature()   # rank order matters


# -- detection -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,mem_gib,expected", [
    ("NVIDIA A100-SXM4-80GB", 79.2, "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", 39.4, "A100-40GB"),
    ("NVIDIA A10", 22.1, "A10-24GB"),
    ("NVIDIA H100 80GB HBM3", 79.1, "H100-80GB"),
    ("NVIDIA H100 PCIe", 79.6, "H100-PCIe-80GB"),       # the most specific preset wins
    ("NVIDIA A100 80GB PCIe", 79.2, "A100-PCIe-80GB"),
    ("NVIDIA H200", 139.8, "H200-141GB"),
    ("Tesla V100-SXM2-16GB", 15.8, "V100-16GB"),
    ("Tesla V100S-PCIE-32GB", 31.7, "V100S-32GB"),
    ("Tesla T4", 14.7, "T4-16GB"),
    ("NVIDIA GeForce RTX 4090", 23.6, "RTX4090-24GB"),
    ("AMD Instinct MI210", 64.0, "MI210-64GB"),
    ("Tesla V100-SXM2-32GB", 31.7, None),           # no preset of that memory size
    ("NVIDIA GeForce RTX 3090", 23.6, "RTX3090-24GB"),
    ("NVIDIA TITAN RTX", 23.6, "TitanRTX-24GB"),
    ("NVIDIA GeForce RTX 2080 Ti", 10.8, "RTX2080-Ti-11GB"),
    ("NVIDIA GeForce RTX 2080", 7.8, None),          # not the Ti
])
def test_match_preset(name, mem_gib, expected):
    got = match_preset(name, int(mem_gib * GiB))
    assert (got.name if got else None) == expected


def test_detect_without_gpu_is_one_cpu_device(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    c = Cluster.detect()
    assert len(c) == 1 and not c.is_emulated and c.devices[0].spec.backend == "gloo"
    assert c.devices[0].spec.vendor == "cpu"


def test_detect_with_gpus(monkeypatch):
    import torch
    props = [types.SimpleNamespace(name="NVIDIA H200", total_memory=int(139.8 * GiB)),
             types.SimpleNamespace(name="Mystery GPU 9000", total_memory=48 * GiB)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    c = Cluster.detect()
    assert [d.spec.name for d in c.devices] == ["H200-141GB", "Mystery-GPU-9000"]
    assert c.devices[1].spec.memory_bytes == 48 * GiB and c.num_nodes == 1
    assert c.devices[1].spec.backend == "nccl"


# -- bad input -----------------------------------------------------------------------------------

def _node(**kw):
    return {"nodes": [{"device": "A100-80GB", "count": 8}, {"device": "V100-16GB", "count": 4, **kw}]}


def _custom(**kw):
    dev = {"name": "acc", "tflops": 100, "memory_GB": 32, "mem_bandwidth_GBps": 900, **kw}
    return {"nodes": [{"device": {k: v for k, v in dev.items() if v is not None}, "count": 2}]}


def _emulated(**kw):
    return {"nodes": [{"device": {"name": "e", "emulate": "cpu", "speed": 0.5, "memory_GB": 2, **kw},
                       "count": 1}]}


BAD = [
    # (dict, fragments the message must contain)
    (_node(count=-2), ["nodes[1].count", "-2", "not a positive integer"]),
    (_node(count=0), ["nodes[1].count", "0"]),
    (_node(count="8"), ["nodes[1].count", "'8'"]),
    (_node(count=True), ["nodes[1].count", "True"]),
    (_node(count=2.5), ["nodes[1].count", "2.5"]),
    ({"nodes": [{"device": "A100-80GB"}]}, ["nodes[0].count", "missing"]),
    ({"nodes": [{"device": "A100-80GB", "cout": 8}]}, ["nodes[0].cout", "did you mean 'count'"]),
    ({"nodes": [{"device": "A100-80G", "count": 8}]},
     ["nodes[0].device", "'A100-80G'", "did you mean 'A100-80GB'", "MI300X-192GB"]),
    ({"nodes": [{"device": 42, "count": 8}]}, ["nodes[0].device", "42"]),
    ({"nodes": [{"count": 8}]}, ["nodes[0].device", "missing"]),
    (_node(repeat=0), ["nodes[1].repeat", "0"]),
    (_node(intra_bandwidth_GBps=-1), ["nodes[1].intra_bandwidth_GBps", "-1"]),
    ({"nodes": []}, ["nodes", "empty"]),
    ({"nodes": {"device": "A100-80GB"}}, ["nodes", "not a list"]),
    ({"name": "x"}, ["nodes", "missing"]),
    ({"nodez": [], "nodes": [{"device": "T4-16GB", "count": 1}]}, ["nodez", "did you mean 'nodes'"]),
    ([1, 2], ["[1, 2]", "not a mapping"]),
    (None, ["empty"]),
    ({"nodes": ["A100-80GB"]}, ["nodes[0]", "'A100-80GB'", "not a mapping"]),
    (_custom(memory_GB=0), ["nodes[0].device.memory_GB", "0"]),
    (_custom(memory_GB=-4), ["nodes[0].device.memory_GB", "-4"]),
    (_custom(tflops=None), ["nodes[0].device.tflops", "missing"]),
    (_custom(tflops="320"), ["nodes[0].device.tflops", "'320'"]),
    (_custom(tflops=float("nan")), ["nodes[0].device.tflops", "nan"]),
    (_custom(vendor="intel"), ["nodes[0].device.vendor", "'intel'", "nvidia"]),
    (_custom(name=""), ["nodes[0].device.name", "''"]),
    (_custom(tflop=3), ["nodes[0].device.tflop", "did you mean 'tflops'"]),
    (_emulated(speed=0), ["nodes[0].device.speed", "0", "(0, 1]"]),
    (_emulated(speed=-0.5), ["nodes[0].device.speed", "-0.5"]),
    (_emulated(speed=2), ["nodes[0].device.speed", "2"]),
    (_emulated(memory_GB=0), ["nodes[0].device.memory_GB", "0"]),
    (_emulated(emulate="gpu"), ["nodes[0].device.emulate", "'gpu'"]),
    (_emulated(tflops=5), ["nodes[0].device.tflops", "unknown key"]),
    ({"nodes": [{"device": {"name": "e", "emulate": "cpu", "memory_GB": 2}, "count": 1}]},
     ["nodes[0].device.speed", "missing"]),
    ({"nodes": [{"device": "T4-16GB", "count": 1}], "network": {"bandwidth_GBps": -1}},
     ["network.bandwidth_GBps", "-1"]),
    ({"nodes": [{"device": "T4-16GB", "count": 1}], "network": {"latency_us": "fast"}},
     ["network.latency_us", "'fast'"]),
    ({"nodes": [{"device": "T4-16GB", "count": 1}], "network": {"bandwith_GBps": 1}},
     ["network.bandwith_GBps", "did you mean 'bandwidth_GBps'"]),
    ({"nodes": [{"device": "T4-16GB", "count": 1}], "network": 5}, ["network", "5"]),
    ({"nodes": [{"device": "T4-16GB", "count": 4, "network_bandwidth_GBps": 0}]},
     ["nodes[0].network_bandwidth_GBps", "0"]),
    ({"nodes": [{"device": {"name": "T4-16GB", "tflops": 1, "memory_GB": 1, "mem_bandwidth_GBps": 1},
                 "count": 1}, {"device": "T4-16GB", "count": 1}]},
     ["nodes[1].device", "'T4-16GB'", "nodes[0].device"]),
    ({"nodes": [{"device": {"name": "e", "emulate": "cpu", "speed": 1, "memory_GB": 2}, "count": 1},
                {"device": {"name": "e", "emulate": "cpu", "speed": 0.5, "memory_GB": 2}, "count": 1}]},
     ["nodes[1].device", "'e'", "different spec"]),
    ({"nodes": [{"devices": [], "count": 1}]}, ["nodes[0]"]),
    ({"nodes": [{"devices": []}]}, ["nodes[0].devices", "[]"]),
    ({"nodes": [{"devices": [{"device": "T4-16GB", "count": -1}]}]}, ["nodes[0].devices[0].count", "-1"]),
    ({"nodes": [{"devices": [{"device": "T4-16GB", "count": 1, "repeat": 2}]}]},
     ["nodes[0].devices[0].repeat", "unknown key"]),
]


@pytest.mark.parametrize("d,fragments", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_raises_cluster_error_naming_field_and_value(d, fragments):
    with pytest.raises(ClusterError) as info:
        Cluster.from_dict(d)
    assert isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_bad_yaml_file_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nnodes:\n  - device: A100-80GB\n    count: [8\n")
    with pytest.raises(ClusterError, match=r"broken\.yaml:\d+: malformed YAML"):
        Cluster.from_yaml(path)
    path.write_text("nodes:\n  - device: A100-80GB\n    count: -2\n")
    with pytest.raises(ClusterError, match=r"broken\.yaml: nodes\[0\]\.count: -2 is not a positive integer"):
        Cluster.from_yaml(path)
    path.write_text("")
    with pytest.raises(ClusterError, match="empty"):
        Cluster.from_yaml(path)


def test_missing_file(tmp_path):
    with pytest.raises(ClusterError, match="no-such.yaml: no such cluster file"):
        Cluster.from_yaml(tmp_path / "no-such.yaml")


def test_hand_built_cluster_is_validated():
    spec = PRESETS["T4-16GB"]
    from autopar.cluster.model import Device
    with pytest.raises(ClusterError, match="rank"):
        Cluster("x", (Device(1, spec, 0, 0),), 1)
    with pytest.raises(ClusterError, match="num_nodes"):
        Cluster("x", (Device(0, spec, 0, 0),), 2)
    other = DeviceSpec("T4-16GB", "nvidia", 1.0, 1.0, 1, 1.0, 1.0)
    with pytest.raises(ClusterError, match="two different specs"):
        Cluster("x", (Device(0, spec, 0, 0), Device(1, other, 0, 1)), 1)


# -- communication costs -------------------------------------------------------------------------

def test_two_rank_allreduce_formula():
    c = Cluster.homogeneous("A100-80GB", 2)
    n, nbytes = 2, 1e9
    bw, lat = c.bandwidth_Bps(0, 1), c.latency_s(0, 1)
    expected = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat
    assert comm.allreduce_time_s(c, [0, 1], nbytes) == pytest.approx(expected, rel=1e-12)
    assert comm.reduce_scatter_time_s(c, [0, 1], nbytes) == pytest.approx(expected / 2, rel=1e-12)
    assert comm.allgather_time_s(c, [0, 1], nbytes) == pytest.approx(expected / 2, rel=1e-12)
    assert comm.p2p_time_s(c, 0, 1, nbytes) == pytest.approx(lat + nbytes / bw, rel=1e-12)
    assert comm.broadcast_time_s(c, [0, 1], nbytes) == pytest.approx(lat + nbytes / bw, rel=1e-12)


def test_ring_across_nodes_is_bounded_by_the_network():
    c = load("poplar-a100")
    n = 8
    expected = 2 * (n - 1) / n * 1e9 / 12.5e9 + 2 * (n - 1) * 10e-6
    assert comm.allreduce_time_s(c, range(8), 1e9) == pytest.approx(expected, rel=1e-12)
    assert comm.allreduce_time_s(c, range(4), 1e9) < comm.allreduce_time_s(c, range(4, 8), 1e9) * 1.0001
    assert comm.ring_link(c, [0, 1, 2, 3]) == (300e9, c.latency_s(0, 1))


def _shared(nic_a=1.25, nic_b=6.25):
    """Two nodes of 4 GPUs, each with one NIC for the node (10 and 50 Gbit/s), as cloud instances."""
    return Cluster.from_dict({"nodes": [{"device": "V100-16GB", "count": 4, "network_bandwidth_GBps": nic_a},
                                        {"device": "T4-16GB", "count": 4, "network_bandwidth_GBps": nic_b}],
                              "network": {"bandwidth_GBps": 12.5, "latency_us": 30}})


def test_a_node_declared_network_is_shared_by_its_flows_and_round_trips():
    c = _shared()
    assert Cluster.from_dict(c.to_dict()) == c and c.to_dict()["nodes"][0]["network_bandwidth_GBps"] == 1.25
    assert c.subset([0, 4]).node_network_Bps == (1.25e9, 6.25e9)
    # one flow alone: the slower node's figure, not the network's per-device 12.5 GB/s
    assert c.bandwidth_Bps(0, 4) == 1.25e9 and c.bandwidth_Bps(4, 0) == 1.25e9
    # a flat ring over both nodes leaves each node once: one flow each way
    assert comm.ring_link(c, range(8))[0] == 1.25e9
    # four such rings at once (the TP positions' data-parallel rings) share each node's NIC
    assert comm.ring_link(c, [0, 4], concurrent=4)[0] == 1.25e9 / 4
    n, s = 2, 1e9
    one = comm.allreduce_time_s(c, [0, 4], s)
    four = comm.allreduce_time_s(c, [0, 4], s, concurrent=4)
    assert four - 2 * (n - 1) * 30e-6 == pytest.approx(4 * (one - 2 * (n - 1) * 30e-6), rel=1e-12)
    # a ring that zigzags between the nodes crosses them 4 times each way: 4 flows per NIC
    assert comm.ring_link(c, [0, 4, 1, 5, 2, 6, 3, 7])[0] == 1.25e9 / 4
    assert comm.p2p_time_s(c, 0, 4, s, concurrent=2) == pytest.approx(30e-6 + s / (1.25e9 / 2))
    # inside a node nothing changes, nor on a cluster whose nodes declare none
    assert comm.ring_link(c, range(4), concurrent=4) == comm.ring_link(c, range(4))
    plain = load("poplar-a100")
    assert comm.ring_link(plain, [0, 4], concurrent=4) == comm.ring_link(plain, [0, 4])
    # the hierarchical algorithm's m = 4 rings across nodes run at once and share the NICs: its inter
    # step moves s / 4 per ring at 1.25 / 4 GB/s (per-device NICs would give each ring 1.25 GB/s)
    intra = max(comm.reduce_scatter_time_s(c, g, s) for g in (range(4), range(4, 8)))
    inter = 2 * 1 / 2 * (s / 4) / (1.25e9 / 4) + 2 * 30e-6
    assert comm.allreduce_time_s(c, range(8), s, algorithm="hierarchical") == pytest.approx(2 * intra + inter)


@pytest.mark.parametrize("name", ["poplar-a100", "mixed-3", "demo"])
@pytest.mark.parametrize("fn", [comm.allreduce_time_s, comm.reduce_scatter_time_s, comm.allgather_time_s,
                                comm.broadcast_time_s])
def test_collectives_monotone_in_bytes_and_ring_size(name, fn):
    c = load(name)
    sizes = [0, 1, 1e3, 1e6, 1e9]
    for k in range(1, len(c) + 1):
        times = [fn(c, range(k), s) for s in sizes]
        assert times == sorted(times)
    for s in sizes[1:]:
        times = [fn(c, range(k), s) for k in range(1, len(c) + 1)]
        assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:])), times


@settings(max_examples=40, deadline=None)
@given(ranks=st.lists(st.integers(0, 23), min_size=1, max_size=24, unique=True),
       a=st.floats(0, 1e10), b=st.floats(0, 1e10))
def test_collective_costs_are_monotone_and_additive(ranks, a, b):
    c = load("mixed-3")
    lo, hi = sorted((a, b))
    for fn in (comm.allreduce_time_s, comm.reduce_scatter_time_s, comm.allgather_time_s,
               comm.broadcast_time_s):
        assert 0 <= fn(c, ranks, lo) <= fn(c, ranks, hi)
    assert comm.allreduce_time_s(c, ranks, hi) == pytest.approx(
        comm.reduce_scatter_time_s(c, ranks, hi) + comm.allgather_time_s(c, ranks, hi), rel=1e-12)


def test_link_model_is_replaceable():
    c = load("poplar-a100")
    slow = comm.LinkModel(network_bandwidth_Bps=1e9, network_latency_s=1e-3)
    assert comm.p2p_time_s(c, 0, 4, 1e6, slow) == pytest.approx(1e-3 + 1e6 / 1e9)
    assert comm.p2p_time_s(c, 0, 4, 1e6) == pytest.approx(10e-6 + 1e6 / 12.5e9)
    half = comm.LinkModel(bandwidth_efficiency=0.5)
    assert comm.pair_bandwidth_Bps(c, 0, 1, half) == 150e9
    with pytest.raises(ValueError, match="bandwidth_efficiency"):
        comm.LinkModel(bandwidth_efficiency=0)


def test_comm_rejects_bad_arguments():
    c = load("poplar-a100")
    with pytest.raises(ValueError, match="repeats"):
        comm.allreduce_time_s(c, [0, 1, 0], 10)
    with pytest.raises(ClusterError, match="ranks: 9"):
        comm.allreduce_time_s(c, [0, 9], 10)
    with pytest.raises(ValueError, match="empty"):
        comm.allgather_time_s(c, [], 10)
    with pytest.raises(ValueError, match="nbytes: -1"):
        comm.p2p_time_s(c, 0, 1, -1)
    assert comm.allreduce_time_s(c, [3], 1e9) == 0 and comm.p2p_time_s(c, 2, 2, 1e9) == 0


def test_hierarchical_allreduce():
    c = load("poplar-a100")
    s = 1e9
    lat_intra = c.latency_s(0, 1)
    intra_rs = 3 * (lat_intra + s / 4 / 300e9)
    inter_ar = 2 * 1 * (10e-6 + s / 4 / 2 / 12.5e9)
    got = comm.allreduce_time_s(c, range(8), s, algorithm="hierarchical")
    assert got == pytest.approx(2 * intra_rs + inter_ar, rel=1e-12)
    assert comm.reduce_scatter_time_s(c, range(8), s, algorithm="hierarchical") == pytest.approx(
        intra_rs + inter_ar / 2, rel=1e-12)
    assert got < comm.allreduce_time_s(c, range(8), s)          # m NICs at once beat one flat ring
    assert comm.allreduce_time_s(c, range(8), s, algorithm="auto") == got
    # One node, or one rank per node: the hierarchy is the ring.
    for ranks in (range(4), [0, 4]):
        hier = comm.allreduce_time_s(c, ranks, s, algorithm="hierarchical")
        assert hier == comm.allreduce_time_s(c, ranks, s)
    # Tiny messages: latency dominates and auto keeps whichever is faster.
    tiny = [comm.allreduce_time_s(c, range(8), 8, algorithm=a) for a in ("ring", "hierarchical", "auto")]
    assert tiny[2] == min(tiny[:2])
    with pytest.raises(ValueError, match="algorithm: 'tree'"):
        comm.allreduce_time_s(c, range(8), s, algorithm="tree")


@pytest.mark.parametrize("name", ["mixed-3", "hethub-768"])
def test_hierarchical_monotone_in_bytes(name):
    c = load(name)
    for fn in (comm.allreduce_time_s, comm.reduce_scatter_time_s, comm.allgather_time_s):
        for alg in ("hierarchical", "auto"):
            times = [fn(c, range(len(c)), s, algorithm=alg) for s in (0, 1e3, 1e6, 1e9)]
            assert times == sorted(times) and times[0] > 0


def test_subset_keeps_nodes_links_and_types():
    c = load("mixed-3")
    a100 = c.subset(c.device_types()["A100-40GB"])
    assert len(a100) == 8 and a100.num_nodes == 1 and list(a100.device_types()) == ["A100-40GB"]
    s = c.subset([9, 3, 2])
    assert [d.spec.name for d in s.devices] == ["H100-80GB", "H100-80GB", "A100-40GB"]
    assert s.num_nodes == 2 and s.link_kind(0, 1) == "intra" and s.link_kind(1, 2) == "network"
    assert s.network_bandwidth_Bps == c.network_bandwidth_Bps
    assert c.subset(range(len(c)), name=c.name) == c
    for bad in ([], [1, 1], [24]):
        with pytest.raises(ClusterError, match="ranks"):
            c.subset(bad)


def test_load_takes_a_path_or_a_builtin_name(tmp_path, monkeypatch):
    from autopar.cluster.model import load as load_cluster
    assert load_cluster(CLUSTERS / "poplar-a100.yaml") == load("poplar-a100")
    monkeypatch.chdir(tmp_path)
    assert load_cluster("demo") == builtin("demo")
    with pytest.raises(ClusterError, match="no such cluster file"):
        load_cluster("demo2")


def test_absurd_sizes_are_refused_before_building():
    with pytest.raises(ClusterError, match=r"nodes\[0\]: the cluster reaches 800000 devices"):
        Cluster.from_dict({"nodes": [{"device": "T4-16GB", "count": 8, "repeat": 100000}]})
    with pytest.raises(ClusterError, match="count: 1000000"):
        Cluster.homogeneous(preset="T4-16GB", count=10**6)
