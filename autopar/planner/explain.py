"""Where a plan's predicted step goes, per stage (``autopar plan --explain``): compute, communication,
bubble, optimizer and memory, all from the same cost model and simulator that chose the plan.

Terms (seconds per step, predicted; the slowest member of a stage)
- compute: the stage's forward and backward work over every micro-batch (busy time in the simulated
  schedule; tensor-parallel all-reduces inside a block count here, as the cost tables price them);
- p2p: its sends of activations and gradients to the next stage;
- bubble: the rest of the simulated pipeline during which the stage waits (step of the schedule minus
  its compute);
- sync: its gradient all-reduce over the stage's members after the schedule (``cost.tp.stage_sync_time_s``;
  under ZeRO-3 by block its rounds of per-block gathers and reduce-scatters);
- optimizer: its optimizer step (``cost.pipeline.stage_optimizer_s``);
- memory: the largest predicted peak of its ranks over that rank's usable memory.
A one-stage plan (schedule "none") has no simulated pipeline: a data-parallel plan's row is the
data-parallel planner's own breakdown (compute, communication, optimizer of the slowest rank); a
tensor-parallel one's, its busiest rank's ``cost.step.predicted_phases`` (its collectives as sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.config import MEMORY_FRACTION
from autopar.cost.memory import usable_bytes
from autopar.cost.pipeline import plan_timeline, stage_durations, stage_optimizer_s, stage_sync_s
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["StageCost", "explain_stages", "explain_table"]


@dataclass(frozen=True, slots=True)
class StageCost:
    """One stage's share of the predicted step (see the module docstring)."""

    stage: int
    blocks: tuple[int, int]
    devices: str
    compute_s: float
    p2p_s: float
    bubble_s: float
    sync_s: float
    optimizer_s: float
    memory_fraction: float     # of the tightest rank's usable memory


def _devices(plan: Plan, cluster: "Cluster", s: int) -> str:
    st = plan.stages[s]
    types: dict[str, int] = {}
    for r in st.ranks:
        types[cluster.devices[r].spec.name] = types.get(cluster.devices[r].spec.name, 0) + 1
    tp = sorted({len(g) for g in st.groups})
    return (" + ".join(f"{n} x {t}" for t, n in types.items())
            + f" (tp {'/'.join(map(str, tp))} x dp {len(st.groups)})")


def _memory(plan: Plan, cluster: "Cluster", s: int, memory_fraction: float) -> float:
    mem = plan.predicted.memory_bytes
    return max((mem.get(r, 0) / usable_bytes(cluster.devices[r].spec, memory_fraction)
                for r in plan.stages[s].ranks), default=0.0)


def _slowest_rank(plan: Plan, costs: ModelCosts, cluster: "Cluster") -> tuple[float, float, float]:
    """(compute, collectives, optimizer) seconds of the rank of ``plan`` busiest in
    ``cost.step.predicted_phases``."""
    from autopar.cost.step import predicted_phases

    compute_keys = ("forward", "backward")
    best = (0.0, 0.0, 0.0)
    for d in predicted_phases(plan, costs, cluster).values():
        row = (sum(d.get(k, 0.0) for k in compute_keys),
               sum(v for k, v in d.items() if k not in (*compute_keys, "optimizer", "wait")), d.get("optimizer", 0.0))
        if sum(row) > sum(best):
            best = row
    return best


def explain_stages(plan: Plan, costs: ModelCosts, cluster: "Cluster",
                   memory_fraction: float = MEMORY_FRACTION) -> list[StageCost]:
    """Per stage, where the predicted step goes (see the module docstring)."""
    rho = plan.predicted.breakdown.get("tp_replicated_fraction")
    if plan.schedule == "none":
        b = plan.predicted.breakdown
        st = plan.stages[0]
        if "compute_s" in b:
            compute, sync, opt = b["compute_s"], b.get("comm_s", 0.0), b.get("optimizer_s", 0.0)
        else:      # a one-stage plan of another planner (tensor parallel): its slowest rank's phases
            compute, sync, opt = _slowest_rank(plan, costs, cluster)
        return [StageCost(0, (st.block_start, st.block_stop), _devices(plan, cluster, 0), compute,
                          0.0, 0.0, sync, opt, _memory(plan, cluster, 0, memory_fraction))]
    timeline, _ = plan_timeline(plan, costs, cluster)
    _, _, comm = stage_durations(costs, cluster, plan.stages, replicated_fraction=rho)
    out = []
    for s, st in enumerate(plan.stages):
        busy = float(timeline.busy_s[s]) if s < len(timeline.busy_s) else 0.0
        out.append(StageCost(
            s, (st.block_start, st.block_stop), _devices(plan, cluster, s), busy,
            float(comm[s].sum()) if s < len(comm) else 0.0, max(0.0, timeline.step_time_s - busy),
            stage_sync_s(plan, costs, cluster, st, rho),
            stage_optimizer_s(costs, cluster, st, plan.zero_stage, rho),
            _memory(plan, cluster, s, memory_fraction)))
    return out


def explain_table(plan: Plan, costs: ModelCosts, cluster: "Cluster", memory_fraction: float = MEMORY_FRACTION):
    """``explain_stages`` as a rich ``Table``, with a last line of means over stages as shares of the step."""
    from rich.table import Table

    rows = explain_stages(plan, costs, cluster, memory_fraction)
    step = plan.predicted.step_time_s
    t = Table(title=f"where the predicted step of {step:.4g} s goes, per stage (seconds; predicted)")
    for c in ("stage", "blocks", "devices", "compute", "p2p", "bubble", "sync", "optimizer", "memory"):
        t.add_column(c, justify="left" if c == "devices" else "right")
    for r in rows:
        t.add_row(str(r.stage), f"{r.blocks[0]}:{r.blocks[1]}", r.devices, f"{r.compute_s:.4g}", f"{r.p2p_s:.3g}",
                  f"{r.bubble_s:.4g}", f"{r.sync_s:.3g}", f"{r.optimizer_s:.3g}", f"{r.memory_fraction:.0%}")
    if rows and step > 0:
        n = len(rows)

        def share(x):
            return f"{sum(x) / n / step:.1%}"
        t.add_row("mean", "", "share of the step", share(r.compute_s for r in rows), share(r.p2p_s for r in rows),
                  share(r.bubble_s for r in rows), share(r.sync_s for r in rows),
                  share(r.optimizer_s for r in rows), "")
    return t
