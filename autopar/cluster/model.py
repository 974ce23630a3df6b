"""The cluster model: which devices exist, how they are grouped into nodes, and the links between them.

Terms
- rank: a device's index in the cluster, 0..len-1, numbered node by node in file order, device by
  device inside a node.
- node: a machine; devices of one node talk over the intra-node link, devices of different nodes over
  the network (see ``autopar.cluster.links`` for link kinds, including host-staged "bridge" links).
- device type: the spec name (``DeviceSpec.name``). Within one cluster a name means one spec; two
  different specs under one name are an error. Emulated devices at different speeds are different
  types because they carry different names.
- local_rank: a device's index inside its node.

The schema of cluster files and dicts is ``autopar.cluster.schema``'s; detection is
``autopar.cluster.detect``'s; links are ``autopar.cluster.links``'.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from autopar.cluster import links
from autopar.cluster.detect import detect_gpu_specs
from autopar.cluster.devices import GiB, DeviceSpec, cpu_spec_detect
from autopar.cluster.schema import (
    DEFAULT_NETWORK_BANDWIDTH_Bps, DEFAULT_NETWORK_LATENCY_s, MAX_DEVICES, ClusterLayout, parse, parse_preset,
    parse_text, positive_int, spec_to_schema, unscale,
)
from autopar.errors import ClusterError

__all__ = [
    "DeviceSpec", "Device", "Cluster", "builtin", "builtin_names", "load", "DEFAULT_NETWORK_BANDWIDTH_Bps",
    "DEFAULT_NETWORK_LATENCY_s",
]

@dataclass(frozen=True, slots=True)
class Device:
    rank: int
    spec: DeviceSpec
    node: int
    local_rank: int

    def __repr__(self) -> str:
        return f"Device(rank={self.rank}, {self.spec.name}, node={self.node}, local_rank={self.local_rank})"


def _node_of(d: Device) -> int:
    return d.node


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    devices: tuple[Device, ...]
    num_nodes: int
    network_bandwidth_Bps: float = DEFAULT_NETWORK_BANDWIDTH_Bps
    network_latency_s: float = DEFAULT_NETWORK_LATENCY_s
    # Per node: the intra-node link given in the file (B/s), or None for the devices' default.
    node_intra_Bps: tuple[float | None, ...] = ()
    # Per node: its network bandwidth given in the file (its NICs together, shared by its devices' flows
    # to other nodes), or None: every device has its own NIC at ``network_bandwidth_Bps``.
    node_network_Bps: tuple[float | None, ...] = ()

    def __post_init__(self):
        devices = tuple(self.devices)
        object.__setattr__(self, "devices", devices)
        if not devices:
            raise ClusterError("devices: empty; a cluster needs at least one device")
        if not self.node_intra_Bps:
            object.__setattr__(self, "node_intra_Bps", (None,) * self.num_nodes)
        if not self.node_network_Bps:
            object.__setattr__(self, "node_network_Bps", (None,) * self.num_nodes)
        for field in ("node_intra_Bps", "node_network_Bps"):
            if len(getattr(self, field)) != self.num_nodes:
                raise ClusterError(f"{field}: {len(getattr(self, field))} entries for {self.num_nodes} nodes")
        if any(x is not None and not x > 0 for x in self.node_network_Bps):
            raise ClusterError(f"node_network_Bps: {self.node_network_Bps!r} must be > 0 where given")
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
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ClusterError(f"{path}: no such cluster file (built-in clusters: "
                               f"{', '.join(builtin_names())}; or see benchmarks/clusters/)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ClusterError(f"{path}: cannot read the cluster file: {e}") from None
        return _assemble(parse_text(text, path))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "") -> "Cluster":
        return _assemble(parse(d, source))

    @classmethod
    def homogeneous(cls, preset: str | DeviceSpec, count: int, per_node: int | None = None,
                    *, name: str | None = None, network_bandwidth_Bps: float = DEFAULT_NETWORK_BANDWIDTH_Bps,
                    network_latency_s: float = DEFAULT_NETWORK_LATENCY_s) -> "Cluster":
        """``count`` devices of one preset (or spec), ``per_node`` to a node (default: one node);
        when ``per_node`` does not divide ``count`` the last node holds the rest."""
        spec = preset if isinstance(preset, DeviceSpec) else parse_preset(preset, "preset")
        count = positive_int(count, "count")
        if count > MAX_DEVICES:
            raise ClusterError(f"count: {count} is more than {MAX_DEVICES} devices")
        per_node = count if per_node is None else positive_int(per_node, "per_node")
        sizes = [per_node] * (count // per_node) + ([count % per_node] if count % per_node else [])
        return _assemble(ClusterLayout(name or f"{spec.name}x{count}", tuple(((spec, n),) for n in sizes),
                                       (None,) * len(sizes), float(network_bandwidth_Bps),
                                       float(network_latency_s)))

    @classmethod
    def detect(cls) -> "Cluster":
        """This machine: its CUDA/ROCm GPUs (matched to a preset where the name and memory fit), else
        one CPU device at native speed (not emulated)."""
        specs = detect_gpu_specs()
        name, groups = ("local-gpu", tuple((s, 1) for s in specs)) if specs else \
            ("local-cpu", ((cpu_spec_detect(), 1),))
        return _assemble(ClusterLayout(name, (groups,), (None,), DEFAULT_NETWORK_BANDWIDTH_Bps,
                                       DEFAULT_NETWORK_LATENCY_s))

    def subset(self, ranks, *, name: str | None = None) -> "Cluster":
        """The sub-cluster of ``ranks`` (renumbered 0.. in rank order; nodes that keep a device keep
        their order, intra-node link and the network), e.g. one device type alone."""
        chosen = sorted(set(ranks))
        if not chosen or len(chosen) != len(list(ranks)):
            raise ClusterError(f"ranks: {list(ranks)!r} must be distinct ranks, at least one")
        for r in chosen:
            links.check_rank(self, r, "ranks")
        node_groups: list[list[tuple[DeviceSpec, int]]] = []
        node_intra: list[float | None] = []
        node_net: list[float | None] = []
        last = None
        for r in chosen:
            d = self.devices[r]
            if d.node != last:
                node_groups.append([])
                node_intra.append(self.node_intra_Bps[d.node])
                node_net.append(self.node_network_Bps[d.node])
                last = d.node
            groups = node_groups[-1]
            if groups and groups[-1][0] == d.spec:
                groups[-1] = (d.spec, groups[-1][1] + 1)
            else:
                groups.append((d.spec, 1))
        return _assemble(ClusterLayout(name or f"{self.name}[{len(chosen)}]",
                                       tuple(tuple(g) for g in node_groups), tuple(node_intra),
                                       self.network_bandwidth_Bps, self.network_latency_s, tuple(node_net)))

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
        # devices are in node order (checked on construction): a node's ranks are one run of them
        lo = bisect.bisect_left(self.devices, node, key=_node_of)
        hi = bisect.bisect_right(self.devices, node, lo=lo, key=_node_of)
        return tuple(range(lo, hi))

    def node_devices(self) -> tuple[tuple[Device, ...], ...]:
        """The devices of each node, node by node (one pass over the devices)."""
        return tuple(tuple(ds) for _, ds in itertools.groupby(self.devices, key=_node_of))

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
        return links.pair_bandwidth_Bps(self, a, b)

    def latency_s(self, a: int, b: int) -> float:
        return links.pair_latency_s(self, a, b)

    def link_kind(self, a: int, b: int) -> str:
        return links.link_kind(self, a, b)

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
            key = (tuple((s, n) for s, n in groups), self.node_intra_Bps[node], self.node_network_Bps[node])
            if key == prev:
                nodes[-1]["repeat"] = nodes[-1].get("repeat", 1) + 1
                continue
            prev = key
            if len(groups) == 1:
                entry = {"device": spec_to_schema(groups[0][0]), "count": groups[0][1]}
            else:
                entry = {"devices": [{"device": spec_to_schema(s), "count": n} for s, n in groups]}
            if self.node_intra_Bps[node] is not None:
                entry["intra_bandwidth_GBps"] = unscale(self.node_intra_Bps[node], 1e9)
            if self.node_network_Bps[node] is not None:
                entry["network_bandwidth_GBps"] = unscale(self.node_network_Bps[node], 1e9)
            nodes.append(entry)
        return {
            "name": self.name,
            "nodes": nodes,
            "network": {"bandwidth_GBps": unscale(self.network_bandwidth_Bps, 1e9),
                        "latency_us": unscale(self.network_latency_s, 1e6, divide=True)},
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
                         + (f"  emulated at {s.speed:g}x" if s.is_emulated
                            else "  native CPU" if s.vendor == "cpu" else ""))
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
    return _assemble(parse_text(path.read_text(encoding="utf-8"), f"<builtin {name}>"))


def _assemble(layout: ClusterLayout) -> Cluster:
    """Number a layout's devices into ranks: node by node, device by device."""
    devices = []
    for node, groups in enumerate(layout.node_groups):
        local = 0
        for spec, count in groups:
            for _ in range(count):
                devices.append(Device(rank=len(devices), spec=spec, node=node, local_rank=local))
                local += 1
    return Cluster(name=layout.name, devices=tuple(devices), num_nodes=len(layout.node_groups),
                   network_bandwidth_Bps=layout.network_bandwidth_Bps,
                   network_latency_s=layout.network_latency_s, node_intra_Bps=layout.node_intra_Bps,
                   node_network_Bps=layout.node_network_Bps)
