"""The pipeline cost model: what a pipeline of one-rank members costs, as the stage cost tensor of a
grouping (``pipeline_cost_tensor``) and as a built plan (its ``Stage`` tuple) in time and memory.
The search over groupings, splits and micro-batch counts lives in ``autopar.planner.pp``.

Terms
- context (``PipelineContext``): the fixed inputs of one planning call: model costs, cluster, global
  batch, ZeRO stage and the usable ``memory_fraction`` of each device.
- stage members: the data-parallel members of a stage (rank tuples; here of one rank each). A member's
  samples of a micro-batch are proportional to its device's speed on the span's blocks (at the
  micro-batch's even share), rounded up; its seconds are one forward and one backward call, each with
  its type's ``ModelCosts.call_overhead``. ``pipeline_cost_tensor`` hands these member loads to
  ``autopar.cost.stage.stage_cost_tensor``, the tensor the joint planner uses too.
- stage durations: per-micro-batch forward and backward seconds of each stage's slowest member (each
  call with its type's ``ModelCosts.call_overhead``; a recompute stage's backward reruns the forward)
  and p2p seconds of each stage boundary, split over min(k, l) parallel links between stages of k and
  l members (``stage_durations``). Tensor-parallel members are priced by ``autopar.cost.tp``.
- stage memory: ``autopar.cost.memory.stage_memory_bytes`` (every work factor 1 here).
- prediction: ``simulate`` of the generated schedule with the stage durations, then each stage's
  gradient all-reduce over its members starting when the stage finishes (a tied parameter held by
  several stages: when they all have, over their ranks), then each rank's optimizer step
  (``stage_optimizer_s``) and, under ZeRO >= 1, the gather of the updated parameters
  (``plan_timeline``, ``_finish_s``), and last the loss sum's all-reduce over every rank
  (``pipeline_loss_allreduce_s``: the engine's last call of a step, which every rank waits in for the
  slowest). ZeRO-3's per-micro-batch parameter gathers are not modelled.
- virtual stages (``Plan.virtual_stages``, "interleaved-1f1b"): the stage durations are per chunk and
  the simulator runs each rank stage's chunks on one worker; after the schedule a rank all-reduces
  its chunks' gradients one after another and steps one optimizer over all of them
  (``_finish_s``); memory sums its chunks (``pipeline_memory_bytes``).
- zero-bubble ("zb-h1"): a backward splits into BI and BW, priced as the runtime's split measures:
  BI ``ZB_INPUT_SHARE`` and BW ``ZB_WEIGHT_SHARE`` of the whole backward's compute (a recompute
  stage's rerun forward in BI); the first stage's whole backward runs at its BW (its inputs need no
  gradient: ``autopar.runtime.pipeline_zb``). The paper's ideal is 0.5 + 0.5 (a matmul's two backward
  GEMMs); measured on CPU on gpt-tiny layers (hidden 128 and 256, one thread, median of 15) BI took
  0.95 and BW 0.85 of a backward: small GEMMs, where the elementwise input-gradient work dominates,
  and one autograd call per parameter group. So ZB-H1 pays only where bubbles outweigh that 80%.
- overlap the model assumes, as the runtime does it: a send takes no worker time (``isend``, its wait
  deferred to the end of the step: ``PipelineEngine.overlap_sends``), so a transfer overlaps the
  compute of both ends; a receive blocks its worker until the data has arrived (pre-posted where the
  pair allows); gradient all-reduces start when a stage has finished its schedule, not during it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from autopar.config import SCHEDULES
from autopar.cost.comm import (
    allgather_time_s, allreduce_time_s, dp_comm_hides, loss_allreduce_s, p2p_time_s, zero_gather_s,
    zero_reduce_scatter_s,
)
from autopar.cost.memory import stage_input_bytes, tp_local_block_params, usable_bytes
from autopar.cost.stage import MemberLoad, RowParts, StageLink, micro_sizes, p2p_alpha_beta, span_sums, \
    stage_cost_tensor, stage_row_parts, stage_split_feasible
from autopar.ir.costs import ModelCosts, sharded_state_bytes
from autopar.ir.plan import Plan, Stage, zero3_by_block
from autopar.ir.schedule import in_flight_micro_batches, make_schedule
from autopar.ir.timeline import Timeline, simulate

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["PipelineContext", "pipeline_cost_tensor", "pipeline_split_feasible", "stage_durations",
           "stage_input_bytes", "plan_timeline", "stage_optimizer_s", "pipeline_memory_bytes",
           "pipeline_loss_allreduce_s", "tied_allreduces_s", "split_durations", "zero3_block_round_s", "stage_sync_s",
           "ZB_INPUT_SHARE", "ZB_WEIGHT_SHARE"]

ZB_INPUT_SHARE = 0.95    # BI / whole backward, as the runtime's split measures (see the module docstring)
ZB_WEIGHT_SHARE = 0.85   # BW / whole backward


# -- planning context and the stage cost tensor -----------------------------------------------------

@dataclass(frozen=True, slots=True)
class PipelineContext:
    """The fixed inputs of one pipeline planning call (see the module docstring)."""

    costs: ModelCosts
    cluster: "Cluster"
    global_batch: int
    zero_stage: int
    memory_fraction: float
    # what ``pipeline_cost_tensor`` computes once per call of the planner: the span sums, the p2p
    # links and the stage rows (by micro-batch size, recompute and the stage's member types)
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    def type_of(self, rank: int) -> str:
        return self.cluster.devices[rank].spec.name

    def cap_bytes(self, rank: int) -> float:
        return usable_bytes(self.cluster.devices[rank].spec, self.memory_fraction)


def pipeline_cost_tensor(ctx: PipelineContext, stages: Sequence[Sequence[tuple[int, ...]]], num_micro: int,
                         schedule: str, recompute: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``autopar.cost.stage.stage_cost_tensor`` of a grouping's ``stages`` (members: one-rank tuples)
    at ``num_micro`` micro-batches, with the member loads of the module docstring. ``recompute``:
    whether entries that do not fit keeping every activation may recompute them."""
    links, b, parts = _grouping_rows(ctx, stages, num_micro, recompute)
    with np.errstate(divide="ignore", invalid="ignore"):
        return stage_cost_tensor(ctx.costs, links, num_micro, b, schedule, parts)


def pipeline_split_feasible(ctx: PipelineContext, stages: Sequence[Sequence[tuple[int, ...]]], num_micro: int,
                            schedule: str, recompute: bool = True) -> bool:
    """Whether ``pipeline_cost_tensor`` (same arguments) has a split whose every stage is finite,
    without building it (``autopar.cost.stage.stage_split_feasible``: the rows' fit masks alone)."""
    links, b, parts = _grouping_rows(ctx, stages, num_micro, recompute)
    with np.errstate(divide="ignore", invalid="ignore"):
        return stage_split_feasible(ctx.costs, links, num_micro, b, schedule, parts)


def _grouping_rows(ctx: PipelineContext, stages: Sequence[Sequence[tuple[int, ...]]], num_micro: int,
                   recompute: bool):
    """(links to the next stage, micro-batch size, ``parts(s)``: stage s's ``RowParts``) of a grouping."""
    c = ctx.costs
    n = c.num_blocks
    b = micro_sizes(ctx.global_batch, num_micro)[0]
    spans = ctx.cache.get("spans")
    if spans is None:
        spans = ctx.cache["spans"] = (
            span_sums(c.params), span_sums(c.param_bytes), span_sums(c.act_bytes),
            np.concatenate([[0.0], c.out_bytes]), (np.arange(n + 1)[None, :] - np.arange(n + 1)[:, None]) > 0)
    params, wbytes, act, input_bytes, valid = spans
    pairs = ctx.cache.setdefault("p2p", {})   # (src, dst) -> alpha-beta terms
    links = []
    for st, nxt in zip(stages, stages[1:]):
        pair = (st[0][0], nxt[0][0])
        if pair not in pairs:
            pairs[pair] = p2p_alpha_beta(ctx.cluster, *pair)
        links.append(StageLink(*pairs[pair], min(len(st), len(nxt))))
    links.append(None)

    # stages of the same member types, counts and memory share one row, at every count of this size
    cache: dict = ctx.cache.setdefault(("rows", b, bool(recompute)), {})

    def parts(s: int) -> RowParts:
        members = stages[s]
        nm = len(members)
        by_type: dict[str, list[int]] = {}
        for m in members:
            by_type.setdefault(ctx.type_of(m[0]), []).append(m[0])
        caps = {t: min(ctx.cap_bytes(r) for r in rs) for t, rs in by_type.items()}
        key = (nm, tuple((t, len(rs), caps[t]) for t, rs in by_type.items()))
        if key in cache:
            return cache[key]
        state = sharded_state_bytes(wbytes, params, c.grad_bytes_per_param, c.optimizer_bytes_per_param,
                                    ctx.zero_stage, 1.0 / nm)
        # Each member's share of a micro-batch is proportional to its speed on the blocks (as the
        # planner builds stages); the largest-remainder rounding never exceeds the ceiling used here.
        ref = max(b / nm, 1.0)
        speed = {t: 1.0 / span_sums(c.fwd_time(t, ref) + c.bwd_time(t, ref)) for t in by_type}
        total = sum(len(rs) * speed[t] for t, rs in by_type.items())
        loads = []
        for t, rs in by_type.items():
            share = np.full((n + 1, n + 1), float(b)) if nm == 1 else np.ceil(b * speed[t] / total - 1e-9)
            share = np.where(valid, share, 0.0)
            time_t = np.zeros((n + 1, n + 1))
            time_rc = np.zeros((n + 1, n + 1))
            for k in np.unique(share[valid]):
                if k > 0:
                    fwd_k = span_sums(c.fwd_time(t, int(k))) + c.call_overhead(t, "forward")
                    bwd_k = span_sums(c.bwd_time(t, int(k))) + c.call_overhead(t, "backward")
                    time_t = np.where(share == k, fwd_k + bwd_k, time_t)
                    time_rc = np.where(share == k, 2 * fwd_k + bwd_k, time_rc)
            loads.append(MemberLoad(share, time_t, time_rc, caps[t], ((caps[t], 1.0),)))
        cache[key] = stage_row_parts(state, act, input_bytes, valid, loads, recompute)
        return cache[key]

    return links, b, parts


# -- exact stage durations, memory and the simulated prediction -------------------------------------

def stage_durations(costs: ModelCosts, cluster: "Cluster", stages: Sequence[Stage], *,
                    replicated_fraction: float | None = None,
                    kinds: dict | None = None, rows: dict | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-micro-batch forward and backward seconds [stage][micro] (slowest member, each with its
    type's ``ModelCosts.call_overhead``) and transfer seconds [boundary][micro] of a plan. A transfer between stages of k and l members runs over
    min(k, l) member-to-member links in parallel, each priced as the link between the two stages'
    first ranks, shared with the other links that leave its node where the node declares its network.
    A member that is a tensor-parallel group (``Stage.tp_shares``) is priced by
    ``autopar.cost.tp`` with ``replicated_fraction`` (None: its default). ``kinds``: a memo of TP
    groups' kinds ((ranks, head shares) -> ``tp_cost.group_kind`` on ``cluster``) the caller keeps
    across calls on the same cluster (the joint planner prices the same members in every candidate).
    ``rows``: a memo of each stage's forward and backward rows by the stage (and its transfer row by
    the stage and the next), for a caller that prices variants sharing most stages (interleaving's
    recompute rounds); kept with the stages, so their ids are not reused."""
    S = len(stages)
    M = max(len(mb) for st in stages for mb in st.micro_batches)
    fwd, bwd, comm = np.zeros((S, M)), np.zeros((S, M)), np.zeros((max(S - 1, 0), M))
    tp_seen: dict = {}
    tp_ids: dict = {}
    kinds = {} if kinds is None else kinds   # (ranks, head shares) -> the group's kind
    calls: dict = {}   # device types of a member -> its call overhead (the slowest type's)
    for s, st in enumerate(stages):
        key = (id(st), M, replicated_fraction)
        hit = rows.get(key) if rows is not None else None
        if hit is not None and hit[0] is st:
            fwd[s], bwd[s] = hit[1], hit[2]
        else:
            _stage_rows(costs, cluster, st, fwd[s], bwd[s], replicated_fraction, kinds, tp_seen, tp_ids, calls)
            if rows is not None:
                rows[key] = (st, fwd[s].copy(), bwd[s].copy())
        if s < S - 1:
            nxt = stages[s + 1]
            key = (id(st), id(nxt), M)
            hit = rows.get(key) if rows is not None else None
            if hit is not None and hit[0] is st and hit[1] is nxt:
                comm[s] = hit[2]
            else:
                comm[s] = _transfer_row(costs, cluster, st, nxt, M)
                if rows is not None:
                    rows[key] = (st, nxt, comm[s].copy())
    return fwd, bwd, comm


def _stage_rows(costs, cluster, st: Stage, fwd: np.ndarray, bwd: np.ndarray, replicated_fraction, kinds: dict,
                tp_seen: dict, tp_ids: dict, calls: dict) -> None:
    """Fill one stage's forward and backward seconds per micro-batch (``stage_durations``' rows)."""
    blocks = slice(st.block_start, st.block_stop)
    seen: dict[tuple, tuple[float, float]] = {}   # (member kind, samples) -> (fwd, bwd) seconds
    alike: dict = {}   # (member kind, call, micro-batch count) -> its members: priced as one matrix
    for g, members in enumerate(st.groups):
        t = cluster.devices[members[0]].spec.name
        kind = None
        types = (t,)
        if len(members) > 1:
            if st.tp_shares:
                from autopar.cost import tp as tp_cost  # local: the TP cost model imports nothing from here

                at_key = (tuple(members), tuple(st.tp_shares[g]))   # chunks of one rank stage: the same groups
                kind = kinds.get(at_key)
                if kind is None:
                    kind = kinds[at_key] = tp_cost.group_kind(cluster, members, st.tp_shares[g])
                t = tp_ids.setdefault(kind, len(tp_ids))
                types = kind.types
            else:
                types = tuple(cluster.devices[r].spec.name for r in members)
        call = calls.get(types)
        if call is None:
            call = calls[types] = (max(costs.call_overhead(x, "forward") for x in types),
                                   max(costs.call_overhead(x, "backward") for x in types))
        xs = st.micro_batches[g]
        alike.setdefault((t, call, len(xs)), (kind, []))[1].append(xs)
    for (t, call, n), (kind, rows) in alike.items():
        if not n:
            continue
        arr = np.array(rows) if len(rows) > 1 else np.asarray(rows[0])[None, :]
        vals = np.unique(arr)
        fv, bv = np.empty(len(vals)), np.empty(len(vals))
        for i, x in enumerate(vals.tolist()):
            if (t, x) not in seen:
                if kind is None:
                    seen[(t, x)] = (float(costs.fwd_time(t, x)[blocks].sum()),
                                    float(costs.bwd_time(t, x)[blocks].sum()))
                else:
                    seen[(t, x)] = tp_cost.kind_times(costs, cluster, kind, x, blocks, replicated_fraction,
                                                      tp_seen, st.sequence_parallel)
            f, b = seen[(t, x)]
            if x > 0:        # a forward call and a backward call (autopar.cost.step)
                f, b = f + call[0], b + call[1]
                if st.recompute:   # the backward reruns the forward (another call)
                    b = b + f
            fv[i], bv[i] = f, b
        at = np.searchsorted(vals, arr)   # each member's micro-batches' entries in ``vals``
        fwd[:n] = np.maximum(fwd[:n], fv[at].max(axis=0))
        bwd[:n] = np.maximum(bwd[:n], bv[at].max(axis=0))


def _transfer_row(costs, cluster, st: Stage, nxt: Stage, M: int) -> list[float]:
    """Seconds of each micro-batch's transfer from ``st`` to ``nxt`` (``stage_durations``' comm row), as
    ``runtime.pipeline_msg`` moves it (the gradients come back alike, priced the same). Between TP members
    of one degree t > 1, rank k sends chunk k of the rows to rank k, t senders at once, and the receiving
    member all-gathers the chunks; otherwise every rank of a member of t ranks sends its whole copy to the
    ranks of the receiving member of u ranks whose index is its own mod t: ceil(u / t) copies over each
    sender's link, min(t, u) senders at once."""
    links = min(len(st.groups), len(nxt.groups))
    t, u = (len(st.groups[0]) if st.tp_shares else 1), (len(nxt.groups[0]) if nxt.tp_shares else 1)
    split = t if t == u > 1 else 1
    copies = 1 if split > 1 else -(-u // t)
    per_sample = float(costs.out_bytes[st.block_stop - 1])
    devices = cluster.devices
    src, dst = devices[st.groups[0][0]].node, devices[nxt.groups[0][0]].node
    # the senders that leave the first link's node at once, counted where they share a declared network
    flows = 1
    if src != dst and (cluster.node_network_Bps[src] is not None or cluster.node_network_Bps[dst] is not None):
        flows = min(t, u) * sum(1 for i in range(links) if devices[st.groups[i][0]].node == src
                                and devices[nxt.groups[i][0]].node != src)
    sent: dict[float, float] = {}   # bytes -> seconds over this boundary
    if len({len(mb) for mb in st.micro_batches}) == 1:
        sizes = np.array(st.micro_batches).sum(axis=0).tolist()
    else:
        sizes = [sum(col) for col in itertools.zip_longest(*st.micro_batches, fillvalue=0)]
    sizes += [0] * (M - len(sizes))
    of_size: dict = {}   # samples of a micro-batch -> seconds over this boundary
    for size in dict.fromkeys(sizes):
        nbytes = per_sample * math.ceil(size / links) * copies
        if nbytes not in sent:
            sent[nbytes] = p2p_time_s(cluster, st.groups[0][0], nxt.groups[0][0], nbytes / split,
                                      concurrent=max(flows, 1))
            if split > 1 and nbytes > 0:
                sent[nbytes] += allgather_time_s(cluster, nxt.groups[0], nbytes)
        of_size[size] = sent[nbytes]
    return [of_size[x] for x in sizes]


def _allreduce_s(costs, cluster, stage: Stage, replicated_fraction: float | None = None, zero_stage: int = 0) -> float:
    from autopar.cost import tp as tp_cost

    return tp_cost.stage_sync_time_s(costs, cluster, stage, replicated_fraction, zero_stage=zero_stage)   # the one definition


def plan_timeline(plan: Plan, costs: ModelCosts, cluster: "Cluster", *,
                  durations: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> tuple[Timeline, float]:
    """The simulated timeline of a pipeline plan's schedule and its step time (the last stage to finish
    its backward and then its gradient all-reduce). The planner predicts with this same function.
    Tensor-parallel members are priced with the replicated fraction the joint planner recorded in
    ``plan.predicted.breakdown["tp_replicated_fraction"]`` (``autopar.cost.tp``'s default if absent).
    ``durations``: ``stage_durations`` of these stages at that fraction, when the caller has them."""
    stages = plan.stages
    M = plan.num_micro_batches
    rho = plan.predicted.breakdown.get("tp_replicated_fraction")
    fwd, bwd, comm = durations if durations is not None else \
        stage_durations(costs, cluster, stages, replicated_fraction=rho)
    name = plan.schedule if plan.schedule in SCHEDULES and plan.schedule != "auto" else "1f1b"
    wgrad = None
    if name == "zb-h1":
        bwd, wgrad = split_durations(stages, fwd, bwd)
    timeline = simulate(make_schedule(name, len(stages), M, plan.virtual_stages), fwd, bwd, comm,
                        wgrad_time_s=wgrad)
    R = plan.rank_stages
    worker_ends = timeline.stage_end_s   # a property over every event: once
    ends = [worker_ends[s % R] for s in range(len(stages))]
    return timeline, _finish_s(plan, costs, cluster, ends, rho)[0]


def split_durations(stages: Sequence[Stage], fwd: np.ndarray, bwd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(BI + BW, BW) seconds [stage][micro] of a zero-bubble split of ``stage_durations``' backwards
    (see the module docstring): the shares of the backward without a recompute stage's rerun forward,
    which BI runs; the first stage runs its whole backward as its BW."""
    rerun = np.array([[1.0] if st.recompute else [0.0] for st in stages]) * fwd
    pure = np.maximum(bwd - rerun, 0.0)
    wgrad = ZB_WEIGHT_SHARE * pure
    total = ZB_INPUT_SHARE * pure + rerun + wgrad
    total[0], wgrad[0] = bwd[0], bwd[0]
    return total, wgrad


def pipeline_memory_bytes(costs: ModelCosts, stages: Sequence[Stage], schedule: str, zero_stage: int,
                          virtual_stages: int = 1, replicated_fraction: float | None = None) -> dict[int, int]:
    """Peak bytes of every rank of a pipeline plan: ``autopar.cost.memory.stage_memory_bytes`` without
    virtual stages; with them (one-rank members), the sum over a rank's chunks of each chunk's state
    and its activations in flight (``in_flight_micro_batches`` per chunk: each chunk's own peak, so
    the sum is no less than the rank's peak)."""
    from autopar.cost.memory import stage_memory_bytes

    if virtual_stages == 1:
        return stage_memory_bytes(costs, stages, schedule, zero_stage, replicated_fraction)
    out: dict[int, float] = {}
    S = len(stages)
    for s, st in enumerate(stages):
        blocks = slice(st.block_start, st.block_stop)
        state = sharded_state_bytes(float(costs.param_bytes[blocks].sum()), float(costs.params[blocks].sum()),
                                    costs.grad_bytes_per_param, costs.optimizer_bytes_per_param, zero_stage,
                                    1.0 / len(st.groups))
        act = float(costs.act_bytes[blocks].sum())
        fly = in_flight_micro_batches(schedule, s, S, len(st.micro_batches[0]), virtual_stages)
        held = stage_input_bytes(costs, st) if st.recompute else 0.0
        for g, ranks in enumerate(st.groups):
            x = max(st.micro_batches[g])
            need = state + act * x * (1 if st.recompute else fly) + held * x * fly
            for r in ranks:
                out[r] = out.get(r, 0.0) + need
    return {r: int(math.ceil(v)) for r, v in sorted(out.items())}


def _tied_stage_sets(costs: ModelCosts, stages: Sequence[Stage]) -> list[tuple[tuple[int, ...], float]]:
    """(stages, gradient bytes) of every tied parameter group whose blocks lie in several stages."""
    out = []
    for group in costs.tied_groups:
        held = tuple(sorted({s for b in group for s, st in enumerate(stages) if st.block_start <= b < st.block_stop}))
        if len(held) > 1:
            # The tied weight is counted in the group's first block (its owner): at most that block's size.
            out.append((held, float(costs.params[min(group)]) * costs.grad_bytes_per_param))
    return out


def _zero_share(stage: Stage, g: int) -> float:
    """Member ``g``'s part of a one-rank-member stage's flat shards: its ``zero_shares`` entry over
    their sum, else 1 / members."""
    if stage.zero_shares:
        return float(stage.zero_shares[g]) / max(float(sum(stage.zero_shares)), 1e-300)
    return 1.0 / len(stage.groups)


def stage_optimizer_s(costs: ModelCosts, cluster: "Cluster", stage: Stage, zero_stage: int,
                      replicated_fraction: float | None = None, *, types: dict | None = None) -> float:
    """Seconds of the optimizer step of a stage's slowest rank: every rank steps the stage's parameters,
    on a stage of k one-rank members under ZeRO >= 1 its flat shard (1/k of them, or its ``zero_shares``
    part: ``runtime.dp_sync``),
    a tensor-parallel rank its shard (``cost.tp.tp_rank_params``: the parameters the rewrite leaves
    whole plus its share of the rest; 1/k of that under ZeRO >= 1 where ``cost.tp.tp_zero_stage`` is 1,
    stepped as one flat buffer: ``runtime.dp_sync``). Unflattened, each rank pays the per-tensor term of
    the tensors it steps (``ModelCosts.optimizer_time``): a TP rank a piece of every tensor of the
    stage, a ZeRO member 1/k of them. ``types``: a memo (ranks -> their device types) the caller
    keeps across calls on ``cluster``."""
    p = float(costs.params[stage.block_start:stage.block_stop].sum())
    k = costs.block_tensors(slice(stage.block_start, stage.block_stop))
    nm = len(stage.groups)
    tp = bool(stage.tp_shares) and any(len(g) > 1 for g in stage.groups)
    worst = 0.0
    seen: set = set()   # (device type, parameters): ranks that step alike
    if tp:
        from autopar.cost import tp as tp_cost

        rho = tp_cost.DEFAULT_REPLICATED_FRACTION if replicated_fraction is None else replicated_fraction
        tp_zero = bool(tp_cost.tp_zero_stage(stage, zero_stage))   # the sync over the members (runtime.dp_sync)
    blocks = slice(stage.block_start, stage.block_stop)
    helds: dict = {}   # head shares -> per rank parameters: members of equal shares hold alike
    types = {} if types is None else types
    alike: set = set()   # (device types, head shares): members that step alike
    for g, members in enumerate(stage.groups):
        at = members if isinstance(members, tuple) else tuple(members)
        names = types.get(at)
        if names is None:
            names = types[at] = tuple(cluster.devices[r].spec.name for r in at)
        sig = (names, tuple(stage.tp_shares[g]) if tp and len(members) > 1 else None)
        if sig in alike:
            continue
        alike.add(sig)
        held = None
        if tp and len(members) > 1:
            key = tuple(stage.tp_shares[g])
            held = helds.get(key)
            if held is None:
                shares = np.asarray(stage.tp_shares[g], dtype=np.float64)
                held = tp_cost.tp_rank_params(costs, blocks, shares / max(shares.sum(), 1.0), rho)
                if tp_zero:
                    held = held / nm
                helds[key] = held
        for i, r in enumerate(members):
            n, tensors, flat = p, k, False
            if held is not None:
                n, flat = float(held[i]), tp_zero
            elif zero_stage >= 1 and nm > 1 and not tp:   # the sync's flat shard (runtime.dp_sync)
                n, flat = p * _zero_share(stage, g), True
            t = names[i]
            if (t, n) in seen:
                continue
            seen.add((t, n))
            worst = max(worst, costs.optimizer_time(t, n, flat=flat, tensors=tensors)
                        + (costs.call_overhead(t) if n > 0 else 0.0))
    return worst


def zero3_block_round_s(costs: ModelCosts, cluster: "Cluster", stage: Stage, rho: float | None) -> float:
    """Seconds a round (one micro-batch) of ZeRO-3 by block in a recomputing stage of TP members
    (``ir.plan.zero3_by_block``) adds to its compute: over the ring of the members' first ranks (each TP
    index's peers run alike, in parallel), each block's local weights (its state work factor at the
    largest share) gathered for forward and again for the re-run in backward, and its gradient
    reduce-scattered, as ``runtime.dp_sync`` runs them (``cost.comm.zero_gather_s`` /
    ``zero_reduce_scatter_s``). Where the data-parallel collectives hide behind compute
    (``cost.comm.dp_comm_hides``: the sync prefetches the next block's weights), only each pass's
    first gather waits; the reduce-scatters, issued between blocks, do not hide."""
    from autopar.cost import tp as tp_cost

    blocks = slice(stage.block_start, stage.block_stop)
    f = max(max(sh) / sum(sh) for sh in tp_cost.stage_tp_shares(stage))
    local_p, _ = tp_local_block_params(costs, stage, tp_cost.DEFAULT_REPLICATED_FRACTION if rho is None else rho, f)
    local = [int(round(u)) for u in local_p if u > 0]
    if not local:
        return 0.0
    ranks = [m[0] for m in stage.groups]
    size = float(costs.param_bytes[blocks].sum() / max(float(costs.params[blocks].sum()), 1.0))
    gathers = [zero_gather_s(cluster, ranks, u, size) for u in local]
    rs = sum(zero_reduce_scatter_s(cluster, ranks, u, int(costs.grad_bytes_per_param)) for u in local)
    exposed = gathers[0] + gathers[-1] if dp_comm_hides(cluster, ranks) else 2 * sum(gathers)
    return exposed + rs


def stage_sync_s(plan: Plan, costs: ModelCosts, cluster: "Cluster", stage: Stage, rho: float | None) -> float:
    """Seconds of ``stage``'s gradient reduction in ``plan``: under ZeRO-3 by block every micro-batch's
    round of per-block collectives (``zero3_block_round_s``), else the reduction over its members after
    the schedule (``cost.tp.stage_sync_time_s``)."""
    if zero3_by_block(plan.stages, plan.zero_stage):
        return plan.num_micro_batches * zero3_block_round_s(costs, cluster, stage, rho)
    return _allreduce_s(costs, cluster, stage, rho, plan.zero_stage)


def _finish_s(plan: Plan, costs: ModelCosts, cluster: "Cluster", ends: Sequence[float],
              rho: float | None) -> tuple[float, float]:
    """(step seconds, slowest optimizer step) after the schedule: each stage all-reduces its gradients
    over its members when it finishes; a tied parameter held by several stages waits for all of them
    and is summed over their ranks; then each rank steps its optimizer (ZeRO >= 1: and its members
    gather the updated parameters), as ``runtime.pipeline`` does."""
    stages = plan.stages
    R = plan.rank_stages
    chunks = [range(p, len(stages), R) for p in range(R)]   # a rank stage's chunks (one without interleaving)
    ar = [stage_sync_s(plan, costs, cluster, st, rho) for st in stages]
    ready = [0.0] * len(stages)
    for cs in chunks:   # a rank reduces its chunks' gradients one after another
        for c in cs:
            ready[c] = float(ends[c]) + sum(ar[x] for x in cs)
    for held, nbytes in _tied_stage_sets(costs, stages):
        ranks = sorted({r for s in held for r in stages[s].ranks})
        at = max(ready[s] for s in held) + allreduce_time_s(cluster, ranks, nbytes)
        for s in held:
            ready[s] = at
    opt = [stage_optimizer_s(costs, cluster, st, plan.zero_stage, rho) for st in stages]
    gather = [0.0] * len(stages)
    for s, st in enumerate(stages):
        if plan.zero_stage >= 1 and len(st.groups) > 1 and not (st.tp_shares and any(len(g) > 1 for g in st.groups)):
            gather[s] = allgather_time_s(cluster, [g[0] for g in st.groups],
                                         float(costs.param_bytes[st.block_start:st.block_stop].sum()))
    tail = [max(ready[c] for c in cs) + sum(opt[c] + gather[c] for c in cs) for cs in chunks]
    opt = [sum(opt[c] for c in cs) for cs in chunks]
    # Then the step's loss sum, all-reduced over every rank (all wait for the last to finish).
    return float(max(tail)) + pipeline_loss_allreduce_s(plan, cluster), float(max(opt, default=0.0))


def pipeline_loss_allreduce_s(plan: Plan, cluster: "Cluster") -> float:
    """Seconds of the loss sum a pipeline step all-reduces over all its ranks at the end
    (``runtime.pipeline``: one float64, all latency); 0 on one rank."""
    ranks = sorted({r for st in plan.stages for r in st.ranks})
    return loss_allreduce_s(cluster, ranks) if len(ranks) > 1 else 0.0


def tied_allreduces_s(plan: Plan, costs: ModelCosts, cluster: "Cluster") -> dict[int, float]:
    """Per rank, the seconds of the all-reduces of tied parameters held by several stages that it joins
    (``_finish_s``: each over the ranks of the stages holding the group, after they all have finished)."""
    out: dict[int, float] = {}
    for held, nbytes in _tied_stage_sets(costs, plan.stages):
        ranks = sorted({r for s in held for r in plan.stages[s].ranks})
        t = allreduce_time_s(cluster, ranks, nbytes)
        for r in ranks:
            out[r] = out.get(r, 0.0) + t
    return out
