"""The stage cost tensor: what a pipeline stage costs on every block span, the one tensor that the
pipeline planner (``autopar.cost.pipeline.pipeline_cost_tensor``) and the joint planner
(``autopar.cost.joint.joint_cost_tensor``) hand to the split DP (``autopar.planner.pp.split_blocks``).

Terms
- span: blocks [i, j); ``[i, j]`` arrays over the n + 1 block boundaries hold a span's sum
  (``span_sums``: seconds, parameters, bytes) and are zero on and negative below the diagonal;
  ``valid`` marks the entries with j > i.
- micro-batch sizes (``micro_sizes``): M micro-batches of ``batch // M`` or one more sample, the larger
  first; the tensor prices the largest.
- member load (``MemberLoad``): one kind of data-parallel member of a stage at that micro-batch: its
  samples ([i, j] or one number), its forward + backward seconds keeping and recomputing activations
  ([i, j]), the bytes of state + activations its tightest rank holds (``room_bytes``) and the distinct
  (usable bytes, TP work factor) of its ranks. How a planner's members split a micro-batch and what
  their times are is the planner's cost model (``cost.pipeline``: devices, shares by speed on each span;
  ``cost.joint``: tensor-parallel kinds, shares by whole-model speed).
- stage row (``stage_cost_row``): [i, j] = seconds of the stage's slowest member, inf where a member
  cannot hold its state plus the activations of the micro-batches in flight
  (``autopar.ir.schedule.in_flight_micro_batches``); with recomputation, where keeping does not fit,
  the entry keeps per micro-batch in flight only the stage input (the output of block i - 1, whole on
  every TP rank) plus one micro-batch's activations, and pays the recomputing time. Keeping is never
  slower, so the per-entry choice is exact for the split DP.
- stage cost tensor (``stage_cost_tensor``): [s, i, j] = stage row s plus the p2p send of the span's
  output to stage s + 1 (alpha-beta, split over the parallel links between the stages).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopar.cost.comm import p2p_time_s
from autopar.ir.costs import ModelCosts
from autopar.ir.schedule import in_flight_micro_batches

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["micro_sizes", "span_sums", "p2p_alpha_beta", "StageLink", "MemberLoad", "stage_cost_row",
           "stage_cost_tensor"]


def micro_sizes(batch: int, num_micro: int) -> tuple[int, ...]:
    """``num_micro`` sizes summing to ``batch`` that differ by at most 1, the larger first."""
    q, r = divmod(batch, num_micro)
    return (q + 1,) * r + (q,) * (num_micro - r)


def span_sums(per_block: np.ndarray) -> np.ndarray:
    """[i, j] = sum of ``per_block`` over blocks [i, j) (negative below the diagonal)."""
    p = np.concatenate([[0.0], np.cumsum(per_block)])
    return p[None, :] - p[:, None]


def p2p_alpha_beta(cluster: "Cluster", src: int, dst: int) -> tuple[float, float]:
    """(seconds, seconds per byte) of a p2p transfer from rank ``src`` to ``dst``."""
    alpha = p2p_time_s(cluster, src, dst, 0.0)
    return alpha, (p2p_time_s(cluster, src, dst, 1e9) - alpha) / 1e9


@dataclass(frozen=True, slots=True)
class StageLink:
    """The p2p link from a stage to the next: alpha-beta terms and the member-to-member links in parallel."""

    alpha_s: float
    beta_s_per_byte: float
    num_links: int


@dataclass(frozen=True, slots=True, eq=False)
class MemberLoad:
    """One kind of member of a stage at the priced micro-batch (see the module docstring)."""

    samples: float | np.ndarray
    time_s: np.ndarray
    recompute_time_s: np.ndarray | None
    room_bytes: float
    rank_caps: tuple[tuple[float, float], ...]


def stage_cost_row(state_bytes: np.ndarray, act_bytes: np.ndarray, input_bytes: np.ndarray, valid: np.ndarray,
                   loads: Sequence[MemberLoad], in_flight: int, recompute: bool,
                   force_recompute: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """([i, j] seconds of the stage, inf where it does not fit; [i, j] whether the entry recomputes).
    ``force_recompute`` (a pinned ``recompute=True``): every entry recomputes, none keeps.

    ``state_bytes``, ``act_bytes``: [i, j] spans of the stage's (sharded) state and of its activations
    per sample; ``input_bytes``: [i] bytes per sample of the stage input at boundary i."""
    t = np.zeros(valid.shape)
    t_rc = np.zeros(valid.shape)
    fits = valid.copy()
    fits_rc = valid.copy() if recompute else np.zeros_like(valid)
    for load in loads:
        k = load.samples
        t = np.maximum(t, load.time_s)
        fits &= state_bytes + act_bytes * (k * in_flight) <= load.room_bytes
        if recompute:
            t_rc = np.maximum(t_rc, load.recompute_time_s)
            # per rank: its work factor of the state and of one micro-batch's activations, and the
            # whole stage input of every micro-batch in flight.
            held = input_bytes[:, None] * (k * in_flight)
            for cap, factor in load.rank_caps:
                fits_rc &= (state_bytes + act_bytes * k) * factor + held <= cap
    if force_recompute:
        fits &= False
    use_rc = fits_rc & ~fits
    return np.where(fits, t, np.where(use_rc, t_rc, np.inf)), use_rc


def stage_cost_tensor(costs: ModelCosts, links: Sequence[StageLink | None], num_micro: int, micro_batch: int,
                      schedule: str, row: Callable[[int, int], tuple[np.ndarray, np.ndarray]],
                      ) -> tuple[np.ndarray, np.ndarray]:
    """([s, i, j] seconds of stage s on blocks [i, j) at ``micro_batch`` samples, inf where it does not
    fit; [s, i, j] whether that entry recomputes). ``links[s]``: stage s's link to the next (None for
    the last); ``row(s, in_flight)``: the ``stage_cost_row`` of stage s."""
    n = costs.num_blocks
    S = len(links)
    out = np.empty((S, n + 1, n + 1))
    rc = np.zeros((S, n + 1, n + 1), dtype=bool)
    out_bytes = np.concatenate([[0.0], costs.out_bytes])
    for s, link in enumerate(links):
        t_s, rc[s] = row(s, in_flight_micro_batches(schedule, s, S, num_micro))
        if link is not None:
            per_link = math.ceil(micro_batch / link.num_links)
            t_s = t_s + (link.alpha_s + link.beta_s_per_byte * per_link * out_bytes)[None, :]
        out[s] = t_s
    return out, rc
