"""Alpha-beta cost model of point-to-point transfers and collectives over the ranks of a cluster.

Terms
- link: the path between two ranks. Its kind is
  "intra"   both in one node and of one device family: NVLink / Infinity Fabric / PCIe peer-to-peer,
            or shared memory between two CPU processes;
  "network" in different nodes, same device family: the inter-node network (one NIC per device);
  "bridge"  different device families (CPU vs GPU, NVIDIA vs AMD vs another vendor): no common
            collective library, so the data is staged through host memory on both sides. Bandwidth is
            the slower side's host link (PCIe, or shared memory for a CPU), also bounded by the network
            when the two are in different nodes; latency is the intra or network latency plus
            ``LinkModel.bridge_latency_s``.
- device family: "cpu" for CPU and emulated devices, else the vendor ("nvidia", "amd"); vendor
  "other" devices form one family per device type (an unknown accelerator talks only to its own kind).
- alpha-beta: a message of n bytes over a link costs ``latency_s + n / bandwidth_Bps``.
- ring: ranks in the given order, each sending to the next and the last to the first. Every step
  moves one chunk over every link at once, so the slowest link bounds the bandwidth term and the
  largest latency is paid once per step.

Collectives take ``nbytes`` as the size of the full buffer on each rank (the unsharded tensor):
  allreduce       2 (n-1) steps of nbytes/n          (reduce-scatter then all-gather)
  reduce_scatter  (n-1) steps of nbytes/n            (each rank ends with nbytes/n reduced)
  allgather       (n-1) steps of nbytes/n            (each rank starts with nbytes/n)
  broadcast       pipelined along the ring: nbytes/bw + (n-1) latencies
A collective over one rank costs 0.

Algorithms (keyword ``algorithm``)
- "ring" (default): one flat ring over the ranks in the given order, as above.
- "hierarchical": ranks grouped by node (groups in order of first appearance): a ring inside every node
  (all nodes at once, the slowest one counts), then m rings across nodes at once, the j-th through
  the j-th rank of every node, each on a 1/m shard (m = the smallest group; every device has its own
  NIC, as in GPU clusters), then the intra-node ring again where the collective needs it. This is
  how NCCL's many channels reach m x the per-NIC bandwidth across nodes.
- "auto": the faster of the two (NCCL chooses its algorithm per size too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

from autopar.cluster.devices import PCIE4_X16_Bps, DeviceSpec
from autopar.errors import ClusterError

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = [
    "LinkModel", "DEFAULT_LINK", "LinkKind", "Algorithm", "link_kind", "family", "pair_bandwidth_Bps",
    "pair_latency_s", "ring_link", "p2p_time_s", "allreduce_time_s", "reduce_scatter_time_s",
    "allgather_time_s", "broadcast_time_s",
]

LinkKind = Literal["intra", "network", "bridge"]
Algorithm = Literal["ring", "hierarchical", "auto"]


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
                raise ValueError(f"LinkModel.{name}: {getattr(self, name)!r} must be >= 0")
        if not self.host_link_Bps > 0:
            raise ValueError(f"LinkModel.host_link_Bps: {self.host_link_Bps!r} must be > 0")
        if self.network_bandwidth_Bps is not None and not self.network_bandwidth_Bps > 0:
            raise ValueError(f"LinkModel.network_bandwidth_Bps: {self.network_bandwidth_Bps!r} must be > 0")
        if self.network_latency_s is not None and not self.network_latency_s >= 0:
            raise ValueError(f"LinkModel.network_latency_s: {self.network_latency_s!r} must be >= 0")
        if not 0 < self.bandwidth_efficiency <= 1:
            raise ValueError(f"LinkModel.bandwidth_efficiency: {self.bandwidth_efficiency!r} "
                             "must be in (0, 1]")


DEFAULT_LINK = LinkModel()


def family(spec: DeviceSpec) -> str:
    if spec.is_emulated or spec.vendor == "cpu":
        return "cpu"
    if spec.vendor == "other":
        return f"other:{spec.name}"
    return spec.vendor


def _check_rank(cluster: "Cluster", rank: int, what: str = "rank") -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(cluster.devices):
        raise ClusterError(f"{what}: {rank!r} is not a rank of cluster {cluster.name!r} "
                           f"(ranks 0..{len(cluster.devices) - 1})")


def link_kind(cluster: "Cluster", a: int, b: int) -> LinkKind:
    _check_rank(cluster, a)
    _check_rank(cluster, b)
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


def pair_bandwidth_Bps(cluster: "Cluster", a: int, b: int, link: LinkModel = DEFAULT_LINK) -> float:
    """Per-direction bandwidth between two ranks (infinite from a rank to itself)."""
    kind = link_kind(cluster, a, b)
    if a == b:
        return math.inf
    da, db = cluster.devices[a], cluster.devices[b]
    if kind == "intra":
        bw = cluster.node_intra_bandwidth_Bps(da.node, (da.spec, db.spec))
    elif kind == "network":
        bw = _network(cluster, link)[0]
    else:
        bw = min(_host_side_Bps(da.spec, link), _host_side_Bps(db.spec, link))
        if da.node != db.node:
            bw = min(bw, _network(cluster, link)[0])
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


def p2p_time_s(cluster: "Cluster", src: int, dst: int, nbytes: float,
               link: LinkModel = DEFAULT_LINK) -> float:
    _check_nbytes(nbytes)
    if src == dst:
        _check_rank(cluster, src, "src")
        return 0.0
    return pair_latency_s(cluster, src, dst, link) + nbytes / pair_bandwidth_Bps(cluster, src, dst, link)


def _check_nbytes(nbytes: float) -> None:
    if not (isinstance(nbytes, (int, float)) and not isinstance(nbytes, bool)) or not nbytes >= 0:
        raise ValueError(f"nbytes: {nbytes!r} must be a number >= 0")


def _ring(cluster: "Cluster", ranks: Sequence[int]) -> tuple[int, ...]:
    ranks = tuple(ranks)
    if not ranks:
        raise ValueError("ranks: empty; a collective needs at least one rank")
    for r in ranks:
        _check_rank(cluster, r, "ranks")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks: {ranks} repeats a rank")
    return ranks


def ring_link(cluster: "Cluster", ranks: Sequence[int],
              link: LinkModel = DEFAULT_LINK) -> tuple[float, float]:
    """(bandwidth_Bps of the slowest link, largest latency_s) of the ring over ``ranks`` in order."""
    ranks = _ring(cluster, ranks)
    if len(ranks) == 1:
        return math.inf, 0.0
    pairs = [(ranks[i], ranks[(i + 1) % len(ranks)]) for i in range(len(ranks))]
    bw = min(pair_bandwidth_Bps(cluster, a, b, link) for a, b in pairs)
    lat = max(pair_latency_s(cluster, a, b, link) for a, b in pairs)
    return bw, lat


def _ring_steps_time_s(cluster, ranks: tuple[int, ...], nbytes: float, steps_per_rank: int,
                       link: LinkModel) -> float:
    n = len(ranks)
    if n == 1:
        return 0.0
    bw, lat = ring_link(cluster, ranks, link)
    return steps_per_rank * (n - 1) * (lat + nbytes / n / bw)


def _node_groups(cluster, ranks: tuple[int, ...]) -> list[tuple[int, ...]]:
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(cluster.devices[r].node, []).append(r)
    return [tuple(g) for g in groups.values()]


def _hierarchical_time_s(cluster, groups: list[tuple[int, ...]], nbytes: float, intra_steps: int,
                         inter_steps: int, link: LinkModel) -> float:
    """``intra_steps`` intra-node ring passes (1 or 2) around ``inter_steps`` passes across nodes."""
    m = min(len(g) for g in groups)
    intra = max(_ring_steps_time_s(cluster, g, nbytes, 1, link) for g in groups)
    inter = max(_ring_steps_time_s(cluster, tuple(g[j] for g in groups), nbytes / m, inter_steps, link)
                for j in range(m))
    return intra_steps * intra + inter


def _collective_time_s(cluster, ranks, nbytes, ring_steps: int, intra_steps: int, inter_steps: int,
                       link: LinkModel, algorithm: str) -> float:
    _check_nbytes(nbytes)
    ranks = _ring(cluster, ranks)
    if algorithm not in ("ring", "hierarchical", "auto"):
        raise ValueError(f"algorithm: {algorithm!r} is not one of 'ring', 'hierarchical', 'auto'")
    if len(ranks) == 1:
        return 0.0
    ring = _ring_steps_time_s(cluster, ranks, nbytes, ring_steps, link)
    if algorithm == "ring":
        return ring
    groups = _node_groups(cluster, ranks)
    if len(groups) == 1 or len(groups) == len(ranks):
        return ring  # one node, or one rank per node: the hierarchy is the ring itself
    hier = _hierarchical_time_s(cluster, groups, nbytes, intra_steps, inter_steps, link)
    return hier if algorithm == "hierarchical" else min(ring, hier)


def allreduce_time_s(cluster: "Cluster", ranks: Sequence[int], nbytes: float,
                     link: LinkModel = DEFAULT_LINK, algorithm: Algorithm = "ring") -> float:
    """Allreduce of an ``nbytes`` buffer. Ring: 2 (n-1) / n * nbytes / bw + 2 (n-1) latencies;
    hierarchical: intra reduce-scatter, inter allreduce of 1/m shards, intra all-gather."""
    return _collective_time_s(cluster, ranks, nbytes, 2, 2, 2, link, algorithm)


def reduce_scatter_time_s(cluster: "Cluster", ranks: Sequence[int], nbytes: float,
                          link: LinkModel = DEFAULT_LINK, algorithm: Algorithm = "ring") -> float:
    """Reduce-scatter of an ``nbytes`` buffer into n shards. Ring: (n-1)/n * nbytes/bw + (n-1) latencies."""
    return _collective_time_s(cluster, ranks, nbytes, 1, 1, 1, link, algorithm)


def allgather_time_s(cluster: "Cluster", ranks: Sequence[int], nbytes: float,
                     link: LinkModel = DEFAULT_LINK, algorithm: Algorithm = "ring") -> float:
    """All-gather of n shards into an ``nbytes`` buffer. Ring: (n-1)/n * nbytes/bw + (n-1) latencies."""
    return _collective_time_s(cluster, ranks, nbytes, 1, 1, 1, link, algorithm)


def broadcast_time_s(cluster: "Cluster", ranks: Sequence[int], nbytes: float,
                     link: LinkModel = DEFAULT_LINK) -> float:
    """Pipelined ring broadcast from ``ranks[0]``: nbytes / bw + (n-1) latencies."""
    _check_nbytes(nbytes)
    ranks = _ring(cluster, ranks)
    n = len(ranks)
    if n == 1:
        return 0.0
    # A chain, not a ring: the link from the last rank back to the root carries nothing.
    chain = [(ranks[i], ranks[i + 1]) for i in range(n - 1)]
    bw = min(pair_bandwidth_Bps(cluster, a, b, link) for a, b in chain)
    lat = max(pair_latency_s(cluster, a, b, link) for a, b in chain)
    return (n - 1) * lat + nbytes / bw
