"""The joint planner's cost model: what a stage grouping of tensor-parallel members costs at every
split (the cost tensor the split DP minimises, and a cheap lower bound of it), and what a built
candidate (its ``Stage`` tuple) needs in memory. The search over layouts, groupings and micro-batch
counts lives in ``autopar.planner.joint``, which imports these names.

Terms
- context (``_Ctx``): the fixed inputs of one joint planning call (model costs, cluster, global
  batch, the ZeRO stage searched with, the usable ``memory_fraction`` of each device, the TP
  replicated fraction ``rho``, the members by rank tuple, whether stages may recompute) and a cache
  of what candidates share: kind ids, span times per (kind, samples), state bytes per span, each
  member's room.
- kind id: the index of a member kind (``tp_cost.GroupKind``: device types, head shares, all-reduce
  link) in the order first seen; members of one kind share every cost.
- span: blocks [i, j); ``[i, j]`` arrays over n + 1 block boundaries hold a span's sum (seconds,
  parameters, bytes) and are zero below the diagonal.
- room: the bytes of (unsharded) block state + activations that a member's tightest rank can hold
  (its usable bytes over its TP work factor, ``tp_cost.work_factors``).
- stage prep (``_StagePrep``, ``_prepare``): what the cost tensor needs of one stage, independent of
  the micro-batch count: its member count, its distinct kinds (speed fraction of the stage, room, the
  (usable bytes, work factor) of its ranks) and the alpha-beta p2p link to the next stage.
- in flight (``_in_flight``): the micro-batches a stage holds activations of: GPipe all M, 1F1B
  ``min(M, S - s)`` on stage s.
- cost tensor (``_cost_tensor``): [s, i, j] = seconds of stage s on blocks [i, j) at the largest
  micro-batch (slowest kind at its share, TP all-reduces, p2p send of its output), inf where it does
  not fit; with recomputation, where keeping does not fit, the entry keeps only the stage input per
  micro-batch in flight and reruns the forward.
- split lower bound (``_split_lower_bound``): a bound of the split estimate
  ``sum_s t_s + (M - 1) max_s t_s`` of a grouping over every split, without the cost tensor.
- memory (``_memory``, ``_fits``): bytes per rank of a built candidate under a schedule and ZeRO
  stage (states sharded over the stage's members, activations sharded like the work), against
  ``memory_fraction`` of each device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopar.cost import tp as tp_cost
from autopar.cost.comm import p2p_time_s
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Stage
from autopar.planner.layouts import Member
from autopar.planner.pp import micro_sizes, stage_input_bytes

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__: list[str] = []   # every name is private to ``autopar.planner.joint``, which imports them


# -- the cost tensor of one grouping -----------------------------------------------------------------

@dataclass
class _Ctx:
    costs: ModelCosts
    cluster: "Cluster"
    global_batch: int
    zero_stage: int
    memory_fraction: float
    rho: float
    members: dict                  # rank tuple -> Member
    cache: dict
    recompute: bool = False        # offer activation recomputation to stages whose memory binds

    def kind_id(self, kind) -> int:
        ids = self.cache.setdefault("kind_ids", {})
        if kind not in ids:
            ids[kind] = len(ids)
            self.cache.setdefault("kind_list", []).append(kind)
        return ids[kind]

    def upper(self) -> np.ndarray:
        if "upper" not in self.cache:
            n = self.costs.num_blocks
            self.cache["upper"] = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
        return self.cache["upper"]

    def out_bytes0(self) -> np.ndarray:
        if "out0" not in self.cache:
            self.cache["out0"] = np.concatenate([[0.0], self.costs.out_bytes])
        return self.cache["out0"]

    def cap(self, r: int) -> float:
        return self.cluster.devices[r].spec.memory_bytes * self.memory_fraction

    def ratio(self, kid: int, k: int) -> float:
        """``T_p`` x min over blocks of (time of kind ``kid`` at ``k`` samples) / (reference time
        ``p``: kind 0 at 1 sample), for ``_split_lower_bound``."""
        key = ("ratio", kid, k)
        if key not in self.cache:
            ref = self.span_time(0, 1)[0]
            steps = np.diff(ref)
            mine = np.diff(self.span_time(kid, k)[0])
            ok = steps > 0
            self.cache[key] = float(ref[-1] * np.min(mine[ok] / steps[ok])) if ok.any() else 0.0
        return self.cache[key]

    def kind_speed(self, kind) -> float:
        key = ("speed", self.kind_id(kind))
        if key not in self.cache:
            f, b = tp_cost.kind_block_times(self.costs, kind, 1.0, self.rho)
            self.cache[key] = 1.0 / max(float(f.sum() + b.sum()), 1e-30)
        return self.cache[key]

    def span_time(self, kid: int, k: int, recompute: bool = False) -> np.ndarray:
        """[i, j] = forward + backward seconds of blocks [i, j) on kind ``kid`` at ``k`` samples; with
        ``recompute`` the backward reruns the forward (one more forward)."""
        key = ("span", kid, k, recompute)
        if key not in self.cache:
            kind = self.cache["kind_list"][kid]
            f, b = tp_cost.kind_block_times(self.costs, kind, float(k), self.rho)
            p = np.concatenate([[0.0], np.cumsum((2 * f if recompute else f) + b)])
            self.cache[key] = p[None, :] - p[:, None]
        return self.cache[key]

    def spans(self):
        if "spans" not in self.cache:
            c = self.costs
            pre = lambda x: np.concatenate([[0.0], np.cumsum(x)])  # noqa: E731
            span = lambda p: p[None, :] - p[:, None]               # noqa: E731
            self.cache["spans"] = (span(pre(c.params)), span(pre(c.param_bytes)), span(pre(c.act_bytes)))
        return self.cache["spans"]

    def zero_for(self, num_micro: int) -> int:
        """The ZeRO stage whose memory a candidate of ``num_micro`` micro-batches is searched with:
        ZeRO-2 only at one micro-batch (see the module docstring)."""
        return self.zero_stage if num_micro <= 1 else min(self.zero_stage, 1)

    def state(self, num_members: int, zero_stage: int | None = None) -> np.ndarray:
        z = self.zero_stage if zero_stage is None else zero_stage
        key = ("state", num_members, z)
        if key not in self.cache:
            c = self.costs
            params, wbytes, _ = self.spans()
            f = 1.0 / num_members
            self.cache[key] = (wbytes * (f if z >= 3 else 1.0)
                               + params * (c.grad_bytes_per_param * (f if z >= 2 else 1.0)
                                           + c.optimizer_bytes_per_param * (f if z >= 1 else 1.0)))
        return self.cache[key]

    def rank_caps(self, member: Member) -> tuple[tuple[float, float], ...]:
        """Distinct (usable bytes, work factor) of the member's ranks."""
        factors = tp_cost.work_factors(np.asarray(member.shares, float) / sum(member.shares), self.rho)
        return tuple(sorted({(self.cap(r), float(k)) for r, k in zip(member.ranks, factors)}))

    def room(self, member: Member) -> float:
        """Bytes of (unsharded) block state + activations the member's tightest rank can hold."""
        key = ("room", member.ranks)
        if key not in self.cache:
            factors = tp_cost.work_factors(np.asarray(member.shares, float) / sum(member.shares), self.rho)
            self.cache[key] = min(self.cap(r) / k for r, k in zip(member.ranks, factors))
        return self.cache[key]


def _in_flight(schedule: str, stage: int, num_stages: int, num_micro: int) -> int:
    return num_micro if schedule == "gpipe" else min(num_micro, num_stages - stage)


@dataclass(frozen=True, slots=True)
class _StagePrep:
    """What the cost tensor needs of one stage, independent of the micro-batch count."""

    num_members: int
    # distinct (kind id, speed fraction of the stage, room, distinct (cap bytes, work factor) of its ranks)
    kinds: tuple[tuple[int, float, float, tuple[tuple[float, float], ...]], ...]
    p2p: tuple[float, float, int] | None          # (alpha s, beta s/B, parallel links) to the next stage


def _prepare(ctx: _Ctx, stages: Sequence[Sequence[Member]]) -> list[_StagePrep]:
    out = []
    for s, members in enumerate(stages):
        ids = [ctx.kind_id(m.kind) for m in members]
        v = [ctx.kind_speed(m.kind) for m in members]
        total = sum(v)
        kinds = tuple(sorted({(i, x / total, ctx.room(m), ctx.rank_caps(m)) for i, x, m in zip(ids, v, members)}))
        p2p = None
        if s < len(stages) - 1:
            nxt = stages[s + 1]
            src, dst = members[0].ranks[0], nxt[0].ranks[0]
            alpha = p2p_time_s(ctx.cluster, src, dst, 0.0)
            beta = (p2p_time_s(ctx.cluster, src, dst, 1e9) - alpha) / 1e9
            p2p = (alpha, beta, min(len(members), len(nxt)))
        out.append(_StagePrep(len(members), kinds, p2p))
    return out


def _cost_tensor(ctx: _Ctx, prep: Sequence[_StagePrep], num_micro: int, schedule: str,
                 recompute: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """([s, i, j] = seconds of stage s on blocks [i, j) at the largest micro-batch (slowest member, TP
    all-reduces, p2p send of its output), inf where a member's rank cannot hold its state and the
    activations in flight; [s, i, j] = whether that entry recomputes its activations). A member's
    samples of a micro-batch are its speed's share, rounded up.

    With ``recompute`` an entry that does not fit keeping every activation tries activation
    recomputation: per micro-batch in flight only the stage input (``out_bytes`` of block i - 1,
    replicated on every TP rank), plus one micro-batch's full activations, for one more forward in the
    backward. Keeping is never slower, so an entry recomputes only where keeping does not fit: the
    per-stage choice is exact for the split DP."""
    c = ctx.costs
    n = c.num_blocks
    S = len(prep)
    b = micro_sizes(ctx.global_batch, num_micro)[0]
    _, _, act = ctx.spans()
    out = np.empty((S, n + 1, n + 1))
    rc = np.zeros((S, n + 1, n + 1), dtype=bool)
    upper = ctx.upper()
    out_bytes = ctx.out_bytes0()
    row_cache: dict = {}
    for s, st in enumerate(prep):
        fly = _in_flight(schedule, s, S, num_micro)
        if st.num_members == 1:
            shares = tuple((i, b, room, caps) for i, _, room, caps in st.kinds)
        else:
            shares = tuple((i, int(math.ceil(b * f - 1e-9)), room, caps) for i, f, room, caps in st.kinds)
        zero = ctx.zero_for(num_micro)
        sig = (shares, st.num_members, fly, recompute, zero)
        if sig not in row_cache:
            state = ctx.state(st.num_members, zero)
            t = np.zeros((n + 1, n + 1))
            t_rc = np.zeros((n + 1, n + 1))
            fits = upper.copy()
            fits_rc = upper.copy() if recompute else np.zeros_like(upper)
            for kid, k, room, caps in shares:
                if k <= 0:
                    continue
                t = np.maximum(t, ctx.span_time(kid, k))
                fits &= state + act * (k * fly) <= room
                if recompute:
                    t_rc = np.maximum(t_rc, ctx.span_time(kid, k, True))
                    # per rank: its work factor of the states and one micro-batch's activations, and
                    # the whole stage input (block i - 1's output) of every micro-batch in flight.
                    held = (out_bytes * (k * fly))[:, None]
                    for cap, factor in caps:
                        fits_rc &= (state + act * k) * factor + held <= cap
            use_rc = fits_rc & ~fits
            row_cache[sig] = (np.where(fits, t, np.where(use_rc, t_rc, np.inf)), use_rc)
        t_s, rc[s] = row_cache[sig]
        if st.p2p is not None:
            alpha, beta, links = st.p2p
            t_s = t_s + (alpha + beta * math.ceil(b / links) * out_bytes)[None, :]
        out[s] = t_s
    return out, rc


def _split_lower_bound(ctx: _Ctx, prep: Sequence[_StagePrep], num_micro: int) -> float:
    """A lower bound of the split estimate ``sum_s t_s + (M - 1) max_s t_s`` of a grouping at M micro-
    batches, over every split, without the cost tensor. With a reference profile ``p`` (the first
    kind at 1 sample), stage s holding blocks of profile fraction x_s takes at least ``x_s * q_s``,
    q_s = ``T_p`` x the least per-block ratio of its slowest kind's time at its share to ``p``. Then
    max_s x_s q_s >= c* = 1 / sum_s (1 / q_s) (as sum x_s = 1) and sum_s x_s q_s >= min_s q_s."""
    b = micro_sizes(ctx.global_batch, num_micro)[0]
    inv, low = 0.0, math.inf
    for st in prep:
        q = 0.0
        for kid, f, _room, _caps in st.kinds:
            k = b if st.num_members == 1 else int(math.ceil(b * f - 1e-9))
            if k > 0:
                q = max(q, ctx.ratio(kid, k))
        if q <= 0:
            return 0.0
        inv += 1.0 / q
        low = min(low, q)
    return (num_micro - 1) / inv + low


# -- memory of a built candidate ------------------------------------------------------------------

def _memory(ctx: _Ctx, stages: Sequence[Stage], schedule: str, zero_stage: int) -> dict[int, int]:
    c = ctx.costs
    out = {}
    for s, st in enumerate(stages):
        blocks = slice(st.block_start, st.block_stop)
        f = 1.0 / len(st.groups)
        p = float(c.params[blocks].sum())
        state = (float(c.param_bytes[blocks].sum()) * (f if zero_stage >= 3 else 1.0)
                 + p * (c.grad_bytes_per_param * (f if zero_stage >= 2 else 1.0)
                        + c.optimizer_bytes_per_param * (f if zero_stage >= 1 else 1.0)))
        act = float(c.act_bytes[blocks].sum())
        fly = _in_flight(schedule, s, len(stages), len(st.micro_batches[0]))
        held = stage_input_bytes(c, st) if st.recompute else 0.0
        for g, ranks in enumerate(st.groups):
            shares = st.tp_shares[g] if st.tp_shares else (1,)
            factors = tp_cost.work_factors(np.asarray(shares, float) / sum(shares), ctx.rho)
            x = max(st.micro_batches[g])
            # Recompute: one micro-batch's activations (sharded like the work) and every in-flight
            # micro-batch's stage input (whole on every rank); else every in-flight activation.
            need = state + act * x * (1 if st.recompute else fly)
            for r, k in zip(ranks, factors):
                out[r] = int(math.ceil(need * k + held * x * fly))
    return dict(sorted(out.items()))


def _fits(ctx: _Ctx, memory: dict[int, int]) -> bool:
    return all(v <= ctx.cap(r) for r, v in memory.items())
