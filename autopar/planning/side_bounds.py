"""The bounds' planner searches in side processes, alongside the main search: the upper bound plans
every device type alone and the homogeneous MFU plans a homogeneous cluster (``bounds.bound_searches``),
none of which depends on the plan they judge, so on a machine with a spare core they need not wait
for it. llama-140b on hethub-768 (CPU seconds, cold): the main search ~2.5, the upper bound's plans
~2.3, the homogeneous plan ~1.0.

Terms
- side process: a ``fork`` of the planning process (it inherits the cost tables and the cluster; no
  pickling on the way in) that runs one part of ``bound_searches`` (``BOUND_PARTS``: one process per
  part) and sends its result back through a pipe
  (the sub-plans pickle as plain frozen data). The result is the same function of the same inputs
  as computing it in the planning process: the same plans and figures, bit for bit.
- worthwhile: Linux (``fork`` is the start method that shares the process as it is), at least two
  CPUs this process may run on, a cluster of at least ``MIN_DEVICES`` devices (smaller clusters plan
  their bounds in well under a second, less than a fork and a pipe are worth), called from the main
  thread, and no other Python thread alive but daemon helpers (tqdm's monitor, which importing
  ``torch._dynamo`` for the analysis starts): forking a process whose working threads may hold
  locks can hang the child, so the threaded process groups of the tests and any planning from a
  thread stay in-process.
- fallback: whatever goes wrong in the side process (it dies, raises, cannot start, or has not
  answered ``_PATIENCE_X`` times the main search's time after it, at least ``_PATIENCE_S``) is not
  trusted: that part's searches run again in the planning process, which then raises what they raise.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

from autopar.ir.costs import ModelCosts
from autopar.planner.bounds import BOUND_PARTS, bound_searches, merge_bound_parts

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["MIN_DEVICES", "start_bound_searches", "side_process_worthwhile"]

MIN_DEVICES = 64
_PATIENCE_S, _PATIENCE_X = 120.0, 10.0   # wait for the side process at least this, or x the main search


def side_process_worthwhile(cluster: "Cluster") -> bool:
    """Whether ``start_bound_searches`` runs the searches in a side process (see the module docstring)."""
    if not sys.platform.startswith("linux") or len(cluster) < MIN_DEVICES:
        return False
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # pragma: no cover - Linux has it
        cpus = os.cpu_count() or 1
    if cpus < 2 or threading.current_thread() is not threading.main_thread():
        return False
    return all(t.daemon for t in threading.enumerate() if t is not threading.main_thread())


def start_bound_searches(costs: ModelCosts, cluster: "Cluster", global_batch: int, *, parts=BOUND_PARTS,
                         **plan_kw) -> tuple[Callable[[], tuple], Callable[[], None], bool]:
    """(``result()``, ``cancel()``, whether side processes were started): ``result()`` returns
    ``bound_searches(costs, cluster, global_batch, **plan_kw)`` (of ``parts`` only: the other's entries
    empty), from the side processes when it was
    worthwhile and they succeeded, else computed when asked; ``cancel()`` ends the side processes when
    the result is no longer wanted (the main search failed). Call one of them exactly once.

    Each of ``BOUND_PARTS`` (the upper bound's per-type plans; the homogeneous cluster's plan) runs in a
    process of its own: with the main search that makes three processes on two cores, whose total CPU
    the scheduler spreads over both, where one side process holding every search ended alone last
    (llama-140b / hethub-768: the main search ~2.5 s, the upper bound ~2.3 s, the homogeneous ~1.0 s)."""
    whole = set(parts) == set(BOUND_PARTS)      # else the one part asked (its result, the other empty)

    def here() -> tuple:
        return bound_searches(costs, cluster, global_batch, part="all" if whole else parts[0], **plan_kw)

    if not side_process_worthwhile(cluster):
        return here, lambda: None, False
    import multiprocessing as mp   # local: only large clusters pay for its import

    ctx = mp.get_context("fork")
    sides: list = []   # (part, receiving end, process)
    try:
        for part in parts:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(send, costs, cluster, global_batch, part, plan_kw), daemon=True)
            try:
                proc.start()
            finally:
                send.close()
            sides.append((part, recv, proc))
    except OSError:   # pragma: no cover - no process could be made
        for _, recv, proc in sides:
            recv.close()
            proc.kill()
            proc.join()
        return here, lambda: None, False

    started = time.perf_counter()

    def one(part, recv, proc) -> tuple:
        # the bound searches take about what the main search takes: a side process far slower than
        # that is taken as hung and replaced
        patience = max(_PATIENCE_S, _PATIENCE_X * (time.perf_counter() - started))
        try:
            ok, got = recv.recv() if recv.poll(patience) else (False, None)
        except (EOFError, OSError):   # the side process died before it answered
            ok, got = False, None
        finally:
            recv.close()
            if proc.is_alive() and not ok:
                proc.kill()
            proc.join()
        return got if ok else bound_searches(costs, cluster, global_batch, part=part, **plan_kw)

    def result() -> tuple:
        got = {part: one(part, recv, proc) for part, recv, proc in sides}
        empty = (None, {}, None, {})
        return merge_bound_parts(got.get("upper", empty), got.get("homogeneous", empty))

    def cancel() -> None:
        for _, recv, proc in sides:
            recv.close()
            proc.kill()
            proc.join()

    return result, cancel, True


def _child(send, costs, cluster, global_batch, part, plan_kw) -> None:
    """A side process: the result of ``part`` of the searches, or (False, None) when they raise (the
    planning process then runs that part itself and raises what it raises)."""
    try:
        out = (True, bound_searches(costs, cluster, global_batch, part=part, **plan_kw))
    except BaseException:   # noqa: BLE001 - any failure means: compute it in the planning process
        out = (False, None)
    try:
        send.send(out)
    except Exception:   # noqa: BLE001 - unpicklable or a closed pipe: the parent recomputes
        pass
    finally:
        send.close()
