"""The pipeline cost model: what a built pipeline plan (its ``Stage`` tuple) costs in time and memory.
The search over groupings, splits and micro-batch counts lives in ``autopar.planner.pp``.

Terms
- context (``_Context``): the fixed inputs of one planning call: model costs, cluster, global batch,
  ZeRO stage and the usable ``memory_fraction`` of each device.
- stage durations: per-micro-batch forward and backward seconds of each stage's slowest member (each
  call with its type's ``ModelCosts.call_overhead``; a recompute stage's backward reruns the forward)
  and p2p seconds of each stage boundary, split over min(k, l) parallel links between stages of k and
  l members (``stage_durations``). Tensor-parallel members are priced by ``autopar.cost.tp``.
- stage memory: weights + gradients + optimizer state of its blocks (sharded over its members under
  ZeRO, ``_state_fractions``) + activations of the micro-batches in flight (``_in_flight``: GPipe
  holds all M, 1F1B holds ``min(M, S - s)`` on stage s). A recompute stage keeps per micro-batch in
  flight only its input (``stage_input_bytes``) plus, at its peak, one micro-batch's full activations
  (``_memory_bytes``).
- prediction: ``simulate`` of the generated schedule with the stage durations, then each stage's
  gradient all-reduce over its members starting when the stage finishes (a tied parameter held by
  several stages: when they all have, over their ranks), then each rank's optimizer step
  (``stage_optimizer_s``) and, under ZeRO >= 1, the gather of the updated parameters
  (``plan_timeline``, ``_finish_s``). ZeRO-3's per-micro-batch parameter gathers are not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from autopar.cost.comm import allgather_time_s, allreduce_time_s, p2p_time_s
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan, Stage
from autopar.ir.schedule import Timeline, make_schedule, simulate

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["stage_durations", "stage_input_bytes", "plan_timeline", "stage_optimizer_s"]


# -- planning context and shared memory terms --------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Context:
    costs: ModelCosts
    cluster: "Cluster"
    global_batch: int
    zero_stage: int
    memory_fraction: float

    def type_of(self, rank: int) -> str:
        return self.cluster.devices[rank].spec.name

    def cap_bytes(self, rank: int) -> float:
        return self.cluster.devices[rank].spec.memory_bytes * self.memory_fraction


def _state_fractions(zero_stage: int, num_members: int) -> tuple[float, float, float]:
    f = 1.0 / num_members
    return (f if zero_stage >= 3 else 1.0), (f if zero_stage >= 2 else 1.0), (f if zero_stage >= 1 else 1.0)


def _in_flight(schedule: str, stage: int, num_stages: int, num_micro: int) -> int:
    return num_micro if schedule == "gpipe" else min(num_micro, num_stages - stage)


# -- exact stage durations, memory and the simulated prediction -------------------------------------

def stage_durations(costs: ModelCosts, cluster: "Cluster", stages: Sequence[Stage], *,
                    replicated_fraction: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-micro-batch forward and backward seconds [stage][micro] (slowest member, each with its
    type's ``ModelCosts.call_overhead``) and transfer seconds [boundary][micro] of a plan. A transfer between stages of k and l members runs over
    min(k, l) member-to-member links in parallel, each priced as the link between the two stages'
    first ranks. A member that is a tensor-parallel group (``Stage.tp_shares``) is priced by
    ``autopar.cost.tp`` with ``replicated_fraction`` (None: its default)."""
    S = len(stages)
    M = max(len(mb) for st in stages for mb in st.micro_batches)
    fwd, bwd, comm = np.zeros((S, M)), np.zeros((S, M)), np.zeros((max(S - 1, 0), M))
    tp_seen: dict = {}
    tp_ids: dict = {}
    for s, st in enumerate(stages):
        blocks = slice(st.block_start, st.block_stop)
        seen: dict[tuple, tuple[float, float]] = {}   # (member kind, samples) -> (fwd, bwd) seconds
        for g, members in enumerate(st.groups):
            t = cluster.devices[members[0]].spec.name
            kind = None
            if len(members) > 1 and st.tp_shares:
                from autopar.cost import tp as tp_cost  # local: the TP cost model imports nothing from here

                kind = tp_cost.group_kind(cluster, members, st.tp_shares[g])
                t = tp_ids.setdefault(kind, len(tp_ids))
            call = max(costs.call_overhead(cluster.devices[r].spec.name) for r in members)
            for m, x in enumerate(st.micro_batches[g]):
                if (t, x) not in seen:
                    if kind is None:
                        seen[(t, x)] = (float(costs.fwd_time(t, x)[blocks].sum()),
                                        float(costs.bwd_time(t, x)[blocks].sum()))
                    else:
                        seen[(t, x)] = tp_cost.kind_times(costs, cluster, kind, x, blocks, replicated_fraction,
                                                          tp_seen)
                f, b = seen[(t, x)]
                if x > 0:        # a forward call and a backward call (autopar.cost.step)
                    f, b = f + call, b + call
                    if st.recompute:   # the backward reruns the forward (another call)
                        b = b + f
                fwd[s, m] = max(fwd[s, m], f)
                bwd[s, m] = max(bwd[s, m], b)
        if s < S - 1:
            nxt = stages[s + 1]
            links = min(len(st.groups), len(nxt.groups))
            per_sample = float(costs.out_bytes[st.block_stop - 1])
            for m in range(M):
                size = sum(mb[m] for mb in st.micro_batches if m < len(mb))
                comm[s, m] = p2p_time_s(cluster, st.groups[0][0], nxt.groups[0][0],
                                        per_sample * math.ceil(size / links))
    return fwd, bwd, comm


def stage_input_bytes(costs: ModelCosts, stage: Stage) -> float:
    """Bytes per sample of a stage's input activations: the output of the block before it (0 for the
    first stage, whose input is the graph input). A recompute stage keeps only these per micro-batch
    in flight."""
    return float(costs.out_bytes[stage.block_start - 1]) if stage.block_start > 0 else 0.0


def _allreduce_s(costs, cluster, stage: Stage, replicated_fraction: float | None = None) -> float:
    if len(stage.groups) < 2:
        return 0.0
    if stage.tp_shares and any(len(g) > 1 for g in stage.groups):
        from autopar.cost import tp as tp_cost

        return tp_cost.stage_allreduce_time_s(costs, cluster, stage, replicated_fraction)
    grad_bytes = float(costs.params[stage.block_start:stage.block_stop].sum()) * costs.grad_bytes_per_param
    return allreduce_time_s(cluster, [g[0] for g in stage.groups], grad_bytes)


def plan_timeline(plan: Plan, costs: ModelCosts, cluster: "Cluster") -> tuple[Timeline, float]:
    """The simulated timeline of a pipeline plan's schedule and its step time (the last stage to finish
    its backward and then its gradient all-reduce). The planner predicts with this same function.
    Tensor-parallel members are priced with the replicated fraction the joint planner recorded in
    ``plan.predicted.breakdown["tp_replicated_fraction"]`` (``autopar.cost.tp``'s default if absent)."""
    stages = plan.stages
    M = plan.num_micro_batches
    rho = plan.predicted.breakdown.get("tp_replicated_fraction")
    fwd, bwd, comm = stage_durations(costs, cluster, stages, replicated_fraction=rho)
    name = plan.schedule if plan.schedule in ("gpipe", "1f1b") else "1f1b"
    timeline = simulate(make_schedule(name, len(stages), M), fwd, bwd, comm)
    return timeline, _finish_s(plan, costs, cluster, timeline.stage_end_s, rho)[0]


def _tied_stage_sets(costs: ModelCosts, stages: Sequence[Stage]) -> list[tuple[tuple[int, ...], float]]:
    """(stages, gradient bytes) of every tied parameter group whose blocks lie in several stages."""
    out = []
    for group in costs.tied_groups:
        held = tuple(sorted({s for b in group for s, st in enumerate(stages) if st.block_start <= b < st.block_stop}))
        if len(held) > 1:
            # The tied weight is counted in the group's first block (its owner): at most that block's size.
            out.append((held, float(costs.params[min(group)]) * costs.grad_bytes_per_param))
    return out


def stage_optimizer_s(costs: ModelCosts, cluster: "Cluster", stage: Stage, zero_stage: int,
                      replicated_fraction: float | None = None) -> float:
    """Seconds of the optimizer step of a stage's slowest rank: every rank steps the stage's parameters,
    1/k of them on a stage of k one-rank members under ZeRO >= 1 (``runtime.pipeline`` deals them out),
    a tensor-parallel rank its shard (``rho + (1 - rho) * share / total`` of them)."""
    p = float(costs.params[stage.block_start:stage.block_stop].sum())
    nm = len(stage.groups)
    tp = bool(stage.tp_shares) and any(len(g) > 1 for g in stage.groups)
    worst = 0.0
    for g, members in enumerate(stage.groups):
        for i, r in enumerate(members):
            n = p
            if tp and len(members) > 1:
                from autopar.cost import tp as tp_cost

                rho = tp_cost.DEFAULT_REPLICATED_FRACTION if replicated_fraction is None else replicated_fraction
                shares = stage.tp_shares[g]
                n = p * (rho + (1 - rho) * shares[i] / max(sum(shares), 1))
            elif zero_stage >= 1 and nm > 1 and not tp:
                n = p / nm
            worst = max(worst, costs.optimizer_time(cluster.devices[r].spec.name, n)
                        + (costs.call_overhead(cluster.devices[r].spec.name) if n > 0 else 0.0))
    return worst


def _finish_s(plan: Plan, costs: ModelCosts, cluster: "Cluster", ends: Sequence[float],
              rho: float | None) -> tuple[float, float]:
    """(step seconds, slowest optimizer step) after the schedule: each stage all-reduces its gradients
    over its members when it finishes; a tied parameter held by several stages waits for all of them
    and is summed over their ranks; then each rank steps its optimizer (ZeRO >= 1: and its members
    gather the updated parameters), as ``runtime.pipeline`` does."""
    stages = plan.stages
    ready = [float(ends[s]) + _allreduce_s(costs, cluster, st, rho) for s, st in enumerate(stages)]
    for held, nbytes in _tied_stage_sets(costs, stages):
        ranks = sorted({r for s in held for r in stages[s].ranks})
        at = max(ready[s] for s in held) + allreduce_time_s(cluster, ranks, nbytes)
        for s in held:
            ready[s] = at
    opt = [stage_optimizer_s(costs, cluster, st, plan.zero_stage, rho) for st in stages]
    tail = []
    for s, st in enumerate(stages):
        gather = 0.0
        if plan.zero_stage >= 1 and len(st.groups) > 1 and not (st.tp_shares and any(len(g) > 1 for g in st.groups)):
            gather = allgather_time_s(cluster, [g[0] for g in st.groups],
                                      float(costs.param_bytes[st.block_start:st.block_stop].sum()))
        tail.append(ready[s] + opt[s] + gather)
    return float(max(tail)), float(max(opt, default=0.0))


def _memory_bytes(ctx: _Context, stages: Sequence[Stage], schedule: str) -> dict[int, int]:
    c = ctx.costs
    out = {}
    for s, st in enumerate(stages):
        blocks = slice(st.block_start, st.block_stop)
        nm = len(st.groups)
        fw, fg, fo = _state_fractions(ctx.zero_stage, nm)
        p = float(c.params[blocks].sum())
        state = float(c.param_bytes[blocks].sum()) * fw + p * (c.grad_bytes_per_param * fg
                                                               + c.optimizer_bytes_per_param * fo)
        act = float(c.act_bytes[blocks].sum())
        fly = _in_flight(schedule, s, len(stages), len(st.micro_batches[0]))
        held = stage_input_bytes(c, st) if st.recompute else 0.0
        for g, members in enumerate(st.groups):
            x = max(st.micro_batches[g])
            need = state + (act * x + held * x * fly if st.recompute else act * x * fly)
            for r in members:
                out[r] = int(math.ceil(need))
    return dict(sorted(out.items()))
