"""Step profiles: per rank and per step, measured and predicted seconds of each phase of a training
step, as plain frozen data with a JSON round trip (``compiled.profile()`` returns one).

Terms
- event: one interval of a rank's step (``Event``: phase, start and end in seconds from the step's
  origin, bytes moved). Phases:
  - compute: ``forward``, ``backward``, ``optimizer``, and ``compute`` (forward and backward that the
    recorder could not tell apart);
  - ``sleep``: an emulated device's clock sleeping after a compute block (``autopar.runtime.emulate``);
  - collectives: ``all_reduce``, ``broadcast``, ``all_gather``, ``reduce_scatter``, ``barrier``;
  - point-to-point: ``send`` (posting), ``send_wait`` (waiting for posted sends), ``recv``;
  - ``wait``: waiting for peers: the part of a collective before the last rank of its group entered it
    (an asynchronous one: began waiting on it),
    the part of a receive before its sender posted the message (``from_records`` splits them off);
  - ``other``: the rest of the step's wall time (Python, copies, flattening outside any block).
- origin of a step: the earliest start of that step over the ranks of one machine, so every rank's
  events share one time axis (``time.perf_counter``, one clock per machine). Ranks on different
  machines are not aligned: their waits are not split off, and each keeps its own origin.
- measured seconds of a phase (``StepProfile.measured``): the median over the recorded steps of the
  phase's total in a step. With ``fold_sleep`` (the default for comparisons) an emulated rank's sleep
  is shared out over its compute phases in proportion to their work, which is what the emulated
  device's compute costs (the sleep stretches CPU time to ``cpu_time / speed * time_scale``).
- predicted seconds of a phase (``RankInfo.predicted``): the cost model's figure for the same phase of
  the same rank (``autopar.cost.step.predicted_phases``); ``wait`` is the rank's idle time in the
  predicted step.
- gap: measured minus predicted seconds of a phase on a rank; ``StepProfile.gaps`` sums them by phase
  or by device type and sorts them largest first.

Every figure from emulated devices is emulated; predicted figures are predictions of the cost model.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field

__all__ = ["Event", "RankStep", "RankInfo", "StepProfile", "PhaseGap", "from_records", "COMPUTE_PHASES",
           "COLLECTIVES", "MESSAGES", "COMPARED_PHASES"]

COMPUTE_PHASES = ("forward", "backward", "optimizer", "compute")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier")
MESSAGES = ("send", "send_wait", "recv")
# The phases compared with the prediction; messages are one row ("p2p").
COMPARED_PHASES = ("forward", "backward", "optimizer", "compute", *COLLECTIVES, "p2p", "wait", "other")


@dataclass(frozen=True, slots=True)
class Event:
    phase: str
    t0: float          # seconds from the step's origin
    t1: float
    nbytes: int = 0

    @property
    def duration_s(self) -> float:
        return self.t1 - self.t0


@dataclass(frozen=True, slots=True)
class RankStep:
    """One rank's step: its start and wall time from the step's origin, and its events."""
    rank: int
    step: int
    start_s: float
    wall_s: float
    events: tuple[Event, ...]

    def phase_s(self, fold_sleep: bool = False) -> dict[str, float]:
        """Seconds per phase in this step, ``other`` being the wall time no event covers (see the
        module docstring for ``fold_sleep``); messages are also summed as ``p2p``."""
        out: dict[str, float] = {}
        for e in self.events:
            out[e.phase] = out.get(e.phase, 0.0) + e.duration_s
        covered = sum(out.values())
        if fold_sleep and out.get("sleep", 0.0) > 0:
            work = sum(out.get(p, 0.0) for p in COMPUTE_PHASES)
            sleep = out.pop("sleep")
            if work > 0:
                for p in COMPUTE_PHASES:
                    if p in out:
                        out[p] += sleep * out[p] / work
            else:
                out["compute"] = out.get("compute", 0.0) + sleep
        out["other"] = max(0.0, self.wall_s - covered)
        p2p = sum(out.get(p, 0.0) for p in MESSAGES)
        if p2p:
            out["p2p"] = p2p
        return out


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What is known of a rank besides its events: its device, stage, the predicted phases and memory."""
    rank: int
    device_type: str
    stage: int = 0
    speed: float | None = None             # an emulated device's speed; None at native speed
    predicted: dict[str, float] = field(default_factory=dict)   # phase -> predicted seconds per step
    predicted_memory_bytes: int = 0
    measured_memory_bytes: int | None = None    # peak measured (None where nothing measured it)


@dataclass(frozen=True, slots=True)
class PhaseGap:
    key: str                # the phase, or the device type
    measured_s: float
    predicted_s: float

    @property
    def gap_s(self) -> float:
        return self.measured_s - self.predicted_s

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else float("inf")


@dataclass(frozen=True, slots=True)
class StepProfile:
    strategy: str
    predicted_step_s: float
    ranks: tuple[RankInfo, ...]
    steps: tuple[RankStep, ...]
    emulated: bool = False

    # -- figures ---------------------------------------------------------------------------------
    def step_indices(self) -> tuple[int, ...]:
        return tuple(sorted({s.step for s in self.steps}))

    def step_times_s(self) -> tuple[float, ...]:
        """Per recorded step: the slowest rank's end, from the step's origin."""
        out: dict[int, float] = {}
        for s in self.steps:
            out[s.step] = max(out.get(s.step, 0.0), s.start_s + s.wall_s)
        return tuple(out[i] for i in sorted(out))

    def measured(self, rank: int, fold_sleep: bool = True) -> dict[str, float]:
        """Median over the recorded steps of each phase's seconds on ``rank``."""
        per = [s.phase_s(fold_sleep) for s in self.steps if s.rank == rank]
        phases = sorted({p for d in per for p in d})
        return {p: statistics.median(d.get(p, 0.0) for d in per) for p in phases} if per else {}

    def rank_info(self, rank: int) -> RankInfo:
        return next(r for r in self.ranks if r.rank == rank)

    def compare(self, rank: int) -> list[PhaseGap]:
        """Measured (sleep folded) against predicted seconds of each compared phase on ``rank``. Where
        the rank's forward and backward were not told apart, they are compared as ``compute``."""
        meas = self.measured(rank)
        pred = dict(self.rank_info(rank).predicted)
        if meas.get("compute", 0.0) > 0 and "compute" not in pred:
            pred["compute"] = pred.pop("forward", 0.0) + pred.pop("backward", 0.0)
            meas["compute"] = meas.get("compute", 0.0) + meas.pop("forward", 0.0) + meas.pop("backward", 0.0)
        rows = []
        for p in COMPARED_PHASES:
            m, q = meas.get(p, 0.0), pred.get(p, 0.0)
            if m > 0 or q > 0:
                rows.append(PhaseGap(p, m, q))
        return rows

    def gaps(self, by: str = "phase") -> list[PhaseGap]:
        """Measured against predicted seconds summed over ranks by ``"phase"`` or ``"device_type"``
        (per rank and step), largest absolute gap first."""
        if by not in ("phase", "device_type"):
            raise ValueError(f"StepProfile.gaps: by must be 'phase' or 'device_type', got {by!r}")
        acc: dict[str, list[float]] = {}
        for info in self.ranks:
            for g in self.compare(info.rank):
                key = g.key if by == "phase" else info.device_type
                if by == "device_type" and g.key in ("wait", "other"):
                    continue          # idle time is not the device's cost
                a = acc.setdefault(key, [0.0, 0.0])
                a[0] += g.measured_s
                a[1] += g.predicted_s
        rows = [PhaseGap(k, m, q) for k, (m, q) in acc.items()]
        return sorted(rows, key=lambda g: -abs(g.gap_s))

    # -- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> "StepProfile":
        ranks = tuple(RankInfo(**r) for r in d["ranks"])
        steps = tuple(RankStep(s["rank"], s["step"], s["start_s"], s["wall_s"],
                               tuple(Event(**e) for e in s["events"])) for s in d["steps"])
        return cls(d["strategy"], d["predicted_step_s"], ranks, steps, d.get("emulated", False))

    @classmethod
    def from_json(cls, text: str) -> "StepProfile":
        return cls.from_dict(json.loads(text))


def _split_waits(per_rank: dict[int, list], hosts: dict[int, str]) -> dict[int, list]:
    """Split the waiting part off collectives and receives (see the module docstring). ``per_rank``:
    rank -> [(phase, t0, t1, nbytes, key[, entry])] of one step, absolute times; ``entry`` (default
    ``t0``) is when the rank issued an asynchronous collective; its waiting part ends at the latest
    ``t0`` (wait start) over the group, as a blocking one's ends at the latest entry."""
    entries: dict[tuple, list[tuple[float, str]]] = {}
    sends: dict[tuple, tuple[float, str]] = {}
    for r, evs in per_rank.items():
        for ev in evs:
            phase, t0, key = ev[0], ev[1], ev[4]
            if key is None:
                continue
            if phase == "send":
                sends[_hashable(key)] = (t0, hosts[r])
            elif phase != "recv":
                # An asynchronous collective (``entry``: when it was issued) waits on the peer that blocks
                # on it last: issued early, it still completes only once that peer's process drives it
                # (an emulated rank computing after the issue starves it), so the group counts as entered
                # at the latest wait start; a blocking one at the latest entry.
                entries.setdefault(_hashable(key), []).append((t0, hosts[r]))
    out: dict[int, list] = {}
    for r, evs in per_rank.items():
        new = []
        for ev in evs:
            phase, t0, t1, nb, key = ev[:5]
            start = None
            if key is not None and phase == "recv":
                s = sends.get(_hashable(key))
                if s is not None and s[1] == hosts[r]:
                    start = s[0]
            elif key is not None and phase != "send":
                es = entries.get(_hashable(key), ())
                if len(es) > 1 and len({h for _, h in es}) == 1:
                    start = max(t for t, _ in es)
            if start is not None and start > t0:
                mid = min(start, t1)
                new.append(("wait", t0, mid, 0))
                new.append((phase, mid, t1, nb))     # kept at zero length: the collective and its bytes
            else:
                new.append((phase, t0, t1, nb))
        out[r] = new
    return out


def _hashable(key) -> tuple:
    return tuple(_hashable(k) if isinstance(k, (list, tuple)) else k for k in key)


def from_records(records, ranks: tuple[RankInfo, ...], strategy: str, predicted_step_s: float,
                 emulated: bool = False, last: int | None = None) -> StepProfile:
    """A ``StepProfile`` from every rank's ``autopar.runtime.recorder.RankSteps`` (their recorded steps,
    the same step indices on every rank), keeping the ``last`` steps (default all)."""
    hosts = {rec.rank: rec.host for rec in records}
    by_step: dict[int, dict[int, tuple]] = {}
    for rec in records:
        for index, t0, t1, events in rec.steps:
            by_step.setdefault(index, {})[rec.rank] = (t0, t1, events)
    indices = sorted(i for i, d in by_step.items() if len(d) == len(records))
    if last is not None:
        indices = indices[-last:] if last > 0 else []
    steps = []
    for i in indices:
        d = by_step[i]
        split = _split_waits({r: list(ev) for r, (_, _, ev) in d.items()}, hosts)
        origin = {}
        for h in set(hosts.values()):
            origin[h] = min(t0 for r, (t0, _, _) in d.items() if hosts[r] == h)
        for r in sorted(d):
            t0, t1, _ = d[r]
            o = origin[hosts[r]]
            evs = tuple(Event(p, a - o, b - o, int(nb)) for p, a, b, nb in split[r])
            steps.append(RankStep(r, i, t0 - o, t1 - t0, evs))
    return StepProfile(strategy, float(predicted_step_s), tuple(ranks), tuple(steps), emulated)
