"""Links between the ranks of a cluster: what kind each is, its bandwidth and its latency.

Terms
- link: the path between two ranks. Its kind is
  "intra"   both in one node and of one device family: NVLink / Infinity Fabric / PCIe peer-to-peer,
            or shared memory between two CPU processes;
  "network" in different nodes, same device family: the inter-node network: one NIC per device at
            the network's bandwidth, or where a node declares its own ``network_bandwidth_GBps``,
            that node's NICs together, shared by the flows its devices send (or receive) at once
            (``node_flow_Bps``: ``autopar.cost.comm`` counts the flows of a ring, and of the rings a
            caller says run at once);
  "bridge"  different device families (CPU vs GPU, NVIDIA vs AMD vs another vendor): no common
            collective library, so the data is staged through host memory on both sides. Bandwidth is
            the slower side's host link (PCIe, or shared memory for a CPU), also bounded by the network
            when the two are in different nodes; latency is the intra or network latency plus
            ``LinkModel.bridge_latency_s``.
- device family: "cpu" for CPU and emulated devices, else the vendor ("nvidia", "amd"); vendor
  "other" devices form one family per device type (an unknown accelerator talks only to its own kind).

- emulated link (``EmulatedLink``): what gloo really achieves between the emulated CPU ranks of one
  node on this machine, measured once per machine and core layout (``autopar.cost.calibrate.
  measure_emulated_link``): per operation (all-reduce, all-gather, reduce-scatter, broadcast,
  point-to-point) its own latency and bandwidth (alpha-beta), the pair that makes
  ``autopar.cost.comm``'s formula for that operation fit the times measured at several message sizes.
  Gloo's operations differ several-fold on one machine, in latency as much as in bandwidth (a
  broadcast's step costs a fraction of an all-reduce's), so one figure cannot price them all. It is the
  default link between ``emulate: cpu`` devices of a node whose cluster file declares no
  ``intra_bandwidth_GBps``: a cluster carries it once ``autopar.cluster.emulation.with_emulated_link``
  attached it (the planner's clusters do: ``autopar.cost.calibrate.calibrated_cluster``). GPU and
  native-CPU links never use it.

Bandwidths are per direction, in bytes per second; latencies in seconds. The time of a transfer or a
collective over these links is ``autopar.cost.comm``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from autopar.cluster.devices import PCIE4_X16_Bps, DeviceSpec
from autopar.errors import ClusterError

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = [
    "LinkModel", "DEFAULT_LINK", "EmulatedLink", "LINK_OPS", "emulated_link_of", "LinkKind", "family", "check_rank",
    "link_kind", "pair_bandwidth_Bps", "pair_latency_s", "node_flow_Bps", "network_edge_Bps",
]

LinkKind = Literal["intra", "network", "bridge"]


@dataclass(frozen=True, slots=True)
class LinkModel:
    """Parameters of the link model; replace with measured figures where known."""
    intra_latency_s: float = 3e-6            # NVLink / PCIe peer-to-peer hop (NCCL's few us)
    cpu_intra_latency_s: float = 30e-6       # gloo between two processes of one machine
    bridge_latency_s: float = 20e-6          # extra for a host-staged copy (two PCIe hops + sync)
    host_link_Bps: float = PCIE4_X16_Bps     # a GPU's PCIe link to host, per direction
    network_bandwidth_Bps: float | None = None   # None: the cluster's figure
    network_latency_s: float | None = None       # None: the cluster's figure
    bandwidth_efficiency: float = 1.0        # achieved / nominal bandwidth, all links

    def __post_init__(self):
        for name in ("intra_latency_s", "cpu_intra_latency_s", "bridge_latency_s"):
            if not getattr(self, name) >= 0:
                raise ClusterError(f"LinkModel.{name}: {getattr(self, name)!r} must be >= 0")
        if not self.host_link_Bps > 0:
            raise ClusterError(f"LinkModel.host_link_Bps: {self.host_link_Bps!r} must be > 0")
        if self.network_bandwidth_Bps is not None and not self.network_bandwidth_Bps > 0:
            raise ClusterError(f"LinkModel.network_bandwidth_Bps: {self.network_bandwidth_Bps!r} must be > 0")
        if self.network_latency_s is not None and not self.network_latency_s >= 0:
            raise ClusterError(f"LinkModel.network_latency_s: {self.network_latency_s!r} must be >= 0")
        if not 0 < self.bandwidth_efficiency <= 1:
            raise ClusterError(f"LinkModel.bandwidth_efficiency: {self.bandwidth_efficiency!r} "
                             "must be in (0, 1]")


DEFAULT_LINK = LinkModel()

LINK_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")


def _latency_ok(x: float) -> bool:
    return x >= 0 and math.isfinite(x)


def _per_op(name: str, value, check) -> tuple[tuple[str, float], ...]:
    """``value`` (a number for every op, or (op, figure) pairs / a dict) as (op, float) pairs in
    ``LINK_OPS`` order, each figure checked by ``check``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        ops = {op: float(value) for op in LINK_OPS}
    else:
        ops = {str(op): float(v) for op, v in (value.items() if isinstance(value, dict) else value)}
    missing = [op for op in LINK_OPS if op not in ops]
    if missing:
        raise ClusterError(f"EmulatedLink.{name}: no figure for {', '.join(missing)}")
    bad = [op for op in LINK_OPS if not check(ops[op])]
    if bad:
        raise ClusterError(f"EmulatedLink.{name}: {', '.join(bad)} out of range ({ {op: ops[op] for op in bad} })")
    return tuple((op, ops[op]) for op in LINK_OPS)


@dataclass(frozen=True, slots=True)
class EmulatedLink:
    """The measured link between the emulated CPU ranks of a node (see the module docstring).
    ``latency_s``: seconds of one message step, per operation as (operation, seconds) pairs for every
    one of ``LINK_OPS`` (normalised to ``LINK_OPS`` order), or one number for every operation (kept as
    given); ``bandwidth_Bps``: (operation, bytes/s) pairs likewise. ``latency(op)`` reads either."""
    latency_s: float | tuple[tuple[str, float], ...]
    bandwidth_Bps: tuple[tuple[str, float], ...]   # (operation, bytes/s) for every one of LINK_OPS
    nodes: tuple[int, ...] = ()                     # the nodes it applies to (no declared intra link)
    layout: str = ""                                # the core layout it was measured under, e.g. "0|1|1"

    def __post_init__(self):
        if isinstance(self.latency_s, (int, float)) and not isinstance(self.latency_s, bool):
            if not _latency_ok(self.latency_s):
                raise ClusterError(f"EmulatedLink.latency_s: {self.latency_s!r} must be a finite number >= 0")
            object.__setattr__(self, "latency_s", float(self.latency_s))
        else:
            object.__setattr__(self, "latency_s", _per_op("latency_s", self.latency_s, _latency_ok))
        object.__setattr__(self, "bandwidth_Bps", _per_op("bandwidth_Bps", self.bandwidth_Bps, lambda x: x > 0))
        object.__setattr__(self, "nodes", tuple(self.nodes))

    def latency(self, op: str) -> float:
        return self.latency_s if isinstance(self.latency_s, float) else dict(self.latency_s)[op]

    def bandwidth(self, op: str) -> float:
        return dict(self.bandwidth_Bps)[op]

    def scaled(self, factor: float) -> "EmulatedLink":
        """This link with every operation ``factor`` times slower (a calibrated ``comm`` factor): its
        latencies multiplied and its bandwidths divided, so every time priced on it is multiplied."""
        return EmulatedLink(tuple((op, self.latency(op) * factor) for op in LINK_OPS),
                            tuple((op, bw / factor) for op, bw in self.bandwidth_Bps), self.nodes, self.layout)

    def to_json(self) -> dict:
        lat = self.latency_s if isinstance(self.latency_s, float) else dict(self.latency_s)
        return {"latency_s": lat, "bandwidth_Bps": dict(self.bandwidth_Bps), "layout": self.layout}

    @classmethod
    def from_json(cls, d: dict, nodes: tuple[int, ...] = ()) -> "EmulatedLink":
        return cls(d["latency_s"], d["bandwidth_Bps"], tuple(nodes), str(d.get("layout", "")))


def emulated_link_of(cluster: "Cluster", ranks) -> EmulatedLink | None:
    """The measured link that prices a collective or transfer over ``ranks``: the one ``cluster``
    carries (``emulated_link``), when every rank is an emulated device of one node it applies to;
    else None (the nominal link model)."""
    link = getattr(cluster, "emulated_link", None)
    if link is None:
        return None
    devices = cluster.devices
    node = devices[ranks[0]].node
    if node not in link.nodes:
        return None
    for r in ranks:
        d = devices[r]
        if d.node != node or not d.spec.is_emulated:
            return None
    return link


def family(spec: DeviceSpec) -> str:
    """The device family of ``spec`` (see the module docstring): who can talk to whom directly."""
    if spec.is_emulated or spec.vendor == "cpu":
        return "cpu"
    if spec.vendor == "other":
        return f"other:{spec.name}"
    return spec.vendor


def check_rank(cluster: "Cluster", rank: int, what: str = "rank") -> None:
    """``ClusterError`` naming ``what`` unless ``rank`` is a rank of ``cluster``."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(cluster.devices):
        raise ClusterError(f"{what}: {rank!r} is not a rank of cluster {cluster.name!r} "
                           f"(ranks 0..{len(cluster.devices) - 1})")


def link_kind(cluster: "Cluster", a: int, b: int) -> LinkKind:
    """The kind of the link between ranks ``a`` and ``b``."""
    check_rank(cluster, a)
    check_rank(cluster, b)
    da, db = cluster.devices[a], cluster.devices[b]
    if family(da.spec) != family(db.spec):
        return "bridge"
    return "intra" if da.node == db.node else "network"


def _host_side_Bps(spec: DeviceSpec, link: LinkModel) -> float:
    if family(spec) == "cpu":
        return spec.intra_bandwidth_Bps
    return min(spec.intra_bandwidth_Bps, link.host_link_Bps)


def _network(cluster: "Cluster", link: LinkModel) -> tuple[float, float]:
    bw, lat = link.network_bandwidth_Bps, link.network_latency_s
    bw = cluster.network_bandwidth_Bps if bw is None else bw
    lat = cluster.network_latency_s if lat is None else lat
    return bw, lat


def node_flow_Bps(cluster: "Cluster", node: int, flows: int = 1, link: LinkModel = DEFAULT_LINK) -> float:
    """Per-direction network bandwidth of one of ``flows`` flows that leave (or enter) ``node`` at once:
    its declared network bandwidth over the flows, or the network's per-device bandwidth where the node
    declares none (each device its own NIC, so a device's one flow has it whole)."""
    nic = cluster.node_network_Bps[node]
    return _network(cluster, link)[0] if nic is None else nic / max(flows, 1)


def network_edge_Bps(cluster: "Cluster", src_node: int, dst_node: int, out_flows: int = 1, in_flows: int = 1,
                     link: LinkModel = DEFAULT_LINK) -> float:
    """Per-direction bandwidth of one flow from ``src_node`` to ``dst_node`` while ``out_flows`` leave the
    one and ``in_flows`` enter the other (``node_flow_Bps`` on each side), before link efficiency."""
    return min(node_flow_Bps(cluster, src_node, out_flows, link), node_flow_Bps(cluster, dst_node, in_flows, link))


def pair_bandwidth_Bps(cluster: "Cluster", a: int, b: int, link: LinkModel = DEFAULT_LINK) -> float:
    """Per-direction bandwidth between two ranks (infinite from a rank to itself); across nodes, of one
    flow alone (``node_flow_Bps``)."""
    kind = link_kind(cluster, a, b)
    if a == b:
        return math.inf
    da, db = cluster.devices[a], cluster.devices[b]
    if kind == "intra":
        bw = cluster.node_intra_bandwidth_Bps(da.node, (da.spec, db.spec))
    elif kind == "network":
        bw = network_edge_Bps(cluster, da.node, db.node, link=link)
    else:
        bw = min(_host_side_Bps(da.spec, link), _host_side_Bps(db.spec, link))
        if da.node != db.node:
            bw = min(bw, network_edge_Bps(cluster, da.node, db.node, link=link))
    return bw * link.bandwidth_efficiency


def pair_latency_s(cluster: "Cluster", a: int, b: int, link: LinkModel = DEFAULT_LINK) -> float:
    """One-message latency between two ranks (0 from a rank to itself)."""
    kind = link_kind(cluster, a, b)
    if a == b:
        return 0.0
    da, db = cluster.devices[a], cluster.devices[b]
    cpu = family(da.spec) == "cpu" and family(db.spec) == "cpu"
    base = _network(cluster, link)[1] if da.node != db.node else (
        link.cpu_intra_latency_s if cpu else link.intra_latency_s)
    return base + (link.bridge_latency_s if kind == "bridge" else 0.0)
