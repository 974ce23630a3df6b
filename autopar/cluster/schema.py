"""The cluster schema: parsing and validating a cluster file (YAML) or dict, and writing a cluster back.

The parser checks every field and raises ``ClusterError`` naming its path (``nodes[1].device.speed``)
and value; it returns a ``ClusterLayout`` (the devices node by node, the links), which
``autopar.cluster.model.Cluster`` numbers into ranks. Nothing is half-built.

Schema (YAML or dict; see shared/spec/api.md)::

    name: a100-v100                 # optional
    nodes:
      - device: A100-80GB           # a preset name (case-insensitive) ...
        count: 8                    # devices in this node
        repeat: 2                   # optional: this many identical nodes (default 1)
        intra_bandwidth_GBps: 300   # optional: device-to-device inside the node (default: preset)
        network_bandwidth_GBps: 50  # optional: the node's NICs together, shared by its devices' flows to
                                    # other nodes (default: every device has its own NIC at the network's)
      - device: {name: accel-a, tflops: 280, memory_GB: 64, mem_bandwidth_GBps: 1600}
        count: 8                    # custom; optional fp32_tflops, vendor, intra_bandwidth_GBps
      - device: {name: slow, emulate: cpu, speed: 0.5, memory_GB: 2}
        count: 1                    # an emulated device: a CPU process at `speed` x this CPU
      - device: {name: hot, emulate: cpu, speed: 1.0, actual_speed: 0.5, memory_GB: 2}
        count: 1                    # declared (and planned) at 1.0, but its clock runs it at 0.5: a
                                    # throttled or shared device, for calibration and re-planning
      - device: cpu                 # the preset CPU: this machine's CPU at native speed, not emulated
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
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from autopar.cluster.devices import GiB, PCIE4_X16_Bps, PRESETS, VENDORS, DeviceSpec, emulated_spec, preset
from autopar.errors import ClusterError, quoted

__all__ = [
    "ClusterLayout", "parse", "parse_text", "parse_preset", "positive_int", "spec_to_schema", "unscale",
    "DEFAULT_NETWORK_BANDWIDTH_Bps", "DEFAULT_NETWORK_LATENCY_s", "MAX_DEVICES",
]

DEFAULT_NETWORK_BANDWIDTH_Bps = 12.5e9  # 100 Gb/s per device (InfiniBand EDR / 100GbE)
DEFAULT_NETWORK_LATENCY_s = 10e-6
MAX_DEVICES = 1 << 16  # a typo guard (count: 80000), far above any cluster we plan for

_TOP_KEYS = ("name", "nodes", "network")
_NODE_KEYS = ("device", "count", "repeat", "intra_bandwidth_GBps", "network_bandwidth_GBps", "devices")
_GROUP_KEYS = ("device", "count")
_NETWORK_KEYS = ("bandwidth_GBps", "latency_us")
_CUSTOM_KEYS = ("name", "tflops", "memory_GB", "mem_bandwidth_GBps", "fp32_tflops", "vendor",
                "intra_bandwidth_GBps")
_CUSTOM_REQUIRED = ("name", "tflops", "memory_GB", "mem_bandwidth_GBps")
_EMULATED_KEYS = ("name", "emulate", "speed", "memory_GB", "actual_speed")
_EMULATED_REQUIRED = ("name", "emulate", "speed", "memory_GB")


@dataclass(frozen=True, slots=True)
class ClusterLayout:
    """A parsed cluster before ranks are numbered: per node, its (device spec, count) groups in order."""
    name: str
    node_groups: tuple[tuple[tuple[DeviceSpec, int], ...], ...]
    node_intra_Bps: tuple[float | None, ...]   # per node: the file's intra-node link, or None
    network_bandwidth_Bps: float
    network_latency_s: float
    node_network_Bps: tuple[float | None, ...] = ()   # per node: the file's node network figure, or None


# -- parsing -------------------------------------------------------------------------------------

def parse_text(text: str, source: str) -> ClusterLayout:
    """The layout of a cluster file's text (``source`` names it in errors)."""
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
    return parse(d, source)


def _err(source: str, msg: str) -> ClusterError:
    return ClusterError(f"{source}: {msg}" if source else msg)


def parse(d: Any, source: str = "") -> ClusterLayout:
    """The layout of a cluster dict in the schema above."""
    try:
        return _parse(d)
    except ClusterError as e:
        raise _err(source, str(e)) from None


def _check_keys(d: Mapping, allowed: tuple[str, ...], path: str) -> None:
    for key in d:
        if key not in allowed:
            plain = (key if isinstance(key, str) and 0 < len(key) <= 40 and key.isprintable() and " " not in key
                     else quoted(key))
            close = difflib.get_close_matches(plain, allowed, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(allowed)}"
            where = f"{path}.{plain}" if path else plain
            raise ClusterError(f"{where}: unknown key {quoted(key)}; {hint}")


def _mapping(value: Any, path: str, what: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ClusterError(f"{path or 'cluster'}: {quoted(value)} is not a mapping; expected {what}")
    return value


def _is_number(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:   # an int beyond any float: 10**400
        return False


def _scaled(value: float, scale: float, path: str, unit: str) -> float:
    """``value * scale`` (a unit conversion), or ``ClusterError`` at ``path`` where that leaves the
    finite floats (``bandwidth_GBps: 1e300`` is 1e309 B/s: infinite, not fast)."""
    out = value * scale
    if not math.isfinite(out) or out <= 0:
        raise ClusterError(f"{path}: {quoted(value)} is out of range ({unit}); give a finite figure of the "
                           "device or link")
    return out


def positive_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ClusterError(f"{path}: {quoted(value)} is not a positive integer")
    return value


def _positive_number(value: Any, path: str, unit: str = "", scale: float = 1.0) -> float:
    """``value`` x ``scale`` (its unit's conversion), checked positive and finite before and after."""
    if not _is_number(value) or value <= 0:
        raise ClusterError(f"{path}: {quoted(value)} is not a positive number{unit and ' (' + unit + ')'}")
    return _scaled(float(value), scale, path, unit)


def _nonneg_number(value: Any, path: str, unit: str = "") -> float:
    if not _is_number(value) or value < 0:
        raise ClusterError(f"{path}: {quoted(value)} is not a number >= 0{unit and ' (' + unit + ')'}")
    return float(value)


def _name(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ClusterError(f"{path}: {quoted(value)} is not a non-empty name")
    return value.strip()


def parse_preset(name: Any, path: str) -> DeviceSpec:
    """The preset ``name`` (case-insensitive), or ``ClusterError`` at ``path`` with the closest name."""
    if not isinstance(name, str):
        raise ClusterError(f"{path}: {quoted(name)} is not a preset name or a device mapping")
    try:
        return preset(name)
    except KeyError:
        lower = {k.lower(): k for k in PRESETS}
        close = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.4)
        hint = f"did you mean {lower[close[0]]!r}? " if close else ""
        raise ClusterError(f"{path}: unknown device preset {quoted(name)}; {hint}"
                           f"presets: {', '.join(PRESETS)}; or give a custom mapping "
                           "{name, tflops, memory_GB, mem_bandwidth_GBps}") from None


def _memory_bytes(value: Any, path: str) -> int:
    gb = _positive_number(value, path, "GB of device memory")
    mem = int(round(_scaled(gb, GiB, path, "GB of device memory")))
    if mem <= 0:
        raise ClusterError(f"{path}: {quoted(value)} is too small")
    return mem


def _parse_device(value: Any, path: str) -> DeviceSpec:
    if not isinstance(value, Mapping):
        return parse_preset(value, path)
    if "emulate" in value:
        _check_keys(value, _EMULATED_KEYS, path)
        for key in _EMULATED_REQUIRED:
            if key not in value:
                raise ClusterError(f"{path}.{key}: missing; an emulated device needs "
                                   f"{', '.join(_EMULATED_REQUIRED)}")
        if value["emulate"] != "cpu":
            raise ClusterError(f"{path}.emulate: {quoted(value['emulate'])} is not supported; use 'cpu'")
        speed = value["speed"]
        if not _is_number(speed) or not 0 < speed <= 1:
            raise ClusterError(f"{path}.speed: {quoted(speed)} must be a number in (0, 1] "
                               "(the fraction of this CPU's speed)")
        spec = emulated_spec(_name(value["name"], f"{path}.name"), float(speed),
                             _memory_bytes(value["memory_GB"], f"{path}.memory_GB"))
        if "actual_speed" in value:
            actual = value["actual_speed"]
            if not _is_number(actual) or not 0 < actual <= 1:
                raise ClusterError(f"{path}.actual_speed: {quoted(actual)} must be a number in (0, 1] (the speed "
                                   "the device really runs at; the planner sees speed)")
            spec = replace(spec, actual_speed=float(actual))
        return spec
    _check_keys(value, _CUSTOM_KEYS, path)
    for key in _CUSTOM_REQUIRED:
        if key not in value:
            raise ClusterError(f"{path}.{key}: missing; a custom device needs "
                               f"{', '.join(_CUSTOM_REQUIRED)} (or use a preset name, or "
                               "'emulate: cpu' for an emulated device)")
    name = _name(value["name"], f"{path}.name")
    flops = _positive_number(value["tflops"], f"{path}.tflops", "dense bf16/fp16 TFLOP/s", 1e12)
    fp32 = (_positive_number(value["fp32_tflops"], f"{path}.fp32_tflops", "TFLOP/s", 1e12)
            if "fp32_tflops" in value else flops / 16)
    vendor = value.get("vendor", "other")
    if vendor not in VENDORS:
        raise ClusterError(f"{path}.vendor: {quoted(vendor)} is not one of {', '.join(VENDORS)}")
    intra = (_positive_number(value["intra_bandwidth_GBps"], f"{path}.intra_bandwidth_GBps", "GB/s", 1e9)
             if "intra_bandwidth_GBps" in value else PCIE4_X16_Bps)
    return DeviceSpec(
        name=name, vendor=vendor, peak_flops_bf16=flops, peak_flops_fp32=fp32,
        memory_bytes=_memory_bytes(value["memory_GB"], f"{path}.memory_GB"),
        mem_bandwidth_Bps=_positive_number(value["mem_bandwidth_GBps"], f"{path}.mem_bandwidth_GBps",
                                           "GB/s", 1e9),
        intra_bandwidth_Bps=intra,
    )


def _parse_group(item: Mapping, path: str) -> tuple[DeviceSpec, int]:
    if "device" not in item:
        raise ClusterError(f"{path}.device: missing; give a preset name or a device mapping")
    if "count" not in item:
        raise ClusterError(f"{path}.count: missing; give the number of devices, e.g. count: 8")
    return _parse_device(item["device"], f"{path}.device"), positive_int(item["count"], f"{path}.count")


def _parse(d: Any) -> ClusterLayout:
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
        raise ClusterError(f"nodes: {quoted(nodes)} is not a list of nodes")
    if not nodes:
        raise ClusterError("nodes: [] is empty; a cluster needs at least one node")
    network = _mapping(d.get("network", {}) or {}, "network", "{bandwidth_GBps, latency_us}")
    _check_keys(network, _NETWORK_KEYS, "network")
    net_bw = (_positive_number(network["bandwidth_GBps"], "network.bandwidth_GBps", "GB/s", 1e9)
              if "bandwidth_GBps" in network else DEFAULT_NETWORK_BANDWIDTH_Bps)
    net_lat = (_nonneg_number(network["latency_us"], "network.latency_us", "microseconds") / 1e6
               if "latency_us" in network else DEFAULT_NETWORK_LATENCY_s)

    node_groups: list[list[tuple[DeviceSpec, int]]] = []
    node_intra: list[float | None] = []
    node_net: list[float | None] = []
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
                raise ClusterError(f"{path}.devices: {quoted(items)} is not a non-empty list of "
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
                raise ClusterError(f"{spath}: device name {quoted(spec.name)} is already used by {other[1]} "
                                   "for a different spec; give each distinct device its own name")
        repeat = positive_int(node["repeat"], f"{path}.repeat") if "repeat" in node else 1
        intra = (_positive_number(node["intra_bandwidth_GBps"], f"{path}.intra_bandwidth_GBps", "GB/s", 1e9)
                 if "intra_bandwidth_GBps" in node else None)
        nic = (_positive_number(node["network_bandwidth_GBps"], f"{path}.network_bandwidth_GBps", "GB/s", 1e9)
               if "network_bandwidth_GBps" in node else None)
        total += repeat * sum(n for _, n, _ in groups)
        if total > MAX_DEVICES:
            raise ClusterError(f"{path}: the cluster reaches {quoted(total)} devices here, more than "
                               f"{MAX_DEVICES}; check count and repeat")
        for _ in range(repeat):
            node_groups.append([(s, n) for s, n, _ in groups])
            node_intra.append(intra)
            node_net.append(nic)
    return ClusterLayout(name, tuple(tuple(g) for g in node_groups), tuple(node_intra), net_bw, net_lat,
                         tuple(node_net))


# -- serialisation helpers -----------------------------------------------------------------------

def unscale(value: float, scale: float, divide: bool = False) -> float | int:
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
    raise ClusterError(f"cannot express {quoted(value)} in units of {scale:g} exactly")


def spec_to_schema(spec: DeviceSpec) -> str | dict:
    """A device's schema form: its preset name, or the custom / emulated mapping."""
    if PRESETS.get(spec.name) == spec:
        return spec.name
    if spec.is_emulated:
        d = {"name": spec.name, "emulate": spec.emulate, "speed": spec.speed,
             "memory_GB": unscale(spec.memory_bytes, GiB)}
        if spec.actual_speed is not None:
            d["actual_speed"] = spec.actual_speed
        if replace(emulated_spec(spec.name, spec.speed, spec.memory_bytes), actual_speed=spec.actual_speed) != spec:
            raise ClusterError(f"{spec.name}: an emulated spec with custom peak figures cannot be "
                               "written in the cluster schema")
        return d
    d = {"name": spec.name, "vendor": spec.vendor, "tflops": unscale(spec.peak_flops_bf16, 1e12),
         "fp32_tflops": unscale(spec.peak_flops_fp32, 1e12), "memory_GB": unscale(spec.memory_bytes, GiB),
         "mem_bandwidth_GBps": unscale(spec.mem_bandwidth_Bps, 1e9),
         "intra_bandwidth_GBps": unscale(spec.intra_bandwidth_Bps, 1e9)}
    return d
