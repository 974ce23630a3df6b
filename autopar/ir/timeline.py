"""The pipeline simulator: executes a ``PipelineSchedule``'s per-worker action lists with given durations
(``simulate``; ``dry_run`` with unit ones, to find deadlocks) into a ``Timeline``, and draws a timeline
as a Gantt chart (``plot_timeline``). The terms (stage, worker, action, dependencies, timeline) are
those of ``autopar.ir.schedule``'s docstring."""

from __future__ import annotations

from collections import deque
from operator import itemgetter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autopar.ir.actions import (COMM_KINDS, COMPUTE_KINDS, Action, PipelineSchedule, ScheduleError, action_row,
                                known_valid, remember_valid)

__all__ = ["Timeline", "simulate", "dry_run", "plot_timeline"]

_END = itemgetter(2)   # an event's end


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
    known = known_valid(schedule)
    if known is not None and num_micro == schedule.num_micro:
        return known
    explicit = _check_structure(schedule, num_micro)
    if (num_micro == schedule.num_micro and type(schedule.actions) is tuple
            and all(type(acts) is tuple for acts in schedule.actions)):
        remember_valid(schedule, explicit)   # immutable: valid for good
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
            if k in COMM_KINDS:
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
    fwd, bwd, comm_f, comm_b, wgr = _durations(S, M, fwd_time_s, bwd_time_s, comm_time_s, comm_bwd_time_s,
                                               wgrad_time_s)
    explicit = _validate(schedule, M)
    # done[kind][s][m]: end time (issue time for sends) or None; "G": when stage s's gradient of
    # micro-batch m's input exists (its B or I ended)
    done: dict[str, list[list[float | None]]] = {
        k: [[None] * M for _ in range(S)] for k in COMPUTE_KINDS + COMM_KINDS + ("G",)}
    events: list[list[tuple[Action, float, float]]] = [[] for _ in range(nw)]
    transfers: list[list[tuple[Action, float, float]]] = [[] for _ in range(nw)]
    busy = [0.0] * nw
    free = [0.0] * nw
    ptr = [0] * nw
    lists = schedule.actions
    last = S - 1
    # the implied receives' Actions of the transfers (shared rows, not one new Action per transfer)
    recv_f = [action_row(s, "RECV_F", M) if s > 0 else None for s in range(S)] if not explicit else None
    recv_b = [action_row(s, "RECV_B", M) if s < last else None for s in range(S)] if not explicit else None
    run = (fwd, bwd, wgr, comm_f, comm_b, explicit, last, recv_f, recv_b, done, done["F"], done["G"], done["BI"],
           done["RECV_F"], done["RECV_B"])

    queue = deque(range(nw))
    queued = [True] * nw
    while queue:
        w = queue.popleft()
        queued[w] = False
        i0 = ptr[w]
        ptr[w], free[w], busy[w] = _advance(run, lists[w], i0, free[w], busy[w], events[w], transfers[w])
        if ptr[w] > i0:
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


def _durations(S: int, M: int, fwd_time_s, bwd_time_s, comm_time_s, comm_bwd_time_s, wgrad_time_s) -> tuple:
    """simulate's duration tables as lists of lists of floats (fast scalar access): forward, backward,
    forward transfer, backward transfer (None: the forward's), the W part of a split backward (None: half)."""
    fwd = _as_matrix(fwd_time_s, (S, M), "fwd_time_s").tolist()
    bwd_a = _as_matrix(bwd_time_s, (S, M), "bwd_time_s")
    comm_f = (np.zeros((S - 1, M)) if comm_time_s is None
              else _as_matrix(comm_time_s, (S - 1, M), "comm_time_s")).tolist()
    comm_b = comm_f if comm_bwd_time_s is None else _as_matrix(comm_bwd_time_s, (S - 1, M), "comm_bwd_time_s").tolist()
    wgr = (bwd_a / 2 if wgrad_time_s is None else np.minimum(_as_matrix(wgrad_time_s, (S, M), "wgrad_time_s"),
                                                               bwd_a)).tolist()
    return fwd, bwd_a.tolist(), comm_f, comm_b, wgr


def _advance(run: tuple, acts, i: int, fw: float, bz: float, ev: list, tr: list) -> tuple[int, float, float]:
    """Run one worker's actions from ``acts[i]`` on, until one waits on a dependency not done yet:
    (its next action's index, its free time, its busy seconds). An action starts when its worker is
    free and its inputs are available on its worker (a transfer after their producer)."""
    fwd, bwd, wgr, comm_f, comm_b, explicit, last, recv_f, recv_b, done, d_f, d_g, d_bi, d_recv_f, d_recv_b = run
    n_acts = len(acts)
    while i < n_acts:
        action = acts[i]
        s, k, m = action.stage, action.kind, action.micro
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
            got = _communicate(action, fw, comm_f, comm_b, done, ev, tr)
            if got is None:
                break
            fw = got
        i += 1
    return i, fw, bz


def _communicate(action: Action, fw: float, comm_f, comm_b, done: dict, ev: list, tr: list) -> float | None:
    """An explicit send or receive at worker free time ``fw``: the worker's free time after it, or None
    while its data is not there yet. A send is asynchronous (issued, no worker time); a receive blocks
    until the data has arrived."""
    s, k, m = action.stage, action.kind, action.micro
    if k == "SEND_F":
        t_ready = done["F"][s][m]
    elif k == "SEND_B":
        t_ready = done["G"][s][m]
    elif k == "RECV_F":
        t = done["SEND_F"][s - 1][m]
        t_ready = None if t is None else t + comm_f[s - 1][m]
    else:   # RECV_B
        t = done["SEND_B"][s + 1][m]
        t_ready = None if t is None else t + comm_b[s][m]
    if t_ready is None:
        return None
    if k == "SEND_F" or k == "SEND_B":
        end = start = fw if fw > t_ready else t_ready
        ev.append((action, start, end))
    else:
        start = fw
        end = fw = fw if fw > t_ready else t_ready
        ev.append((action, start, end))
        comm = comm_f[s - 1][m] if k == "RECV_F" else comm_b[s][m]
        tr.append((action, t_ready - comm, t_ready))
    done[k][s][m] = end
    return fw


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
