"""Pipeline schedules as data, and a simulator that dry-runs them before any process group exists.

Terms
- stage: one pipeline stage, executed by one worker that runs its action list in order. (A stage with
  several data-parallel members is still one worker here: its durations are those of its slowest member.)
- virtual stages (``virtual_stages`` V, interleaved schedules): the model is cut into S stages (model
  chunks) held by W = S / V workers, stage s by worker ``s % W`` (Megatron's interleaving: worker w holds
  chunks w, w + W, ...). ``actions[w]`` is worker w's list and ``Action.stage`` the (virtual) stage;
  without interleaving V = 1 and worker = stage.
- micro-batch: pipeline micro-batch ``m`` in ``0..num_micro-1``; micro-batches may differ in size, so
  durations are given per (stage, micro-batch).
- action: ``Action(stage, kind, micro)``, written compactly like torch.distributed.pipelining, e.g.
  ``"2F0"`` (stage 2, forward, micro-batch 0) or ``"1RECV_B3"``. Kinds:
  ``F`` forward, ``B`` backward (input and weight gradients together), ``BI`` the input-gradient half
  of a backward and ``BW`` its weight-gradient half (zero-bubble schedules split B into BI then BW;
  below "I" and "W" for short), and the
  communication kinds
  ``SEND_F`` (send this stage's forward output to stage+1), ``RECV_F`` (receive this stage's forward
  input from stage-1), ``SEND_B`` (send the gradient of this stage's input to stage-1), ``RECV_B``
  (receive the gradient of this stage's output from stage+1).
- schedule: ``PipelineSchedule``: one action list per stage. A *compute-only* schedule holds only F and
  B; sends and receives between consecutive stages are implied. ``with_comm`` lowers it to an explicit
  schedule for the runtime.
- dependencies: F(s, m) needs F(s-1, m) plus the transfer time across boundary s-1; B(s, m) needs
  F(s, m) and B(s+1, m) plus the transfer across boundary s. In an explicit schedule, F(s, m) needs
  RECV_F(s, m), which needs SEND_F(s-1, m) (issued after F(s-1, m)) plus the transfer; sends are
  asynchronous (take no worker time), a receive blocks its worker until the data has arrived. An I
  depends as a B does and W(s, m) on I(s, m); SEND_B follows the I (the input gradient is all it sends).
- generators (``make_schedule``): ``gpipe``; ``1f1b``; ``interleaved-1f1b`` (Megatron: micro-batches in
  rounds of W, each round through every chunk of a worker, warm-up ``2 (W - w - 1) + (V - 1) W``
  forwards, then one forward one backward; V = 1 is 1F1B); ``zb-h1`` (zero-bubble H1, Qi et al.
  2023: 1F1B's order with each B split into I and W, and stage s deferring up to s of its W's to fill
  the bubbles of the drain, which keeps at most S micro-batches in flight per stage, 1F1B's peak).
- in flight (``in_flight_micro_batches``): the micro-batches whose activations stage s holds at its
  peak: GPipe all M (every forward runs before the first backward), 1F1B ``min(M, S - s)``; for the
  other generators counted on the generated lists (a micro-batch is in flight from its F until its B,
  or its W: the weight gradient still needs the saved activations).
- timeline: the simulated execution: per stage the (action, start_s, end_s) of every action, the step
  time (makespan), the busy (compute) seconds per stage, and the bubble fraction
  ``1 - sum(busy_s) / (num_stages * step_time_s)``.
"""

from __future__ import annotations

import functools
import json
import operator
import re
from collections import deque
from operator import itemgetter
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from autopar.errors import AutoparError

__all__ = [
    "Action", "ActionKind", "PipelineSchedule", "ScheduleError", "Timeline",
    "PIPELINE_SCHEDULES", "ALL_SCHEDULES", "gpipe", "one_f_one_b", "interleaved_one_f_one_b", "zb_h1",
    "make_schedule",
    "in_flight_micro_batches", "with_comm", "simulate", "dry_run", "plot_timeline",
]

PIPELINE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")   # one chunk per stage, whole backwards
ALL_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")   # ``make_schedule``'s
ActionKind = Literal["F", "B", "BI", "BW", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
_COMPUTE = ("F", "B", "BI", "BW")
_COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_END = itemgetter(2)   # an event's end
_ACTION_RE = re.compile(r"^\s*(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|BI|BW|F|B)(\d+)\s*$")


class ScheduleError(AutoparError):
    """A schedule is malformed (wrong stage, duplicate or missing action) or deadlocks."""


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    kind: ActionKind
    micro: int

    def __post_init__(self):
        if self.kind not in _COMPUTE + _COMM:
            raise ScheduleError(f"Action.kind: {self.kind!r} is not one of {_COMPUTE + _COMM}")
        if self.stage < 0 or self.micro < 0:
            raise ScheduleError(f"Action: stage ({self.stage}) and micro ({self.micro}) must be >= 0")

    def __repr__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro}"

    __str__ = __repr__

    @property
    def is_compute(self) -> bool:
        return self.kind in _COMPUTE

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The inverse of ``repr``: ``Action.parse("2F0") == Action(2, "F", 0)``."""
        m = _ACTION_RE.match(text)
        if m is None:
            raise ScheduleError(f"Action: cannot parse {text!r} (expected e.g. '2F0' or '1RECV_B3')")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))


@dataclass(frozen=True, slots=True)
class PipelineSchedule:
    """One action list per worker; ``name`` says which generator made it ("gpipe", "1f1b", ...);
    ``virtual_stages`` the chunks per worker (stage s on worker ``s % num_workers``)."""

    name: str
    num_micro: int
    actions: tuple[tuple[Action, ...], ...]
    virtual_stages: int = 1

    @property
    def num_workers(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        """Stages of the model (virtual stages under interleaving): ``num_workers * virtual_stages``."""
        return len(self.actions) * self.virtual_stages

    @property
    def has_comm(self) -> bool:
        return any(not a.is_compute for acts in self.actions for a in acts)

    @property
    def splits_backward(self) -> bool:
        """Whether backwards are split into I and W (zero-bubble)."""
        return any(a.kind == "BW" for acts in self.actions for a in acts)

    def __repr__(self) -> str:
        rows = "; ".join(" ".join(map(repr, acts)) for acts in self.actions)
        v = f", virtual={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"PipelineSchedule({self.name!r}, stages={self.num_stages}{v}, micro={self.num_micro}: {rows})"

    def to_dict(self) -> dict:
        return {"name": self.name, "num_micro": self.num_micro, "virtual_stages": self.virtual_stages,
                "actions": [[repr(a) for a in acts] for acts in self.actions]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "PipelineSchedule":
        try:
            return cls(name=str(d["name"]), num_micro=int(d["num_micro"]),
                       actions=tuple(tuple(Action.parse(a) for a in acts) for acts in d["actions"]),
                       virtual_stages=int(d.get("virtual_stages", 1)))
        except KeyError as e:
            raise ScheduleError(f"PipelineSchedule: missing field {e.args[0]!r}") from None

    @classmethod
    def from_json(cls, text: str) -> "PipelineSchedule":
        return cls.from_dict(json.loads(text))


# -- generators -------------------------------------------------------------------------------------
#
# The generators share their Action objects (frozen, so sharing is safe): ``_row(s, kind, n)`` is the
# list of Action(s, kind, m) for m < n, built once per (stage, kind) and grown as needed, so that a
# planner pricing hundreds of schedules does not construct (and check) every action again. Their
# schedules are registered as trusted (``_trust``): valid by construction, ``simulate`` does not check
# their structure again (a deadlock is still found by the simulation itself).

_ROWS: dict[tuple[int, str], list[Action]] = {}
_ROWS_MAX_LEN = 1 << 13      # rows longer than this (micro-batches) are built uncached
_ROWS_MAX_KEYS = 4096        # (stage, kind) rows kept; beyond, the cache starts over


def _row(s: int, kind: str, n: int) -> list[Action]:
    """Action(s, kind, m) for m in 0..n-1 (at least; the list is shared: never mutate it)."""
    key = (s, kind)
    row = _ROWS.get(key)
    if row is not None and len(row) >= n:
        return row
    if n > _ROWS_MAX_LEN:
        return [Action(s, kind, m) for m in range(n)]
    old = row or []
    row = old + [Action(s, kind, m) for m in range(len(old), n)]   # a new list: readers keep the old one
    if len(_ROWS) >= _ROWS_MAX_KEYS:
        _ROWS.clear()
    _ROWS[key] = row
    return row


# id(schedule) -> (schedule, whether it has explicit communication) of schedules known to be valid:
# generated ones, and checked ones (of tuples: immutable). Holding the schedule keeps its id unique.
_TRUSTED: dict[int, tuple["PipelineSchedule", bool]] = {}
_TRUSTED_MAX = 512


def _remember_valid(schedule: "PipelineSchedule", explicit: bool) -> None:
    if len(_TRUSTED) >= _TRUSTED_MAX:
        _TRUSTED.pop(next(iter(_TRUSTED)))
    _TRUSTED[id(schedule)] = (schedule, explicit)


def _trust(schedule: "PipelineSchedule") -> "PipelineSchedule":
    """Register a compute-only schedule a generator built (valid by construction) and return it."""
    _remember_valid(schedule, False)
    return schedule


def _check_sizes(num_stages: int, num_micro: int) -> None:
    if num_stages < 1:
        raise ScheduleError(f"num_stages: need >= 1, got {num_stages}")
    if num_micro < 1:
        raise ScheduleError(f"num_micro: need >= 1, got {num_micro}")


def gpipe(num_stages: int, num_micro: int) -> PipelineSchedule:
    """All forwards, then all backwards (in micro-batch order, as torch's ScheduleGPipe)."""
    _check_sizes(num_stages, num_micro)
    M = num_micro
    acts = tuple(tuple(_row(s, "F", M)[:M] + _row(s, "B", M)[:M]) for s in range(num_stages))
    return _trust(PipelineSchedule("gpipe", num_micro, acts))


def one_f_one_b(num_stages: int, num_micro: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush): stage s runs min(S-1-s, M) warm-up forwards, then alternates one forward
    and one backward, then drains; it holds at most min(M, S-s) micro-batches' activations."""
    _check_sizes(num_stages, num_micro)
    M = num_micro
    out = []
    for s in range(num_stages):
        fwd, bwd = _row(s, "F", M), _row(s, "B", M)
        warmup = min(num_stages - 1 - s, M)
        steady = M - warmup                        # pairs: forward warmup + i, then backward i
        pairs: list = [None] * (2 * steady)
        pairs[0::2] = fwd[warmup:M]
        pairs[1::2] = bwd[:steady]
        out.append(tuple(fwd[:warmup] + pairs + bwd[steady:M]))
    return _trust(PipelineSchedule("1f1b", num_micro, tuple(out)))


def interleaved_one_f_one_b(num_workers: int, num_micro: int, virtual_stages: int = 2) -> PipelineSchedule:
    """Interleaved 1F1B (Megatron-LM): ``num_workers`` workers of ``virtual_stages`` chunks each (stage
    ``v * W + w`` on worker w). A worker's forwards take the micro-batches in rounds of W, each round
    through its chunks in order (its backwards the same with the chunks reversed); it runs
    ``2 (W - w - 1) + (V - 1) W`` warm-up forwards (at most all), then one forward one backward, then
    drains. The last round may hold fewer than W micro-batches; where that order would deadlock,
    every worker takes the fewest extra warm-up forwards that avoid it. V = 1 gives 1F1B's lists."""
    _check_sizes(num_workers, num_micro)
    if virtual_stages < 1:
        raise ScheduleError(f"virtual_stages: need >= 1, got {virtual_stages}")
    if virtual_stages == 1:
        return _trust(PipelineSchedule("interleaved-1f1b", num_micro, one_f_one_b(num_workers, num_micro).actions))
    return _interleaved(num_workers, num_micro, virtual_stages)


@functools.lru_cache(maxsize=256)
def _interleaved(W: int, M: int, V: int) -> PipelineSchedule:
    rounds = [range(g, min(g + W, M)) for g in range(0, M, W)]
    fr = {s: _row(s, "F", M) for s in range(V * W)}
    br = {s: _row(s, "B", M) for s in range(V * W)}
    fwd = [[fr[v * W + w][m] for r in rounds for v in range(V) for m in r] for w in range(W)]
    bwd = [[br[v * W + w][m] for r in rounds for v in reversed(range(V)) for m in r] for w in range(W)]
    for extra in range(V * M + 1):
        out = []
        for w in range(W):
            warmup = min(V * M, 2 * (W - w - 1) + (V - 1) * W + extra)
            acts = fwd[w][:warmup]
            for f in range(warmup, V * M):
                acts += [fwd[w][f], bwd[w][f - warmup]]
            acts += bwd[w][V * M - warmup:]
            out.append(tuple(acts))
        sched = _trust(PipelineSchedule("interleaved-1f1b", M, tuple(out), V))
        try:
            dry_run(sched)
            return sched
        except ScheduleError:
            _TRUSTED.pop(id(sched), None)
            continue
    raise ScheduleError(f"interleaved-1f1b: no deadlock-free order for {W} workers x {V} chunks, {M} micro-batches")


def zb_h1(num_stages: int, num_micro: int) -> PipelineSchedule:
    """Zero-bubble H1 (Qi et al., 2023): 1F1B's warm-up and steady order with each backward split into
    I (input gradient, which the stage before waits for) and W (weight gradient, which nobody waits
    for). Stage s keeps up to s W's pending, running one whenever more are, and the rest at the end:
    the later stages' W's fill the drain's bubbles, and a stage holds at most S micro-batches."""
    _check_sizes(num_stages, num_micro)
    out = []
    for s in range(num_stages):
        fwd, bi, bw = _row(s, "F", num_micro), _row(s, "BI", num_micro), _row(s, "BW", num_micro)
        warmup = min(num_stages - 1 - s, num_micro)
        acts = fwd[:warmup]
        f, pending = warmup, deque()
        for m in range(num_micro):
            if f < num_micro:
                acts.append(fwd[f])
                f += 1
            acts.append(bi[m])
            pending.append(m)
            while len(pending) > s:
                acts.append(bw[pending.popleft()])
        acts += [bw[m] for m in pending]
        out.append(tuple(acts))
    return _trust(PipelineSchedule("zb-h1", num_micro, tuple(out)))


def make_schedule(name: str, num_stages: int, num_micro: int, virtual_stages: int = 1) -> PipelineSchedule:
    """The generator by name (``ALL_SCHEDULES``). ``num_stages``: the model's stages (a plan's
    ``len(plan.stages)``); ``virtual_stages``: chunks per worker, only for "interleaved-1f1b" (it must
    divide ``num_stages``; the workers are ``num_stages // virtual_stages``). Remembered by its
    arguments (the schedule is immutable; the planner asks for the same ones again)."""
    if name not in ALL_SCHEDULES:
        raise ScheduleError(f"schedule: unknown {name!r}; choose one of {sorted(ALL_SCHEDULES)}")
    sched = _made(name, operator.index(num_stages), operator.index(num_micro), operator.index(virtual_stages))
    if _TRUSTED.get(id(sched), (None,))[0] is not sched:
        _trust(sched)   # evicted from the trusted ids meanwhile
    return sched


@functools.lru_cache(maxsize=32)
def _made(name: str, num_stages: int, num_micro: int, virtual_stages: int) -> PipelineSchedule:
    if name == "interleaved-1f1b":
        if virtual_stages < 1 or num_stages % virtual_stages:
            raise ScheduleError(f"virtual_stages: {virtual_stages} must be >= 1 and divide num_stages "
                                f"({num_stages})")
        return interleaved_one_f_one_b(num_stages // virtual_stages, num_micro, virtual_stages)
    if virtual_stages != 1:
        raise ScheduleError(f"virtual_stages: {virtual_stages}; only 'interleaved-1f1b' has several "
                            f"chunks per worker, {name!r} has 1")
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}[name](num_stages, num_micro)


@functools.lru_cache(maxsize=512)
def _live_peaks(name: str, num_stages: int, num_micro: int, virtual_stages: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches in flight (F done, B or W not yet) along its worker's list."""
    sched = make_schedule(name, num_stages, num_micro, virtual_stages)
    peaks = [0] * num_stages
    for acts in sched.actions:
        live = [0] * num_stages
        for a in acts:
            live[a.stage] += 1 if a.kind == "F" else -1 if a.kind in ("B", "BW") else 0
            peaks[a.stage] = max(peaks[a.stage], live[a.stage])
    return tuple(peaks)


def in_flight_micro_batches(schedule: str, stage: int, num_stages: int, num_micro: int,
                            virtual_stages: int = 1) -> int:
    """Micro-batches whose activations ``stage`` of ``num_stages`` holds at its peak under ``schedule``
    (see the module docstring; ``virtual_stages`` as ``make_schedule``'s). Names outside
    ``ALL_SCHEDULES`` count as 1F1B."""
    if schedule == "gpipe":
        return num_micro
    if schedule in ("zb-h1", "interleaved-1f1b"):
        return _live_peaks(schedule, num_stages, num_micro, virtual_stages)[stage]
    return min(num_micro, num_stages - stage)


def with_comm(schedule: PipelineSchedule) -> PipelineSchedule:
    """Lower a compute-only schedule: RECV_F before each F of stage > 0, SEND_F after each F of a
    stage before the last, RECV_B before each B (or I) of a stage before the last, SEND_B after each B
    (or I) of stage > 0; a W needs no communication. Sends are meant to be asynchronous (isend),
    receives blocking."""
    if schedule.has_comm:
        raise ScheduleError("with_comm: the schedule already has SEND/RECV actions")
    last = schedule.num_stages - 1
    out = []
    for acts in schedule.actions:
        lowered: list[Action] = []
        for a in acts:
            s = a.stage
            if a.kind == "F":
                lowered += [Action(s, "RECV_F", a.micro)] if s > 0 else []
                lowered.append(a)
                lowered += [Action(s, "SEND_F", a.micro)] if s < last else []
            elif a.kind in ("B", "BI"):
                lowered += [Action(s, "RECV_B", a.micro)] if s < last else []
                lowered.append(a)
                lowered += [Action(s, "SEND_B", a.micro)] if s > 0 else []
            else:
                lowered.append(a)
        out.append(tuple(lowered))
    return PipelineSchedule(schedule.name, schedule.num_micro, tuple(out), schedule.virtual_stages)


# -- simulation -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Timeline:
    """The simulated execution of a schedule (see the module docstring); rows are workers (stages when
    there is no interleaving)."""

    events: tuple[tuple[tuple[Action, float, float], ...], ...]   # per worker, in execution order
    transfers: tuple[tuple[tuple[Action, float, float], ...], ...]  # per receiving worker: data in flight
    step_time_s: float
    busy_s: tuple[float, ...]
    schedule_name: str = ""

    @property
    def num_stages(self) -> int:
        return len(self.events)

    @property
    def bubble_fraction(self) -> float:
        if self.step_time_s <= 0:
            return 0.0
        return 1.0 - sum(self.busy_s) / (self.num_stages * self.step_time_s)

    @property
    def stage_end_s(self) -> tuple[float, ...]:
        """When each worker finished its last action."""
        return tuple(max(map(_END, ev), default=0.0) for ev in self.events)

    def __repr__(self) -> str:
        return (f"Timeline({self.schedule_name!r}, stages={self.num_stages}, step={self.step_time_s:.4g}s, "
                f"bubble={self.bubble_fraction:.1%})")


def _as_matrix(x, shape: tuple[int, int], name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 1 and shape[0] == 1 and a.shape[0] == shape[1]:
        a = a[None, :]
    if a.size == 0 and shape[0] == 0:
        return np.zeros(shape)
    if a.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} ([stage][micro]), got {a.shape}")
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise ValueError(f"{name}: durations must be finite and >= 0")
    return a


def _validate(schedule: PipelineSchedule, num_micro: int) -> bool:
    """Structural checks; returns whether the schedule has explicit communication. Actions are compared
    as (stage, kind, micro) tuples (an ``Action``'s equality; tuples hash without a Python call).
    Generated schedules and ones checked before (by identity) are not checked again."""
    known = _TRUSTED.get(id(schedule))
    if known is not None and known[0] is schedule and num_micro == schedule.num_micro:
        return known[1]
    explicit = _check_structure(schedule, num_micro)
    if (num_micro == schedule.num_micro and type(schedule.actions) is tuple
            and all(type(acts) is tuple for acts in schedule.actions)):
        _remember_valid(schedule, explicit)   # immutable: valid for good
    return explicit


def _check_structure(schedule: PipelineSchedule, num_micro: int) -> bool:
    S, nw = schedule.num_stages, schedule.num_workers
    explicit = False
    seen: set[tuple[int, str, int]] = set()
    for w, acts in enumerate(schedule.actions):
        for a in acts:
            s, k, m = a.stage, a.kind, a.micro
            if s % nw != w or s >= S:
                raise ScheduleError(f"action {a!r} is in the list of {'worker' if nw < S else 'stage'} {w}")
            if m >= num_micro:
                raise ScheduleError(f"action {a!r}: micro-batch {m} >= num_micro {num_micro}")
            key = (s, k, m)
            if key in seen:
                raise ScheduleError(f"action {a!r} appears twice")
            if k in _COMM:
                explicit = True
                if (k in ("RECV_F", "SEND_B") and s == 0) or (k in ("SEND_F", "RECV_B") and s == S - 1):
                    raise ScheduleError(f"action {a!r}: stage {s} has no neighbour in that direction")
            seen.add(key)
    needed = [(s, "F", m) for s in range(S) for m in range(num_micro)]
    for s in range(S):
        for m in range(num_micro):
            split = (s, "BI", m) in seen or (s, "BW", m) in seen
            if split and (s, "B", m) in seen:
                raise ScheduleError(f"stage {s} micro-batch {m} has both a B and an I/W split")
            needed += [(s, "BI", m), (s, "BW", m)] if split else [(s, "B", m)]
    if explicit:
        needed += [(s, k, m) for s in range(S) for m in range(num_micro)
                   for k in (("RECV_F", "SEND_B") if s > 0 else ()) + (("SEND_F", "RECV_B") if s < S - 1 else ())]
    if len(seen) != len(needed) or any(key not in seen for key in needed):
        missing = [Action(*key) for key in needed if key not in seen]
        if missing:
            shown = ", ".join(map(repr, missing[:8])) + (" ..." if len(missing) > 8 else "")
            raise ScheduleError(f"schedule {schedule.name!r} is missing {len(missing)} action(s): {shown}")
    return explicit


def simulate(schedule: PipelineSchedule, fwd_time_s, bwd_time_s, comm_time_s=None,
             comm_bwd_time_s=None, wgrad_time_s=None) -> Timeline:
    """Execute the per-worker action lists in order, each worker on its own.

    ``fwd_time_s`` and ``bwd_time_s`` are arrays [stage][micro] of seconds (stages of the model:
    virtual stages under interleaving); ``comm_time_s`` is [boundary][micro] (boundary s sits between
    stage s and s+1; None = free), the transfer time of micro-batch m's activation across it;
    ``comm_bwd_time_s`` the same for the gradient going back (None = same as forward);
    ``wgrad_time_s`` [stage][micro] the W part of each backward where the schedule splits them (I
    takes the rest; None = half). An action starts when its worker is free and its dependencies are
    done plus the transfer. Raises ``ScheduleError`` on a malformed schedule or a deadlock, naming
    the stuck actions."""
    S, M, nw = schedule.num_stages, schedule.num_micro, schedule.num_workers
    fwd = _as_matrix(fwd_time_s, (S, M), "fwd_time_s").tolist()   # lists of floats: fast scalar access
    bwd_a = _as_matrix(bwd_time_s, (S, M), "bwd_time_s")
    bwd = bwd_a.tolist()
    comm_f = (np.zeros((S - 1, M)) if comm_time_s is None
              else _as_matrix(comm_time_s, (S - 1, M), "comm_time_s")).tolist()
    comm_b = comm_f if comm_bwd_time_s is None else _as_matrix(comm_bwd_time_s, (S - 1, M), "comm_bwd_time_s").tolist()
    wgr = (bwd_a / 2 if wgrad_time_s is None else np.minimum(_as_matrix(wgrad_time_s, (S, M), "wgrad_time_s"),
                                                               bwd_a)).tolist()
    explicit = _validate(schedule, M)

    # done[kind][s][m]: end time (issue time for sends) or None; "G": when stage s's gradient of
    # micro-batch m's input exists (its B or I ended)
    done: dict[str, list[list[float | None]]] = {
        k: [[None] * M for _ in range(S)] for k in _COMPUTE + _COMM + ("G",)}
    d_f, d_g, d_bi = done["F"], done["G"], done["BI"]
    d_recv_f, d_recv_b, d_send_f, d_send_b = done["RECV_F"], done["RECV_B"], done["SEND_F"], done["SEND_B"]
    events: list[list[tuple[Action, float, float]]] = [[] for _ in range(nw)]
    transfers: list[list[tuple[Action, float, float]]] = [[] for _ in range(nw)]
    busy = [0.0] * nw
    free = [0.0] * nw
    ptr = [0] * nw
    lists = schedule.actions
    last = S - 1
    # the implied receives' Actions of the transfers (shared rows, not one new Action per transfer)
    recv_f = [_row(s, "RECV_F", M) if s > 0 else None for s in range(S)] if not explicit else None
    recv_b = [_row(s, "RECV_B", M) if s < last else None for s in range(S)] if not explicit else None

    queue = deque(range(nw))
    queued = [True] * nw
    while queue:
        w = queue.popleft()
        queued[w] = False
        acts = lists[w]
        n_acts = len(acts)
        ev, tr = events[w], transfers[w]
        i0 = i = ptr[w]
        fw, bz = free[w], busy[w]   # the worker's free time and busy seconds, written back below
        while i < n_acts:
            action = acts[i]
            s, k, m = action.stage, action.kind, action.micro
            # when the inputs of the action are available on its worker (break: a dependency is not done)
            if k == "F":
                if s == 0:
                    t_ready = 0.0
                elif explicit:
                    t_ready = d_recv_f[s][m]
                    if t_ready is None:
                        break
                else:
                    t0 = d_f[s - 1][m]
                    if t0 is None:
                        break
                    t_ready = t0 + comm_f[s - 1][m]
                start = fw if fw > t_ready else t_ready
                dur = fwd[s][m]
                end = start + dur
                bz += dur
                fw = end
                ev.append((action, start, end))
                if s > 0 and not explicit:
                    tr.append((recv_f[s][m], t0, t_ready))
                d_f[s][m] = end
            elif k == "B" or k == "BI":
                t_f = d_f[s][m]
                if t_f is None:
                    break
                if s == last:
                    t_ready = t_f
                elif explicit:
                    t = d_recv_b[s][m]
                    if t is None:
                        break
                    t_ready = t_f if t_f > t else t
                else:
                    t0 = d_g[s + 1][m]
                    if t0 is None:
                        break
                    t = t0 + comm_b[s][m]
                    t_ready = t_f if t_f > t else t
                start = fw if fw > t_ready else t_ready
                dur = bwd[s][m] if k == "B" else bwd[s][m] - wgr[s][m]
                end = start + dur
                bz += dur
                fw = end
                ev.append((action, start, end))
                d_g[s][m] = end
                if s < last and not explicit:
                    tr.append((recv_b[s][m], t0, t))
                done[k][s][m] = end
            elif k == "BW":
                t_ready = d_bi[s][m]
                if t_ready is None:
                    break
                start = fw if fw > t_ready else t_ready
                dur = wgr[s][m]
                end = start + dur
                bz += dur
                fw = end
                ev.append((action, start, end))
                done[k][s][m] = end
            else:
                if k == "SEND_F":
                    t_ready = d_f[s][m]
                elif k == "SEND_B":
                    t_ready = d_g[s][m]
                elif k == "RECV_F":
                    t = d_send_f[s - 1][m]
                    t_ready = None if t is None else t + comm_f[s - 1][m]
                else:   # RECV_B
                    t = d_send_b[s + 1][m]
                    t_ready = None if t is None else t + comm_b[s][m]
                if t_ready is None:
                    break
                if k == "SEND_F" or k == "SEND_B":
                    end = start = fw if fw > t_ready else t_ready   # asynchronous: issued, no worker time
                    ev.append((action, start, end))
                else:   # a blocking receive: the worker waits until the data has arrived
                    start = fw
                    end = fw if fw > t_ready else t_ready
                    fw = end
                    ev.append((action, start, end))
                    comm = comm_f[s - 1][m] if k == "RECV_F" else comm_b[s][m]
                    tr.append((action, t_ready - comm, t_ready))
                done[k][s][m] = end
            i += 1
        ptr[w], free[w], busy[w] = i, fw, bz
        if i > i0:
            for n in ((w - 1) % nw, (w + 1) % nw):
                if n != w and not queued[n] and ptr[n] < len(lists[n]):
                    queue.append(n)
                    queued[n] = True

    stuck = [schedule.actions[w][ptr[w]] for w in range(nw) if ptr[w] < len(lists[w])]
    if stuck:
        raise ScheduleError(
            f"schedule {schedule.name!r} deadlocks: stuck at {', '.join(map(repr, stuck))} "
            f"(each waits on an action that is ordered after another stuck action)")
    step = max((max(map(_END, ev)) for ev in events if ev), default=0.0)
    return Timeline(events=tuple(map(tuple, events)), transfers=tuple(map(tuple, transfers)),
                    step_time_s=float(step), busy_s=tuple(map(float, busy)), schedule_name=schedule.name)


def dry_run(schedule: PipelineSchedule) -> Timeline:
    """Simulate with unit durations (B = 2, split as I = W = 1) and free transfers: raises
    ``ScheduleError`` if it deadlocks."""
    S, M = schedule.num_stages, schedule.num_micro
    ones = np.ones((S, M))
    return simulate(schedule, ones, 2 * ones, np.zeros((max(S - 1, 0), M)))


# -- display ----------------------------------------------------------------------------------------

_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "BI": "#DD8452", "BW": "#55A868", "comm": "#8172B3", "idle": "#E5E5E5"}


def plot_timeline(timeline: Timeline, path, labels: Sequence[str] | None = None) -> None:
    """A Gantt chart of the timeline saved as PNG: one row per stage (or rank, via ``labels``);
    forward, backward, communication (data in flight towards that row, a thin bar) and idle time
    (including a worker blocked in a receive) in distinct colours."""
    from matplotlib.figure import Figure   # lazy: plotting is optional and slow to import
    from matplotlib.patches import Patch

    S = timeline.num_stages
    labels = list(labels) if labels is not None else [f"stage {s}" for s in range(S)]
    if len(labels) != S:
        raise ValueError(f"labels: need one per stage ({S}), got {len(labels)}")
    step = timeline.step_time_s if timeline.step_time_s > 0 else 1.0
    fig = Figure(figsize=(min(max(8.0, 4 + 0.15 * sum(map(len, timeline.events))), 18), 1.6 + 0.6 * S))
    ax = fig.add_subplot(1, 1, 1)
    for row, s in enumerate(range(S)):
        y = S - 1 - row
        ax.broken_barh([(0, step)], (y - 0.4, 0.8), facecolors=_COLOURS["idle"])
        for a, t0, t1 in timeline.transfers[s]:
            if t1 > t0:
                ax.broken_barh([(t0, t1 - t0)], (y - 0.4, 0.2), facecolors=_COLOURS["comm"])
        for a, t0, t1 in timeline.events[s]:
            if a.is_compute and t1 > t0:
                ax.broken_barh([(t0, t1 - t0)], (y - 0.35, 0.7), facecolors=_COLOURS[a.kind],
                               edgecolors="white", linewidth=0.5)
                if (t1 - t0) / step > 0.02:
                    ax.text((t0 + t1) / 2, y, str(a.micro), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(S))
    ax.set_yticklabels(list(reversed(labels)))
    ax.set_xlim(0, step)
    ax.set_xlabel("time (s)")
    ax.set_title(f"{timeline.schedule_name or 'pipeline'}: step {timeline.step_time_s:.4g} s, "
                 f"bubble {timeline.bubble_fraction:.1%}", loc="left", fontsize=10)
    ax.legend(handles=[Patch(color=_COLOURS[k], label=name) for k, name in
                       (("F", "forward"), ("B", "backward (BI: its input gradient)"), ("BW", "weight gradient"),
                        ("comm", "communication"), ("idle", "idle"))],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if S < 3 else -0.2), ncol=5, fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
