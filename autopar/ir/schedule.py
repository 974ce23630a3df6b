"""Pipeline schedules as data and their generators; ``autopar.ir.timeline`` simulates them (dry-runs them
before any process group exists) and draws their Gantt charts.

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
import operator
from collections import deque

from autopar.ir.actions import (Action, ActionKind, PipelineSchedule, ScheduleError, action_row, forget_valid,
                                known_valid, remember_valid)
from autopar.ir.timeline import dry_run

__all__ = [
    "Action", "ActionKind", "PipelineSchedule", "ScheduleError",
    "PIPELINE_SCHEDULES", "ALL_SCHEDULES", "gpipe", "one_f_one_b", "interleaved_one_f_one_b", "interleaved_order", "zb_h1",
    "make_schedule",
    "in_flight_micro_batches", "with_comm",
]

PIPELINE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")   # one chunk per stage, whole backwards
ALL_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")   # ``make_schedule``'s


# -- generators -------------------------------------------------------------------------------------
#
# The generators share their Action objects (frozen, so sharing is safe): ``action_row(s, kind, n)``
# (``autopar.ir.actions``) is built once per (stage, kind) and grown as needed, so that a planner
# pricing hundreds of schedules does not construct (and check) every action again. Their schedules are
# registered as valid (``_trust``): ``simulate`` does not check their structure again (a deadlock is
# still found by the simulation itself).


def _trust(schedule: PipelineSchedule) -> PipelineSchedule:
    """Register a compute-only schedule a generator built (valid by construction) and return it."""
    remember_valid(schedule, False)
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
    acts = tuple(tuple(action_row(s, "F", M)[:M] + action_row(s, "B", M)[:M]) for s in range(num_stages))
    return _trust(PipelineSchedule("gpipe", num_micro, acts))


def one_f_one_b(num_stages: int, num_micro: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush): stage s runs min(S-1-s, M) warm-up forwards, then alternates one forward
    and one backward, then drains; it holds at most min(M, S-s) micro-batches' activations."""
    _check_sizes(num_stages, num_micro)
    M = num_micro
    out = []
    for s in range(num_stages):
        fwd, bwd = action_row(s, "F", M), action_row(s, "B", M)
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


_TRIED_ONE_BY_ONE = 8     # extra warm-up counts an interleaved order tries in turn before it gallops


@functools.lru_cache(maxsize=8)
def _interleaved_rows(W: int, M: int, V: int) -> tuple[list, list]:
    """Per worker, its forwards and its backwards in interleaved 1F1B's order (rounds of W
    micro-batches, chunks in order for forwards and reversed for backwards)."""
    rounds = [range(g, min(g + W, M)) for g in range(0, M, W)]
    fr = {s: action_row(s, "F", M) for s in range(V * W)}
    br = {s: action_row(s, "B", M) for s in range(V * W)}
    fwd = [[fr[v * W + w][m] for r in rounds for v in range(V) for m in r] for w in range(W)]
    bwd = [[br[v * W + w][m] for r in rounds for v in reversed(range(V)) for m in r] for w in range(W)]
    return fwd, bwd


def interleaved_order(W: int, M: int, V: int, extra: int) -> PipelineSchedule | None:
    """Interleaved 1F1B's order with ``extra`` more warm-up forwards on every worker than
    ``interleaved_one_f_one_b`` gives, if it is deadlock-free (else None)."""
    fwd, bwd = _interleaved_rows(W, M, V)
    out = []
    for w in range(W):
        warmup = min(V * M, 2 * (W - w - 1) + (V - 1) * W + extra)
        acts = fwd[w][:warmup]
        for f in range(warmup, V * M):
            acts += [fwd[w][f], bwd[w][f - warmup]]
        out.append(tuple(acts + bwd[w][V * M - warmup:]))
    sched = _trust(PipelineSchedule("interleaved-1f1b", M, tuple(out), V))
    try:
        dry_run(sched)
        return sched
    except ScheduleError:
        forget_valid(sched)
        return None


@functools.lru_cache(maxsize=256)
def _interleaved(W: int, M: int, V: int) -> PipelineSchedule:
    # The fewest extra forwards that avoid a deadlock: the first few counts one by one (most orders
    # need none or a few), then, as more warm-up never brings a deadlock back (each worker only runs
    # ahead further), galloping and bisecting, where trying every count dry-ran the whole schedule
    # hundreds of times at hundreds of micro-batches; tests/test_schedule_virtual.py checks the count
    # against trying every one on small sizes.
    top = V * M
    for extra in range(min(_TRIED_ONE_BY_ONE, top + 1)):
        found = interleaved_order(W, M, V, extra)
        if found is not None:
            return found
    lo, hi, best = _TRIED_ONE_BY_ONE - 1, min(2 * _TRIED_ONE_BY_ONE, top), None
    while best is None and lo < top:      # gallop: order(lo) deadlocks
        best = interleaved_order(W, M, V, hi)
        if best is None:
            lo, hi = hi, min(2 * hi, top)
    if best is None:
        raise ScheduleError(f"interleaved-1f1b: no deadlock-free order for {W} workers x {V} chunks, {M} micro-batches")
    while hi - lo > 1:                    # bisect: order(lo) deadlocks, order(hi) is best
        mid = (lo + hi) // 2
        got = interleaved_order(W, M, V, mid)
        if got is None:
            lo = mid
        else:
            forget_valid(best)
            best, hi = got, mid
    return best


def zb_h1(num_stages: int, num_micro: int) -> PipelineSchedule:
    """Zero-bubble H1 (Qi et al., 2023): 1F1B's warm-up and steady order with each backward split into
    I (input gradient, which the stage before waits for) and W (weight gradient, which nobody waits
    for). Stage s keeps up to s W's pending, running one whenever more are, and the rest at the end:
    the later stages' W's fill the drain's bubbles, and a stage holds at most S micro-batches."""
    _check_sizes(num_stages, num_micro)
    out = []
    for s in range(num_stages):
        fwd, bi, bw = action_row(s, "F", num_micro), action_row(s, "BI", num_micro), action_row(s, "BW", num_micro)
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
    if known_valid(sched) is None:
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
