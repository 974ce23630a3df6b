"""Heterogeneous data-parallel planning with ZeRO (Poplar-style) and its two baselines.

Terms
- rank: one device of the cluster taking part in the plan (``ranks``, default all); every rank holds
  a replica (ZeRO-0) or a shard (ZeRO-1: optimizer state; 2: + gradients; 3: + weights).
- ZeRO shard fractions (uneven shards, ``Stage.zero_shares``): the part of the sharded states each
  rank keeps and steps. The baselines keep even 1/N shards. ``"dp"`` also tries the fractions that
  balance the optimizer step (``balanced_zero_shares``: water-filling, each rank's shard capped by its
  memory) and their midpoint with even; each candidate is planned with its own memory caps (a bigger
  shard leaves less room for activations), so shares of the batch and of the states are chosen
  together, and the fastest is kept. The engines cut the shards from the fractions
  (``autopar.runtime.dp_flat.shard_bounds``).
- share: the samples of the global batch a rank computes each step; it steps through its own list of
  micro-batches (gradient accumulation), so shares and list lengths may differ between ranks.
- micro-step curve: seconds of one micro-step (forward + backward of every block) as a function of
  the micro-batch size, a monotone PCHIP interpolant of the cost tables (``micro_step_curve``);
  under ZeRO-3 each micro-step also pays the gathers it needs (``ZeroComm.per_micro_step_s``).
- max micro-batch: the largest micro-batch a rank holds in ``memory_fraction`` of its memory next to
  its states, ZeRO-3's gathered block and a fixed workspace (``max_micro_batch``; the rank memory is
  ``autopar.cost.memory.rank_memory``, re-exported here).
- ZeRO communication, per step, among the plan's ranks (``autopar.cost.comm``, flat or hierarchical rings;
  the sharded collectives as the engine runs them, ``autopar.cost.comm.zero_collectives``):
  ZeRO-0 all-reduce of the gradients after the last micro-step; ZeRO-1 the same, then an all-gather
  of the updated parameters; ZeRO-2, on every micro-step, a reduce-scatter of the gradients (they are
  sharded, so they cannot be accumulated whole across micro-steps: DeepSpeed's ZeRO-2 reduces after
  every backward too) + after the last one an all-gather of the parameters; ZeRO-3, on every
  micro-step, an all-gather of the parameters for forward, another for backward and a
  reduce-scatter of the gradients. ZeRO-2 thus trades ZeRO-1's full gradient for one reduce-scatter
  per micro-step, and pays only when memory binds or a rank takes one micro-step.
- rank time: its micro-step curve summed over its micro-batches. Step time: the slowest rank's time,
  plus the per-step collectives (which every rank enters together after its last micro-step), plus
  the slowest rank's optimizer step (``optimizer_step_s``: ``ModelCosts.optimizer_time`` of every
  parameter under ZeRO-0, of its shard under ZeRO >= 1), which runs between the gradient
  reduction and the ZeRO-1/2 all-gather.
  Under ZeRO-2/3 every rank joins every round of per-micro-step collectives (a rank with fewer
  micro-steps joins with empty ones), so the rounds run in lockstep: the step is the sum over rounds
  of the round's slowest micro-step plus its collectives. Uneven micro-step counts thus cost ZeRO-2/3
  time, and the planner falls back to ZeRO-0/1 where they fit. The full gradient a micro-step's
  backward produces before its reduce-scatter is not counted in memory (ZeRO-2/3).

Strategies: ``"dp"`` chooses shares and micro-batches that minimise the step time exactly
(``autopar.planner.allocate``); ``"uniform-dp"`` (DeepSpeed-style) gives every rank ``B/N`` samples (the first
``B mod N`` one more) in micro-batches of one size, the least max micro-batch over ranks;
``"proportional-dp"`` (Whale-style) gives shares proportional to ``peak_flops_bf16`` (largest
remainder rounding) in micro-batches capped by each rank's memory.

Upper bound, compute bound and efficiency are ``autopar.planner.bounds``'; ``plan_dp`` leaves them 0.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from autopar.config import DP_STRATEGIES, MEMORY_FRACTION, ZERO_STAGES, PlanConfig
from autopar.cost import comm
from autopar.cost.memory import (  # re-exported: the data-parallel planner's memory model
    DEFAULT_WORKSPACE_BYTES, RankMemory, activation_bytes_per_sample, check_zero_stage, max_micro_batch,
    rank_memory,
)
from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.planner.allocate import allocate, balanced_split, lockstep_allocations

if TYPE_CHECKING:  # pragma: no cover
    from scipy.interpolate import PchipInterpolator

    from autopar.cluster.model import Cluster

__all__ = [
    "DpStrategy", "DP_STRATEGIES", "ZERO_STAGES", "DEFAULT_WORKSPACE_BYTES", "ZeroComm", "RankMemory",
    "zero_comm", "micro_step_curve", "activation_bytes_per_sample", "rank_memory", "max_micro_batch",
    "plan_dp", "optimizer_step_s", "shard_memory", "balanced_zero_shares",
]

DpStrategy = Literal["dp", "uniform-dp", "proportional-dp"]


# -- communication -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ZeroComm:
    """Communication of one ZeRO stage over a ring of ranks: seconds and bytes each rank sends."""

    zero_stage: int
    per_step_s: float             # after the last micro-step (ZeRO-0/1/2)
    per_micro_step_s: float       # on every micro-step (ZeRO-2/3)
    per_step_bytes: float
    per_micro_step_bytes: float
    # ZeRO-0/1 with overlap: the gradient all-reduce (part of per_step_s) may run during the last
    # backward, bucket by bucket, all but the last bucket (``last_bucket_s``) hidden.
    allreduce_s: float = 0.0
    last_bucket_s: float = 0.0

    def bytes_moved(self, num_micro_steps: int) -> float:
        return self.per_step_bytes + self.per_micro_step_bytes * num_micro_steps


def zero_comm(costs: ModelCosts, cluster: "Cluster", ranks: Sequence[int], zero_stage: int,
              link: comm.LinkModel = comm.DEFAULT_LINK, algorithm: comm.Algorithm = "auto",
              fractions: Sequence[float] | None = None, *, recompute: bool = False) -> ZeroComm:
    """The collectives of ``zero_stage`` over ``ranks`` (see the module docstring); ``algorithm`` as in
    ``autopar.cost.comm`` ("auto": the faster of a flat ring and a hierarchical one, as NCCL picks).
    ``fractions``: the shards (None: even). The sharded collectives are priced as the engine runs
    them (``autopar.cost.comm.zero_collectives``): uneven shards gathered by one broadcast per owner,
    reduce-scatters in rounds of one staging buffer, ZeRO-3 unit by unit (``recompute``: one unit)."""
    check_zero_stage(zero_stage)
    ranks = tuple(ranks)
    # The dp strategies and their baselines ask for the same collectives (thousands of ranks: seconds
    # each): kept per cluster object, for this costs object.
    memo = comm.cluster_memo(cluster)
    key = ("zero_comm", ranks, zero_stage, link, algorithm,
           None if fractions is None else tuple(float(f) for f in fractions), recompute)
    hit = memo.get(key)
    if hit is not None and hit[0] is costs:
        return hit[1]
    got = _zero_comm(costs, cluster, ranks, zero_stage, link, algorithm, fractions, recompute)
    memo[key] = (costs, got)
    return got


def _zero_comm(costs, cluster, ranks, zero_stage, link, algorithm, fractions, recompute) -> ZeroComm:
    n = len(ranks)
    grad_bytes = float(costs.params.sum()) * costs.grad_bytes_per_param
    param_bytes = float(costs.param_bytes.sum())
    ring = (n - 1) / n if n else 0.0   # fraction of a buffer each rank sends in a ring RS / AG
    dar = comm.dp_allreduces(costs, cluster, ranks, zero_stage, link=link, algorithm=algorithm) if n else \
        comm.DpAllReduces()
    ar, last, loss = dar.grad_s, dar.last_bucket_s, dar.loss_s   # buckets (each its latencies) and the loss sum
    zc = comm.zero_collectives(costs, cluster, ranks, zero_stage, fractions, link=link,
                               algorithm=algorithm) if n else comm.ZeroCollectives()
    rs_bytes = ring * zc.round_reduce_scatter_bytes
    if zero_stage == 0:
        return ZeroComm(0, ar + loss, 0.0, 2 * ring * grad_bytes, 0.0, ar, last)
    if zero_stage == 1:
        return ZeroComm(1, ar + zc.step_gather_s + loss, 0.0, ring * (2 * grad_bytes + param_bytes), 0.0, ar, last)
    if zero_stage == 2:
        return ZeroComm(2, zc.step_gather_s + loss, zc.round_reduce_scatter_s, ring * param_bytes, rs_bytes)
    gathers = 2 if not recompute else 1
    return ZeroComm(3, loss, zc.round_gather_s + zc.round_reduce_scatter_s, 0.0,
                    ring * gathers * param_bytes + rs_bytes)


# -- profiling curves and memory -------------------------------------------------------------------
def micro_step_curve(costs: ModelCosts, device_type: str, zero_stage: int = 0,
                     comm_cost: ZeroComm | None = None, *, max_batch: int | None = None,
                     recompute: bool = False) -> PchipInterpolator:
    """Seconds of one micro-step on ``device_type`` as a function of the micro-batch size.

    Built from the sizes the cost tables were sampled at plus 1 and ``max_batch`` (so evaluating at
    ``1..max_batch`` never extrapolates); PCHIP keeps monotone samples monotone. A micro-step is one
    compute call (``ModelCosts.call_overhead``). ``comm_cost`` adds its per-micro-step collectives
    (non-zero under ZeRO-2 and 3). ``recompute``: the backward re-runs the forward (one more forward).
    """
    check_zero_stage(zero_stage)
    if device_type not in costs.fwd_table:
        raise PlanError(f"device_type: no cost table for {device_type!r} "
                        f"(the costs cover {list(costs.device_types)})")
    if comm_cost is not None and comm_cost.zero_stage != zero_stage:
        raise ValueError(f"comm_cost: computed for ZeRO-{comm_cost.zero_stage}, not ZeRO-{zero_stage}")
    xs = {1.0} | {float(b) for b in costs.sample_batches if b >= 1}
    if max_batch is not None:
        xs.add(float(max(1, max_batch)))
    if len(xs) == 1:
        xs.add(2.0)
    x = np.array(sorted(xs))
    extra = (comm_cost.per_micro_step_s if comm_cost is not None else 0.0) + costs.call_overhead(device_type, "micro_step")
    y = np.array([costs.step_time(device_type, b)
                  + (float(costs.fwd_time(device_type, b).sum()) if recompute else 0.0) for b in x]) + extra
    from scipy.interpolate import PchipInterpolator   # local: scipy.interpolate takes ~0.5 s to import

    return PchipInterpolator(x, y, extrapolate=True)


# -- planning -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Candidate:
    zero_stage: int
    shares: tuple[int, ...]
    micro: tuple[tuple[int, ...], ...]
    step_time_s: float
    compute_s: float
    comm_s: float
    bytes_moved: float
    memory_bytes: dict[int, int]
    note: str = ""
    optimizer_s: float = 0.0
    recompute: bool = False
    zero_shares: tuple[float, ...] = ()   # per rank, () = even


def _check_ranks(cluster: "Cluster", ranks) -> tuple[int, ...]:
    if ranks is None:
        return tuple(range(len(cluster)))
    out = tuple(ranks)
    if not out:
        raise PlanError("ranks: empty; a data-parallel plan needs at least one rank")
    for r in out:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < len(cluster):
            raise PlanError(f"ranks: {r!r} is not a rank of the cluster (ranks 0..{len(cluster) - 1})")
    if len(set(out)) != len(out):
        raise PlanError(f"ranks: {out} repeats a rank")
    return tuple(sorted(int(r) for r in out))


def _check_dp_batch(dp_batch, ranks: tuple[int, ...], global_batch: int) -> dict[int, int]:
    pinned = {}
    for r, s in dict(dp_batch).items():
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r not in ranks:
            raise PlanError(f"dp_batch: rank {r!r} is not in the plan (ranks {list(ranks)})")
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise PlanError(f"dp_batch[{r}] = {s!r}: need an integer number of samples >= 0")
        pinned[int(r)] = int(s)
    total = sum(pinned.values())
    if len(pinned) == len(ranks) and total != global_batch:
        raise PlanError(f"dp_batch pins every rank to {total} samples in all, but the global batch "
                        f"is {global_batch}: the shares must cover it exactly")
    if total > global_batch:
        raise PlanError(f"dp_batch pins {total} samples, more than the global batch of {global_batch}")
    return pinned


def _largest_remainder(weights: Sequence[float], total: int) -> list[int]:
    w = np.asarray(weights, dtype=float)
    exact = w / w.sum() * total
    out = np.floor(exact).astype(int)
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: total - int(out.sum())]:
        out[i] += 1
    return [int(v) for v in out]


def _uniform_split(samples: int, micro: int) -> tuple[int, ...]:
    full, rest = divmod(samples, micro)
    return (micro,) * full + ((rest,) if rest else ())


def _fit_error(costs, cluster, ranks, mems, zero_stage) -> str | None:
    """Why ``zero_stage`` cannot run on these ranks (states or one sample do not fit), or None."""
    for r, m in zip(ranks, mems):
        if m.fixed_bytes > m.usable_bytes:
            return (f"ZeRO-{zero_stage}: rank {r} ({cluster.devices[r].spec.name}) needs {m.fixed_bytes:.4g} "
                    f"bytes before any sample ({m.fixed_terms()}) and has {m.usable_bytes:.4g} usable")
    if all(m.max_micro == 0 for m in mems):
        i = max(range(len(ranks)), key=lambda j: mems[j].usable_bytes - mems[j].fixed_bytes)
        m = mems[i]
        return (f"ZeRO-{zero_stage}: a micro-batch of 1 sample needs {m.peak_bytes(1):.4g} bytes "
                f"({m.fixed_terms()} + {m.micro_term()}) and the roomiest device, rank {ranks[i]} "
                f"({cluster.devices[ranks[i]].spec.name}), has {m.usable_bytes:.4g} usable")
    return None


def optimizer_step_s(costs: ModelCosts, cluster: "Cluster", ranks: Sequence[int], zero_stage: int,
                     fractions: Sequence[float] | None = None) -> float:
    """Seconds of the slowest rank's optimizer step (a compute call) in a data-parallel plan over
    ``ranks``: every parameter under ZeRO-0, its shard (one flat buffer) under ZeRO >= 1: the
    fraction ``fractions[i]`` of the parameters for ``ranks[i]`` (default: even, 1/N each)."""
    total = float(costs.params.sum())
    if zero_stage < 1:
        parts = [1.0] * len(ranks)
    else:
        parts = list(fractions) if fractions is not None else [1.0 / max(1, len(ranks))] * len(ranks)
    return max((costs.optimizer_time(cluster.devices[r].spec.name, total * f, flat=zero_stage >= 1)
                + costs.call_overhead(cluster.devices[r].spec.name) for r, f in zip(ranks, parts)),
               default=0.0)


def shard_memory(costs: ModelCosts, spec, zero_stage: int, fraction: float,
                 memory_fraction: float = MEMORY_FRACTION, *, workspace_bytes: float = DEFAULT_WORKSPACE_BYTES,
                 recompute: bool = False) -> RankMemory:
    """``rank_memory`` of a rank keeping the ``fraction`` of the sharded states (ZeRO >= 1; uneven
    shards), instead of 1/N."""
    m = rank_memory(costs, spec, zero_stage, 1, memory_fraction, workspace_bytes=workspace_bytes,
                    recompute=recompute)
    return replace(m, state_bytes=costs.state_bytes(zero_stage=zero_stage, shard_fraction=float(fraction)))


def balanced_zero_shares(costs: ModelCosts, cluster: "Cluster", ranks: Sequence[int], zero_stage: int,
                         memory_fraction: float = MEMORY_FRACTION, *,
                         workspace_bytes: float = DEFAULT_WORKSPACE_BYTES,
                         recompute: bool = False) -> tuple[float, ...] | None:
    """Shard fractions (one per rank of ``ranks``, summing to 1) that minimise the slowest rank's
    optimizer step (``optimizer_step_s``) under ZeRO >= 1, each rank's shard capped so that its
    states and one sample still fit in its memory (or, where that cannot cover the model, its states
    alone). Water-filling on the linear optimizer times ``a_r + b_r f_r``: the level ``T`` with
    ``sum_r clip((T - a_r) / b_r, 0, cap_r) = 1``, found by bisection. None when the caps cannot
    cover the model or no rank's optimizer time depends on its shard."""
    if zero_stage < 1 or not ranks:
        return None
    total = float(costs.params.sum())
    names = [cluster.devices[r].spec.name for r in ranks]
    a = [costs.call_overhead(n) for n in names]
    b = [costs.optimizer_time(n, total, flat=True) for n in names]
    if total <= 0 or all(x <= 0 for x in b):
        return None
    caps = None
    for one_sample in (True, False):
        got, per_spec = [], {}   # a rank's cap depends on its spec alone: once per device type
        for r in ranks:
            spec = cluster.devices[r].spec
            if spec not in per_spec:
                m0, m1 = (shard_memory(costs, spec, zero_stage, f, memory_fraction, workspace_bytes=workspace_bytes,
                                       recompute=recompute) for f in (0.0, 1.0))
                room = m0.usable_bytes - m0.fixed_bytes - (m0.micro_bytes(1) if one_sample else 0.0)
                slope = m1.state_bytes - m0.state_bytes
                per_spec[spec] = (1.0 if slope <= 0 and room >= 0 else min(1.0, max(0.0, room / slope))
                                  if slope > 0 else 0.0)
            got.append(per_spec[spec])
        if sum(got) >= 1.0:
            caps = got
            break
    if caps is None:
        return None
    a_, b_, c_ = (np.asarray(v, dtype=np.float64) for v in (a, b, caps))
    pos, safe_b = b_ > 0, np.where(b_ > 0, b_, 1.0)

    def filled(level: float) -> list[float]:   # per rank clip((level - a) / b, 0, cap); b = 0: cap once level >= a
        rising = np.minimum(c_, np.maximum(0.0, (level - a_) / safe_b))
        return np.where(pos, rising, np.where(level >= a_, c_, 0.0)).tolist()

    lo, hi = min(a), max(ai + bi * c for ai, bi, c in zip(a, b, caps))
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if sum(filled(mid)) < 1.0 else (lo, mid)
    f = filled(hi)
    s = sum(f)
    return tuple(x / s for x in f)


def _share_candidates(costs, cluster, ranks, zero_stage, memory_fraction, workspace_bytes,
                      recompute) -> list[tuple[float, ...] | None]:
    """The shard fractions ``"dp"`` tries (None: even): even, the optimizer-balanced shares and their
    midpoint. Homogeneous ranks and ZeRO-0 try even only."""
    n = len(ranks)
    if zero_stage < 1 or n < 2:
        return [None]
    bal = balanced_zero_shares(costs, cluster, ranks, zero_stage, memory_fraction,
                               workspace_bytes=workspace_bytes, recompute=recompute)
    if bal is None or max(abs(x - 1.0 / n) for x in bal) < 1e-9:
        return [None]
    mid = tuple(0.5 * (x + 1.0 / n) for x in bal)
    return [None, bal, mid]


def _evaluate(shares, micro, fns, zc: ZeroComm, ranks, mems, note="", optimizer_s: float = 0.0,
              recompute: bool = False, bwds=None, restarts=None) -> _Candidate:
    rank_time = [sum(map(fns[i], mb)) + (restarts[i] if restarts and mb else 0.0) for i, mb in enumerate(micro)]
    slow = int(np.argmax(rank_time))
    steps = [len(mb) for mb in micro]
    if zc.per_micro_step_s > 0:
        # ZeRO-2/3: every rank joins every round's collectives (one without a micro-step in the round
        # with nothing), so the rounds run in lockstep: each lasts its slowest micro-step.
        rounds = max(steps, default=0)
        compute_s = sum(max(fns[i](mb[r]) - zc.per_micro_step_s for i, mb in enumerate(micro) if r < len(mb))
                        for r in range(rounds))
        comm_s = zc.per_step_s + zc.per_micro_step_s * rounds
    else:
        comm_s = zc.per_step_s
        compute_s = rank_time[slow]
        if bwds is not None and zc.allreduce_s > 0 and micro[slow]:
            # Overlap (ZeRO-0/1): the buckets' all-reduces run during the slowest rank's last backward;
            # what is left after it is exposed, at least the last bucket's all-reduce.
            window = bwds[slow](micro[slow][-1])
            comm_s -= max(0.0, min(zc.allreduce_s - zc.last_bucket_s, window))
    memory = {r: m.peak_bytes(max(mb, default=0)) for r, m, mb in zip(ranks, mems, micro)}
    return _Candidate(
        zero_stage=zc.zero_stage, shares=tuple(shares), micro=tuple(tuple(m) for m in micro),
        step_time_s=compute_s + comm_s + optimizer_s, compute_s=compute_s, comm_s=comm_s,
        bytes_moved=zc.bytes_moved(max(steps)), memory_bytes=memory, note=note, optimizer_s=optimizer_s,
        recompute=recompute,
    )


def _rank_memories(costs, specs, zero_stage, fractions, memory_fraction, workspace_bytes, recompute) -> list:
    """Each rank's memory model: a rank's memory depends on its spec and shard alone, so once per (type, shard)."""
    n = len(specs)
    kw = dict(workspace_bytes=workspace_bytes, recompute=recompute)
    per: dict = {}
    for s, f in zip(specs, fractions if fractions is not None else [None] * n):
        if (s, f) not in per:
            per[s, f] = rank_memory(costs, s, zero_stage, n, memory_fraction, **kw) if f is None else \
                shard_memory(costs, s, zero_stage, f, memory_fraction, **kw)
    return [per[s, f] for s, f in zip(specs, fractions if fractions is not None else [None] * n)]


def _baseline_split(strategy, cluster, ranks, caps, global_batch, zero_stage) -> tuple[list, list]:
    """(shares, micro-batches) of a baseline: "uniform-dp" even shares in micro-batches every rank holds,
    "proportional-dp" shares by peak FLOP/s (largest remainder) on the ranks that hold a sample."""
    n = len(ranks)
    if strategy == "uniform-dp":
        if global_batch < n:
            raise PlanError(f"uniform-dp gives every rank work: needs a global batch of at least "
                            f"{n} samples for {n} ranks, got {global_batch}")
        micro_size = min(caps)
        if micro_size == 0:
            r = ranks[caps.index(0)]
            raise PlanError(f"ZeRO-{zero_stage}: uniform-dp needs every rank to hold a micro-batch; "
                            f"rank {r} ({cluster.devices[r].spec.name}) cannot hold 1 sample")
        micro_size = min(micro_size, -(-global_batch // n))
        base, extra = divmod(global_batch, n)
        shares = [base + (1 if i < extra else 0) for i in range(n)]
        return shares, [_uniform_split(s, micro_size) for s in shares]
    able = [i for i in range(n) if caps[i] > 0]
    got = _largest_remainder([cluster.devices[ranks[i]].spec.peak_flops_bf16 for i in able], global_batch)
    shares = [0] * n
    for i, s in zip(able, got):
        shares[i] = s
    return shares, [balanced_split(s, -(-s // caps[i])) if s else () for i, s in enumerate(shares)]


def _plan_stage(costs, cluster, ranks, global_batch, strategy, zero_stage, pinned, memory_fraction,
                workspace_bytes, link, algorithm, recompute: bool = False,
                fractions: tuple[float, ...] | None = None, overlap: bool = True) -> _Candidate:
    """The best allocation of one strategy at one ZeRO stage, with shard ``fractions`` per rank
    (None: even 1/N); ``overlap``: ZeRO-0/1 reduce gradients during the last backward."""
    specs = [cluster.devices[r].spec for r in ranks]
    mems = _rank_memories(costs, specs, zero_stage, fractions, memory_fraction, workspace_bytes, recompute)
    why = _fit_error(costs, cluster, ranks, mems, zero_stage)
    if why:
        raise PlanError(why)
    caps = [m.max_micro for m in mems]
    zc = zero_comm(costs, cluster, ranks, zero_stage, link, algorithm, fractions, recompute=recompute)
    # One curve (and so one allocation table) per device type.
    by_type: dict[str, tuple] = {}
    fns = []
    for spec, cap in zip(specs, caps):
        key = (spec.name, cap)
        if key not in by_type:
            curve = micro_step_curve(costs, spec.name, zero_stage, zc, max_batch=min(cap, global_batch),
                                     recompute=recompute)
            by_type[key] = functools.lru_cache(maxsize=None)(lambda b, c=curve: float(c(b)))   # once per size
        fns.append(by_type[key])
    bwds = restarts = None
    if overlap and zc.allreduce_s > 0 and comm.dp_comm_hides(cluster, ranks):
        def backward_s(name):
            return lambda b: float(costs.bwd_time(name, b).sum()
                                   + (costs.fwd_time(name, b).sum() if recompute else 0.0))
        bwds = [backward_s(spec.name) for spec in specs]
        restarts = comm.dp_bucket_restarts_s(costs, [spec.name for spec in specs])   # per bucket launched

    opt_s = optimizer_step_s(costs, cluster, ranks, zero_stage, fractions)
    kept = tuple(float(f) for f in fractions) if fractions is not None else ()

    def evaluate(shares, micro, note=""):
        return replace(_evaluate(shares, micro, fns, zc, ranks, mems, note, opt_s, recompute, bwds, restarts),
                       zero_shares=kept)

    if strategy in ("uniform-dp", "proportional-dp"):
        return evaluate(*_baseline_split(strategy, cluster, ranks, caps, global_batch, zero_stage))
    for r, s in pinned.items():
        m = mems[ranks.index(r)]
        if s > 0 and m.max_micro == 0:
            raise PlanError(f"ZeRO-{zero_stage}: dp_batch[{r}] = {s}, but rank {r} "
                            f"({cluster.devices[r].spec.name}) cannot hold 1 sample: it needs "
                            f"{m.peak_bytes(1):.4g} bytes and has {m.usable_bytes:.4g} usable")
    fixed = {ranks.index(r): s for r, s in pinned.items()}
    alloc = allocate(fns, caps, global_batch, fixed_shares=fixed)
    best = evaluate(alloc.shares, alloc.micro_batches)
    if zc.per_micro_step_s > 0 and not fixed:
        # ZeRO-2/3 rounds run in lockstep: also try R rounds of one micro-batch per rank each, sized
        # so that every round's micro-steps end together.
        for shares, micro in lockstep_allocations(fns, caps, global_batch):
            alt = evaluate(shares, micro, note="lockstep rounds")
            if alt.step_time_s < best.step_time_s * (1 - 1e-12):
                best = alt
    if not fixed:
        # The allocator is exact over even splits; a baseline's uneven split (one remainder
        # micro-batch) can still win on a concave curve, so the better of them is kept.
        for other in ("uniform-dp", "proportional-dp"):
            try:
                alt = _plan_stage(costs, cluster, ranks, global_batch, other, zero_stage, {},
                                  memory_fraction, workspace_bytes, link, algorithm, recompute, fractions,
                                  overlap)
            except PlanError:
                continue
            if alt.step_time_s < best.step_time_s * (1 - 1e-12):
                best = replace(alt, note=f"{other}'s allocation predicted faster; kept it")
    return best


def _variant_candidates(costs, cluster, ranks, global_batch, strategy, variants, pinned, memory_fraction,
                        workspace_bytes, link, algorithm, overlap) -> tuple[dict, dict]:
    """(the best ``_Candidate`` per (ZeRO stage, recompute) variant that fits, why the others do not).
    "dp" also chooses each rank's ZeRO shard (uneven shards): every candidate is planned with its own
    memory caps, and the fastest kept; the baselines keep even shards."""
    found: dict[tuple[int, bool], _Candidate] = {}
    failed: dict[tuple[int, bool], str] = {}
    for z, rc in variants:
        shares = (_share_candidates(costs, cluster, ranks, z, memory_fraction, workspace_bytes, rc)
                  if strategy == "dp" else [None])
        for fractions in shares:
            try:
                c = _plan_stage(costs, cluster, ranks, global_batch, strategy, z, pinned,
                                memory_fraction, workspace_bytes, link, algorithm, rc, fractions, overlap)
            except PlanError as e:
                if fractions is None:
                    failed[(z, rc)] = str(e)
                continue
            old = found.get((z, rc))
            if old is None or c.step_time_s < old.step_time_s * (1 - 1e-12):
                found[(z, rc)] = c
                failed.pop((z, rc), None)
    return found, failed


def _variant_notes(variants, found: dict, failed: dict, best: _Candidate) -> list[str]:
    """One line per variant: its predicted step and where it goes, or why it does not fit."""
    notes = []
    for z, rc in variants:
        name = f"zero-{z}{' recompute' if rc else ''}"
        if (z, rc) in found:
            c = found[(z, rc)]
            mark = " (chosen)" if c is best else ""
            notes.append(f"{name}{mark}: {c.step_time_s:.6g} s/step (compute {c.compute_s:.4g} s, "
                         f"comm {c.comm_s:.4g} s, optimizer {c.optimizer_s:.4g} s, "
                         f"{c.bytes_moved:.4g} B sent per rank)"
                         + (f"; ZeRO shards {', '.join(f'{x:.3f}' for x in c.zero_shares)}" if c.zero_shares else "")
                         + (f"; {c.note}" if c.note else ""))
        else:
            notes.append(f"{name}: does not fit: {failed[(z, rc)]}")
    return notes


def plan_dp(costs: ModelCosts, cluster: "Cluster", global_batch: int, *, strategy: DpStrategy = "dp",
            zero_stage: int | Literal["auto"] = "auto", dp_batch: Mapping[int, int] | None = None,
            ranks: Sequence[int] | None = None, memory_fraction: float = MEMORY_FRACTION,
            workspace_bytes: float = DEFAULT_WORKSPACE_BYTES,
            link: comm.LinkModel = comm.DEFAULT_LINK, algorithm: comm.Algorithm = "auto",
            recompute: bool = False, overlap: bool = True, force_recompute: bool = False) -> Plan:
    """A data-parallel plan (one stage over every block, one member per rank) and its prediction.

    ``zero_stage="auto"`` tries every stage and keeps the fastest that fits (fewest bytes moved on a
    tie); ``Plan.notes`` lists each stage's predicted step time or why it does not fit.
    ``dp_batch`` pins some ranks' shares (strategy "dp" only); the others take the rest.
    ``ranks`` restricts the plan to a subset of the cluster. Upper bound, compute bound and
    efficiency are left at 0: ``autopar.planner.bounds.with_all_bounds`` sets them. ``recompute`` (strategy "dp" only; the baselines
    keep their activations) also tries every ZeRO stage recomputing activations block by block
    (``Stage.recompute``: memory of ``activation_bytes_per_sample``, one more forward per micro-step);
    keeping wins ties; ``force_recompute`` (a pinned recompute, any strategy) tries only recomputing
    plans. ``overlap`` (the engine's default, ``RunConfig.overlap``): ZeRO-0/1's gradient
    all-reduce is priced as the runtime runs it, in buckets of ``comm.grad_bucket_bytes`` during the slowest
    rank's last backward: exposed is what does not fit in that backward, at least the last bucket.
    ZeRO-3's prefetch is not priced (its gathers stay on the micro-step's critical path).
    """
    if strategy not in DP_STRATEGIES:
        raise PlanError(f"strategy: {strategy!r} is not a data-parallel strategy {DP_STRATEGIES}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
        raise PlanError(f"global_batch: {global_batch!r} must be an integer >= 1")
    global_batch = int(global_batch)
    PlanConfig(memory_fraction=memory_fraction)   # the choice's one check
    ranks = _check_ranks(cluster, ranks)
    pinned = {}
    if dp_batch is not None:
        if strategy != "dp":
            raise PlanError(f"dp_batch: pinned shares need strategy='dp', not {strategy!r}")
        pinned = _check_dp_batch(dp_batch, ranks, global_batch)
    for r in ranks:
        name = cluster.devices[r].spec.name
        if name not in costs.fwd_table:
            raise PlanError(f"costs: no time table for device type {name!r} of rank {r} "
                            f"(the costs cover {list(costs.device_types)})")
    if zero_stage == "auto":
        stages = ZERO_STAGES
    else:
        check_zero_stage(zero_stage)
        stages = (int(zero_stage),)

    variants = [(z, False) for z in stages]
    if force_recompute:
        variants = [(z, True) for z in stages]
    elif recompute and strategy == "dp":
        variants += [(z, True) for z in stages]
    found, failed = _variant_candidates(costs, cluster, ranks, global_batch, strategy, variants, pinned,
                                        memory_fraction, workspace_bytes, link, algorithm, overlap)
    if not found:
        kept = [v for (_, rc), v in failed.items() if rc == force_recompute]
        if len(kept) == 1:
            raise PlanError(f"{strategy}: " + kept[0])
        raise PlanError(f"{strategy}: no ZeRO stage fits: " + "; ".join(kept))
    best_time = min(c.step_time_s for c in found.values())
    tied = [c for c in found.values() if c.step_time_s <= best_time * (1 + 1e-9)]
    best = min(tied, key=lambda c: (c.recompute, c.bytes_moved, c.zero_stage))

    notes = _variant_notes(variants, found, failed, best)
    stage = Stage(block_start=0, block_stop=max(costs.num_blocks, 1),
                  groups=tuple((r,) for r in ranks), micro_batches=best.micro, recompute=best.recompute,
                  zero_shares=best.zero_shares)
    predicted = Predicted(
        step_time_s=best.step_time_s, samples_per_s=global_batch / best.step_time_s,
        memory_bytes=dict(best.memory_bytes),
        breakdown={"compute_s": best.compute_s, "comm_s": best.comm_s, "optimizer_s": best.optimizer_s},
    )
    return Plan(strategy=strategy, global_batch_size=global_batch, zero_stage=best.zero_stage,
                schedule="none", stages=(stage,), predicted=predicted,
                block_names=tuple(costs.block_names), notes=tuple(notes))
