"""Real training runs on this machine: the worker that ``autopar train`` and ``autopar demo`` launch on
every rank, comparing strategies side by side in ONE run (the same processes, one after the other).

On a CPU-only machine the devices are *emulated* (CPU processes slowed to their speed); every figure
this module reports from such a run says so.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

__all__ = ["RunSpec", "StrategyResult", "train_worker", "run_comparison", "measured_timeline"]


@dataclass(frozen=True)
class RunSpec:
    model: str                  # zoo name or package.module:factory
    cluster_dict: dict
    global_batch: int
    steps: int
    strategies: tuple[str, ...]
    lr: float = 1e-3
    warmup_steps: int = 1
    seed: int = 0
    zero_stage: object = "auto"
    model_overrides: tuple[tuple[str, object], ...] = ()   # zoo config fields, e.g. (("num_layers", 10),)
    schedule: str = "auto"
    recompute: bool = False


@dataclass(frozen=True)
class StrategyResult:
    strategy: str
    plan_json: str
    losses: tuple[float, ...]
    step_times_s: tuple[float, ...]     # measured wall time of each step (max over ranks)
    predicted_step_s: float
    traces: tuple = ()                  # per rank: the pipeline engine's action trace of the last step

    @property
    def measured_step_s(self) -> float:
        timed = self.step_times_s[1:] if len(self.step_times_s) > 1 else self.step_times_s
        return statistics.median(timed)


def train_worker(rank: int, spec: RunSpec) -> list[dict]:
    """Runs on every rank: for each strategy, compile, train ``steps`` steps, record loss and time."""
    import autopar
    from autopar.cluster.model import Cluster
    from autopar.models import build, load
    from autopar.runtime.communicator import ReduceOp, pg_all_reduce, pg_barrier

    cluster = Cluster.from_dict(spec.cluster_dict)
    out = []
    for strategy in spec.strategies:
        case = build(spec.model, device="cpu", seed=spec.seed, **dict(spec.model_overrides)) \
            if spec.model_overrides else load(spec.model, device="cpu", seed=spec.seed)
        compiled = autopar.compile(case.model, cluster, case.example_inputs, spec.global_batch, case.loss_fn,
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=spec.lr), strategy=strategy,
                                   zero_stage=spec.zero_stage, schedule=spec.schedule, recompute=spec.recompute)
        losses, times = [], []
        for step in range(spec.steps + spec.warmup_steps):
            inputs, targets = case.batch(spec.global_batch, seed=step)
            pg_barrier()
            t0 = time.perf_counter()
            loss = compiled.step(inputs, targets)
            dt = torch.tensor([time.perf_counter() - t0])
            pg_all_reduce(dt, op=ReduceOp.MAX)
            if step >= spec.warmup_steps:
                losses.append(float(loss))
                times.append(float(dt))
        out.append(dict(strategy=strategy, plan_json=compiled.plan.to_json(), losses=tuple(losses),
                        step_times_s=tuple(times), predicted_step_s=compiled.plan.predicted.step_time_s,
                        trace=tuple(getattr(compiled.engine, "last_trace", ()))))
    return out


def run_comparison(spec: RunSpec, cluster) -> list[StrategyResult]:
    import autopar

    results = autopar.launch(train_worker, cluster, spec)
    out = []
    for i, r in enumerate(results[0]):
        r = dict(r)
        r.pop("trace")
        out.append(StrategyResult(**r, traces=tuple(rank[i]["trace"] for rank in results)))
    return out


def measured_timeline(result: StrategyResult, cluster):
    """A ``schedule.Timeline`` of a real pipeline run's last step (each stage drawn from its first rank),
    for ``schedule.plot_timeline``; the labels name the stage, rank and device."""
    from autopar.ir.plan import Plan
    from autopar.ir.schedule import Action, Timeline

    plan = Plan.from_json(result.plan_json)
    events, transfers, busy, labels = [], [], [], []
    for s, stage in enumerate(plan.stages):
        r = stage.groups[0][0]
        ev, tr = [], []
        for kind, micro, t0, t1 in result.traces[r]:
            if kind in ("F", "B"):
                ev.append((Action(s, kind, micro), t0, t1))
            elif kind.startswith("RECV"):
                tr.append((Action(s, kind, micro), t0, t1))
        events.append(tuple(ev))
        transfers.append(tuple(tr))
        busy.append(sum(t1 - t0 for _, t0, t1 in ev))
        labels.append(f"stage {s}: rank {r} ({cluster.devices[r].spec.name})")
    end = max((t1 for ev in events for _, _, t1 in ev), default=0.0)
    return Timeline(events=tuple(events), transfers=tuple(transfers), step_time_s=end, busy_s=tuple(busy),
                    schedule_name=f"measured {plan.schedule}"), labels
