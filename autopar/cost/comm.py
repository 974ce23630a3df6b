"""Alpha-beta cost model of point-to-point transfers and collectives over the ranks of a cluster.

Terms
- link, link kind, device family: see ``autopar.cluster.links`` (re-exported here: ``LinkModel``,
  ``DEFAULT_LINK``, ``LinkKind``, ``family``, ``link_kind``, ``pair_bandwidth_Bps``, ``pair_latency_s``).
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
- shared node networks: where a node declares its network (``network_bandwidth_GBps``: its NICs
  together), the flows that leave it at once share it, and those that enter it: a ring's cross-node
  edges out of (into) each node, times the rings a caller runs at once (``concurrent``: a stage's TP
  positions' data-parallel rings, the hierarchical algorithm's m rings, a pipeline boundary's member
  links). A node that declares none keeps one NIC per device.
- "auto": the faster of the two (NCCL chooses its algorithm per size too).

ZeRO collectives as the data-parallel engine runs them (``autopar.runtime.dp_flat``), on one *unit*
(a flat buffer of ``numel`` elements of ``element_size`` bytes, sharded by ``shares`` into contiguous
shards by largest remainder, as ``autopar.runtime.dp_flat.shard_bounds``):
  zero_gather_s          even shards: one all-gather in place; uneven shards: one broadcast per owner
                         of a non-empty shard, of that shard, from the owner (``zero_shards_even``)
  zero_reduce_scatter_s  rounds of reduce-scatters through a staging buffer of ``positions x c``
                         elements (``autopar.ir.costs.zero_staging_numel``), each padded to the full
                         staging buffer: ceil(largest shard / c) rounds, each paying its latencies
  zero_units             the units a step gathers and reduce-scatters: one of every parameter, or
                         under ZeRO-3 one per block with parameters (forward and backward gathers)
  zero_collectives       the per-step and per-round seconds of a ZeRO stage over all of them (the
                         planner's ``zero_comm`` and ``autopar.cost.step.predicted_phases`` both read it)
The data-parallel engine's all-reduces (``dp_allreduces``): under ZeRO 0/1 the flat gradient, in
buckets of at most ``grad_bucket_bytes`` with overlap (``autopar.runtime.dp_overlap``;
packed from the blocks' gradients as the engine packs parameters, ``grad_buckets``; each bucket pays
its latencies), in one all-reduce without;
under every stage the step's loss sum (``LOSS_BYTES``, one float64), which every engine all-reduces
over its ranks once per step (``loss_allreduce_s``; the pipeline engine over all its ranks too).

Emulated links: between the emulated CPU ranks of a node whose cluster file declares no intra-node
link, a cluster that carries a measured ``EmulatedLink`` (``autopar.cluster.links``; the planner's do)
prices each operation with that operation's measured latency and bandwidth, in the same formulas.
Every other link, GPU links above all, is priced as before.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

import numpy as np

from autopar.config import GRAD_BUCKET_BYTES, UNHIDDEN_BUCKET_BYTES
from autopar.cluster.links import (
    DEFAULT_LINK, LinkKind, LinkModel, check_rank, emulated_link_of, family, link_kind, network_edge_Bps,
    pair_bandwidth_Bps, pair_latency_s,
)
from autopar.errors import ClusterError
from autopar.ir.costs import ModelCosts, bucket_ranges, zero_shard_numels, zero_staging_numel

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = [
    "LinkModel", "DEFAULT_LINK", "LinkKind", "Algorithm", "link_kind", "family", "pair_bandwidth_Bps",
    "pair_latency_s", "ring_link", "p2p_time_s", "allreduce_time_s", "reduce_scatter_time_s",
    "allgather_time_s", "broadcast_time_s", "zero_shard_sizes", "zero_shards_even", "zero_gather_s",
    "zero_reduce_scatter_rounds", "zero_reduce_scatter_s", "zero_units", "ZeroCollectives", "zero_collectives",
    "LOSS_BYTES", "loss_allreduce_s", "grad_buckets", "DpAllReduces", "dp_allreduces", "dp_bucket_restarts_s", "dp_comm_hides",
    "grad_bucket_bytes", "distinct_rings", "cluster_memo",
]

Algorithm = Literal["ring", "hierarchical", "auto"]


def p2p_time_s(cluster: "Cluster", src: int, dst: int, nbytes: float,
               link: LinkModel = DEFAULT_LINK, *, concurrent: int = 1) -> float:
    """One transfer of ``nbytes`` from ``src`` to ``dst``, ``concurrent`` such transfers leaving the
    source's node and entering the destination's at once (they share a node's declared network)."""
    _check_nbytes(nbytes)
    if src == dst:
        check_rank(cluster, src, "src")
        return 0.0
    check_rank(cluster, src, "src")
    check_rank(cluster, dst, "dst")
    measured = emulated_link_of(cluster, (src, dst))
    if measured is not None:
        return measured.latency("p2p") + nbytes / measured.bandwidth("p2p")
    bw = pair_bandwidth_Bps(cluster, src, dst, link)
    a, b = cluster.devices[src].node, cluster.devices[dst].node
    if concurrent > 1 and a != b:
        bw = min(bw, link.bandwidth_efficiency * network_edge_Bps(cluster, a, b, concurrent, concurrent, link))
    return pair_latency_s(cluster, src, dst, link) + nbytes / bw


def _check_nbytes(nbytes: float) -> None:
    if not (isinstance(nbytes, (int, float)) and not isinstance(nbytes, bool)) or not nbytes >= 0:
        raise ValueError(f"nbytes: {nbytes!r} must be a number >= 0")


def _ring(cluster: "Cluster", ranks: Sequence[int]) -> tuple[int, ...]:
    """``ranks`` as a tuple, checked (ranks of ``cluster``, none twice) once per cluster object: the
    rings checked before are remembered with ``ring_link``'s memo."""
    ranks = tuple(ranks)
    checked = _ring_memo_entry(cluster)[2]
    if ranks in checked and set(map(type, ranks)) == _INT_TYPE:   # (True, 2) == (1, 2): ints only
        return ranks
    if not ranks:
        raise ClusterError("ranks: empty; a collective needs at least one rank")
    if not (set(map(type, ranks)) == _INT_TYPE and 0 <= min(ranks) and max(ranks) < len(cluster.devices)):
        for r in ranks:     # the one that is no rank, named
            check_rank(cluster, r, "ranks")
    if len(set(ranks)) != len(ranks):
        raise ClusterError(f"ranks: {ranks} repeats a rank")
    if len(checked) >= _RING_CHECKED_MAX:
        checked.clear()
    checked.add(ranks)
    return ranks


def ring_link(cluster: "Cluster", ranks: Sequence[int],
              link: LinkModel = DEFAULT_LINK, op: str = "all_reduce", concurrent: int = 1) -> tuple[float, float]:
    """(bandwidth_Bps of the slowest link, largest latency_s) of the ring over ``ranks`` in order; over
    a measured emulated link, ``op``'s bandwidth and latency (one of ``autopar.cluster.links.LINK_OPS``).
    ``concurrent``: rings of the same nodes running at once (a stage's TP positions' data-parallel
    rings): where a node declares its network, the flows that leave it (and enter it) share it.
    Remembered per cluster object (the planner prices the same rings hundreds of thousands of times)."""
    memo = cluster_memo(cluster)
    mkey = (tuple(ranks), link, op) if concurrent == 1 else (tuple(ranks), link, op, concurrent)
    hit = memo.get(mkey)
    if hit is None:
        hit = memo[mkey] = _ring_link(cluster, ranks, link, op, concurrent)
    return hit


_RING_MEMO: dict[int, tuple["Cluster", dict, set]] = {}
_RING_MEMO_CLUSTERS = 8
_RING_CHECKED_MAX = 1 << 16   # checked rings kept per cluster; beyond, the set starts over
_INT_TYPE = {int}


def cluster_memo(cluster) -> dict:
    """What the cost model derives from one cluster object alone, kept for it (clusters are frozen; a
    few are kept, by identity): ``ring_link``'s results, ``distinct_rings``', per-rank arrays."""
    return _ring_memo_entry(cluster)[1]


def _ring_memo_entry(cluster) -> tuple:
    """(cluster, its ``ring_link`` results, the rank tuples ``_ring`` has checked on it)."""
    entry = _RING_MEMO.get(id(cluster))
    if entry is None or entry[0] is not cluster:
        if len(_RING_MEMO) >= _RING_MEMO_CLUSTERS:
            _RING_MEMO.pop(next(iter(_RING_MEMO)))
        entry = _RING_MEMO[id(cluster)] = (cluster, {}, set())
    return entry


def _ring_link(cluster, ranks, link, op, concurrent=1) -> tuple[float, float]:
    ranks = _ring(cluster, ranks)
    if len(ranks) == 1:
        return math.inf, 0.0
    measured = emulated_link_of(cluster, ranks)
    if measured is not None:
        return measured.bandwidth(op), measured.latency(op)
    # Pairs of the same (intra-node link figure if they share a node, device types) have the same link:
    # price each such pair once (a ring over thousands of nodes has a handful of distinct pairs).
    distinct: dict = {}
    devices = cluster.devices
    intra = cluster.node_intra_Bps
    for i, a in enumerate(ranks):
        b = ranks[(i + 1) % len(ranks)]
        da, db = devices[a], devices[b]
        key = (("intra", intra[da.node]) if da.node == db.node else None, da.spec.name, db.spec.name)
        if key not in distinct:
            distinct[key] = (a, b)
    bw = min(pair_bandwidth_Bps(cluster, a, b, link) for a, b in distinct.values())
    lat = max(pair_latency_s(cluster, a, b, link) for a, b in distinct.values())
    if declares_network(cluster):
        bw = min(bw, _shared_network_Bps(cluster, ranks, link, concurrent))
    return bw, lat


def declares_network(cluster) -> bool:
    """Whether some node of ``cluster`` declares its network (``Cluster.node_network_Bps``), remembered
    per cluster object (a tuple of thousands of nodes, asked per ring)."""
    memo = cluster_memo(cluster)
    got = memo.get("declares_network")
    if got is None:
        got = memo["declares_network"] = any(x is not None for x in cluster.node_network_Bps)
    return got


def _shared_network_Bps(cluster, ranks: tuple[int, ...], link: LinkModel, concurrent: int) -> float:
    """The slowest cross-node edge of a ring where its nodes' declared networks are shared: each node's
    by the ring's edges that leave it (sending) or enter it (receiving), times ``concurrent`` rings."""
    devices = cluster.devices
    out: dict[int, int] = {}
    into: dict[int, int] = {}
    edges = []
    for i, a in enumerate(ranks):
        na, nb = devices[a].node, devices[ranks[(i + 1) % len(ranks)]].node
        if na != nb:
            out[na] = out.get(na, 0) + 1
            into[nb] = into.get(nb, 0) + 1
            edges.append((na, nb))
    if not edges:
        return math.inf
    return link.bandwidth_efficiency * min(
        network_edge_Bps(cluster, na, nb, concurrent * out[na], concurrent * into[nb], link) for na, nb in set(edges))


def _ring_steps_time_s(cluster, ranks: tuple[int, ...], nbytes: float, steps_per_rank: int,
                       link: LinkModel, op: str = "all_reduce", concurrent: int = 1) -> float:
    n = len(ranks)
    if n == 1:
        return 0.0
    bw, lat = ring_link(cluster, ranks, link, op, concurrent)
    return steps_per_rank * (n - 1) * (lat + nbytes / n / bw)


def _node_groups(cluster, ranks: tuple[int, ...]) -> list[tuple[int, ...]]:
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(cluster.devices[r].node, []).append(r)
    return [tuple(g) for g in groups.values()]


def _hierarchical_time_s(cluster, groups: list[tuple[int, ...]], nbytes: float, intra_steps: int,
                         inter_steps: int, link: LinkModel, concurrent: int = 1) -> float:
    """``intra_steps`` intra-node ring passes (1 or 2) around ``inter_steps`` passes across nodes (its
    m rings at once: they share a node's declared network)."""
    m = min(len(g) for g in groups)
    intra = max(_ring_steps_time_s(cluster, g, nbytes, 1, link) for g in groups)
    inter = max(_ring_steps_time_s(cluster, tuple(g[j] for g in groups), nbytes / m, inter_steps, link,
                                   concurrent=m * concurrent) for j in range(m))
    return intra_steps * intra + inter


def _collective_time_s(cluster, ranks, nbytes, ring_steps: int, intra_steps: int, inter_steps: int,
                       link: LinkModel, algorithm: str, op: str, concurrent: int = 1) -> float:
    _check_nbytes(nbytes)
    ranks = _ring(cluster, ranks)
    if algorithm not in ("ring", "hierarchical", "auto"):
        raise ValueError(f"algorithm: {algorithm!r} is not one of 'ring', 'hierarchical', 'auto'")
    if len(ranks) == 1:
        return 0.0
    ring = _ring_steps_time_s(cluster, ranks, nbytes, ring_steps, link, op, concurrent)
    if algorithm == "ring":
        return ring
    groups = _node_groups(cluster, ranks)
    if len(groups) == 1 or len(groups) == len(ranks):
        return ring  # one node, or one rank per node: the hierarchy is the ring itself
    hier = _hierarchical_time_s(cluster, groups, nbytes, intra_steps, inter_steps, link, concurrent)
    return hier if algorithm == "hierarchical" else min(ring, hier)


def allreduce_time_s(cluster: "Cluster", ranks: Sequence[int], nbytes: float,
                     link: LinkModel = DEFAULT_LINK, algorithm: Algorithm = "ring",
                     *, concurrent: int = 1) -> float:
    """Allreduce of an ``nbytes`` buffer. Ring: 2 (n-1) / n * nbytes / bw + 2 (n-1) latencies;
    hierarchical: intra reduce-scatter, inter allreduce of 1/m shards, intra all-gather."""
    return _collective_time_s(cluster, ranks, nbytes, 2, 2, 2, link, algorithm, "all_reduce", concurrent)


def reduce_scatter_time_s(cluster: "Cluster", ranks: Sequence[int], nbytes: float,
                          link: LinkModel = DEFAULT_LINK, algorithm: Algorithm = "ring",
                          *, concurrent: int = 1) -> float:
    """Reduce-scatter of an ``nbytes`` buffer into n shards. Ring: (n-1)/n * nbytes/bw + (n-1) latencies."""
    return _collective_time_s(cluster, ranks, nbytes, 1, 1, 1, link, algorithm, "reduce_scatter", concurrent)


def allgather_time_s(cluster: "Cluster", ranks: Sequence[int], nbytes: float,
                     link: LinkModel = DEFAULT_LINK, algorithm: Algorithm = "ring",
                     *, concurrent: int = 1) -> float:
    """All-gather of n shards into an ``nbytes`` buffer. Ring: (n-1)/n * nbytes/bw + (n-1) latencies."""
    return _collective_time_s(cluster, ranks, nbytes, 1, 1, 1, link, algorithm, "all_gather", concurrent)


def broadcast_time_s(cluster: "Cluster", ranks: Sequence[int], nbytes: float,
                     link: LinkModel = DEFAULT_LINK) -> float:
    """Pipelined ring broadcast from ``ranks[0]``: nbytes / bw + (n-1) latencies."""
    _check_nbytes(nbytes)
    ranks = _ring(cluster, ranks)
    n = len(ranks)
    if n == 1:
        return 0.0
    measured = emulated_link_of(cluster, ranks)
    if measured is not None:
        return (n - 1) * measured.latency("broadcast") + nbytes / measured.bandwidth("broadcast")
    # A chain, not a ring: the link from the last rank back to the root carries nothing.
    chain = [(ranks[i], ranks[i + 1]) for i in range(n - 1)]
    bw = min(pair_bandwidth_Bps(cluster, a, b, link) for a, b in chain)
    lat = max(pair_latency_s(cluster, a, b, link) for a, b in chain)
    return (n - 1) * lat + nbytes / bw


# -- ZeRO collectives as the data-parallel engine runs them ------------------------------------------
def zero_shard_sizes(numel: int, num_shards: int, shares: Sequence[float] | None = None) -> tuple[int, ...]:
    """Elements of each contiguous shard of ``numel`` elements split in proportion to ``shares``
    (None: even), as the engine's ``autopar.runtime.dp_flat.shard_bounds`` cuts them
    (``ir.costs.zero_shard_numels``)."""
    numel = int(numel)
    if numel < 0 or num_shards < 1:
        raise ValueError(f"zero_shard_sizes: numel {numel} must be >= 0 and num_shards {num_shards} >= 1")
    w = [1.0] * num_shards if shares is None or len(shares) == 0 else [float(x) for x in shares]
    if len(w) != num_shards or any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"zero_shares: need {num_shards} finite shares >= 0 with a positive sum, got {shares}")
    return zero_shard_numels(numel, w)


def zero_shards_even(numel: int, num_shards: int, shares: Sequence[float] | None = None) -> bool:
    """Whether every shard has the same size: the engine then all-gathers in place, else it broadcasts."""
    return len(set(zero_shard_sizes(numel, num_shards, shares))) == 1


def zero_gather_s(cluster: "Cluster", ranks: Sequence[int], numel: int, element_size: float,
                  shares: Sequence[float] | None = None, link: LinkModel = DEFAULT_LINK,
                  algorithm: Algorithm = "auto") -> float:
    """Seconds to gather one unit's ZeRO shards onto every rank of ``ranks`` (positions in order), as
    the engine does: even shards one all-gather of the unit, uneven ones a broadcast of each non-empty
    shard from its owner (a chain rooted at the owner). One rank: 0."""
    ranks = _ring(cluster, ranks)
    n = len(ranks)
    if n == 1 or numel <= 0:
        return 0.0
    sizes = zero_shard_sizes(numel, n, shares)
    if len(set(sizes)) == 1:
        return allgather_time_s(cluster, ranks, float(numel) * element_size, link=link, algorithm=algorithm)
    # Each broadcast is broadcast_time_s over the ring rotated to its owner: a chain over every link of
    # the ring but the one into the owner. The links are priced once and each chain's slowest link and
    # largest latency come from prefix and suffix extremes: n chains in O(n), not O(n^2) pair lookups
    # (768 ranks: half a million per unit), the same figures.
    measured = emulated_link_of(cluster, ranks)
    if measured is not None:
        lat_b, bw_b = measured.latency("broadcast"), measured.bandwidth("broadcast")
        return sum((n - 1) * lat_b + float(size) * element_size / bw_b for size in sizes if size > 0)
    edges = [(ranks[i], ranks[(i + 1) % n]) for i in range(n)]
    bws = [pair_bandwidth_Bps(cluster, a, b, link) for a, b in edges]
    lats = [pair_latency_s(cluster, a, b, link) for a, b in edges]
    bw_pre, bw_suf = list(itertools.accumulate(bws, min)), list(itertools.accumulate(reversed(bws), min))[::-1]
    lat_pre, lat_suf = list(itertools.accumulate(lats, max)), list(itertools.accumulate(reversed(lats), max))[::-1]

    def without(pre, suf, q, pick):      # the extreme of every edge but edge q
        parts = ([pre[q - 1]] if q > 0 else []) + ([suf[q + 1]] if q + 1 < n else [])
        return pick(parts)

    total = 0.0
    for p, size in enumerate(sizes):
        if size > 0:
            q = (p - 1) % n                     # the link into the owner carries nothing
            total += (n - 1) * without(lat_pre, lat_suf, q, max) + float(size) * element_size / without(
                bw_pre, bw_suf, q, min)
    return total


def zero_reduce_scatter_rounds(numel: int, num_shards: int, element_size: int,
                               shares: Sequence[float] | None = None) -> tuple[int, int]:
    """(rounds, elements per position of a round) of the engine's reduce-scatter of one unit."""
    if num_shards < 2 or numel <= 0:
        return 0, 0
    largest = max(zero_shard_sizes(numel, num_shards, shares))
    c = zero_staging_numel(int(numel), num_shards, int(element_size))
    return (-(-largest // c) if largest else 0), c


def zero_reduce_scatter_s(cluster: "Cluster", ranks: Sequence[int], numel: int, element_size: int,
                          shares: Sequence[float] | None = None, link: LinkModel = DEFAULT_LINK,
                          algorithm: Algorithm = "auto") -> float:
    """Seconds of the engine's reduce-scatter of one unit's gradient into its ZeRO shards: its rounds
    (``zero_reduce_scatter_rounds``), each a reduce-scatter of the whole staging buffer
    (``positions x c`` elements, padded). One rank: 0."""
    ranks = _ring(cluster, ranks)
    rounds, c = zero_reduce_scatter_rounds(numel, len(ranks), element_size, shares)
    if not rounds:
        return 0.0
    return rounds * reduce_scatter_time_s(cluster, ranks, float(len(ranks) * c * element_size), link=link,
                                          algorithm=algorithm)


def zero_units(costs: ModelCosts, zero_stage: int, blocks: slice = slice(None)) -> tuple[tuple[int, int], ...]:
    """(elements, gathers per round) of each unit the engine gathers and reduce-scatters over the
    ``blocks`` of ``costs``: ZeRO-3 one unit per block with parameters, gathered for forward and again
    for backward (``"block"`` granularity; a recomputed block's second gather is for its re-run,
    which its backward then uses); otherwise one unit of every parameter. The engine's root unit
    (parameters of several blocks, e.g. a tied embedding) is priced as its block's."""
    params = np.asarray(costs.params[blocks], dtype=np.float64)
    if zero_stage >= 3:
        return tuple((int(round(p)), 2) for p in params if p > 0)
    total = int(round(float(params.sum())))
    return ((total, 1),) if total > 0 else ()


@dataclass(frozen=True, slots=True)
class ZeroCollectives:
    """Seconds of a ZeRO stage's sharded collectives over one ring (the all-reduces are apart).
    ``gather_op``: the phase they record, "all_gather" (even shards) or "broadcast" (uneven)."""
    step_gather_s: float = 0.0          # after the optimizer (ZeRO-1/2): the updated weights
    round_gather_s: float = 0.0         # every round (ZeRO-3): forward and backward gathers
    round_reduce_scatter_s: float = 0.0  # every round (ZeRO-2/3)
    gather_op: str = "all_gather"
    round_reduce_scatter_bytes: float = 0.0   # staged bytes reduce-scattered per round (padded)


def zero_collectives(costs: ModelCosts, cluster: "Cluster", ranks: Sequence[int], zero_stage: int,
                     shares: Sequence[float] | None = None, *,
                     blocks: slice = slice(None), link: LinkModel = DEFAULT_LINK,
                     algorithm: Algorithm = "auto") -> ZeroCollectives:
    """The gathers and reduce-scatters of ``zero_stage`` over ``ranks`` with shard ``shares``, unit
    by unit (``zero_units``), as the engine runs them (``zero_gather_s``, ``zero_reduce_scatter_s``)."""
    ranks = _ring(cluster, ranks)
    n = len(ranks)
    if zero_stage < 1 or n == 1:
        return ZeroCollectives()
    params = float(np.asarray(costs.params[blocks]).sum())
    size = int(round(float(np.asarray(costs.param_bytes[blocks]).sum()) / params)) if params > 0 else 4
    units = zero_units(costs, zero_stage, blocks)
    # Units of equal size (a model's identical blocks) cost alike: each size priced once, summed in order.
    distinct = dict.fromkeys(u for u, _ in units)
    gathers = {u: zero_gather_s(cluster, ranks, u, size, shares, link, algorithm) for u in distinct}
    gather = sum(k * gathers[u] for u, k in units)
    uneven = any(not zero_shards_even(u, n, shares) for u in distinct)
    op = "broadcast" if uneven else "all_gather"
    if zero_stage == 1:
        return ZeroCollectives(step_gather_s=gather, gather_op=op)
    scatters = {u: zero_reduce_scatter_s(cluster, ranks, u, size, shares, link, algorithm) for u in distinct}
    rs = sum(scatters[u] for u, _ in units)
    rounds_of = {u: zero_reduce_scatter_rounds(u, n, size, shares) for u in distinct}
    staged = 0.0
    for u, _ in units:
        rounds, c = rounds_of[u]
        staged += rounds * n * c * size
    if zero_stage == 2:
        return ZeroCollectives(gather, 0.0, rs, op, staged)
    return ZeroCollectives(0.0, gather, rs, op, staged)


# -- the data-parallel engine's all-reduces ----------------------------------------------------------
LOSS_BYTES = 8      # the loss sum every engine all-reduces once per step (one float64)


def loss_allreduce_s(cluster: "Cluster", ranks: Sequence[int], link: LinkModel = DEFAULT_LINK,
                     algorithm: Algorithm = "auto") -> float:
    """Seconds of the step's loss all-reduce over ``ranks`` (``LOSS_BYTES``): all latency."""
    return allreduce_time_s(cluster, ranks, float(LOSS_BYTES), link=link, algorithm=algorithm)


def grad_buckets(costs: ModelCosts, blocks: slice = slice(None),
                 bucket_bytes: float = GRAD_BUCKET_BYTES) -> tuple[float, ...]:
    """Bytes of each gradient bucket the engine all-reduces over the ``blocks`` of ``costs``, in launch
    order (last blocks first), with the engine's packing rule (``autopar.ir.costs.bucket_ranges``): items
    taken from the end while the bucket stays within ``bucket_bytes``. The cost tables know blocks, not
    parameters: a block is one item, a block larger than a bucket ceil(block / bucket) equal items
    (its parameters, which no bucket can hold together)."""
    if not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes: {bucket_bytes!r} must be > 0")
    grads = np.asarray(costs.params[blocks], dtype=np.float64) * costs.grad_bytes_per_param
    items: list[float] = []              # in flat order
    for b in grads:
        if b > 0:
            k = max(1, math.ceil(float(b) / bucket_bytes))
            items.extend([float(b) / k] * k)
    offsets = np.concatenate(([0.0], np.cumsum(items)[:-1])) if items else ()
    return tuple(sum(items[i] for i in r) for r in bucket_ranges(items, offsets, bucket_bytes))


@dataclass(frozen=True, slots=True)
class DpAllReduces:
    """The all-reduces of one data-parallel step (``dp_allreduces``): ``grad_s`` the gradient's
    (ZeRO 0/1; all its buckets), ``last_bucket_s`` one bucket's (what overlap cannot hide),
    ``loss_s`` the loss sum's; ``buckets`` how many the gradient is reduced in."""
    grad_s: float = 0.0
    last_bucket_s: float = 0.0
    loss_s: float = 0.0
    buckets: int = 0

    @property
    def total_s(self) -> float:
        return self.grad_s + self.loss_s


def dp_allreduces(costs: ModelCosts, cluster: "Cluster", ranks: Sequence[int], zero_stage: int, *,
                  blocks: slice = slice(None), overlap: bool = True, bucket_bytes: float | None = None,
                  link: LinkModel = DEFAULT_LINK, algorithm: Algorithm = "auto") -> DpAllReduces:
    """The data-parallel engine's all-reduces of one step over ``ranks`` (see the module docstring):
    ZeRO 0/1 the gradient of ``blocks``, bucket by bucket with ``overlap`` (``grad_buckets`` of
    ``bucket_bytes``, None: ``grad_bucket_bytes``; one all-reduce of the whole gradient without), and
    the loss sum at every stage. One rank: nothing."""
    if bucket_bytes is None:
        bucket_bytes = grad_bucket_bytes(cluster, ranks)
    ranks = _ring(cluster, ranks)
    if len(ranks) == 1:
        return DpAllReduces()
    loss = loss_allreduce_s(cluster, ranks, link, algorithm)
    grad_bytes = float(np.asarray(costs.params[blocks], dtype=np.float64).sum()) * costs.grad_bytes_per_param
    if zero_stage >= 2 or grad_bytes <= 0:
        return DpAllReduces(loss_s=loss)
    buckets = grad_buckets(costs, blocks, bucket_bytes) if overlap else (grad_bytes,)
    times = [allreduce_time_s(cluster, ranks, b, link=link, algorithm=algorithm) for b in buckets]
    return DpAllReduces(float(sum(times)), times[-1], loss, len(buckets))


def grad_bucket_bytes(cluster: "Cluster", ranks: Sequence[int]) -> int:
    """The gradient bucket the data-parallel engine of ``ranks`` reduces in (``runtime.dp_overlap``):
    ``GRAD_BUCKET_BYTES`` where the reduction hides behind backward (``dp_comm_hides``: smaller buckets
    leave less exposed after it), else ``UNHIDDEN_BUCKET_BYTES``, DDP's default: the reduction then
    adds to the step whole, and fewer, larger collectives pay fewer latencies and fewer wake-ups of
    gloo's thread (on 2 native CPU ranks, a 13.8M-parameter Llama steps 2-5% faster in 25 MiB
    buckets than in 4 MiB ones, ``benchmarks/vs_torch.py``)."""
    return GRAD_BUCKET_BYTES if dp_comm_hides(cluster, ranks) else UNHIDDEN_BUCKET_BYTES


def dp_comm_hides(cluster: "Cluster", ranks: Sequence[int]) -> bool:
    """Whether the bucketed gradient all-reduce of data-parallel ``ranks`` runs beside their last
    backward, so that overlap hides all but its last bucket: on NCCL ranks (the collectives run on the
    GPU's own engine) and on emulated ones (their slow-down leaves their core idle for part of each
    block, where gloo's thread runs). A native CPU rank's backward fills its cores, and gloo's thread
    takes its time from that backward: the all-reduce adds to the step whole, as ``comm_hides`` (TP)
    has it for every gloo rank."""
    return all(cluster.devices[r].spec.backend == "nccl" or cluster.devices[r].spec.is_emulated for r in ranks)


def dp_bucket_restarts_s(costs: ModelCosts, device_types, buckets: int | None = None) -> list[float]:
    """Seconds a data-parallel rank of each of ``device_types`` pays in its last backward for the cold
    restarts after its gradient-bucket launches (ZeRO 0/1 with overlap, ``autopar.runtime.dp_overlap``):
    ``ModelCosts.bucket_restart`` once per bucket (``buckets``; None: ``grad_buckets`` of every block),
    0 on types no emulated clock runs."""
    per = [costs.bucket_restart(t) for t in device_types]
    if not any(per):
        return [0.0] * len(per)
    n = len(grad_buckets(costs)) if buckets is None else int(buckets)
    return [n * p for p in per]


# -- data-parallel rings over tensor-parallel members ----------------------------------------------

def distinct_rings(cluster, groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """The j-th ranks of every member (members of equal size), for each position j whose ring differs
    from the earlier ones in its ranks' device types and nodes (counted from the ring's first rank's
    node): those cost alike. Remembered per cluster object with ``ring_link``'s results, by the members."""
    memo = cluster_memo(cluster)
    key = ("distinct", tuple(map(tuple, groups)))
    hit = memo.get(key)
    if hit is None:
        places = memo.get("places")
        if places is None:
            codes: dict = {}
            places = memo["places"] = (
                np.array([codes.setdefault(d.spec.name, len(codes)) for d in cluster.devices]),
                np.array([d.node for d in cluster.devices]))
        code, node = places
        at = np.array(key[1])                                        # [member, position]
        kinds = np.stack([code[at], node[at] - node[at[0]][None, :]], axis=-1)   # [member, position, 2]
        of: dict = {}
        for j in range(at.shape[1]):
            of.setdefault(kinds[:, j].tobytes(), at[:, j].tolist())
        hit = memo[key] = list(of.values())
    return hit
