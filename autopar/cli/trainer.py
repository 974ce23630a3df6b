"""Real training runs on this machine: the worker that ``autopar train`` and ``autopar demo`` launch on
every rank, comparing strategies side by side in ONE run (the same processes, their steps interleaved).

On a CPU-only machine the devices are *emulated* (CPU processes slowed to their speed); every figure
this module reports from such a run says so.

Terms
- warm-up steps: the first ``warmup_steps`` steps of every strategy (allocations, first-call costs,
  caches); they train like the others but are kept apart (``warmup_times_s``) and never enter a figure.
  ``WARMUP_STEPS`` (8) by default: an emulated clock charges each block the least CPU time it has seen at
  its position (steady emulation, ``autopar.runtime.emulate``), and those minima take several steps to
  settle. bert-tiny dp on the demo cluster (emulated, slowdown 2, one cache) measured 1.06-1.34x its
  prediction over seven runs after 2 warm-up steps, still falling within a run, and 0.99-1.01x over
  three runs after 8.
- measured steps: the next ``steps`` steps. A step's time is its wall time on the slowest rank (every
  rank starts it after a barrier).
- interleaving: every strategy is compiled first, then step ``i`` of every strategy runs before step
  ``i + 1`` of any, the order reversed on every other step (A B, B A, ...). A neighbour that loads the
  machine for a while then slows every strategy alike, and step ``i`` of two strategies form a *pair*.
- consecutive (``RunSpec.consecutive``, ``autopar train --consecutive K``): the strategies take turns in
  runs of K steps instead of one (A A A B B B, then B B B A A A, ...; 0: all of a strategy's steps in one
  run, one strategy after the other, as a user's job runs one plan). Steps alternated one by one evict
  each other's weights and autograd state from the caches, so every step of every strategy starts cold:
  bert-tiny ``tp`` on the demo cluster (emulated, load 0.6) measured 1.42x its prediction alternated with
  six other strategies, 1.04x alone. Pairs are still step ``i`` of each strategy.
- spread (``Spread``): median, quartiles and range of a set of values, over the measured steps.
- speedup of A over B: per pair, B's step time over A's; reported as the median over pairs with its
  spread (``paired_speedup``).
- clock totals: per rank, the emulated clock's totals over the measured steps (``ClockStats`` fields:
  CPU time, sleep, and blocks that overran their target because of contention).
- profile: ``compiled.profile()`` of the measured steps (``autopar.ir.profile.StepProfile``): per rank
  and phase, measured against predicted seconds; ``gap_lines`` prints the largest gaps by phase and
  by device type, ``plot_profiles`` draws the measured last step of every strategy as a Gantt chart.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

__all__ = ["strategy_variant", "turns", "order_text", "RunSpec", "StrategyResult", "Spread", "spread", "paired_speedup",
           "train_worker", "run_comparison", "measured_timeline", "WARMUP_STEPS", "gap_lines", "plot_profiles", "PHASE_COLORS"]


WARMUP_STEPS = 8     # the default warm-up (module docstring: the steady clock's minima settle)


def strategy_variant(token: str, default_zero) -> tuple[str, object]:
    """(strategy, ZeRO stage) of a ``--compare`` entry: ``dp`` (the run's ``--zero``) or ``dp:zero=K``
    (K one of 0-3 or auto), so one run can measure a strategy's ZeRO stages side by side. ``ValueError``
    naming the entry when it is neither."""
    name, _, opt = token.partition(":")
    if not opt:
        return name, default_zero
    key, _, value = opt.partition("=")
    if key != "zero" or value not in ("0", "1", "2", "3", "auto"):
        raise ValueError(f"{token!r}: a strategy is NAME or NAME:zero=K with K one of 0, 1, 2, 3, auto")
    return name, value if value == "auto" else int(value)


@dataclass(frozen=True)
class RunSpec:
    model: str                  # zoo name or package.module:factory
    cluster_dict: dict
    global_batch: int
    steps: int                  # measured steps per strategy, after the warm-up steps
    strategies: tuple[str, ...]
    lr: float = 1e-3
    warmup_steps: int = WARMUP_STEPS
    seed: int = 0
    zero_stage: object = "auto"
    model_overrides: tuple[tuple[str, object], ...] = ()   # zoo config fields, e.g. (("num_layers", 10),)
    schedule: str = "auto"
    recompute: bool = True
    track_memory: bool | None = None    # RunConfig.track_memory (None: as the device says)
    replan: str = "off"                 # compile's replan= (autopar.runtime.replan)
    max_restarts: int = 0               # launch's max_restarts= (autopar.runtime.elastic, docs/elastic.md)
    checkpoint_dir: str | None = None   # compile's checkpoint_dir= (one sub-directory per strategy)
    checkpoint_every: int | None = None
    checkpoint_keep: int | None = None  # compile's checkpoint_keep=
    consecutive: int = 1                # steps a strategy runs before the next takes its turn (0: all)

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"RunSpec.steps: must be >= 1, got {self.steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"RunSpec.warmup_steps: must be >= 0, got {self.warmup_steps}")
        if isinstance(self.consecutive, bool) or not isinstance(self.consecutive, int) or self.consecutive < 0:
            raise ValueError(f"RunSpec.consecutive: must be an int >= 0, got {self.consecutive!r}")


@dataclass(frozen=True, slots=True)
class Spread:
    """Median, quartiles and range of ``num`` values (see the module docstring)."""
    median: float
    q1: float
    q3: float
    min: float
    max: float
    num: int

    def as_dict(self) -> dict:
        return dict(median=self.median, q1=self.q1, q3=self.q3, min=self.min, max=self.max, num=self.num)

    def scaled(self, factor: float) -> "Spread":
        return Spread(self.median * factor, self.q1 * factor, self.q3 * factor, self.min * factor,
                      self.max * factor, self.num)


def spread(values) -> Spread:
    """The ``Spread`` of ``values`` (at least one); quartiles by the inclusive method."""
    vs = sorted(float(v) for v in values)
    if not vs:
        raise ValueError("spread: no values")
    q1, _, q3 = statistics.quantiles(vs, n=4, method="inclusive") if len(vs) > 1 else (vs[0],) * 3
    return Spread(statistics.median(vs), q1, q3, vs[0], vs[-1], len(vs))


def paired_speedup(fast_times_s, base_times_s) -> Spread:
    """The spread of ``base / fast`` over paired steps (same index; the shorter list decides)."""
    pairs = list(zip(fast_times_s, base_times_s))
    return spread(b / f for f, b in pairs)


@dataclass(frozen=True)
class StrategyResult:
    strategy: str
    plan_json: str
    losses: tuple[float, ...]           # of the measured steps
    step_times_s: tuple[float, ...]     # wall time of each measured step (max over ranks)
    predicted_step_s: float
    traces: tuple = ()                  # per rank: the pipeline engine's action trace of the last step
    warmup_times_s: tuple[float, ...] = ()   # the warm-up steps, excluded from every figure
    clock_stats: tuple = ()             # per rank: emulate.ClockStats totals over the measured steps
    profile_json: str = ""              # compiled.profile() of the measured steps (autopar.ir.profile)
    replans: tuple[str, ...] = ()       # replan="auto": each check's ReplanReport.summary()

    @property
    def profile(self):
        from autopar.ir.profile import StepProfile

        return StepProfile.from_json(self.profile_json) if self.profile_json else None

    @property
    def step_spread(self) -> Spread:
        return spread(self.step_times_s)

    @property
    def measured_step_s(self) -> float:
        return self.step_spread.median


def _clock(compiled):
    from autopar.runtime.emulate import NullClock

    return getattr(compiled.engine, "clock", None) or NullClock()


def _clock_delta(after, before):
    from autopar.runtime.emulate import ClockStats

    return ClockStats(after.speed, after.compute_s - before.compute_s, after.slept_s - before.slept_s,
                      after.num_blocks - before.num_blocks, after.overrun_s - before.overrun_s,
                      after.num_overruns - before.num_overruns)


def turns(runs: list, start: int, stop: int, consecutive: int = 1):
    """(step, run) in the order ``train_worker`` steps them: runs of ``consecutive`` steps per strategy
    (0: all of them), the strategies' order reversed on every other turn (module docstring)."""
    k = max(1, (stop - start) if consecutive == 0 else consecutive)
    for first in range(start, stop, k):
        for run in (runs if consecutive == 0 or (first // k) % 2 == 0 else runs[::-1]):
            for step in range(first, min(stop, first + k)):
                yield step, run


def order_text(consecutive: int) -> str:
    """How the strategies of a run with ``RunSpec.consecutive`` take turns, for its printed header."""
    if consecutive == 0:
        return "strategies one after the other (each one's steps back to back)"
    return "strategies interleaved step by step" if consecutive == 1 else f"strategies taking turns every {consecutive} steps"


def train_worker(rank: int, spec: RunSpec) -> list[dict]:
    """Runs on every rank: compile every strategy, then train them interleaved (module docstring),
    ``warmup_steps + steps`` steps each, recording loss, time and clock totals."""
    import autopar
    from autopar.cluster.model import Cluster
    from autopar.models import build, load
    from autopar.runtime.communicator import ReduceOp, pg_all_reduce, pg_barrier

    cluster = Cluster.from_dict(spec.cluster_dict)
    runs = []
    for token in spec.strategies:
        strategy, zero_stage = strategy_variant(token, spec.zero_stage)
        case = build(spec.model, device="cpu", seed=spec.seed, **dict(spec.model_overrides)) \
            if spec.model_overrides else load(spec.model, device="cpu", seed=spec.seed)
        run = autopar.RunConfig(optimizer=lambda ps: torch.optim.AdamW(ps, lr=spec.lr),
                                track_memory=spec.track_memory)
        compiled = autopar.compile(case.model, cluster, case.example_inputs, spec.global_batch, case.loss_fn,
                                   run=run, strategy=strategy,
                                   # the targets' shape and dtype let the cost model time the loss
                                   example_targets=case.batch(int(case.example_inputs[0].shape[0]),
                                                              seed=spec.seed)[1] if case.loss_fn else None,
                                   zero_stage=zero_stage, schedule=spec.schedule, recompute=spec.recompute,
                                   **({"replan": spec.replan} if spec.replan != "off" else {}),
                                   **({"checkpoint_dir": f"{spec.checkpoint_dir}/{token.replace(':', '-')}",
                                       "checkpoint_every": spec.checkpoint_every,
                                       "checkpoint_keep": spec.checkpoint_keep} if spec.checkpoint_dir else {}))
        runs.append(dict(strategy=token, case=case, compiled=compiled, losses=[], times=[], warmup=[],
                         clock0=None))
    start = min(run["compiled"].step_count for run in runs)   # > 0 after resuming from a checkpoint
    for step, run in turns(runs, start, spec.warmup_steps + spec.steps, spec.consecutive):
        compiled = run["compiled"]
        if compiled.step_count > step:       # resumed past this step
            continue
        inputs, targets = run["case"].batch(spec.global_batch, seed=step)
        if step >= spec.warmup_steps and run["clock0"] is None:
            run["clock0"] = _clock(compiled).stats()
        pg_barrier()
        t0 = time.perf_counter()
        loss = compiled.step(inputs, targets)
        dt = torch.tensor([time.perf_counter() - t0])
        pg_all_reduce(dt, op=ReduceOp.MAX)
        if step >= spec.warmup_steps:
            run["losses"].append(float(loss))
            run["times"].append(float(dt))
        else:
            run["warmup"].append(float(dt))
    out = []
    for run in runs:
        compiled = run["compiled"]
        profile = compiled.profile(last=spec.steps)      # collective: every rank, in the same order
        out.append(dict(strategy=run["strategy"], plan_json=compiled.plan.to_json(), losses=tuple(run["losses"]),
                        profile_json=profile.to_json() if rank == 0 else "",
                        step_times_s=tuple(run["times"]), predicted_step_s=compiled.plan.predicted.step_time_s,
                        warmup_times_s=tuple(run["warmup"]),
                        clock=_clock_delta(_clock(compiled).stats(), run["clock0"]),
                        trace=tuple(getattr(compiled.engine, "last_trace", ())),
                        replans=tuple(r.summary() for r in getattr(compiled, "replans", ()))))
    return out


def run_comparison(spec: RunSpec, cluster) -> list[StrategyResult]:
    import autopar

    results = autopar.launch(train_worker, cluster, spec, max_restarts=spec.max_restarts)
    out = []
    for i, r in enumerate(results[0]):
        r = dict(r)
        r.pop("trace")
        r.pop("clock")
        out.append(StrategyResult(**r, traces=tuple(rank[i]["trace"] for rank in results),
                                  clock_stats=tuple(rank[i]["clock"] for rank in results)))
    return out


def measured_timeline(result: StrategyResult, cluster):
    """A ``timeline.Timeline`` of a real pipeline run's last step (each stage drawn from its first rank),
    for ``timeline.plot_timeline``; the labels name the stage, rank and device."""
    from autopar.ir.plan import Plan
    from autopar.ir.schedule import Action
    from autopar.ir.timeline import Timeline

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


def gap_lines(profile, top: int = 4) -> list[str]:
    """The largest gaps between measured and predicted seconds per step, by phase and by device type
    (summed over ranks; medians over the measured steps; emulated sleep folded into the compute it
    stretches), and each rank's peak memory, measured beside predicted, where a meter measured it."""
    if profile is None:
        return []
    out = []
    for by in ("phase", "device_type"):
        rows = [g for g in profile.gaps(by) if abs(g.gap_s) > 0][:top]
        if rows:
            out.append(f"  largest gaps by {by.replace('_', ' ')} (measured - predicted, per step, all ranks): " +
                       "; ".join(f"{g.key} {g.gap_s * 1e3:+.1f} ms ({g.measured_s * 1e3:.1f} vs "
                                 f"{g.predicted_s * 1e3:.1f})" for g in rows))
    peaks = [(i.rank, i.device_type, i.measured_memory_bytes, i.predicted_memory_bytes) for i in profile.ranks
             if i.measured_memory_bytes is not None]
    if peaks:
        mib = 1 << 20
        out.append("  peak memory per rank (measured / predicted, MiB): " + "; ".join(
            f"rank {r} {t} {m / mib:.0f} / {p / mib:.0f}" + (f" ({m / p:.2f})" if p > 0 else "")
            for r, t, m, p in peaks))
    return out


PHASE_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868", "compute": "#8172B3",
                "sleep": "#D9D9D9", "wait": "#F2C6C6", "all_reduce": "#C44E52", "all_gather": "#937860",
                "reduce_scatter": "#DA8BC3", "broadcast": "#8C8C8C", "barrier": "#CCB974", "send": "#64B5CD",
                "send_wait": "#A6D8E8", "recv": "#2A7F9E"}


def plot_profiles(results, cluster, path: str) -> None:
    """A Gantt chart of the last measured step of every strategy (one panel each, one row per rank),
    from the step profiles; emulated figures are marked so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    profs = [(r.strategy, r.profile) for r in results if r.profile_json]
    fig, axes = plt.subplots(len(profs), 1, figsize=(11, 1.2 + 0.55 * len(cluster) * len(profs)), squeeze=False)
    seen = set()
    for ax, (name, prof) in zip(axes[:, 0], profs):
        last = max(prof.step_indices())
        steps = [s for s in prof.steps if s.step == last]
        for s in steps:
            for e in s.events:
                ax.barh(s.rank, e.t1 - e.t0, left=e.t0 * 1, height=0.7,
                        color=PHASE_COLORS.get(e.phase, "#000000"), linewidth=0)
                seen.add(e.phase)
        end = max(s.start_s + s.wall_s for s in steps)
        ax.set_yticks([s.rank for s in steps])
        ax.set_yticklabels([f"rank {s.rank} ({cluster.devices[s.rank].spec.name})" for s in steps], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1.02)
        emu = ", emulated devices" if prof.emulated else ""
        ax.set_title(f"{name}: measured step {last} ({end * 1e3:.1f} ms{emu}; predicted "
                     f"{prof.predicted_step_s * 1e3:.1f} ms)", fontsize=9)
    axes[-1, 0].set_xlabel("seconds from the step's start")
    handles = [Patch(color=PHASE_COLORS[p], label=p) for p in PHASE_COLORS if p in seen]
    fig.legend(handles=handles, loc="lower center", ncol=min(8, len(handles)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
