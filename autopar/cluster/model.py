"""The cluster model: which devices exist, how they are grouped into nodes, and the links between them.

Terms
- rank: a device's index in the cluster, 0..len-1, numbered node by node in file order, device by
  device inside a node.
- node: a machine; devices of one node talk over the intra-node link, devices of different nodes over
  the network (see ``autopar.cost.comm`` for link kinds, including host-staged "bridge" links).
- device type: the spec name (``DeviceSpec.name``). Within one cluster a name means one spec; two
  different specs under one name are an error. Emulated devices at different speeds are different
  types because they carry different names.
- local_rank: a device's index inside its node.

Schema (YAML or dict; see shared/spec/api.md)::

    name: a100-v100                 # optional
    nodes:
      - device: A100-80GB           # a preset name (case-insensitive) ...
        count: 8                    # devices in this node
        repeat: 2                   # optional: this many identical nodes (default 1)
        intra_bandwidth_GBps: 300   # optional: device-to-device inside the node (default: preset)
      - device: {name: accel-a, tflops: 280, memory_GB: 64, mem_bandwidth_GBps: 1600}
        count: 8                    # custom; optional fp32_tflops, vendor, intra_bandwidth_GBps
      - device: {name: slow, emulate: cpu, speed: 0.5, memory_GB: 2}
        count: 1
      - devices:                    # extension: a node mixing several device types
          - {device: A100-80GB, count: 4}
          - {device: V100-16GB, count: 4}
    network: {bandwidth_GBps: 12.5, latency_us: 10}   # between nodes

Units: memory_GB is binary (GiB, as vendors count device memory); bandwidths are decimal GB/s;
tflops are 1e12 FLOP/s. Custom devices default to fp32_tflops = tflops / 16, vendor "other" and a
PCIe Gen4 x16 intra-node link.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from autopar.cost import comm
from autopar.cluster.devices import (
    GiB, PCIE4_X16_Bps, PRESETS, VENDORS, DeviceSpec, cpu_spec_detect, emulated_spec, preset,
)
from autopar.errors import ClusterError

__all__ = [
    "DeviceSpec", "Device", "Cluster", "builtin", "builtin_names", "load", "DEFAULT_NETWORK_BANDWIDTH_Bps",
    "DEFAULT_NETWORK_LATENCY_s",
]

DEFAULT_NETWORK_BANDWIDTH_Bps = 12.5e9  # 100 Gb/s per device (InfiniBand EDR / 100GbE)
DEFAULT_NETWORK_LATENCY_s = 10e-6
MAX_DEVICES = 1 << 16  # a typo guard (count: 80000), far above any cluster we plan for

_TOP_KEYS = ("name", "nodes", "network")
_NODE_KEYS = ("device", "count", "repeat", "intra_bandwidth_GBps", "devices")
_GROUP_KEYS = ("device", "count")
_NETWORK_KEYS = ("bandwidth_GBps", "latency_us")
_CUSTOM_KEYS = ("name", "tflops", "memory_GB", "mem_bandwidth_GBps", "fp32_tflops", "vendor",
                "intra_bandwidth_GBps")
_CUSTOM_REQUIRED = ("name", "tflops", "memory_GB", "mem_bandwidth_GBps")
_EMULATED_KEYS = ("name", "emulate", "speed", "memory_GB")
_EMULATED_REQUIRED = ("name", "emulate", "speed", "memory_GB")


@dataclass(frozen=True, slots=True)
class Device:
    rank: int
    spec: DeviceSpec
    node: int
    local_rank: int

    def __repr__(self) -> str:
        return f"Device(rank={self.rank}, {self.spec.name}, node={self.node}, local_rank={self.local_rank})"


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    devices: tuple[Device, ...]
    num_nodes: int
    network_bandwidth_Bps: float = DEFAULT_NETWORK_BANDWIDTH_Bps
    network_latency_s: float = DEFAULT_NETWORK_LATENCY_s
    # Per node: the intra-node link given in the file (B/s), or None for the devices' default.
    node_intra_Bps: tuple[float | None, ...] = ()

    def __post_init__(self):
        devices = tuple(self.devices)
        object.__setattr__(self, "devices", devices)
        if not devices:
            raise ClusterError("devices: empty; a cluster needs at least one device")
        if not self.node_intra_Bps:
            object.__setattr__(self, "node_intra_Bps", (None,) * self.num_nodes)
        if len(self.node_intra_Bps) != self.num_nodes:
            raise ClusterError(f"node_intra_Bps: {len(self.node_intra_Bps)} entries for "
                               f"{self.num_nodes} nodes")
        local = [0] * self.num_nodes
        last_node = 0
        seen: dict[str, DeviceSpec] = {}
        for i, d in enumerate(devices):
            if d.rank != i:
                raise ClusterError(f"devices[{i}].rank: {d.rank} should be {i} (ranks are 0..n-1 in order)")
            if not 0 <= d.node < self.num_nodes or d.node < last_node:
                raise ClusterError(f"devices[{i}].node: {d.node} is out of order or not in "
                                   f"0..{self.num_nodes - 1}")
            if d.local_rank != local[d.node]:
                raise ClusterError(f"devices[{i}].local_rank: {d.local_rank} should be {local[d.node]}")
            if seen.setdefault(d.spec.name, d.spec) != d.spec:
                raise ClusterError(f"devices[{i}].spec: two different specs are named {d.spec.name!r}")
            local[d.node] += 1
            last_node = d.node
        if 0 in local:
            raise ClusterError(f"num_nodes: node {local.index(0)} of {self.num_nodes} has no device")
        if not self.network_bandwidth_Bps > 0:
            raise ClusterError(f"network_bandwidth_Bps: {self.network_bandwidth_Bps!r} must be > 0")
        if not self.network_latency_s >= 0:
            raise ClusterError(f"network_latency_s: {self.network_latency_s!r} must be >= 0")

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "Cluster":
        import yaml

        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ClusterError(f"{path}: no such cluster file (built-in clusters: "
                               f"{', '.join(builtin_names())}; or see benchmarks/clusters/)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ClusterError(f"{path}: cannot read the cluster file: {e}") from None
        return _from_text(text, path)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "") -> "Cluster":
        return _build(d, source)

    @classmethod
    def homogeneous(cls, preset: str | DeviceSpec, count: int, per_node: int | None = None,
                    *, name: str | None = None, network_bandwidth_Bps: float = DEFAULT_NETWORK_BANDWIDTH_Bps,
                    network_latency_s: float = DEFAULT_NETWORK_LATENCY_s) -> "Cluster":
        """``count`` devices of one preset (or spec), ``per_node`` to a node (default: one node);
        when ``per_node`` does not divide ``count`` the last node holds the rest."""
        spec = preset if isinstance(preset, DeviceSpec) else _preset(preset, "preset")
        count = _positive_int(count, "count")
        if count > MAX_DEVICES:
            raise ClusterError(f"count: {count} is more than {MAX_DEVICES} devices")
        per_node = count if per_node is None else _positive_int(per_node, "per_node")
        sizes = [per_node] * (count // per_node) + ([count % per_node] if count % per_node else [])
        return _assemble(name or f"{spec.name}x{count}", [[(spec, n)] for n in sizes],
                         [None] * len(sizes), float(network_bandwidth_Bps), float(network_latency_s))

    @classmethod
    def detect(cls) -> "Cluster":
        """This machine: its CUDA/ROCm GPUs (matched to a preset where the name and memory fit), else
        one CPU device (emulated at full speed)."""
        specs = _detect_gpu_specs()
        if not specs:
            return _assemble("local-cpu", [[(cpu_spec_detect(), 1)]], [None],
                             DEFAULT_NETWORK_BANDWIDTH_Bps, DEFAULT_NETWORK_LATENCY_s)
        return _assemble("local-gpu", [[(s, 1) for s in specs]], [None],
                         DEFAULT_NETWORK_BANDWIDTH_Bps, DEFAULT_NETWORK_LATENCY_s)

    def subset(self, ranks, *, name: str | None = None) -> "Cluster":
        """The sub-cluster of ``ranks`` (renumbered 0.. in rank order; nodes that keep a device keep
        their order, intra-node link and the network), e.g. one device type alone."""
        chosen = sorted(set(ranks))
        if not chosen or len(chosen) != len(list(ranks)):
            raise ClusterError(f"ranks: {list(ranks)!r} must be distinct ranks, at least one")
        for r in chosen:
            comm._check_rank(self, r, "ranks")
        node_groups: list[list[tuple[DeviceSpec, int]]] = []
        node_intra: list[float | None] = []
        last = None
        for r in chosen:
            d = self.devices[r]
            if d.node != last:
                node_groups.append([])
                node_intra.append(self.node_intra_Bps[d.node])
                last = d.node
            groups = node_groups[-1]
            if groups and groups[-1][0] == d.spec:
                groups[-1] = (d.spec, groups[-1][1] + 1)
            else:
                groups.append((d.spec, 1))
        return _assemble(name or f"{self.name}[{len(chosen)}]", node_groups, node_intra,
                         self.network_bandwidth_Bps, self.network_latency_s)

    # -- queries ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self):
        return iter(self.devices)

    def device_types(self) -> dict[str, tuple[int, ...]]:
        """Device type name -> its ranks, types in first-seen order."""
        out: dict[str, list[int]] = {}
        for d in self.devices:
            out.setdefault(d.spec.name, []).append(d.rank)
        return {k: tuple(v) for k, v in out.items()}

    def spec_of(self, type_name: str) -> DeviceSpec:
        for d in self.devices:
            if d.spec.name == type_name:
                return d.spec
        raise ClusterError(f"type_name: {type_name!r} is not a device type of cluster {self.name!r} "
                           f"(types: {', '.join(self.device_types())})")

    def ranks_of_node(self, node: int) -> tuple[int, ...]:
        if not 0 <= node < self.num_nodes:
            raise ClusterError(f"node: {node!r} is not in 0..{self.num_nodes - 1}")
        return tuple(d.rank for d in self.devices if d.node == node)

    def node_intra_bandwidth_Bps(self, node: int, specs: tuple[DeviceSpec, ...] = ()) -> float:
        """The intra-node link of ``node``: the file's figure if given, else the slowest default link
        of the devices involved (``specs``, or every device of the node)."""
        given = self.node_intra_Bps[node]
        if given is not None:
            return given
        specs = specs or tuple(self.devices[r].spec for r in self.ranks_of_node(node))
        return min(s.intra_bandwidth_Bps for s in specs)

    def bandwidth_Bps(self, a: int, b: int) -> float:
        """Per-direction bandwidth between ranks a and b (intra-node link, network or bridge)."""
        return comm.pair_bandwidth_Bps(self, a, b)

    def latency_s(self, a: int, b: int) -> float:
        return comm.pair_latency_s(self, a, b)

    def link_kind(self, a: int, b: int) -> str:
        return comm.link_kind(self, a, b)

    @property
    def is_emulated(self) -> bool:
        return all(d.spec.is_emulated for d in self.devices)

    def signature(self) -> str:
        """A stable hash of everything that affects performance (not the cluster's name)."""
        d = self.to_dict()
        d.pop("name", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        """The schema form; ``Cluster.from_dict(c.to_dict()) == c``."""
        nodes: list[dict] = []
        prev = None
        for node in range(self.num_nodes):
            groups: list[list] = []
            for r in self.ranks_of_node(node):
                spec = self.devices[r].spec
                if groups and groups[-1][0] == spec:
                    groups[-1][1] += 1
                else:
                    groups.append([spec, 1])
            key = (tuple((s, n) for s, n in groups), self.node_intra_Bps[node])
            if key == prev:
                nodes[-1]["repeat"] = nodes[-1].get("repeat", 1) + 1
                continue
            prev = key
            if len(groups) == 1:
                entry = {"device": _spec_to_schema(groups[0][0]), "count": groups[0][1]}
            else:
                entry = {"devices": [{"device": _spec_to_schema(s), "count": n} for s, n in groups]}
            if self.node_intra_Bps[node] is not None:
                entry["intra_bandwidth_GBps"] = _unscale(self.node_intra_Bps[node], 1e9)
            nodes.append(entry)
        return {
            "name": self.name,
            "nodes": nodes,
            "network": {"bandwidth_GBps": _unscale(self.network_bandwidth_Bps, 1e9),
                        "latency_us": _unscale(self.network_latency_s, 1e6, divide=True)},
        }

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def summary(self) -> str:
        lines = [f"cluster {self.name}: {len(self)} devices in {self.num_nodes} nodes, network "
                 f"{self.network_bandwidth_Bps / 1e9:g} GB/s, {self.network_latency_s * 1e6:g} us"]
        for t, ranks in self.device_types().items():
            s = self.spec_of(t)
            lines.append(f"  {t:<14} x{len(ranks):<4} {s.peak_flops_bf16 / 1e12:8.1f} TFLOP/s "
                         f"{s.memory_bytes / GiB:7.1f} GB  {s.mem_bandwidth_Bps / 1e9:7.0f} GB/s"
                         + (f"  emulated at {s.speed:g}x" if s.is_emulated else ""))
        return "\n".join(lines)

    def __repr__(self) -> str:
        types = ", ".join(f"{len(r)}x{t}" for t, r in self.device_types().items())
        return f"Cluster({self.name!r}: {types} in {self.num_nodes} nodes)"


# -- built-in clusters ---------------------------------------------------------------------------

def load(source: str | os.PathLike) -> Cluster:
    """A cluster file, or the name of a built-in cluster (``"demo"``) when no such file exists."""
    path = os.fspath(source)
    if not os.path.exists(path) and path in builtin_names():
        return builtin(path)
    return Cluster.from_yaml(path)


def _builtin_dir():
    return resources.files("autopar.cluster") / "builtin"


def builtin_names() -> tuple[str, ...]:
    try:
        return tuple(sorted(p.name[:-5] for p in _builtin_dir().iterdir() if p.name.endswith(".yaml")))
    except (FileNotFoundError, NotADirectoryError):
        return ()


def builtin(name: str) -> Cluster:
    """A cluster shipped inside the package (``autopar/cluster/builtin/NAME.yaml``), e.g. ``"demo"``."""
    path = _builtin_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ClusterError(f"builtin: {name!r} is not a built-in cluster "
                           f"(built-in: {', '.join(builtin_names()) or 'none'})")
    return _from_text(path.read_text(encoding="utf-8"), f"<builtin {name}>")


# -- parsing -------------------------------------------------------------------------------------

def _from_text(text: str, source: str) -> Cluster:
    import yaml

    try:
        d = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = " ".join(str(x) for x in (e.context, e.problem) if x)
        raise ClusterError(f"{where}: malformed YAML: {problem}") from None
    except yaml.YAMLError as e:
        raise ClusterError(f"{source}: malformed YAML: {e}") from None
    return _build(d, source)


def _err(source: str, msg: str) -> ClusterError:
    return ClusterError(f"{source}: {msg}" if source else msg)


def _build(d: Any, source: str) -> Cluster:
    try:
        return _parse(d)
    except ClusterError as e:
        raise _err(source, str(e)) from None


def _check_keys(d: Mapping, allowed: tuple[str, ...], path: str) -> None:
    for key in d:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(allowed)}"
            where = f"{path}.{key}" if path else str(key)
            raise ClusterError(f"{where}: unknown key {key!r}; {hint}")


def _mapping(value: Any, path: str, what: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ClusterError(f"{path or 'cluster'}: {value!r} is not a mapping; expected {what}")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ClusterError(f"{path}: {value!r} is not a positive integer")
    return value


def _positive_number(value: Any, path: str, unit: str = "") -> float:
    if not _is_number(value) or value <= 0:
        raise ClusterError(f"{path}: {value!r} is not a positive number{unit and ' (' + unit + ')'}")
    return float(value)


def _nonneg_number(value: Any, path: str, unit: str = "") -> float:
    if not _is_number(value) or value < 0:
        raise ClusterError(f"{path}: {value!r} is not a number >= 0{unit and ' (' + unit + ')'}")
    return float(value)


def _name(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ClusterError(f"{path}: {value!r} is not a non-empty name")
    return value.strip()


def _preset(name: Any, path: str) -> DeviceSpec:
    if not isinstance(name, str):
        raise ClusterError(f"{path}: {name!r} is not a preset name or a device mapping")
    try:
        return preset(name)
    except KeyError:
        lower = {k.lower(): k for k in PRESETS}
        close = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.4)
        hint = f"did you mean {lower[close[0]]!r}? " if close else ""
        raise ClusterError(f"{path}: unknown device preset {name!r}; {hint}"
                           f"presets: {', '.join(PRESETS)}; or give a custom mapping "
                           "{name, tflops, memory_GB, mem_bandwidth_GBps}") from None


def _memory_bytes(value: Any, path: str) -> int:
    gb = _positive_number(value, path, "GB of device memory")
    mem = int(round(gb * GiB))
    if mem <= 0:
        raise ClusterError(f"{path}: {value!r} is too small")
    return mem


def _parse_device(value: Any, path: str) -> DeviceSpec:
    if not isinstance(value, Mapping):
        return _preset(value, path)
    if "emulate" in value:
        _check_keys(value, _EMULATED_KEYS, path)
        for key in _EMULATED_REQUIRED:
            if key not in value:
                raise ClusterError(f"{path}.{key}: missing; an emulated device needs "
                                   f"{', '.join(_EMULATED_REQUIRED)}")
        if value["emulate"] != "cpu":
            raise ClusterError(f"{path}.emulate: {value['emulate']!r} is not supported; use 'cpu'")
        speed = value["speed"]
        if not _is_number(speed) or not 0 < speed <= 1:
            raise ClusterError(f"{path}.speed: {speed!r} must be a number in (0, 1] "
                               "(the fraction of this CPU's speed)")
        return emulated_spec(_name(value["name"], f"{path}.name"), float(speed),
                             _memory_bytes(value["memory_GB"], f"{path}.memory_GB"))
    _check_keys(value, _CUSTOM_KEYS, path)
    for key in _CUSTOM_REQUIRED:
        if key not in value:
            raise ClusterError(f"{path}.{key}: missing; a custom device needs "
                               f"{', '.join(_CUSTOM_REQUIRED)} (or use a preset name, or "
                               "'emulate: cpu' for an emulated device)")
    name = _name(value["name"], f"{path}.name")
    tflops = _positive_number(value["tflops"], f"{path}.tflops", "dense bf16/fp16 TFLOP/s")
    fp32 = (_positive_number(value["fp32_tflops"], f"{path}.fp32_tflops", "TFLOP/s")
            if "fp32_tflops" in value else tflops / 16)
    vendor = value.get("vendor", "other")
    if vendor not in VENDORS:
        raise ClusterError(f"{path}.vendor: {vendor!r} is not one of {', '.join(VENDORS)}")
    intra = (_positive_number(value["intra_bandwidth_GBps"], f"{path}.intra_bandwidth_GBps", "GB/s") * 1e9
             if "intra_bandwidth_GBps" in value else PCIE4_X16_Bps)
    return DeviceSpec(
        name=name, vendor=vendor, peak_flops_bf16=tflops * 1e12, peak_flops_fp32=fp32 * 1e12,
        memory_bytes=_memory_bytes(value["memory_GB"], f"{path}.memory_GB"),
        mem_bandwidth_Bps=_positive_number(value["mem_bandwidth_GBps"], f"{path}.mem_bandwidth_GBps",
                                           "GB/s") * 1e9,
        intra_bandwidth_Bps=intra,
    )


def _parse_group(item: Mapping, path: str) -> tuple[DeviceSpec, int]:
    if "device" not in item:
        raise ClusterError(f"{path}.device: missing; give a preset name or a device mapping")
    if "count" not in item:
        raise ClusterError(f"{path}.count: missing; give the number of devices, e.g. count: 8")
    return _parse_device(item["device"], f"{path}.device"), _positive_int(item["count"], f"{path}.count")


def _parse(d: Any) -> Cluster:
    if d is None:
        raise ClusterError("cluster: empty; expected a mapping with a 'nodes' list")
    d = _mapping(d, "", "a mapping with 'name', 'nodes', 'network'")
    _check_keys(d, _TOP_KEYS, "")
    name = _name(d["name"], "name") if "name" in d else "cluster"
    if "nodes" not in d:
        raise ClusterError("nodes: missing; give a list of nodes, "
                           "e.g. nodes: [{device: A100-80GB, count: 8}]")
    nodes = d["nodes"]
    if not isinstance(nodes, list):
        raise ClusterError(f"nodes: {nodes!r} is not a list of nodes")
    if not nodes:
        raise ClusterError("nodes: [] is empty; a cluster needs at least one node")
    network = _mapping(d.get("network", {}) or {}, "network", "{bandwidth_GBps, latency_us}")
    _check_keys(network, _NETWORK_KEYS, "network")
    net_bw = (_positive_number(network["bandwidth_GBps"], "network.bandwidth_GBps", "GB/s") * 1e9
              if "bandwidth_GBps" in network else DEFAULT_NETWORK_BANDWIDTH_Bps)
    net_lat = (_nonneg_number(network["latency_us"], "network.latency_us", "microseconds") / 1e6
               if "latency_us" in network else DEFAULT_NETWORK_LATENCY_s)

    node_groups: list[list[tuple[DeviceSpec, int]]] = []
    node_intra: list[float | None] = []
    names: dict[str, tuple[DeviceSpec, str]] = {}
    total = 0
    for i, node in enumerate(nodes):
        path = f"nodes[{i}]"
        node = _mapping(node, path, "a node mapping like {device: A100-80GB, count: 8}")
        _check_keys(node, _NODE_KEYS, path)
        if "devices" in node:
            for key in ("device", "count"):
                if key in node:
                    raise ClusterError(f"{path}.{key}: not allowed together with {path}.devices")
            items = node["devices"]
            if not isinstance(items, list) or not items:
                raise ClusterError(f"{path}.devices: {items!r} is not a non-empty list of "
                                   "{device, count} mappings")
            groups = []
            for j, item in enumerate(items):
                gpath = f"{path}.devices[{j}]"
                item = _mapping(item, gpath, "{device, count}")
                _check_keys(item, _GROUP_KEYS, gpath)
                groups.append((*_parse_group(item, gpath), f"{gpath}.device"))
        else:
            groups = [(*_parse_group(node, path), f"{path}.device")]
        for spec, _, spath in groups:
            other = names.setdefault(spec.name, (spec, spath))
            if other[0] != spec:
                raise ClusterError(f"{spath}: device name {spec.name!r} is already used by {other[1]} "
                                   "for a different spec; give each distinct device its own name")
        repeat = _positive_int(node["repeat"], f"{path}.repeat") if "repeat" in node else 1
        intra = (_positive_number(node["intra_bandwidth_GBps"], f"{path}.intra_bandwidth_GBps", "GB/s") * 1e9
                 if "intra_bandwidth_GBps" in node else None)
        total += repeat * sum(n for _, n, _ in groups)
        if total > MAX_DEVICES:
            raise ClusterError(f"{path}: the cluster reaches {total} devices here, more than "
                               f"{MAX_DEVICES}; check count and repeat")
        for _ in range(repeat):
            node_groups.append([(s, n) for s, n, _ in groups])
            node_intra.append(intra)
    return _assemble(name, node_groups, node_intra, net_bw, net_lat)


def _assemble(name: str, node_groups, node_intra, net_bw: float, net_lat: float) -> Cluster:
    devices = []
    for node, groups in enumerate(node_groups):
        local = 0
        for spec, count in groups:
            for _ in range(count):
                devices.append(Device(rank=len(devices), spec=spec, node=node, local_rank=local))
                local += 1
    return Cluster(name=name, devices=tuple(devices), num_nodes=len(node_groups),
                   network_bandwidth_Bps=net_bw, network_latency_s=net_lat,
                   node_intra_Bps=tuple(node_intra))


# -- serialisation helpers -----------------------------------------------------------------------

def _unscale(value: float, scale: float, divide: bool = False) -> float | int:
    """x such that ``x * scale == value`` exactly (the parser multiplies by ``scale``; with ``divide``
    it divides), so that ``to_dict`` round-trips through the parser bit for bit."""
    x = value * scale if divide else value / scale
    candidates = [x]
    lo = hi = x
    for _ in range(4):
        lo, hi = math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)
        candidates += [lo, hi]
    for c in candidates:
        if (c / scale if divide else c * scale) == value:
            return int(c) if c == int(c) and abs(c) < 2**53 else c
    raise ClusterError(f"cannot express {value!r} in units of {scale:g} exactly")


def _spec_to_schema(spec: DeviceSpec) -> str | dict:
    if PRESETS.get(spec.name) == spec:
        return spec.name
    if spec.is_emulated:
        d = {"name": spec.name, "emulate": spec.emulate, "speed": spec.speed,
             "memory_GB": _unscale(spec.memory_bytes, GiB)}
        if emulated_spec(spec.name, spec.speed, spec.memory_bytes) != spec:
            raise ClusterError(f"{spec.name}: an emulated spec with custom peak figures cannot be "
                               "written in the cluster schema")
        return d
    d = {"name": spec.name, "vendor": spec.vendor, "tflops": _unscale(spec.peak_flops_bf16, 1e12),
         "fp32_tflops": _unscale(spec.peak_flops_fp32, 1e12), "memory_GB": _unscale(spec.memory_bytes, GiB),
         "mem_bandwidth_GBps": _unscale(spec.mem_bandwidth_Bps, 1e9),
         "intra_bandwidth_GBps": _unscale(spec.intra_bandwidth_Bps, 1e9)}
    return d


# -- detection -----------------------------------------------------------------------------------

def _match_preset(device_name: str, memory_bytes: int) -> DeviceSpec | None:
    tokens = [t.upper() for t in re.split(r"[^A-Za-z0-9]+", device_name) if t]
    words = set(tokens) | {a + b for a, b in zip(tokens, tokens[1:])}
    best = None
    for spec in PRESETS.values():
        if spec.is_emulated:
            continue
        model = spec.name.rsplit("-", 1)[0].upper()
        if model in words and abs(memory_bytes - spec.memory_bytes) <= 0.1 * spec.memory_bytes:
            if best is None or len(spec.name) > len(best.name):
                best = spec
    return best


def _detect_gpu_specs() -> list[DeviceSpec]:
    import torch

    if not torch.cuda.is_available():
        return []
    specs = []
    vendor = "amd" if getattr(torch.version, "hip", None) else "nvidia"
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        spec = _match_preset(props.name, props.total_memory)
        if spec is None:
            # Unknown part: real memory, nominal compute (the cost model measures it).
            spec = DeviceSpec(name=re.sub(r"\s+", "-", props.name.strip()), vendor=vendor,
                              peak_flops_bf16=100e12, peak_flops_fp32=10e12,
                              memory_bytes=int(props.total_memory), mem_bandwidth_Bps=1000e9,
                              intra_bandwidth_Bps=PCIE4_X16_Bps)
        specs.append(spec)
    return specs
