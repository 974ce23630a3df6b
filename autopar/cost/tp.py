"""Cost of blocks on a tensor-parallel group of possibly different devices with uneven shares.

Terms
- TP group: a tuple of ranks that together hold one copy of a stage's blocks, each rank a shard.
- share: the number of shard units (attention heads; ``num_heads`` in all) a rank holds; its
  *fraction* is share / num_heads. Matmul-dominated work (and the weights, gradients, optimizer state
  and activations that go with it) is split in proportion to the fractions.
- replicated fraction ``rho``: the part of every block that each rank computes and stores whole
  (norms, residual adds); per rank the work factor is ``rho + (1 - rho) * fraction``. Taken from the
  block statistics where known (``replicated_fraction_of``), else ``DEFAULT_REPLICATED_FRACTION``;
  on CPUs timed on this machine, measured with the rewrite itself (``autopar.measure.tp``).
  One ``rho`` prices forward and backward alike. (Measured on this CPU, the backward fraction is
  smaller than the forward one, by 0.25-0.85 over the four accuracy models: too scattered to price
  a fixed rule; ``tp_measure`` returns the fraction of forward plus backward time.)
- TP communication: Megatron-style, ``TP_ALLREDUCES_PER_BLOCK`` all-reduces per block per micro-step
  (2 in forward, 2 in backward), each of the block's output (``out_bytes`` per sample x samples) over
  the group's ring (``autopar.cost.comm.allreduce_time_s``). Every block counts as a transformer layer
  unless the cost tables carry per-block Linear pair counts (``tp_pairs_of``): then 2 all-reduces per
  pair, and a block without a pair runs whole on every rank.
- member (``Member``): one data-parallel participant of a pipeline stage: a TP group (its ranks, head
  shares, kind and node; a single rank when its degree is 1), as the joint planner lays them out.
- overlaps: priced only on groups whose collectives run on their own engine (``comm_hides``): the
  backward one, and under SP the forward chunked collective-matmul (``cost.tp_fwd``, which holds the
  collectives' prices).
- group time of a block: the slowest rank's share of it (ranks synchronise at every all-reduce, so the
  maximum is taken block by block) plus its all-reduces.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from autopar.cost.comm import allreduce_time_s, distinct_rings, reduce_scatter_time_s, ring_link
from autopar.cost import tp_fwd
from autopar.cost.tp_fwd import (  # re-exported: the collectives' half of the TP cost model
    SP_COLLECTIVES_PER_PAIR, TP_ALLREDUCES_PER_BLOCK, group_wgrad_s, sp_blocks, sp_pad, tp_allreduce_block_s,
    tp_backward_comm_s, tp_block_comm_s, tp_embeddings_of, tp_heads_of, tp_pairs_of, tp_sharded_blocks,
)
from autopar.cost.tp_tables import (  # re-exported: the graph's TP tables
    replicated_fraction_of_graph, tp_memory_replicated_per_block, tp_pairs_per_block,
)
from autopar.ir.costs import ModelCosts
from autopar.errors import PlanError

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = [
    "stage_sync_time_s", "DEFAULT_REPLICATED_FRACTION", "TP_ALLREDUCES_PER_BLOCK", "DEFAULT_NUM_UNITS", "TpGroup",
    "work_factors", "best_shares", "brute_force_shares", "replicated_fraction_of", "tp_memory_replicated_per_block", "allreduce_alpha_beta",
    "GroupKind", "group_kind", "kind_block_times", "kind_times", "group_block_times", "group_step_time_s",
    "group_memory_factor", "group_speed", "dp_allreduce_time_s", "stage_allreduce_time_s", "Member",
    "tp_zero_stage", "tp_zero_saving_bytes", "tp_optimizer_params", "tp_pairs_per_block", "tp_pairs_of",
    "tp_heads_of", "tp_embeddings_of", "tp_sharded_blocks", "stage_tp_shares",
    "replicated_fraction_of_graph", "tp_rank_params", "rank_block_times", "tp_allreduce_block_s",
    "SP_COLLECTIVES_PER_PAIR", "TP_BACKWARD_OVERLAP", "sp_blocks", "sp_pad", "tp_backward_comm_s", "group_wgrad_s",
    "sp_pays", "stage_sequence_parallel", "with_sequence_parallel", "sp_alpha_beta", "comm_hides",
]

DEFAULT_REPLICATED_FRACTION = 0.1
DEFAULT_NUM_UNITS = 64                # shard units when the model's head count is not given
# The runtime overlaps f's backward collective with the columns' weight gradients (passes.tp_overlap,
# applied by the TP engines by default): priced by tp_backward_comm_s
TP_BACKWARD_OVERLAP = True


@dataclass(frozen=True, slots=True)
class TpGroup:
    """A tensor-parallel group: its ranks and the shard units (heads) each holds."""

    ranks: tuple[int, ...]
    shares: tuple[int, ...]

    def __post_init__(self):
        if not self.ranks or len(self.ranks) != len(self.shares):
            raise ValueError(f"TpGroup.shares: {self.shares} needs one entry per rank of {self.ranks}")
        if any(s < 1 for s in self.shares):
            raise ValueError(f"TpGroup.shares: {self.shares} gives a rank no unit")

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def fractions(self) -> np.ndarray:
        s = np.asarray(self.shares, dtype=np.float64)
        return s / s.sum()


def work_factors(fractions: Sequence[float] | np.ndarray, replicated_fraction: float) -> np.ndarray:
    """Per rank, the part of a block's work (and state) it holds: ``rho + (1 - rho) * fraction``."""
    f = np.asarray(fractions, dtype=np.float64)
    if len(f) == 1:
        return np.ones(1)
    return replicated_fraction + (1.0 - replicated_fraction) * f


def _check_rho(replicated_fraction: float) -> float:
    if not 0.0 <= replicated_fraction < 1.0:
        raise ValueError(f"replicated_fraction: {replicated_fraction!r} must be in [0, 1)")
    return float(replicated_fraction)


def best_shares(time_s: Sequence[float], num_units: int,
                replicated_fraction: float = DEFAULT_REPLICATED_FRACTION,
                caps: Sequence[int] | None = None) -> tuple[int, ...]:
    """Whole-unit shares (each >= 1, summing to ``num_units``) minimising the slowest rank, where rank i
    takes ``time_s[i] * (rho + (1 - rho) * share_i / num_units)`` (``time_s[i]``: the whole block on
    rank i's device). ``caps``: the most units each rank may hold (what fits its memory, ``tp_share_caps``;
    None: no bound). Exact: every rank's time grows with its share, so handing out units one at a
    time to the rank that is then the least slow among those below their cap reaches the min-max (it
    is the threshold solution, clipped at the caps); among equal times the lower rank index wins.
    Raises ``PlanError`` when ``num_units`` is smaller than the group, or when the caps leave a rank
    no unit or hold fewer units than ``num_units`` together (no shares fit)."""
    t = [float(x) for x in time_s]
    n = len(t)
    rho = _check_rho(replicated_fraction)
    if n == 0:
        raise ValueError("time_s: empty; a TP group needs at least one rank")
    if any(not (math.isfinite(x) and x > 0) for x in t):
        raise ValueError(f"time_s: {t} must be finite and > 0")
    if num_units < n:
        raise PlanError(f"num_heads: {num_units} units cannot be shared by a TP group of {n} ranks")
    cap = [num_units] * n if caps is None else [int(c) for c in caps]
    if len(cap) != n:
        raise ValueError(f"caps: {len(cap)} caps for a group of {n} ranks")
    if min(cap) < 1 or sum(cap) < num_units:
        raise PlanError(f"tp: no head shares fit: each rank's memory holds at most {cap} of the "
                        f"{num_units} heads")
    if n == 1:
        return (int(num_units),)
    shares = [1] * n

    def cost(i: int, s: int) -> float:
        return t[i] * (rho + (1.0 - rho) * s / num_units)

    heap = [(cost(i, 2), i) for i in range(n) if cap[i] > 1]
    heapq.heapify(heap)
    for _ in range(num_units - n):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        if shares[i] < cap[i]:
            heapq.heappush(heap, (cost(i, shares[i] + 1), i))
    return tuple(shares)


def brute_force_shares(time_s: Sequence[float], num_units: int,
                       replicated_fraction: float = DEFAULT_REPLICATED_FRACTION,
                       caps: Sequence[int] | None = None) -> float:
    """The optimum of ``best_shares`` by enumeration (tests; small groups only): the least slowest time
    (inf when no shares within ``caps`` exist)."""
    import itertools

    n = len(time_s)
    cap = [num_units] * n if caps is None else list(caps)
    best = math.inf
    for cut in itertools.combinations(range(1, num_units), n - 1):
        b = (0, *cut, num_units)
        shares = [b[i + 1] - b[i] for i in range(n)]
        if any(s > c for s, c in zip(shares, cap)):
            continue
        worst = max(time_s[i] * work_factors(np.array(shares) / num_units, replicated_fraction)[i]
                    for i in range(n)) if n > 1 else time_s[0]
        best = min(best, worst)
    return best


def replicated_fraction_of(stats, flop_per_byte: float = 150.0) -> float:
    """The time fraction of non-matmul (memory-bound) work in ``passes`` block statistics: memory-class
    bytes / ``flop_per_byte`` (a device's peak FLOP/s over its memory bandwidth) against matmul and
    attention FLOPs, over all blocks. Falls back to ``DEFAULT_REPLICATED_FRACTION`` without data."""
    heavy = light = 0.0
    for s in stats:
        flops = dict(s.flops_by_class)
        heavy += flops.get("matmul", 0.0) + flops.get("attention", 0.0)
        light += dict(s.bytes_by_class).get("memory", 0.0) * flop_per_byte
    if heavy + light <= 0:
        return DEFAULT_REPLICATED_FRACTION
    return float(min(0.5, light / (heavy + light)))


def allreduce_alpha_beta(cluster: "Cluster", ranks: Sequence[int]) -> tuple[float, float]:
    """(seconds, seconds per byte) of a ring all-reduce over ``ranks``: time = alpha + beta * nbytes."""
    ranks = tuple(ranks)
    n = len(ranks)
    if n < 2:
        return 0.0, 0.0
    bw, lat = ring_link(cluster, ranks)   # the ring formula of ``allreduce_time_s``, in two terms
    return 2 * (n - 1) * lat, 2 * (n - 1) / n / bw


@dataclass(frozen=True, slots=True)
class GroupKind:
    """What a TP group's cost depends on: its ranks' device types, shares and all-reduce link.
    Groups of one kind cost the same (so the planner prices each kind once)."""

    types: tuple[str, ...]
    shares: tuple[int, ...]
    alpha_s: float            # all-reduce latency term over the group
    beta_s_per_byte: float    # all-reduce seconds per byte of the buffer
    # SP's all-gather and reduce-scatter on their own links (``sp_alpha_beta``); None: from the all-reduce's
    sp_link: tuple[float, float, float, float] | None = None
    hides_comm: bool = True   # the backward overlap hides collectives on this group (``comm_hides``)


@dataclass(frozen=True, slots=True)
class Member:
    """One data-parallel participant of a stage: a TP group (a single rank when its degree is 1)."""

    ranks: tuple[int, ...]
    shares: tuple[int, ...]
    kind: GroupKind
    node: int

    @property
    def type_name(self) -> str:
        return self.kind.types[0]


def sp_alpha_beta(cluster: "Cluster", ranks: Sequence[int]) -> tuple[float, float, float, float]:
    """(all-gather seconds, its seconds per byte of the gathered buffer, reduce-scatter seconds, its
    seconds per byte) of one ring call over ``ranks``, each on its own operation's link (``ring_link``'s
    ``op``; emulated links are measured per operation): (n - 1) latencies and (n - 1) / n of the bytes."""
    ranks = tuple(ranks)
    n = len(ranks)
    if n < 2:
        return 0.0, 0.0, 0.0, 0.0
    out = []
    for op in ("all_gather", "reduce_scatter"):
        bw, lat = ring_link(cluster, ranks, op=op)
        out += [(n - 1) * lat, (n - 1) / n / bw]
    return tuple(out)


def comm_hides(cluster: "Cluster", ranks: Sequence[int]) -> bool:
    """Whether a collective over ``ranks`` runs beside their compute, so the backward overlap hides it:
    only where every rank's collectives run on an engine of their own (NCCL, ``DeviceSpec.backend``).
    CPU and emulated ranks (gloo) hide nothing: gloo's thread runs on the rank's own core."""
    return all(cluster.devices[r].spec.backend == "nccl" for r in ranks)


def group_kind(cluster: "Cluster", ranks: Sequence[int], shares: Sequence[int]) -> GroupKind:
    ranks = tuple(int(r) for r in ranks)
    alpha, beta = allreduce_alpha_beta(cluster, ranks)
    sp = sp_alpha_beta(cluster, ranks) if len(ranks) > 1 else None
    return GroupKind(tuple(cluster.devices[r].spec.name for r in ranks), tuple(int(s) for s in shares),
                     alpha, beta, sp, comm_hides(cluster, ranks))


def _block_rho(costs: ModelCosts, rho: float, sequence_parallel: bool) -> np.ndarray | float:
    """The replicated time fraction per block: ``rho``, and in SP blocks ``rho - covered`` in [0, 0.95]
    (``cost.tp_tables``: SP shards the token-wise work outside the pairs; ``measure.tp``: as timed)."""
    sp = sp_blocks(costs) if sequence_parallel else None
    if sp is None or costs.tp_sp_covered is None:
        return rho
    return np.where(sp, np.clip(rho - np.asarray(costs.tp_sp_covered, float), 0.0, 0.95), rho)


def rank_block_times(costs: ModelCosts, types: Sequence[str], shares: Sequence[int], micro_batch: float,
                     replicated_fraction: float | None = None,
                     sequence_parallel: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) compute seconds [rank, block] of a TP group whose ranks are of device
    ``types`` with head ``shares``, at ``micro_batch`` samples: each block's whole time on the rank's
    type times its work factor (``work_factors``; under ``sequence_parallel`` with the SP block's own
    replicated fraction, ``_block_rho``: the sequence shard is the rank's share too); a block without
    a Linear pair runs whole on every rank. Communication is ``tp_allreduce_block_s``'s."""
    return _rank_rows(costs, types, shares, micro_batch, replicated_fraction, sequence_parallel, range(len(types)))


def _rank_rows(costs: ModelCosts, types: Sequence[str], shares: Sequence[int], micro_batch: float,
               replicated_fraction: float | None, sequence_parallel: bool, rows) -> tuple[np.ndarray, np.ndarray]:
    """``rank_block_times``' rows of the ranks ``rows`` (indices into ``types``), each priced alike."""
    rho = DEFAULT_REPLICATED_FRACTION if replicated_fraction is None else _check_rho(replicated_fraction)
    n, r = costs.num_blocks, len(types)
    rows = list(rows)
    if micro_batch <= 0:
        return np.zeros((len(rows), n)), np.zeros((len(rows), n))
    s = np.asarray(shares, dtype=np.float64)
    f = (s / s.sum())[rows]
    rb = _block_rho(costs, rho, sequence_parallel)
    factors = np.ones((len(rows), 1)) if r == 1 else rb + (1.0 - rb) * f[:, None] * np.ones((1, n))
    blocks = tp_sharded_blocks(costs)
    sharded = np.ones(n, dtype=bool) if blocks is None else blocks
    kinds = [types[i] for i in rows]
    fwd = np.stack([np.where(sharded, k, 1.0) * costs.fwd_time(t, micro_batch) for t, k in zip(kinds, factors)])
    bwd = np.stack([np.where(sharded, k, 1.0) * costs.bwd_time(t, micro_batch) for t, k in zip(kinds, factors)])
    return fwd, bwd


def _kind_times(costs, kind, micro_batch, rho, sp: bool, overlap: bool):
    """``kind_block_times`` with both flags given, memoised in ``costs._cache`` (the planner asks for
    SP and plain alike at every (kind, micro-batch); keyed by the tables' identities too, so a table
    replaced on the costs is not served stale)."""
    key = ("tp_kind", kind, float(micro_batch), rho, sp, overlap, id(costs.fwd_table), id(costs.bwd_table),
           id(costs.tp_pairs), id(costs.tp_heads), id(costs.tp_embeddings), id(costs.tp_sp_supported), id(costs.tp_sp_covered), id(costs.tp_wgrad_share),
           tp_fwd.overlap_key(costs))
    hit = costs._cache.get(key)
    if hit is None:
        hit = costs._cache[key] = _kind_times_of(costs, kind, micro_batch, rho, sp, overlap)
    return hit


def _kind_times_of(costs, kind, micro_batch, rho, sp: bool, overlap: bool):
    # ranks of one device type and share are priced alike: the slowest of the distinct ones
    first: dict = {}
    for i, pair in enumerate(zip(kind.types, kind.shares)):
        first.setdefault(pair, i)
    f, b = _rank_rows(costs, kind.types, kind.shares, micro_batch, rho, sp, first.values())
    fwd, bwd = f.max(axis=0), b.max(axis=0)
    if len(kind.types) > 1:     # the collectives, less what the overlaps hide (cost.tp_fwd)
        cf, cb = tp_block_comm_s(costs, kind.alpha_s, kind.beta_s_per_byte, micro_batch, kind.types, kind.shares,
                                 sp, kind.sp_link, kind.hides_comm, overlap)
        fwd, bwd = fwd + cf, bwd + cb
    return fwd, bwd


def kind_block_times(costs: ModelCosts, kind: GroupKind, micro_batch: float,
                     replicated_fraction: float | None = None, sequence_parallel: bool | None = None,
                     overlap: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of every block on a group of ``kind`` at ``micro_batch`` samples:
    the slowest rank's compute (``rank_block_times``; ranks meet at every collective, so block by
    block) plus the group's collectives less what the overlaps hide (``cost.tp_fwd.tp_block_comm_s``):
    forward's less the chunked collective-matmul's part (``cost.tp_fwd.TP_FORWARD_OVERLAP``), backward's
    less the weight-gradient overlap's (``tp_backward_comm_s``; ``overlap`` None: ``TP_BACKWARD_OVERLAP``),
    both only on a kind that ``hides_comm`` (the forward one under SP only). ``sequence_parallel``: True /
    False as a stage runs it; None: as the planner sets it (``sp_pays``: where SP is supported and priced
    no slower on this kind at this micro-batch)."""
    n = costs.num_blocks
    if micro_batch <= 0:
        return np.zeros(n), np.zeros(n)
    ov = TP_BACKWARD_OVERLAP if overlap is None else bool(overlap)
    plain = _kind_times(costs, kind, micro_batch, replicated_fraction, False, ov)
    got = plain
    if sequence_parallel is not False and len(kind.types) > 1 and sp_blocks(costs) is not None:
        sp = _kind_times(costs, kind, micro_batch, replicated_fraction, True, ov)
        if sequence_parallel or float(sp[0].sum() + sp[1].sum()) <= float(plain[0].sum() + plain[1].sum()):
            got = sp
    return got[0].copy(), got[1].copy()      # the memo's arrays stay unchanged whatever a caller does


def sp_pays(costs: ModelCosts, kind: GroupKind, micro_batch: float, replicated_fraction: float | None = None,
            overlap: bool | None = None) -> bool:
    """Whether a TP group of ``kind`` runs sequence parallelism as the planner sets it: a group of two
    or more ranks, SP supported in some block (``sp_blocks``), and forward + backward of the model's
    blocks priced no slower with it (the memory it saves is never more: ``cost.memory``)."""
    if len(kind.types) < 2 or sp_blocks(costs) is None or not sp_blocks(costs).any() or micro_batch <= 0:
        return False
    ov = TP_BACKWARD_OVERLAP if overlap is None else bool(overlap)
    p = _kind_times(costs, kind, micro_batch, replicated_fraction, False, ov)
    s = _kind_times(costs, kind, micro_batch, replicated_fraction, True, ov)
    return float(s[0].sum() + s[1].sum()) <= float(p[0].sum() + p[1].sum())


def kind_times(costs: ModelCosts, cluster: "Cluster", kind: GroupKind, micro_batch: float, blocks: slice,
               replicated_fraction: float | None = None, cache: dict | None = None,
               sequence_parallel: bool | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of a block range on a group of ``kind`` (``cache`` memoises the
    per-block arrays by kind and micro-batch; ``sequence_parallel``: ``kind_block_times``')."""
    key = (kind, micro_batch, replicated_fraction, sequence_parallel)
    if cache is not None and key in cache:
        f, b = cache[key]
    else:
        f, b = kind_block_times(costs, kind, micro_batch, replicated_fraction, sequence_parallel)
        if cache is not None:
            cache[key] = (f, b)
    return float(f[blocks].sum()), float(b[blocks].sum())


def group_block_times(costs: ModelCosts, cluster: "Cluster", group: TpGroup, micro_batch: float,
                      replicated_fraction: float = DEFAULT_REPLICATED_FRACTION,
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of every block on ``group`` at ``micro_batch`` samples, including
    the group's all-reduces (half of them in each direction)."""
    return kind_block_times(costs, group_kind(cluster, group.ranks, group.shares), micro_batch,
                            replicated_fraction)


def group_step_time_s(costs: ModelCosts, cluster: "Cluster", group: TpGroup, micro_batch: float,
                      blocks: slice = slice(None),
                      replicated_fraction: float = DEFAULT_REPLICATED_FRACTION) -> float:
    """Forward + backward seconds of a block range on ``group`` at one micro-batch."""
    f, b = group_block_times(costs, cluster, group, micro_batch, replicated_fraction)
    return float(f[blocks].sum() + b[blocks].sum())


def group_memory_factor(group: TpGroup, replicated_fraction: float = DEFAULT_REPLICATED_FRACTION) -> np.ndarray:
    """Per rank, the part of a block's states and activations it stores (the work factors)."""
    return work_factors(group.fractions, _check_rho(replicated_fraction))


def group_speed(costs: ModelCosts, cluster: "Cluster", group: TpGroup, micro_batch: float = 1.0,
                replicated_fraction: float = DEFAULT_REPLICATED_FRACTION) -> float:
    """Samples per second of the whole model on ``group`` at ``micro_batch`` (no pipeline, no DP)."""
    t = group_step_time_s(costs, cluster, group, micro_batch, slice(None), replicated_fraction)
    return micro_batch / t if t > 0 else math.inf


def dp_allreduce_time_s(costs: ModelCosts, cluster: "Cluster", groups: Sequence[Sequence[int]],
                        blocks: slice, fractions: Sequence[Sequence[float]] | None = None,
                        replicated_fraction: float = DEFAULT_REPLICATED_FRACTION) -> float:
    """The data-parallel gradient all-reduce of a block range among a stage's members (TP groups).

    Members of equal size t run t all-reduces at once, the j-th over the j-th rank of every member (t
    rings sharing a node's declared network: ``comm.ring_link``'s ``concurrent``), of the largest shard (``fractions``: per member its ranks' share fractions; even when None); members
    of unequal sizes are priced as one all-reduce of the largest shard over their first ranks (the
    distinct rings of a stage's members: ``comm.distinct_rings``, remembered per cluster)."""
    groups = [tuple(g) for g in groups]
    if len(groups) < 2:
        return 0.0
    grad = float(costs.params[blocks].sum()) * costs.grad_bytes_per_param
    sizes = {len(g) for g in groups}
    if fractions is None:
        fractions = [[1.0 / len(g)] * len(g) for g in groups]
    # members given one fractions object (``stage_allreduce_time_s``: equal shares) hold alike
    biggest = max(float(work_factors(f, replicated_fraction).max())
                  for f in {id(f): f for f in fractions}.values())
    nbytes = grad * biggest
    if len(sizes) == 1:
        distinct = distinct_rings(cluster, groups)
        return max(allreduce_time_s(cluster, ring, nbytes, algorithm="auto", concurrent=len(groups[0]))
                   for ring in distinct)
    return allreduce_time_s(cluster, [g[0] for g in groups], nbytes, algorithm="auto")


def stage_allreduce_time_s(costs: ModelCosts, cluster: "Cluster", stage,
                           replicated_fraction: float | None = None) -> float:
    """``dp_allreduce_time_s`` of a ``Stage`` whose members are TP groups (``stage.tp_shares``)."""
    rho = DEFAULT_REPLICATED_FRACTION if replicated_fraction is None else replicated_fraction
    fractions = None
    if stage.tp_shares:
        of: dict = {}   # shares -> fractions: members of equal shares alike
        fractions = [of[s] if s in of else of.setdefault(s, np.asarray(s, float) / sum(s))
                     for s in map(tuple, stage.tp_shares)]
    return dp_allreduce_time_s(costs, cluster, stage.groups, slice(stage.block_start, stage.block_stop),
                               fractions, rho)


def stage_sync_time_s(costs: ModelCosts, cluster: "Cluster", stage,
                      replicated_fraction: float | None = None, *, zero_stage: int = 0) -> float:
    """Seconds of a ``Stage``'s gradient reduction over its members (0 with one member): over TP
    members ``stage_allreduce_time_s`` (under ZeRO-1 its reduce-scatter and the
    parameters' all-gather move the same bytes), else one ring of the members' ranks on the stage's
    gradient: an all-reduce, or under ZeRO >= 1 the data-parallel sync's reduce-scatter
    (``runtime.dp_sync``; the all-gather of the parameters after the optimizer is priced apart)."""
    if len(stage.groups) < 2:
        return 0.0
    if stage.tp_shares and any(len(g) > 1 for g in stage.groups):
        return stage_allreduce_time_s(costs, cluster, stage, replicated_fraction)
    grad_bytes = float(costs.params[stage.block_start:stage.block_stop].sum()) * costs.grad_bytes_per_param
    ranks = [g[0] for g in stage.groups]
    if zero_stage >= 1:
        return reduce_scatter_time_s(cluster, ranks, grad_bytes)
    return allreduce_time_s(cluster, ranks, grad_bytes)


# -- ZeRO inside tensor-parallel stages (the data-parallel sync, ``runtime.dp_sync``, over TP peers) --

def stage_tp_shares(stage) -> list[tuple[int, ...]]:
    """Each member's head shares (even when the stage gives none)."""
    if stage.tp_shares:
        return [tuple(map(int, s)) for s in stage.tp_shares]
    return [(1,) * len(m) for m in stage.groups]


def tp_zero_stage(stage, zero_stage: int) -> int:
    """The ZeRO stage a ``Stage`` with tensor-parallel members holds, as ``runtime.tp`` runs it: 1 for
    ``zero_stage >= 1`` when the stage has at least two members, all with the same head shares
    (each TP index's ranks then share one flat layout; ``runtime.tp.tp_zero_applies`` is the
    runtime's side of this rule), else 0 (different shardings reduce full-model buffers)."""
    if zero_stage < 1 or len(stage.groups) < 2:
        return 0
    shares = stage_tp_shares(stage)
    return 1 if len(set(shares)) == 1 else 0


def tp_zero_saving_bytes(costs: ModelCosts, stage, zero_stage: int,
                         replicated_fraction: float = DEFAULT_REPLICATED_FRACTION) -> dict[int, float]:
    """Per rank of a TP ``stage``, the bytes ZeRO-1 saves against ZeRO-0 (0 where ``tp_zero_stage``
    is 0): ``(D - 1) / D`` of its optimizer state over ``D`` members, the state sharded like the
    work (``work_factors``). Weights and the accumulated gradient stay whole; the reduce-scatter and
    all-gather run in place in the two flat buffers, so nothing is added."""
    z = tp_zero_stage(stage, zero_stage)
    params = float(costs.params[stage.block_start:stage.block_stop].sum())
    d = len(stage.groups)
    out = {}
    for ranks, shares in zip(stage.groups, stage_tp_shares(stage)):
        factors = work_factors(np.asarray(shares, float) / sum(shares), _check_rho(replicated_fraction))
        for r, k in zip(ranks, factors):
            out[r] = params * costs.optimizer_bytes_per_param * k * (1.0 - 1.0 / d) if z >= 1 else 0.0
    return out


def tp_rank_params(costs: ModelCosts, blocks: slice, fractions: Sequence[float] | np.ndarray,
                   replicated_fraction: float = DEFAULT_REPLICATED_FRACTION) -> np.ndarray:
    """Per rank of a TP group with share ``fractions``, the parameters of ``blocks`` it holds (and its
    optimizer steps), from the rewrite's layout: per block the part left whole on every rank
    (``ModelCosts.tp_param_replicated``: norms, row biases, blocks without a pair) plus the rank's
    fraction of the rest. Tables without the layout fall back to the work factors' ``rho``. (The time
    fraction ``rho`` overcounts a small shard's parameters: resmlp's 0.1% whole against rho 0.1-0.33.)"""
    f = np.asarray(fractions, dtype=np.float64)
    rep = getattr(costs, "tp_param_replicated", None)
    if rep is None or len(rep) != costs.num_blocks:
        return float(costs.params[blocks].sum()) * work_factors(f, _check_rho(replicated_fraction))
    if len(f) == 1:
        return np.full(1, float(costs.params[blocks].sum()))
    p, r = costs.params[blocks], rep[blocks]
    whole = float(p @ r)
    return whole + (float(p.sum()) - whole) * f


def tp_optimizer_params(stage, params: float, replicated_fraction: float = DEFAULT_REPLICATED_FRACTION,
                        zero_stage: int = 0) -> dict[int, float]:
    """Per rank of a TP ``stage`` holding ``params`` parameters, the parameters its optimizer steps: its
    shard (``work_factors``), and under ZeRO-1 (``tp_zero_stage``) 1/D of it over D members."""
    d = len(stage.groups) if tp_zero_stage(stage, zero_stage) else 1
    out = {}
    for ranks, shares in zip(stage.groups, stage_tp_shares(stage)):
        factors = work_factors(np.asarray(shares, float) / sum(shares), _check_rho(replicated_fraction))
        for r, k in zip(ranks, factors):
            out[r] = params * float(k) / d
    return out


def stage_sequence_parallel(costs: ModelCosts, kinds: Sequence[GroupKind], micro_batches: Sequence[float],
                            replicated_fraction: float | None = None, force: bool = False) -> bool:
    """``Stage.sequence_parallel`` as the planner sets it on a stage whose members are of ``kinds``
    (with their largest micro-batch each): every member a TP group for which ``sp_pays``. A stage
    whose members disagree runs without SP (the flag is the stage's); ``kind_block_times`` with the
    stage's flag then prices what it runs. ``force`` (a pinned SP): every member a TP group and some
    block able to run it, priced slower or not."""
    kinds = list(kinds)
    if force:
        sp = sp_blocks(costs)
        return bool(kinds) and sp is not None and bool(sp.any()) and all(len(k.types) > 1 for k in kinds)
    return bool(kinds) and all(sp_pays(costs, k, float(x), replicated_fraction)
                               for k, x in zip(kinds, micro_batches))


def with_sequence_parallel(costs: ModelCosts, stages: Sequence, members: Sequence[Sequence[Member]],
                           replicated_fraction: float | None = None, force: bool = False) -> tuple:
    """The joint planner's built ``stages`` (of ``members`` each) with ``Stage.sequence_parallel`` set
    as ``stage_sequence_parallel`` says (each member at its largest micro-batch)."""
    out = []
    for st, ms in zip(stages, members):
        sp = stage_sequence_parallel(costs, [m.kind for m in ms], [max(x, default=0) for x in st.micro_batches],
                                     replicated_fraction, force)
        out.append(replace(st, sequence_parallel=sp) if sp != st.sequence_parallel else st)
    return tuple(out)
