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
  ([i, j]), the bytes of state + activations its tightest rank holds (``room_bytes``, for reports)
  and the distinct (usable bytes, TP work factor) of its ranks, or (usable bytes, state work factor,
  activation work factor) where TP shards the two differently (numbers or [i, j] arrays: the joint
  search's ``cost.memory.tp_span_factors``). How a planner's members split a micro-batch and what
  their times are is the planner's cost model (``cost.pipeline``: devices, shares by speed on each span;
  ``cost.joint``: tensor-parallel kinds, shares by whole-model speed).
- stage row (``stage_cost_row``): [i, j] = seconds of the stage's slowest member, inf where a rank
  cannot hold its state (times its state factor) plus the activations of the micro-batches in flight
  (times its activation factor) plus what it holds whole per sample (``fixed_bytes``: a last stage's loss)
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

__all__ = ["micro_sizes", "span_sums", "p2p_alpha_beta", "StageLink", "MemberLoad", "RowParts", "stage_row_parts",
           "stage_cost_row", "stage_cost_tensor", "stage_split_feasible"]


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
    room_bytes: float                      # the tightest rank's room at one factor (reports; rows use rank_caps)
    rank_caps: tuple[tuple, ...]           # (cap, factor) or (cap, state factor, activation factor) per rank


_FITS_ANY = float(2 ** 31)   # an in-flight cap this large fits every micro-batch count


def _in_flight_cap(holds, num: np.ndarray, per: np.ndarray) -> np.ndarray:
    """[i, j] the largest in-flight count f >= 0 with ``holds(f)`` true (-1 where none), where
    ``holds(f)`` is ``num - per * f >= 0`` up to rounding: the quotient, then checked against
    ``holds`` itself one count either side, so that the cap is exactly the largest f the comparison
    the row is defined by accepts; ``_FITS_ANY`` where ``per`` <= 0 and ``num`` >= 0."""
    pos = per > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(pos, np.floor(num / np.where(pos, per, 1.0)), np.where(num >= 0, _FITS_ANY, -1.0))
    # the clip of nan_to_num(q, nan=-1, posinf=_FITS_ANY, neginf=-1) to [-1, _FITS_ANY]: fmax drops nan
    q = np.minimum(np.fmax(q, -1.0), _FITS_ANY)
    exact = q < _FITS_ANY
    up = exact & holds(q + 1)
    q = np.where(up, q + 1, q)
    # two steps down where the count does not hold; an entry that stepped up holds (just checked), and
    # one that held is left as it is by the second step, which only the ones stepped down need
    down = exact & ~up & (q >= 0)
    for _ in range(2):
        down &= ~holds(np.maximum(q, 0.0))
        if not down.any():
            break
        q = np.where(down, q - 1, q)
        down &= q >= 0
    return q


@dataclass(frozen=True, slots=True, eq=False)
class RowParts:
    """What a stage row is at any in-flight count (``stage_row_parts``): the seconds keeping and
    recomputing activations, and per entry the most micro-batches in flight each way fits (-1: none)."""

    time_s: np.ndarray
    recompute_time_s: np.ndarray
    keep_cap: np.ndarray
    recompute_cap: np.ndarray | None
    valid: np.ndarray

    def finite_at(self, in_flight) -> np.ndarray:
        """[i, j] whether ``at(in_flight)``'s row is finite there (it fits, keeping or recomputing)."""
        fits = self.valid & (in_flight <= self.keep_cap)
        finite = fits & np.isfinite(self.time_s)
        if self.recompute_cap is None:
            return finite
        use_rc = self.valid & (in_flight <= self.recompute_cap) & ~fits
        return finite | (use_rc & np.isfinite(self.recompute_time_s))

    def at(self, in_flight) -> tuple[np.ndarray, np.ndarray]:
        """(the row, whether each entry recomputes) at ``in_flight`` micro-batches (a number, or an
        array [k, 1, 1] for k rows at once)."""
        fits = self.valid & (in_flight <= self.keep_cap)
        if self.recompute_cap is None:
            return np.where(fits, self.time_s, np.inf), np.zeros(fits.shape, dtype=bool)
        use_rc = self.valid & (in_flight <= self.recompute_cap) & ~fits
        return np.where(fits, self.time_s, np.where(use_rc, self.recompute_time_s, np.inf)), use_rc


def _rank_factors(entry) -> tuple[float, object, object]:
    """(usable bytes, state work factor, activation work factor) of a ``MemberLoad.rank_caps`` entry:
    ``(cap, factor)`` prices state and activations alike, ``(cap, state, act)`` apart (numbers or
    [i, j] arrays)."""
    if len(entry) == 2:
        return entry[0], entry[1], entry[1]
    return entry[0], entry[1], entry[2]


def stage_row_parts(state_bytes: np.ndarray, act_bytes: np.ndarray, input_bytes: np.ndarray, valid: np.ndarray,
                    loads: Sequence[MemberLoad], recompute: bool, force_recompute: bool = False,
                    fixed_bytes: float = 0.0, reduce_bytes: float | np.ndarray = 0.0) -> RowParts:
    """The ``RowParts`` of ``stage_cost_row`` (same arguments but the in-flight count): its rows at
    every in-flight count from one pass over the loads. ``fixed_bytes``: bytes per sample of the
    member's share that every rank holds whole besides (the loss of a last stage); ``reduce_bytes``
    ([i, j] or a number): the flat gradient copy the stage's all-reduce makes after backward, when
    the activations are freed (``cost.memory.stage_reduce_bytes``; sharded like the state)."""
    t = np.zeros(valid.shape)
    t_rc = np.zeros(valid.shape)
    keep = np.full(valid.shape, -1.0 if force_recompute else _FITS_ANY)
    rc_cap = np.full(valid.shape, _FITS_ANY) if recompute else None
    col = input_bytes[:, None]
    for load in loads:
        k = load.samples
        t = np.maximum(t, load.time_s)
        if recompute:
            t_rc = np.maximum(t_rc, load.recompute_time_s)
        fixed = fixed_bytes * k
        for entry in load.rank_caps:
            cap, kp, ka = _rank_factors(entry)
            state = state_bytes * kp + fixed
            after = reduce_bytes * kp          # after backward: the gradient copy, not the activations
            short = state + after > cap        # entries the reduce alone does not fit
            if not force_recompute:
                # every in-flight micro-batch's activations (sharded like the work) on the state
                per = act_bytes * ka * k + np.zeros(valid.shape)
                got = _in_flight_cap(lambda f: state + per * f <= cap, cap - state, per)
                keep = np.minimum(keep, np.where(short, -1.0, got))
            if recompute:
                # one micro-batch's activations (sharded), and the whole stage input of every
                # micro-batch in flight
                base = state + np.maximum(act_bytes * ka * k, after)
                rc_cap = np.minimum(rc_cap, _in_flight_cap(lambda f: base + col * (k * f) <= cap,
                                                           cap - base, col * k + np.zeros(valid.shape)))
    return RowParts(t, t_rc, keep, rc_cap, valid)


def stage_cost_row(state_bytes: np.ndarray, act_bytes: np.ndarray, input_bytes: np.ndarray, valid: np.ndarray,
                   loads: Sequence[MemberLoad], in_flight: int, recompute: bool,
                   force_recompute: bool = False, fixed_bytes: float = 0.0,
                   reduce_bytes: float | np.ndarray = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """([i, j] seconds of the stage, inf where it does not fit; [i, j] whether the entry recomputes).
    ``force_recompute`` (a pinned ``recompute=True``): every entry recomputes, none keeps.

    ``state_bytes``, ``act_bytes``: [i, j] spans of the stage's (sharded) state and of its activations
    per sample; ``input_bytes``: [i] bytes per sample of the stage input at boundary i. An entry
    keeps where each rank of every load fits ``state * state factor + act * act factor * samples *
    in_flight + fixed * samples`` in its usable bytes; else, with ``recompute``, it recomputes where each
    rank fits ``state * state factor + act * act factor * samples + input * samples * in_flight + fixed
    * samples`` (``stage_row_parts``, ``RowParts.at``); either way the flat gradient copy of the
    all-reduce (``reduce_bytes`` x state factor) must fit in place of the activations."""
    return stage_row_parts(state_bytes, act_bytes, input_bytes, valid, loads, recompute,
                           force_recompute, fixed_bytes, reduce_bytes).at(in_flight)


def stage_cost_tensor(costs: ModelCosts, links: Sequence[StageLink | None], num_micro: int, micro_batch: int,
                      schedule: str, parts: Callable[[int], RowParts],
                      ) -> tuple[np.ndarray, np.ndarray]:
    """([s, i, j] seconds of stage s on blocks [i, j) at ``micro_batch`` samples, inf where it does not
    fit; [s, i, j] whether that entry recomputes). ``links[s]``: stage s's link to the next (None for
    the last); ``parts(s)``: the ``stage_row_parts`` of stage s (stages given the same object are
    evaluated together, at their own in-flight counts)."""
    n = costs.num_blocks
    S = len(links)
    out = np.empty((S, n + 1, n + 1))
    rc = np.empty((S, n + 1, n + 1), dtype=bool)
    out_bytes = np.concatenate([[0.0], costs.out_bytes])
    groups: dict[int, tuple[RowParts, list[int]]] = {}
    for s in range(S):
        p = parts(s)
        groups.setdefault(id(p), (p, []))[1].append(s)
    for p, idx in groups.values():
        fly = np.array([in_flight_micro_batches(schedule, s, S, num_micro) for s in idx], dtype=float)
        if len(set(fly.tolist())) == 1:
            row, use = p.at(float(fly[0]))
            out[idx], rc[idx] = row, use
        else:
            out[idx], rc[idx] = p.at(fly[:, None, None])
    alpha, beta = np.zeros(S), np.zeros(S)   # the send of the span's output to the next stage
    for s, link in enumerate(links):
        if link is not None:
            alpha[s] = link.alpha_s
            beta[s] = link.beta_s_per_byte * math.ceil(micro_batch / link.num_links)
    out += (alpha[:, None] + beta[:, None] * out_bytes[None, :])[:, None, :]
    return out, rc


def stage_split_feasible(costs: ModelCosts, links: Sequence[StageLink | None], num_micro: int, micro_batch: int,
                         schedule: str, parts: Callable[[int], RowParts]) -> bool:
    """Whether ``stage_cost_tensor`` (same arguments) has a split whose every stage is finite, i.e.
    whether ``autopar.planner.pp.min_bottleneck`` of it is finite: the boundaries reachable after each
    stage, from the rows' fit masks alone (no seconds), stopping at the first stage that reaches none."""
    n = costs.num_blocks
    S = len(links)
    out_bytes = None
    reach = np.zeros(n + 1, dtype=bool)
    reach[0] = True
    masks: dict = {}
    for s, link in enumerate(links):
        p = parts(s)
        fly = in_flight_micro_batches(schedule, s, S, num_micro)
        key = (id(p), fly)
        if key not in masks:
            masks[key] = (p, p.finite_at(float(fly)))
        mask = masks[key][1]
        if link is not None:
            ceil = math.ceil(micro_batch / link.num_links)
            if out_bytes is None:
                out_bytes = np.concatenate([[0.0], costs.out_bytes])
                largest = float(np.max(np.abs(out_bytes)))
            # every send is finite when the one of the largest bytes is (alpha, beta >= 0): mask kept
            if not (link.alpha_s >= 0 and link.beta_s_per_byte >= 0
                    and math.isfinite(link.alpha_s + link.beta_s_per_byte * ceil * largest)):
                send = link.alpha_s + link.beta_s_per_byte * ceil * out_bytes
                mask = mask & np.isfinite(send)[None, :]
        reach = mask[reach].any(axis=0)
        if not reach.any():
            return False
    return bool(reach[n])
