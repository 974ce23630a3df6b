"""The exact split DP of a pipeline: n blocks into S consecutive non-empty stages minimising the
classic estimate ``sum_s t_s + (M - 1) max_s t_s`` over a stage cost tensor ``[s, i, j]`` (seconds of
stage s on blocks [i, j), inf where that does not fit). ``autopar.planner.pp`` and the joint search
call it; ``autopar.planner.pp`` re-exports the names.

Terms
- window: the starts s .. n - S + s and ends s + 1 .. n - S + s + 1 stage s can take in such a split
  (``_windows``); the DPs run on these (n - S + 1)^2 entries per stage only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["split_objective", "split_blocks", "min_bottleneck"]


def split_objective(stage_times_s: Sequence[float], num_micro: int) -> float:
    """The classic pipeline estimate ``sum_s t_s + (M - 1) * max_s t_s``."""
    return float(sum(stage_times_s) + (num_micro - 1) * max(stage_times_s))


def _windows(cost: np.ndarray) -> np.ndarray:
    """``[s, a, b] = cost[s, s + a, s + 1 + b]`` for a, b < n - S + 1: the only starts (s .. n - S + s)
    and ends stage s can take when n blocks are split into S non-empty stages. The split DPs below
    run on these (n - S + 1)^2 entries per stage instead of (n + 1)^2 (82 blocks in 56 stages: 9x
    fewer) and find the same minima and argmins: in a tensor masked below the diagonal every other
    entry is off every split."""
    S, n1, _ = cost.shape
    s = np.arange(S)[:, None, None]
    a = np.arange(n1 - S)
    return cost[s, s + a[None, :, None], s + 1 + a[None, None, :]]


def _dp_min_sum(win: np.ndarray) -> tuple[float, list[int] | None]:
    """Min over splits of sum_s cost[s, i_s, i_{s+1}] (inf entries forbidden), on the ``_windows`` of
    the cost tensor; the boundaries or None."""
    S, w, _ = win.shape
    best = np.full(w, np.inf)   # [a]: the least sum reaching boundary s + a before stage s
    best[0] = 0.0
    args = np.empty((S, w), dtype=np.int64)
    cols = np.arange(w)
    for s in range(S):
        total = best[:, None] + win[s]
        args[s] = total.argmin(axis=0)
        best = total[args[s], cols]
    if not np.isfinite(best[-1]):
        return math.inf, None
    bounds = [S + w - 1]   # n
    for s in range(S - 1, -1, -1):
        bounds.append(int(args[s, bounds[-1] - s - 1]) + s)
    return float(best[-1]), bounds[::-1]


def _min_bottleneck_windows(win: np.ndarray) -> float:
    """``min_bottleneck`` on the ``_windows`` of a tensor masked below the diagonal."""
    best = np.full(win.shape[1], np.inf)
    best[0] = 0.0
    for s in range(win.shape[0]):
        best = np.maximum(best[:, None], win[s]).min(axis=0)
    return float(best[-1])


def min_bottleneck(cost: np.ndarray) -> float:
    """Min over splits of max_s cost[s, i_s, i_{s+1}]: the smallest possible bottleneck."""
    S, n1, _ = cost.shape
    best = np.full(n1, np.inf)
    best[0] = 0.0
    for s in range(S):
        best = np.maximum(best[:, None], cost[s]).min(axis=0)
    return float(best[-1])


def _skip_to_cut(win: np.ndarray, floor: float, num_micro: int) -> np.ndarray:
    """Where ``split_blocks``' walk from the top can start: with ``U`` the least sum and ``V`` the
    value at the floor (the least sum under ``max <= floor``), a split whose max exceeds
    ``cut = (V - U) / (M - 1)`` is worth more than V (its sum is at least U), so the walk's first
    point under ``max <= cut`` is its first that can win; there the capped DP finds what the walk
    would have (the same sums and argmins: it only drops entries off that split). The margin of
    1e-9 keeps near-ties, which the walk settles in favour of the larger max, on the walk."""
    if num_micro <= 1:
        return win
    least, _ = _dp_min_sum(win)
    at_floor, bounds = _dp_min_sum(np.where(win <= floor, win, np.inf))
    if bounds is None:
        return win
    cut = (at_floor + (num_micro - 1) * floor - least) / (num_micro - 1) * (1 + 1e-9)
    return np.where(win <= max(cut, floor), win, np.inf)   # >= floor: the floor's split stays (rounding)


def split_blocks(stage_time_s: np.ndarray, num_micro: int) -> tuple[tuple[int, ...], float] | None:
    """The split minimising ``split_objective`` and its value, or None if no split is feasible.

    ``stage_time_s[s, i, j]`` is t_s if stage s holds blocks ``[i, j)``, inf where that does not fit
    in memory (entries with ``j <= i`` are ignored). Exact: walks the (sum, max) Pareto frontier from
    the top: a min-sum DP under a bottleneck cap, then the cap just below the max it found, until the
    cap is infeasible or no smaller bottleneck can win (sums only grow as the cap shrinks)."""
    cost = np.array(stage_time_s, dtype=np.float64)
    S, n1, n1b = cost.shape
    if n1 != n1b or S < 1 or n1 - 1 < S:
        return None
    cost[:, np.tril_indices(n1)[0], np.tril_indices(n1)[1]] = np.inf
    win = _windows(cost)
    floor = _min_bottleneck_windows(win)
    if not np.isfinite(floor):
        return None
    best_value, best_bounds = math.inf, None
    capped = _skip_to_cut(win, floor, num_micro)
    while True:
        total, bounds = _dp_min_sum(capped)
        if bounds is None:
            break
        times = [cost[s, bounds[s], bounds[s + 1]] for s in range(S)]
        top = max(times)
        value = total + (num_micro - 1) * top
        if value < best_value:
            best_value, best_bounds = value, bounds
        if num_micro == 1 or total + (num_micro - 1) * floor >= best_value or top <= floor:
            break
        capped = np.where(win < top, win, np.inf)
    sizes = tuple(best_bounds[s + 1] - best_bounds[s] for s in range(S))
    return sizes, float(best_value)
