"""The emulated link: gloo between a run's emulated ranks on this machine, measured once per machine and
core layout, and priced by ``autopar.cost.comm`` like any link (``calibrate.calibrated_cluster`` attaches
it to the cluster every plan is priced on).

Terms (``autopar.cluster.links.EmulatedLink``; the rule: ``docs/emulation.md``)
- ``measure_emulated_link(layout)``: gloo between ``len(layout)`` ranks on this machine, pinned to core
  ``layout[i]`` of the machine's cores (the cores ``autopar.cluster.emulation.cpu_shares`` gives the
  ranks of a run: gloo copies on the rank's own cores, so two ranks on one core share its time). The
  ranks are processes forked from this one (a run's ranks are processes), each with its own gloo
  process group (threads of this process where fork is not available: their small collectives cost
  several times a process's). The ranks of a run plan at once: one measures (a lock file next to
  ``links.json``), the others wait and read its link. Every operation at every size
  of ``LINK_SIZES`` (4 KB to 16 MB), 15 / 5 / 3 times (small / up to 4 MB / larger) after one warm-up,
  the repeats interleaved; a time runs from the last rank's entry to the last rank's end (a run's
  profile splits the wait for a late peer off the same way), the lower quartile of the repeats (the
  link, not a burst of other work on the cores: the ranks of a run may still be profiling). Per operation,
  ``fit_alpha_beta`` fits its latency per message step and its bandwidth to the sizes (relative least
  squares, ``link_shape``: the steps and bytes of ``autopar.cost.comm``'s formula). About 1.3-2.1 s
  on this 2-core machine at load 7-9. Large messages (16 MB) run slower than the fit (caches): a
  reduce-scatter up to 2x.
- ``emulated_link_for(cluster)``: this machine's link for the cluster's core layout, from the cache
  (``autopar.measure.cache.load_link``, under a key naming ``LINK_VERSION``: a link measured the
  older way is measured again), measured and cached the first time; None when the
  cluster has no node of emulated devices without a declared link, or with
  ``AUTOPAR_EMULATED_LINK=nominal`` (the nominal ``LinkModel`` figures then price it, as before).
- ``calibrated_cluster(cluster)`` attaches it (the planner and ``compiled.profile()`` price the run
  with it); a ``comm`` factor then multiplies its latencies and divides its bandwidths (every time
  priced on it times the factor) instead of dividing the node's nominal link bandwidth.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from autopar import env
from autopar.cluster.rendezvous import loopback_store
from autopar.ir.cache_files import private_dir

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.links import EmulatedLink

__all__ = ["measure_emulated_link", "emulated_link_for", "EMULATED_LINK_ENV", "LINK_SIZES", "LINK_VERSION",
           "link_shape", "fit_alpha_beta"]

EMULATED_LINK_ENV = "AUTOPAR_EMULATED_LINK"
# The emulated link: measured at these message sizes (bytes of the full buffer), each op timed
# ``repeats`` times up to _FULL_REPEAT_BYTES, half as often above and three times as often up to
# _SMALL_BYTES (their times are short and the most disturbed by other jobs); LINK_VERSION names the cache
# entries (links.json) of this way of measuring, so a link measured the old way is measured again.
LINK_SIZES = (4 * 1024, 256 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024)
LINK_VERSION = 2
_FULL_REPEAT_BYTES = 4 * 1024 * 1024
_SMALL_BYTES = 256 * 1024


def _layout_key(layout: tuple[int, ...], cores: int) -> str:
    return f"v{LINK_VERSION}|ranks {len(layout)}|cores {'|'.join(map(str, layout))} of {cores}"


def emulated_link_for(cluster):
    """This machine's measured link for ``cluster``'s emulated ranks (see the module docstring)."""
    from autopar.cluster.emulation import emulated_link_nodes, link_layout, machine_cores
    from autopar.cluster.links import EmulatedLink
    from autopar.measure.cache import load_link, save_link

    if env.read(EMULATED_LINK_ENV).lower() in ("nominal", *env.OFF):
        return None
    nodes = emulated_link_nodes(cluster)
    if not nodes:
        return None
    cores = machine_cores()
    layout = link_layout(cluster, nodes[0], range(cores))
    key = _layout_key(layout, cores)
    found = load_link(key)
    if found is None:
        with _link_lock():      # the ranks of a run plan at once: one measures, the others read its link
            found = load_link(key)
            if found is None:
                found = measure_emulated_link(layout).to_json()
                save_link(key, found)
    return EmulatedLink.from_json(found, nodes)


LOCK_WAIT_S = 300.0      # the longest a process waits for another's link measurement (``_link_lock``)


@contextmanager
def _link_lock(wait_s: float = LOCK_WAIT_S):
    """An exclusive lock on this cache's links (a lock file next to ``links.json``), waited for at most
    ``wait_s`` (a holder that hangs does not hang every later run: ``LaunchError`` naming the file);
    none where the platform has no ``fcntl``."""
    from autopar.errors import LaunchError
    from autopar.measure.cache import links_path

    try:
        import fcntl
    except ImportError:         # pragma: no cover - not POSIX
        yield
        return
    path = links_path().with_suffix(".lock")
    private_dir(path.parent)
    # never through a link planted at the lock's name: created 0600, not followed
    with os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600), "a") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LaunchError(f"links: {path} stayed locked for {wait_s:g} s by another process "
                                      "measuring the emulated link; stop it or remove the file") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def link_shape(op: str, n: int) -> tuple[int, float]:
    """(message steps, bytes moved per byte of the full buffer) of ``op`` over ``n`` ranks in
    ``autopar.cost.comm``'s formulas: its time is ``steps x latency + moved x nbytes / bandwidth``."""
    return {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n), "all_gather": (n - 1, (n - 1) / n),
            "reduce_scatter": (n - 1, (n - 1) / n), "broadcast": (n - 1, 1.0), "p2p": (1, 1.0)}[op]


def fit_alpha_beta(points, steps: int, moved: float) -> tuple[float, float]:
    """(latency per step, bandwidth) of one operation from ``points`` = (full-buffer bytes, seconds):
    least squares of ``steps x latency + moved x bytes / bandwidth`` against the times, each point
    weighted by 1 / its time (relative errors, so the small messages count as much as the large);
    latency >= 0, and where the fit finds no bandwidth term, the largest message's time is all
    bandwidth. Pure."""
    pts = [(float(b), float(t)) for b, t in points if t > 0]
    if not pts:
        raise ValueError("fit_alpha_beta: no positive time")
    a = np.array([[steps / t, moved * b / t] for b, t in pts])
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones(len(pts)), rcond=None)
    if alpha < 0:                       # bandwidth alone: beta by the same weighted least squares
        alpha = 0.0
        beta = float(np.sum(a[:, 1]) / np.sum(a[:, 1] ** 2))
    if not beta > 0:                    # no bandwidth term: the largest message's time is all of it
        b_max, t_max = max(pts)
        alpha = min(float(alpha), min(t for _, t in pts) / steps)
        beta = max(t_max - steps * alpha, 0.1 * t_max) / (moved * b_max)
    return float(alpha), float(1.0 / beta)


def _pg_ops(pg, rank: int, full, shard) -> dict:
    """The measured operations on one process group object (a rank's own ``ProcessGroupGloo``: never
    the default group, which the process forked from may hold, initialised, for its own run)."""
    return {
        "all_reduce": lambda: pg.allreduce([full]).wait(),
        "all_gather": lambda: pg._allgather_base(full, shard).wait(),
        "reduce_scatter": lambda: pg._reduce_scatter_base(shard, full).wait(),
        "broadcast": lambda: pg.broadcast([full]).wait(),
        "p2p": lambda: (pg.send([full], 1, 0).wait() if rank == 0 else
                        pg.recv([full], 0, 0).wait() if rank == 1 else None),
    }


def _rank_ops(ops_of, rank: int, n: int, sizes, reps: dict, barrier, record) -> None:
    """Rank ``rank``'s side of the measurement: every op of ``LINK_OPS`` (``ops_of(full, shard)``) at
    every size, ``reps[size]`` times after one warm-up, each after ``barrier()``, the repeats
    interleaved (round i of every op and size before round i + 1: a burst of load on the machine
    then falls on every op alike); ``record(op, size, i, entered, ended)``."""
    import time

    import torch

    from autopar.cluster.links import LINK_OPS

    ops = {}
    for size in sizes:
        numel = max(n, size // 4 // n * n)
        ops[size] = ops_of(torch.ones(numel), torch.ones(numel // n))
    for i in range(max(reps.values()) + 1):
        for size in sizes:
            if i > reps[size]:
                continue
            for op in LINK_OPS:
                barrier()
                t0 = time.perf_counter()
                ops[size][op]()
                t1 = time.perf_counter()
                if i and (op != "p2p" or rank < 2):
                    record(op, size, i, t0, t1)


def _pin(core: int, tid: int = 0) -> None:
    import os

    try:       # this thread (0: the process), and the gloo threads it starts after, on the rank's core
        os.sched_setaffinity(tid, {core})
    except (AttributeError, OSError):
        pass


def _child(rank: int, n: int, core: int, port: int, sizes, reps: dict, conn) -> None:
    """A forked rank of ``_time_ops_processes``: its records, or its error, sent through ``conn``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    try:
        _pin(core)
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, n + 1, False, timedelta(seconds=30))
        pg = dist.ProcessGroupGloo(dist.PrefixStore("autopar-link", store), rank, n, timedelta(seconds=60))
        out: list = []
        _rank_ops(lambda full, shard: _pg_ops(pg, rank, full, shard), rank, n, sizes, reps,
                  lambda: pg.barrier().wait(), lambda *r: out.append(r))
        conn.send(("ok", out))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", repr(exc)))
    finally:
        conn.close()


def _time_ops_processes(cores: list[int], sizes, reps: dict) -> list | None:
    """Records of every rank, each a process forked from this one and pinned to ``cores[rank]`` (a
    run's ranks are processes: gloo between processes is what they meet); None where this platform
    cannot fork or a rank failed (the caller then measures with threads)."""
    import multiprocessing as mp
    from datetime import timedelta

    if "fork" not in mp.get_all_start_methods():
        return None
    n = len(cores)
    ctx = mp.get_context("fork")
    master = loopback_store(timedelta(seconds=30), n + 1)
    store = master.store
    pipes = [ctx.Pipe(duplex=False) for _ in range(n)]
    procs = [ctx.Process(target=_child, args=(r, n, cores[r], store.port, sizes, reps, pipes[r][1]), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    out: list = []
    ok = True
    for r, (recv, send) in enumerate(pipes):
        send.close()
        try:
            status, got = recv.recv() if recv.poll(120) else ("error", "timed out")
        except EOFError:
            status, got = "error", "no result"
        ok = ok and status == "ok"
        if status == "ok":
            out += [(r, *x) for x in got]
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    del store
    master.close()
    return out if ok else None


def _time_ops_threads(cores: list[int], sizes, reps: dict) -> list:
    """Records of every rank, each a thread of this process with its own gloo process group over one
    in-process store, pinned to ``cores[rank]``."""
    import sys
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    n = len(cores)
    store = dist.HashStore()
    barrier = threading.Barrier(n)
    out: list = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def record(*r) -> None:
        with lock:
            out.append(r)

    def run(rank: int) -> None:
        try:
            _pin(cores[rank], threading.get_native_id())
            pg = dist.ProcessGroupGloo(dist.PrefixStore("autopar-link", store), rank, n, timedelta(seconds=60))
            _rank_ops(lambda full, shard: _pg_ops(pg, rank, full, shard), rank, n, sizes, reps, barrier.wait,
                      lambda *r: record(rank, *r))
        except BaseException as exc:  # noqa: BLE001 - reported after the threads joined
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)     # the ranks are threads here: no 5 ms waits for the GIL between them
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    if errors:
        raise errors[0]
    return out


def measure_emulated_link(layout, *, repeats: int = 5, sizes: tuple[int, ...] = LINK_SIZES,
                          processes: bool = True) -> "EmulatedLink":
    """The gloo link between ``len(layout)`` ranks pinned to cores ``layout`` (see the module docstring);
    ``processes``: ranks as forked processes (threads where that fails, or with False)."""
    from autopar.cluster.emulation import allowed_cores, machine_cores
    from autopar.cluster.links import LINK_OPS, EmulatedLink

    layout = tuple(int(c) for c in layout)
    n = len(layout)
    if n < 2:
        raise ValueError(f"measure_emulated_link: layout {layout} needs at least two ranks")
    machine = sorted(allowed_cores()) if len(allowed_cores()) >= machine_cores() else list(range(machine_cores()))
    cores = [machine[c % len(machine)] for c in layout]
    reps = {size: 3 * repeats if size <= _SMALL_BYTES else repeats if size <= _FULL_REPEAT_BYTES
            else max(2, (repeats + 1) // 2) for size in sizes}
    records = (_time_ops_processes(cores, sizes, reps) if processes else None) or \
        _time_ops_threads(cores, sizes, reps)
    times: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for _, op, size, i, t0, t1 in records:
        times.setdefault((op, size, i), []).append((t0, t1))

    def quartile(op: str, size: int) -> float:
        # from the last rank's entry to the last rank's end: the part a run's profile records as the
        # collective (autopar.ir.profile splits the waiting for a late peer off as "wait"); the lower
        # quartile of the repeats: the link itself, not a burst of another job on the cores
        ts = sorted(max(t1 for _, t1 in times[(op, size, i)]) - max(t0 for t0, _ in times[(op, size, i)])
                    for i in range(1, reps[size] + 1))
        return float(np.quantile(ts, 0.25))

    latency, bandwidth = [], []
    for op in LINK_OPS:
        steps, moved = link_shape(op, n)
        points = [(max(n, size // 4 // n * n) * 4, quartile(op, size)) for size in sizes]
        alpha, bw = fit_alpha_beta(points, steps, moved)
        latency.append((op, alpha))
        bandwidth.append((op, bw))
    return EmulatedLink(tuple(latency), tuple(bandwidth), (), "|".join(map(str, layout)))
