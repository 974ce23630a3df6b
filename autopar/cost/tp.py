"""Cost of blocks on a tensor-parallel group of possibly different devices with uneven shares.

Terms
- TP group: a tuple of ranks that together hold one copy of a stage's blocks, each rank a shard.
- share: the number of shard units (attention heads; ``num_heads`` in all) a rank holds; its
  *fraction* is share / num_heads. Matmul-dominated work (and the weights, gradients, optimizer state
  and activations that go with it) is split in proportion to the fractions.
- replicated fraction ``rho``: the part of every block that each rank computes and stores whole
  (norms, residual adds); per rank the work factor is ``rho + (1 - rho) * fraction``. Taken from the
  block statistics where known (``replicated_fraction_of``), else ``DEFAULT_REPLICATED_FRACTION``;
  on CPUs timed on this machine, measured with the rewrite itself (``autopar.cost.tp_measure``).
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
- group time of a block: the slowest rank's share of it (ranks synchronise at every all-reduce, so the
  maximum is taken block by block) plus its all-reduces.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopar.cost.comm import allreduce_time_s, ring_link
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
    "replicated_fraction_of_graph", "tp_rank_params", "rank_block_times", "tp_allreduce_block_s",
]

DEFAULT_REPLICATED_FRACTION = 0.1
TP_ALLREDUCES_PER_BLOCK = 4           # 2 in forward, 2 in backward
DEFAULT_NUM_UNITS = 64                # shard units when the model's head count is not given


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
                replicated_fraction: float = DEFAULT_REPLICATED_FRACTION) -> tuple[int, ...]:
    """Whole-unit shares (each >= 1, summing to ``num_units``) minimising the slowest rank, where rank i
    takes ``time_s[i] * (rho + (1 - rho) * share_i / num_units)`` (``time_s[i]``: the whole block on
    rank i's device). Exact: every rank's time grows with its share, so handing out units one at a
    time to the rank that is then the least slow reaches the min-max (it is the threshold solution);
    among equal times the lower rank index wins. Raises ``PlanError`` when ``num_units`` is smaller
    than the group."""
    t = [float(x) for x in time_s]
    n = len(t)
    rho = _check_rho(replicated_fraction)
    if n == 0:
        raise ValueError("time_s: empty; a TP group needs at least one rank")
    if any(not (math.isfinite(x) and x > 0) for x in t):
        raise ValueError(f"time_s: {t} must be finite and > 0")
    if num_units < n:
        raise PlanError(f"num_heads: {num_units} units cannot be shared by a TP group of {n} ranks")
    if n == 1:
        return (int(num_units),)
    shares = [1] * n

    def cost(i: int, s: int) -> float:
        return t[i] * (rho + (1.0 - rho) * s / num_units)

    heap = [(cost(i, 2), i) for i in range(n)]
    heapq.heapify(heap)
    for _ in range(num_units - n):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, (cost(i, shares[i] + 1), i))
    return tuple(shares)


def brute_force_shares(time_s: Sequence[float], num_units: int,
                       replicated_fraction: float = DEFAULT_REPLICATED_FRACTION) -> float:
    """The optimum of ``best_shares`` by enumeration (tests; small groups only): the least slowest time."""
    import itertools

    n = len(time_s)
    best = math.inf
    for cut in itertools.combinations(range(1, num_units), n - 1):
        b = (0, *cut, num_units)
        shares = [b[i + 1] - b[i] for i in range(n)]
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


def replicated_fraction_of_graph(gm, flop_per_byte: float = 150.0) -> float | None:
    """``replicated_fraction_of`` measured on the analysed graph itself (``passes.meta.COST`` and
    ``BLOCK`` on its nodes), counting only what tensor parallelism really leaves whole: the
    memory-class work of the nodes outside every Linear pair's region (norms, residual adds), in the
    blocks that have a pair. The elementwise work inside a region (an MLP's activation, attention's
    softmax) runs on sharded tensors, and so does its matmul work; the block statistics count all
    memory-class work as replicated. None when the graph has no pairs or no costs."""
    from autopar.passes.meta import BLOCK, COST
    from autopar.passes.tp_match import find_tp_pairs

    pairs = find_tp_pairs(gm)
    if not pairs:
        return None
    nodes = {n.name: n for n in gm.graph.nodes}
    inside = {name for p in pairs for name in (*p.region, p.row_node)}
    blocks = {nodes[p.row_node].meta.get(BLOCK) for p in pairs}
    heavy = light = 0.0
    for n in gm.graph.nodes:
        cost = n.meta.get(COST)
        if cost is None or n.meta.get(BLOCK) not in blocks:
            continue
        if cost.op_class in ("matmul", "attention"):
            heavy += cost.fwd_flops
        elif n.name not in inside:
            light += cost.act_bytes * flop_per_byte
    if heavy + light <= 0:
        return None
    return float(min(0.5, light / (heavy + light)))


def tp_memory_replicated_per_block(gm, num_blocks: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Per block of an analysed graph, the fractions of its parameters and of its saved activations
    that tensor parallelism leaves whole on every TP rank, from the rewrite's own layout
    (``passes.tp_match.find_tp_pairs``): a pair's column weights and biases and its row weight are
    sharded (the row bias is not); activations are priced by the nodes' outputs (what backward keeps
    is mostly their outputs: the Linears' and norms' inputs), sharded where a node of a pair's region
    made them (the columns' outputs and what follows them up to the row Linear), whole otherwise (the
    columns' input, norms, residual adds, the row Linear's all-reduced output). A block without a pair is whole (1, 1). The memory counterpart of
    ``replicated_fraction_of_graph``, which is a fraction of time. None without pairs."""
    from autopar.passes.meta import BLOCK, COST
    from autopar.passes.tp_match import find_tp_pairs

    pairs = find_tp_pairs(gm)
    if not pairs:
        return None
    nodes = {n.name: n for n in gm.graph.nodes}
    params = dict(gm.named_parameters())
    total_p, sharded_p = np.zeros(int(num_blocks)), np.zeros(int(num_blocks))
    for name, t in params.items():
        b = _block_of_param(name, gm, num_blocks)
        if b is not None:
            total_p[b] += t.numel()
    region: set[str] = set()
    for pair in pairs:
        b = nodes[pair.row_node].meta.get(BLOCK)
        region |= set(pair.region)
        names = [f"{c}.{k}" for c in pair.columns for k in ("weight", "bias")] + [f"{pair.row}.weight"]
        if b is not None and 0 <= b < num_blocks:
            sharded_p[b] += sum(params[n].numel() for n in names if n in params)
    total_a, sharded_a = np.zeros(int(num_blocks)), np.zeros(int(num_blocks))
    for n in gm.graph.nodes:     # the nodes' outputs, which backward keeps (the Linears' inputs among them)
        cost, b = n.meta.get(COST), n.meta.get(BLOCK)
        if cost is None or b is None or not 0 <= b < num_blocks or cost.out_bytes <= 0:
            continue
        total_a[b] += cost.out_bytes
        if n.name in region:
            sharded_a[b] += cost.out_bytes
    with np.errstate(invalid="ignore", divide="ignore"):
        rep_p = np.where(total_p > 0, 1.0 - sharded_p / np.maximum(total_p, 1.0), 1.0)
        rep_a = np.where(total_a > 0, 1.0 - sharded_a / np.maximum(total_a, 1.0), 1.0)
    return np.clip(rep_p, 0.0, 1.0), np.clip(rep_a, 0.0, 1.0)


def _block_of_param(name: str, gm, num_blocks: int) -> int | None:
    """The block of the first node that reads parameter ``name`` (``passes.meta.BLOCK``)."""
    from autopar.passes.meta import BLOCK

    cache = gm.__dict__.setdefault("_autopar_param_blocks", None)
    if cache is None:
        cache = {}
        for n in gm.graph.nodes:
            b = n.meta.get(BLOCK)
            if b is None and n.op == "get_attr":
                b = next((u.meta.get(BLOCK) for u in n.users if u.meta.get(BLOCK) is not None), None)
            if b is None:
                continue
            if n.op == "get_attr":
                cache.setdefault(str(n.target), b)
            elif n.op == "call_module":
                for pname, _ in gm.get_submodule(str(n.target)).named_parameters():
                    cache.setdefault(f"{n.target}.{pname}", b)
        gm.__dict__["_autopar_param_blocks"] = cache
    return cache.get(name)


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


def group_kind(cluster: "Cluster", ranks: Sequence[int], shares: Sequence[int]) -> GroupKind:
    ranks = tuple(int(r) for r in ranks)
    alpha, beta = allreduce_alpha_beta(cluster, ranks)
    return GroupKind(tuple(cluster.devices[r].spec.name for r in ranks), tuple(int(s) for s in shares),
                     alpha, beta)


def rank_block_times(costs: ModelCosts, types: Sequence[str], shares: Sequence[int], micro_batch: float,
                     replicated_fraction: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) compute seconds [rank, block] of a TP group whose ranks are of device
    ``types`` with head ``shares``, at ``micro_batch`` samples: each block's whole time on the rank's
    type times its work factor (``work_factors``); a block without a Linear pair runs whole on every
    rank. Communication is ``tp_allreduce_block_s``'s."""
    rho = DEFAULT_REPLICATED_FRACTION if replicated_fraction is None else _check_rho(replicated_fraction)
    n, r = costs.num_blocks, len(types)
    if micro_batch <= 0:
        return np.zeros((r, n)), np.zeros((r, n))
    s = np.asarray(shares, dtype=np.float64)
    factors = work_factors(s / s.sum(), rho)
    pairs = tp_pairs_of(costs)
    sharded = np.ones(n, dtype=bool) if pairs is None else pairs > 0
    fwd = np.stack([np.where(sharded, k, 1.0) * costs.fwd_time(t, micro_batch) for t, k in zip(types, factors)])
    bwd = np.stack([np.where(sharded, k, 1.0) * costs.bwd_time(t, micro_batch) for t, k in zip(types, factors)])
    return fwd, bwd


def tp_allreduce_block_s(costs: ModelCosts, alpha_s: float, beta_s_per_byte: float, micro_batch: float) -> np.ndarray:
    """Per block, the seconds of a TP group's all-reduces in *one* direction at ``micro_batch``: one
    per Linear pair (``tp_pairs_of``; half of ``TP_ALLREDUCES_PER_BLOCK`` without the counts), each of
    the block's output, over the group's ring (``allreduce_alpha_beta``). The same again in the other
    direction (Megatron's g in forward, f in backward)."""
    pairs = tp_pairs_of(costs)
    count = TP_ALLREDUCES_PER_BLOCK / 2 if pairs is None else pairs
    return count * (alpha_s + beta_s_per_byte * costs.out_bytes * max(float(micro_batch), 0.0))


def kind_block_times(costs: ModelCosts, kind: GroupKind, micro_batch: float,
                     replicated_fraction: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of every block on a group of ``kind`` at ``micro_batch`` samples:
    the slowest rank's compute (``rank_block_times``; ranks meet at every all-reduce, so block by
    block) plus the group's all-reduces (``tp_allreduce_block_s`` in each direction)."""
    n = costs.num_blocks
    if micro_batch <= 0:
        return np.zeros(n), np.zeros(n)
    f, b = rank_block_times(costs, kind.types, kind.shares, micro_batch, replicated_fraction)
    fwd, bwd = f.max(axis=0), b.max(axis=0)
    if len(kind.types) > 1:
        per_dir = tp_allreduce_block_s(costs, kind.alpha_s, kind.beta_s_per_byte, micro_batch)
        fwd = fwd + per_dir
        bwd = bwd + per_dir
    return fwd, bwd


def tp_pairs_per_block(gm, num_blocks: int) -> np.ndarray:
    """Per block of an analysed graph (``passes.meta.BLOCK`` on its nodes), the Linear pairs tensor
    parallelism shards in it (``passes.tp_match.find_tp_pairs``, the rewrite's own matcher). Each pair
    costs one all-reduce in forward (its g, after the row Linear) and one in backward (its f, before
    the columns): a transformer layer has two (attention and MLP), an MLP block one, an embedding or
    a head none (it runs whole on every TP rank)."""
    from autopar.passes.meta import BLOCK
    from autopar.passes.tp_match import find_tp_pairs

    nodes = {n.name: n for n in gm.graph.nodes}
    out = np.zeros(int(num_blocks))
    for pair in find_tp_pairs(gm):
        b = nodes[pair.row_node].meta.get(BLOCK)
        if b is not None and 0 <= int(b) < num_blocks:
            out[int(b)] += 1
    return out


def tp_pairs_of(costs: ModelCosts) -> np.ndarray | None:
    """The per-block pair counts a ``ModelCosts`` carries (``tp_pairs``, from ``tp_pairs_per_block``),
    or None for tables without them: every block is then priced as a transformer layer
    (``TP_ALLREDUCES_PER_BLOCK`` all-reduces, sharded by the work factors)."""
    pairs = getattr(costs, "tp_pairs", None)
    if pairs is None or len(pairs) != costs.num_blocks:
        return None
    return np.asarray(pairs, dtype=np.float64)


def kind_times(costs: ModelCosts, cluster: "Cluster", kind: GroupKind, micro_batch: float, blocks: slice,
               replicated_fraction: float | None = None, cache: dict | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of a block range on a group of ``kind`` (``cache`` memoises the
    per-block arrays by kind and micro-batch)."""
    key = (kind, micro_batch, replicated_fraction)
    if cache is not None and key in cache:
        f, b = cache[key]
    else:
        f, b = kind_block_times(costs, kind, micro_batch, replicated_fraction)
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

    Members of equal size t run t all-reduces at once, the j-th over the j-th rank of every member, of
    the largest shard (``fractions``: per member its ranks' share fractions; even when None); members
    of unequal sizes are priced as one all-reduce of the largest shard over their first ranks."""
    groups = [tuple(g) for g in groups]
    if len(groups) < 2:
        return 0.0
    grad = float(costs.params[blocks].sum()) * costs.grad_bytes_per_param
    sizes = {len(g) for g in groups}
    if fractions is None:
        fractions = [[1.0 / len(g)] * len(g) for g in groups]
    biggest = max(float(work_factors(f, replicated_fraction).max()) for f in fractions)
    nbytes = grad * biggest
    if len(sizes) == 1:
        t = sizes.pop()
        # Positions whose ranks have the same device types and nodes across members cost the same.
        rings = {}
        for j in range(t):
            ring = [g[j] for g in groups]
            key = tuple((cluster.devices[r].spec.name, cluster.devices[r].node - cluster.devices[ring[0]].node)
                        for r in ring)
            rings.setdefault(key, ring)
        return max(allreduce_time_s(cluster, ring, nbytes, algorithm="auto") for ring in rings.values())
    return allreduce_time_s(cluster, [g[0] for g in groups], nbytes, algorithm="auto")


def stage_allreduce_time_s(costs: ModelCosts, cluster: "Cluster", stage,
                           replicated_fraction: float | None = None) -> float:
    """``dp_allreduce_time_s`` of a ``Stage`` whose members are TP groups (``stage.tp_shares``)."""
    rho = DEFAULT_REPLICATED_FRACTION if replicated_fraction is None else replicated_fraction
    fractions = [np.asarray(s, float) / sum(s) for s in stage.tp_shares] if stage.tp_shares else None
    return dp_allreduce_time_s(costs, cluster, stage.groups, slice(stage.block_start, stage.block_stop),
                               fractions, rho)


def stage_sync_time_s(costs: ModelCosts, cluster: "Cluster", stage,
                      replicated_fraction: float | None = None) -> float:
    """Seconds of a ``Stage``'s gradient all-reduce over its members (0 with one member): over TP
    members ``stage_allreduce_time_s``, else one ring of the members' ranks on the stage's gradient."""
    if len(stage.groups) < 2:
        return 0.0
    if stage.tp_shares and any(len(g) > 1 for g in stage.groups):
        return stage_allreduce_time_s(costs, cluster, stage, replicated_fraction)
    grad_bytes = float(costs.params[stage.block_start:stage.block_stop].sum()) * costs.grad_bytes_per_param
    return allreduce_time_s(cluster, [g[0] for g in stage.groups], grad_bytes)


# -- ZeRO-1 inside tensor-parallel stages (``runtime.tp_zero``: Megatron's distributed optimizer) -----

def _member_shares(stage) -> list[tuple[int, ...]]:
    """Each member's head shares (even when the stage gives none)."""
    if stage.tp_shares:
        return [tuple(int(x) for x in s) for s in stage.tp_shares]
    return [(1,) * len(m) for m in stage.groups]


def tp_zero_stage(stage, zero_stage: int) -> int:
    """The ZeRO stage a ``Stage`` with tensor-parallel members holds, as ``runtime.tp`` runs it: 1 for
    ``zero_stage >= 1`` when the stage has at least two members, all with the same head shares
    (each TP index's ranks then share one flat layout; ``runtime.tp_zero.tp_zero_applies`` is the
    runtime's side of this rule), else 0 (different shardings reduce full-model buffers)."""
    shares = _member_shares(stage)
    return 1 if zero_stage >= 1 and len(shares) > 1 and len(set(shares)) == 1 else 0


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
    for ranks, shares in zip(stage.groups, _member_shares(stage)):
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
    for ranks, shares in zip(stage.groups, _member_shares(stage)):
        factors = work_factors(np.asarray(shares, float) / sum(shares), _check_rho(replicated_fraction))
        for r, k in zip(ranks, factors):
            out[r] = params * float(k) / d
    return out
