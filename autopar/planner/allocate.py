"""Uneven data-parallel batch allocation: a pure solver over numbers (no torch, no cluster).

Terms
- rank r: one data-parallel participant, numbered 0..N-1 in the order of ``time_fns``.
- share s_r: the samples of the global batch rank r computes each step; the shares sum exactly to
  the global batch, which need not be divisible by anything; a share may be 0.
- micro-step: one forward + backward over a micro-batch; a rank accumulates gradients over its
  list of micro-batches. ``time_fns[r](b)`` is the seconds of one micro-step of ``b`` samples on
  rank r (including any per-micro-step communication), asked only for ``1 <= b <= max_micro[r]``.
- split: a share s cut into k micro-batches whose sizes differ by at most 1 (``s % k`` of size
  ``ceil(s/k)``, the rest ``floor(s/k)``), each at most ``max_micro[r]``; so ``k >= ceil(s/max_micro)``.
- rank time ``T_r(s)``: the least summed micro-step time over the splits of s (among equal times, the
  fewest micro-steps; with a per-micro-step overhead that is ``ceil(s/max_micro)``); ``T_r(0) = 0``.
- step time: ``max_r T_r(s_r)``, the objective. Costs common to every rank (an all-reduce after the
  last micro-step) do not change the best shares; the caller adds them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autopar.errors import PlanError

__all__ = ["Allocation", "allocate", "balanced_split", "rank_time_table", "round_split", "lockstep_allocations"]


@dataclass(frozen=True, slots=True)
class Allocation:
    """The solver's answer: per rank its share, its micro-batch sizes and its predicted seconds."""

    shares: tuple[int, ...]
    micro_batches: tuple[tuple[int, ...], ...]
    rank_time_s: tuple[float, ...]
    step_time_s: float          # max over ranks of rank_time_s: the optimum of the model

    @property
    def num_ranks(self) -> int:
        return len(self.shares)


def balanced_split(samples: int, num_steps: int) -> tuple[int, ...]:
    """``samples`` cut into ``num_steps`` sizes differing by at most 1, the larger ones first."""
    if samples < 0 or num_steps < 0 or (samples > 0 and num_steps == 0):
        raise ValueError(f"balanced_split: cannot cut samples={samples} into num_steps={num_steps}")
    if samples == 0:
        return ()
    q, r = divmod(samples, num_steps)
    return (q + 1,) * r + (q,) * (num_steps - r)


def rank_time_table(time_fn: Callable[[int], float], max_micro: int,
                    max_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """``(T, K)`` for ``s = 0..max_samples``: the rank time ``T[s]`` and the micro-step count ``K[s]``
    of its best split. ``T[s] = inf`` where no split exists (``max_micro == 0`` and ``s > 0``).

    Exhaustive over k: ``O(max_samples**2)`` cheap array operations, calls ``time_fn`` only for
    ``b <= min(max_micro, max_samples)``.
    """
    S = int(max_samples)
    m = min(int(max_micro), S)
    T = np.full(S + 1, np.inf)
    K = np.zeros(S + 1, dtype=np.int64)
    T[0] = 0.0
    if m <= 0:
        return T, K
    t = np.empty(m + 2)
    t[0] = t[m + 1] = 0.0  # t[m+1] is only ever multiplied by a zero count
    for b in range(1, m + 1):
        v = float(time_fn(b))
        if not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"time_fn({b}) = {v}: micro-step times must be finite and >= 0")
        t[b] = v
    for k in range(1, S + 1):  # k ascending + strict improvement keeps the fewest steps among ties
        s = np.arange(k, min(S, k * m) + 1)
        q, r = np.divmod(s, k)
        cost = r * t[q + 1] + (k - r) * t[q]
        better = cost < T[s]
        T[s[better]] = cost[better]
        K[s[better]] = k
    return T, K


def _check_inputs(time_fns, max_micro, global_batch, fixed_shares) -> dict[int, int]:
    n = len(time_fns)
    if len(max_micro) != n:
        raise ValueError(f"allocate: max_micro has {len(max_micro)} entries for {n} time_fns")
    if n == 0:
        raise PlanError("allocate: no ranks to allocate the batch over")
    for r, m in enumerate(max_micro):
        if int(m) != m or m < 0:
            raise ValueError(f"allocate: max_micro[{r}] = {m!r}, need an integer >= 0")
    if isinstance(global_batch, bool) or int(global_batch) != global_batch or global_batch < 1:
        raise PlanError(f"global_batch = {global_batch!r}: need an integer >= 1")
    fixed = {}
    for r, s in dict(fixed_shares or {}).items():
        if not (isinstance(r, (int, np.integer)) and 0 <= r < n):
            raise PlanError(f"fixed_shares: rank {r!r} does not exist (ranks 0..{n - 1})")
        if isinstance(s, bool) or int(s) != s or s < 0:
            raise PlanError(f"fixed_shares[{r}] = {s!r}: need an integer number of samples >= 0")
        if s > 0 and max_micro[r] == 0:
            raise PlanError(f"fixed_shares[{r}] = {s} samples, but rank {r} cannot hold even one "
                            f"sample (max_micro 0)")
        fixed[int(r)] = int(s)
    pinned = sum(fixed.values())
    if pinned > global_batch:
        raise PlanError(f"fixed_shares pin {pinned} samples, more than global_batch = {global_batch}")
    if all(m == 0 for m in max_micro):
        raise PlanError("the model does not fit: no rank can hold a micro-batch of 1 sample "
                        "(max_micro is 0 on every rank)")
    free = [r for r in range(n) if r not in fixed and max_micro[r] > 0]
    if pinned < global_batch and not free:
        raise PlanError(f"fixed_shares pin {pinned} of global_batch = {global_batch} samples and no "
                        f"other rank can take the remaining {global_batch - pinned}")
    return fixed


def _is_monotone(T: np.ndarray) -> bool:
    return bool(np.all(np.diff(T) >= 0.0))


def _greedy(tables: list[np.ndarray], remaining: int, kinds: Sequence | None = None) -> list[int]:
    """Optimal shares when every table is non-decreasing: threshold search, then greedy fill. ``kinds``:
    per table a key, equal for equal tables (ranks of one device type share one); the threshold search
    runs over the distinct tables, each counted once per rank that holds it (None: all distinct)."""
    distinct: dict = {}
    of_rank = np.array([distinct.setdefault(k, len(distinct)) for k in (range(len(tables)) if kinds is None else kinds)])
    uniq = [None] * len(distinct)
    for T, u in zip(tables, of_rank):
        uniq[u] = T
    weight = np.bincount(of_rank, minlength=len(uniq))
    # Threshold: the least candidate time tau at which the ranks can absorb the batch, capacity
    # c_r(tau) = max{s : T_r(s) <= tau}. The optimum is one of the table values, hence tau.
    cand = np.unique(np.concatenate(uniq))
    cand = cand[np.isfinite(cand)]

    def capacity(tau: float) -> np.ndarray:
        return np.array([np.searchsorted(T, tau, side="right") - 1 for T in uniq])

    lo, hi = 0, len(cand) - 1   # capacity(cand[-1]) covers the batch: every s <= remaining is finite
    while lo < hi:
        mid = (lo + hi) // 2
        if int(capacity(cand[mid]) @ weight) >= remaining:
            hi = mid
        else:
            lo = mid + 1
    caps = capacity(cand[lo])[of_rank]
    # Greedy fill within the caps: each sample goes where it makes that rank's time the least.
    shares = [0] * len(tables)
    heap = [(float(T[1]), i) for i, T in enumerate(tables) if caps[i] >= 1]
    heapq.heapify(heap)
    for _ in range(remaining):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        if shares[i] < caps[i]:
            heapq.heappush(heap, (float(tables[i][shares[i] + 1]), i))
    return shares


def _minmax_dp(tables: list[np.ndarray], remaining: int) -> list[int]:
    """Optimal shares for any tables: F_i(x) = min_s max(F_{i-1}(x - s), T_i(s)), then backtrack."""
    R = remaining
    F = np.full(R + 1, np.inf)
    F[0] = 0.0
    choices = []
    for T in tables:
        G = np.full(R + 1, np.inf)
        C = np.zeros(R + 1, dtype=np.int64)
        for s in range(R + 1):
            cand = np.maximum(F[: R + 1 - s], T[s])
            better = cand < G[s:]
            G[s:][better] = cand[better]
            C[s:][better] = s
        F = G
        choices.append(C)
    shares = [0] * len(tables)
    x = R
    for i in range(len(tables) - 1, -1, -1):
        shares[i] = int(choices[i][x])
        x -= shares[i]
    return shares


def allocate(time_fns: Sequence[Callable[[int], float]], max_micro: Sequence[int], global_batch: int,
             *, fixed_shares: Mapping[int, int] | None = None) -> Allocation:
    """Shares and micro-batch splits that minimise the step time ``max_r T_r(s_r)``, exactly.

    ``fixed_shares`` pins the shares of some ranks; the others absorb the rest of the batch.

    Why it is optimal. Every rank's time table ``T_r(s)`` is computed exhaustively over the splits
    (``rank_time_table``), so what remains is to choose shares summing to the batch B with the least
    max. When every table is non-decreasing (always the case for non-decreasing ``time_fns``: cutting
    one sample from a split never lengthens a micro-step), a rank can take any ``s <= c_r(tau) =
    max{s : T_r(s) <= tau}`` within time tau, so tau is achievable iff ``sum_r c_r(tau) >= B``.
    The optimum tau* is a value of some table (it is some rank's ``T_r(s_r)``), and achievability is
    monotone in tau, so a binary search over the sorted table values finds it. The greedy fill then
    hands out the B samples one at a time, each to the rank whose time after taking it is the least,
    never above its cap ``c_r(tau*)``; while fewer than B are placed some rank is below its cap
    (the caps sum to >= B), so the fill never stalls and every rank ends within tau*.
    When some table is not monotone (a ``time_fn`` that drops, e.g. a faster padded size), capacity
    is no longer an interval and the exact min-max dynamic program over ranks
    ``F_i(x) = min_s max(F_{i-1}(x - s), T_i(s))`` is used instead (``O(N B^2)``).

    Raises ``PlanError`` when the batch cannot be covered (pinned shares exceed it, or no unpinned
    rank can take the rest) or no rank can hold a single sample.
    """
    fixed = _check_inputs(time_fns, max_micro, global_batch, fixed_shares)
    n = len(time_fns)
    remaining = int(global_batch) - sum(fixed.values())
    horizon = max([remaining] + list(fixed.values()))
    # Ranks sharing a (time_fn, max_micro) pair (one device type) share one table.
    memo: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    tables, keys = [], []
    for r in range(n):
        key = (id(time_fns[r]), int(max_micro[r]))
        if key not in memo:
            memo[key] = rank_time_table(time_fns[r], int(max_micro[r]), horizon)
        tables.append(memo[key])
        keys.append(key)

    shares = [0] * n
    for r, s in fixed.items():
        shares[r] = s
    free = [r for r in range(n) if r not in fixed and max_micro[r] > 0]
    if remaining > 0:
        free_tables = [tables[r][0][: remaining + 1] for r in free]
        if all(_is_monotone(T) for T in free_tables):
            got = _greedy(free_tables, remaining, [keys[r] for r in free])
        else:
            got = _minmax_dp(free_tables, remaining)
        for r, s in zip(free, got):
            shares[r] = s

    micro = []
    times = []
    for r in range(n):
        T, K = tables[r]
        s = shares[r]
        micro.append(balanced_split(s, int(K[s])))
        times.append(float(T[s]))
    return Allocation(shares=tuple(shares), micro_batches=tuple(micro), rank_time_s=tuple(times),
                      step_time_s=max(times))


def round_split(fns, caps, total: int) -> list[int] | None:
    """Min-max split of ``total`` samples into one micro-batch per rank (``x_r <= caps[r]``): greedy,
    each sample to the rank whose micro-step would end first (exact for non-decreasing times)."""
    if total > sum(caps):
        return None
    x = [0] * len(fns)
    heap = [(fns[r](1), r) for r in range(len(fns)) if caps[r] > 0]
    heapq.heapify(heap)
    for _ in range(total):
        _, r = heapq.heappop(heap)
        x[r] += 1
        if x[r] < caps[r]:
            heapq.heappush(heap, (fns[r](x[r] + 1), r))
    return x


def lockstep_allocations(fns, caps, global_batch: int):
    """(shares, micro-batch lists) of R rounds of one micro-batch per rank, for a ladder of R from the
    fewest rounds the caps allow: the first ``B mod R`` rounds take one sample more."""
    fewest = max(1, -(-global_batch // max(1, sum(caps))))
    counts = {fewest, fewest + 1}
    r = float(fewest)
    while r < min(global_batch, 64 * fewest):
        counts.add(int(r))
        r *= 1.5
    for R in sorted(c for c in counts if 1 <= c <= global_batch):
        q, rem = divmod(global_batch, R)
        big = round_split(fns, caps, q + 1) if rem else None
        small = round_split(fns, caps, q) if q else [0] * len(fns)
        if small is None or (rem and big is None):
            continue
        micro = []
        for i in range(len(fns)):
            sizes = ([big[i]] * rem if rem else []) + [small[i]] * (R - rem)
            micro.append(tuple(b for b in sizes if b > 0))
        yield [sum(m) for m in micro], micro
