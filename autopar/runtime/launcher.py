"""Starting the ranks of a cluster: ``launch`` (all ranks as processes on this machine), ``init``
(one rank, e.g. under torchrun), the per-rank ``RankContext``, and failure handling.

Terms
- rank: one process per device of the cluster, numbered as ``cluster.devices``.
- default group: the ``torch.distributed`` default process group over every rank. Its backend is NCCL
  when every device is a GPU, else gloo (``default_backend``). A mixed cluster (GPUs with CPU or
  emulated devices) therefore runs its default group on gloo; the communicator creates faster
  subgroups over ranks that share a backend (``subgroup_backend`` says which backend a set of ranks
  can use).
- rendezvous: ``launch`` hosts a ``TCPStore`` in the parent on a port the OS picks (port 0), so two
  launches never collide, listening on loopback only (``autopar.cluster.rendezvous``); ranks connect
  to it as clients. Under torchrun, ``init`` uses
  MASTER_ADDR/MASTER_PORT (``env://``).
- step timeout (``step_timeout_s``): the process-group timeout. A collective that waits longer than
  this on a peer fails, so a hung rank makes its peers fail instead of waiting forever.
- overall timeout (``timeout_s``): ``launch`` kills every rank once this much wall time has passed.
- failure report: a rank whose function raises writes its traceback to the launch's temp directory
  and exits. ``launch`` then kills every other rank (they may be blocked in a collective) and raises
  ``LaunchError`` naming the rank that failed first. A rank that dies without a report (a signal,
  ``os._exit``) is named as well. Errors raised inside a collective because a peer died or timed out
  are *secondary*: they do not hide the rank that caused them.

Every CPU rank ``launch`` starts first takes its CPU share (``autopar.cluster.emulation.cpu_shares``:
its cores and torch thread counts; an emulated rank computes on one thread, pinned), before anything
else runs in it.

Each rank runs in its own process group (``setpgrp``) so that killing it also kills anything it
started (data-loader workers); nothing is left behind.

Elastic restarts (``launch(..., max_restarts=N)``, docs/elastic.md)
- full cluster: the one given to ``launch``/``init``; the cluster in force (``RankContext.cluster``,
  ``autopar.current_cluster()``) is the full cluster less the failed devices, renumbered 0.. in order.
- present devices: a world of fewer ranks than the full cluster has devices runs on the full cluster
  less the devices named in AUTOPAR_FAILED_DEVICES (ranks of the full cluster, comma-separated), or,
  when that is unset, on its first WORLD_SIZE devices (``present_cluster``). ``launch`` sets it for
  every restart; under ``torchrun --max-restarts`` with a smaller world, set it or rely on the rule.
- a restart: when an attempt raises ``LaunchError`` naming a rank (it failed, died or hung), that
  device is dropped and the job is started again on the rest, at most ``max_restarts`` times. The
  overall timeout is not a device failure and ends the job. Attempts are numbered 0.. in
  AUTOPAR_RESTART_COUNT (``autopar.restart_count()``); AUTOPAR_STOPPED_AT holds the wall time at
  which the failed attempt was stopped (for the restart's time split).
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing.connection
import os
import pickle
import re
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar import env
from autopar.errors import LaunchError
from autopar.cluster.emulation import allowed_cores
from autopar.cluster.rendezvous import LOOPBACK, loopback_store
from autopar.runtime.emulate import apply_cpu_share, cpu_shares

__all__ = [
    "RankContext", "launch", "init", "shutdown", "context", "is_initialized",
    "default_backend", "subgroup_backend", "present_cluster", "failed_devices",
    "FAILED_ENV", "RESTART_ENV", "STOPPED_AT_ENV", "planning_group", "PLANNING_TIMEOUT_S", "subgroup_timeout",
]

# what launch sets for a restarted attempt (their meanings: autopar.env.VARIABLES)
FAILED_ENV, RESTART_ENV, STOPPED_AT_ENV = "AUTOPAR_FAILED_DEVICES", "AUTOPAR_RESTART_COUNT", "AUTOPAR_STOPPED_AT"

_HOST = LOOPBACK
_GRACE_S = 3.0            # how long to wait for peers to report once only secondary errors are seen
_KILL_WAIT_S = 5.0
_RENDEZVOUS_TIMEOUT_S = 300.0
# Messages of errors raised inside a collective because of a peer (gloo, NCCL, the store).
_SECONDARY = re.compile(
    r"gloo/transport|Connection closed by peer|Connection reset by peer|Timed out waiting|"
    r"ProcessGroupNCCL|NCCL communicator was aborted|Broken pipe|DistNetworkError|"
    r"wait timeout after|Socket Timeout", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a rank knows about itself once ``init`` has run."""
    rank: int
    world_size: int
    cluster: Any                # autopar.cluster.model.Cluster
    device: torch.device        # cuda:<local index> for GPU ranks, cpu otherwise
    speed: float | None         # emulated devices: fraction of this CPU's speed; None otherwise
    backend: str                # backend of the default group
    local_rank: int
    full_cluster: Any = None    # the cluster the job was started on; ``cluster`` is the part in force

    @property
    def spec(self):
        return self.cluster.devices[self.rank].spec

    @property
    def is_emulated(self) -> bool:
        return self.speed is not None

    def __repr__(self) -> str:
        return (f"RankContext(rank={self.rank}/{self.world_size}, device={self.device}, "
                f"spec={self.spec.name!r}, speed={self.speed}, backend={self.backend!r})")


_context: RankContext | None = None   # set by init() in the rank's process, cleared by shutdown()
_planning: Any = None                 # init()'s planning group (world of several ranks), cleared by shutdown()
_group_timeout: timedelta | None = None   # init()'s step timeout, for every sub-group; cleared by shutdown()

# How long ranks wait for rank 0's plan (``planning_group``): a cold plan analyses the model, times its
# blocks and searches, minutes on a loaded machine, longer than a step's collective may wait. A rank that
# dies meanwhile still stops the job at once: ``launch``'s monitor (or torchrun's agent) sees it exit.
PLANNING_TIMEOUT_S = 1800.0


def default_backend(cluster) -> str:
    """The default group's backend: NCCL when every device is a GPU, gloo otherwise."""
    backends = {d.spec.backend for d in cluster.devices}
    return "nccl" if backends == {"nccl"} else "gloo"


def subgroup_backend(cluster, ranks) -> str:
    """The fastest backend every rank in ``ranks`` can join: NCCL for GPU-only sets, else gloo."""
    backends = {cluster.devices[r].spec.backend for r in ranks}
    return "nccl" if backends == {"nccl"} else "gloo"


def is_initialized() -> bool:
    return _context is not None


def context() -> RankContext:
    """This rank's ``RankContext``; raises ``LaunchError`` before ``init``."""
    if _context is None:
        raise LaunchError("autopar.runtime.context(): not initialised in this process; call "
                          "autopar.init(cluster) first (autopar.launch does it for every rank)")
    return _context


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise LaunchError(f"init: environment variable {name} is not set; run under torchrun or pass "
                          f"rank= and world_size= (or use autopar.launch)")
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"init: environment variable {name}={value!r} is not an integer") from None


def init(cluster, rank: int | None = None, world_size: int | None = None, *,
         store: dist.Store | None = None, step_timeout_s: float = 60.0) -> RankContext:
    """Join the default process group as ``rank`` of ``cluster`` and record this rank's context.

    With ``rank=None`` (torchrun), RANK and WORLD_SIZE come from the environment and the rendezvous
    from MASTER_ADDR/MASTER_PORT. ``store``: rendezvous through this store instead (``launch``).
    """
    global _context, _planning, _group_timeout
    if _context is not None:
        raise LaunchError(f"init: already initialised as rank {_context.rank}; call "
                          f"autopar.runtime.shutdown() before initialising again")
    if dist.is_available() and dist.is_initialized():
        raise LaunchError("init: torch.distributed is already initialised outside autopar; destroy "
                          "that process group first")
    if rank is None:
        rank = _env_int("RANK")
    if world_size is None:
        world_size = _env_int("WORLD_SIZE") if "WORLD_SIZE" in os.environ or store is None \
            else len(cluster)
    if world_size > len(cluster):
        raise LaunchError(f"init: WORLD_SIZE={world_size} but the cluster has {len(cluster)} devices; "
                          f"start one process per device")
    full_cluster, cluster = cluster, present_cluster(cluster, world_size)
    if not 0 <= rank < world_size:
        raise LaunchError(f"init: rank={rank} is outside [0, {world_size})")
    if not step_timeout_s > 0:
        raise LaunchError(f"init: step_timeout_s must be > 0, got {step_timeout_s!r}")
    if store is None:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise LaunchError(f"init: environment variable {name} is not set; run under torchrun "
                                  f"or use autopar.launch")

    spec = cluster.devices[rank].spec
    backend = default_backend(cluster)
    local_rank = (_env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ
                  else cluster.devices[rank].local_rank)
    if spec.backend == "nccl":
        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not 0 <= local_rank < num_gpus:
            raise LaunchError(f"init: rank {rank} is a GPU ({spec.name}) with LOCAL_RANK={local_rank} but "
                              f"this process sees {num_gpus} CUDA device(s); use an emulated cluster "
                              f"(emulate: cpu) to run on CPUs")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    speed = float(spec.speed) if spec.is_emulated else None

    timeout = timedelta(seconds=step_timeout_s)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=timeout)
    _group_timeout = timeout             # sub-groups wait as long as the world, not torch's 30 minutes
    _context = RankContext(rank, world_size, cluster, device, speed, backend, local_rank, full_cluster)
    if world_size > 1:   # every rank runs init, so every rank creates it, in the same order
        _planning = dist.new_group(timeout=timedelta(seconds=max(PLANNING_TIMEOUT_S, step_timeout_s)))
    return _context


def subgroup_timeout() -> timedelta | None:
    """How long every process group autopar makes after ``init`` waits (``runtime.communicator``'s
    ``pg_new_group`` and ``Communicator.new_group``): the step timeout; None before ``init`` or after
    ``shutdown`` (torch's default)."""
    return _group_timeout


def planning_group() -> Any:
    """The process group whose collectives wait up to ``PLANNING_TIMEOUT_S`` (every rank of the world),
    for handing out rank 0's plan; ``None`` (the default group) when ``init`` made none: a world of one
    rank, or process groups that autopar did not initialise."""
    return _planning


def failed_devices(cluster) -> tuple[int, ...]:
    """The ranks of ``cluster`` that AUTOPAR_FAILED_DEVICES names (none when it is unset or empty)."""
    text = env.read(FAILED_ENV)
    try:
        failed = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise LaunchError(f"init: {FAILED_ENV}={text!r} is not a comma-separated list of ranks") from None
    bad = [r for r in failed if not 0 <= r < len(cluster)]
    if bad:
        raise LaunchError(f"init: {FAILED_ENV} names rank(s) {bad} but the cluster has {len(cluster)} devices")
    return failed


def present_cluster(cluster, world_size: int):
    """The devices of ``cluster`` a world of ``world_size`` ranks runs on: all of them when the sizes
    match; otherwise ``cluster`` less the devices AUTOPAR_FAILED_DEVICES names, or when it is unset its
    first ``world_size`` devices; renumbered 0.. in order (``Cluster.subset``)."""
    failed = failed_devices(cluster)
    if not failed and world_size == len(cluster):
        return cluster
    survivors = [r for r in range(len(cluster)) if r not in failed][:None if failed else world_size]
    if len(survivors) != world_size:
        raise LaunchError(f"init: WORLD_SIZE={world_size} but the cluster less {FAILED_ENV}={list(failed)} has "
                          f"{len(survivors)} devices; start one process per device that is present")
    lost = ",".join(map(str, failed)) if failed else f"{world_size}.."
    return cluster.subset(survivors, name=f"{cluster.name}-without-{lost}")


def shutdown() -> None:
    """Destroy the default process group and forget this rank's context (no-op when not initialised)."""
    global _context, _planning, _group_timeout
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _context = _planning = _group_timeout = None


# ---------------------------------------------------------------------------------------------------
# launch: the parent side


class _Final(LaunchError):
    """A failure that no restart cures: the overall timeout, a rank that could not be started."""


def launch(fn: Callable[..., Any], cluster, *args, timeout_s: float | None = None,
           step_timeout_s: float = 60.0, max_restarts: int = 0) -> list:
    """Run ``fn(rank, *args)`` in one process per device of ``cluster`` on this machine; return what
    each rank returned, by rank (tensors come back on the CPU). Raises ``LaunchError`` naming the rank
    when a rank fails, dies or hangs, after stopping every rank.

    ``max_restarts``: when a rank fails, dies or hangs, stop every rank and start the job again on the
    cluster without that device (``autopar.current_cluster()`` in ``fn``), at most this many times; the
    list returned is then by rank of the last attempt's cluster. ``timeout_s`` bounds all attempts."""
    if len(cluster) < 1:
        raise LaunchError("launch: the cluster has no devices")
    if timeout_s is not None and not timeout_s > 0:
        raise LaunchError(f"launch: timeout_s must be > 0 or None, got {timeout_s!r}")
    if not step_timeout_s > 0:
        raise LaunchError(f"launch: step_timeout_s must be > 0, got {step_timeout_s!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise LaunchError(f"launch: max_restarts must be an integer >= 0, got {max_restarts!r}")
    _check_picklable(fn)

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed: list[int] = []          # ranks of ``cluster``, in the order they failed
    history: list[str] = []
    stopped_at = None
    for attempt in range(max_restarts + 1):
        survivors = [r for r in range(len(cluster)) if r not in failed]
        env = {RESTART_ENV: str(attempt), FAILED_ENV: ",".join(map(str, sorted(failed))),
               STOPPED_AT_ENV: "" if stopped_at is None else repr(stopped_at)}
        try:
            return _launch_once(fn, cluster, survivors, args, env, deadline, timeout_s, step_timeout_s)
        except _Final:
            raise
        except LaunchError as exc:
            stopped_at = time.time()
            if exc.rank is None or attempt == max_restarts or len(survivors) == 1:
                if history:
                    raise LaunchError(f"{exc}\nEarlier attempts: {'; '.join(history)}", rank=exc.rank) from exc
                raise
            lost = survivors[exc.rank]
            failed.append(lost)
            history.append(f"attempt {attempt}: device {_name(cluster, lost)} failed")
            print(f"[autopar launch] attempt {attempt}: device {_name(cluster, lost)} failed; restarting on "
                  f"{len(survivors) - 1} devices (restart {attempt + 1} of at most {max_restarts})", file=sys.stderr)
    raise AssertionError("unreachable")


def _launch_once(fn, cluster, survivors, args, elastic_env, deadline, timeout_s, step_timeout_s) -> list:
    """One attempt: the ranks of ``cluster``'s ``survivors`` (renumbered 0..), each in a process."""
    nprocs = len(survivors)
    in_force = cluster.subset(survivors) if nprocs < len(cluster) else cluster
    master = loopback_store(timedelta(seconds=_RENDEZVOUS_TIMEOUT_S))
    spawn = mp.get_context("spawn")
    procs: list = []
    with tempfile.TemporaryDirectory(prefix="autopar-launch-") as workdir:
        try:
            # Every rank is on this machine: GPU ranks take consecutive CUDA devices, by full-cluster rank
            # (a restart keeps each surviving GPU on its device).
            gpu_ranks = [r for r in range(len(cluster)) if cluster.devices[r].spec.backend == "nccl"]
            for rank, full_rank in enumerate(survivors):
                local_rank = gpu_ranks.index(full_rank) if full_rank in gpu_ranks else rank
                env = {"RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(local_rank),
                       "MASTER_ADDR": _HOST, "MASTER_PORT": str(master.port), **elastic_env}
                proc = spawn.Process(
                    target=_worker, name=f"autopar-rank-{rank}", daemon=False,
                    args=(fn, cluster, rank, args, master.port, workdir, step_timeout_s, env,
                          os.getpid()))
                try:
                    proc.start()
                except Exception as exc:
                    raise _Final(f"launch: could not start rank {rank}: {exc} (fn and args must be "
                                 f"picklable)", rank=rank) from exc
                procs.append(proc)
            return _monitor(procs, Path(workdir), deadline, timeout_s, step_timeout_s, in_force)
        finally:
            _kill_all(procs)
            master.close()
            del master


def _check_picklable(fn) -> None:
    module = getattr(fn, "__module__", None)
    if module == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
        raise LaunchError(f"launch: fn={fn!r} is defined interactively; the spawned ranks cannot import "
                          f"it. Define it in a module (a .py file) and import it")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise LaunchError(f"launch: fn={fn!r} cannot be pickled ({exc}); pass a module-level function "
                          f"(not a lambda, closure or nested function)") from None


def _monitor(procs, workdir: Path, deadline, timeout_s, step_timeout_s, cluster) -> list:
    pending = set(range(len(procs)))
    while pending:
        wait_s = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
        multiprocessing.connection.wait([procs[r].sentinel for r in pending], timeout=wait_s)
        for r in list(pending):
            if procs[r].exitcode is not None:
                pending.discard(r)
        failed = [r for r in range(len(procs))
                  if procs[r].exitcode not in (None, 0) or
                  (procs[r].exitcode == 0 and not _result_path(workdir, r).exists())]
        if failed:
            _raise_failure(procs, workdir, step_timeout_s, cluster)
        if pending and deadline is not None and time.monotonic() >= deadline:
            running = sorted(pending)
            _kill_all(procs)
            raise _Final(f"launch: timed out after timeout_s={timeout_s} s with rank(s) "
                         f"{_names(cluster, running)} still running; every rank was stopped", rank=running[0])
    return [_load_result(workdir, r) for r in range(len(procs))]


def _raise_failure(procs, workdir: Path, step_timeout_s, cluster):
    """Find the rank that caused the failure, stop everything, raise ``LaunchError``."""
    failures = _collect(procs, workdir)
    if all(f["secondary"] for f in failures.values()):
        # Only collective errors so far: give the culprit a moment to report or to exit.
        end = time.monotonic() + _GRACE_S
        while time.monotonic() < end:
            alive = [p.sentinel for p in procs if p.exitcode is None]
            if not alive:
                break
            multiprocessing.connection.wait(alive, timeout=end - time.monotonic())
            failures = _collect(procs, workdir)
            if not all(f["secondary"] for f in failures.values()):
                break
    still_running = [r for r, p in enumerate(procs) if p.exitcode is None]
    _kill_all(procs)

    primary = [r for r, f in failures.items() if not f["secondary"]]
    if primary:
        # Unreported deaths first (no timestamp), then the earliest report.
        culprit = min(primary, key=lambda r: (failures[r]["time"] is not None,
                                              failures[r]["time"] or 0.0, r))
        head = f"rank {_name(cluster, culprit)} failed: {failures[culprit]['summary']}"
        detail = failures[culprit]["traceback"]
    elif still_running:
        culprit = still_running[0]
        head = (f"rank {_name(cluster, culprit)} hung: its peers' collectives failed (step_timeout_s="
                f"{step_timeout_s}) while rank(s) {still_running} were still running")
        detail = ""
    else:
        culprit = min(failures, key=lambda r: (failures[r]["time"] or 0.0, r))
        head = (f"rank {_name(cluster, culprit)} failed: {failures[culprit]['summary']} (only collective "
                f"errors: a rank may have skipped a collective or returned early)")
        detail = failures[culprit]["traceback"]
    others = [f"rank {r}: {f['summary']}" for r, f in sorted(failures.items()) if r != culprit]
    others += [f"rank {r}: still running, killed" for r in still_running if r != culprit]
    message = f"launch: {head}; every rank was stopped."
    if others:
        message += "\nOther ranks:\n  " + "\n  ".join(others)
    if detail:
        message += f"\nTraceback of rank {culprit}:\n{detail.rstrip()}"
    raise LaunchError(message, rank=culprit)


def _collect(procs, workdir: Path) -> dict[int, dict]:
    """Failure facts per failed rank: summary, traceback, time (None if unreported), secondary."""
    failures = {}
    for r, proc in enumerate(procs):
        report = workdir / f"rank{r}.error.json"
        if report.exists():
            failures[r] = json.loads(report.read_text())
        elif proc.exitcode is not None and (proc.exitcode != 0 or
                                             not _result_path(workdir, r).exists()):
            code = proc.exitcode
            if code < 0:
                try:
                    how = f"killed by signal {signal.Signals(-code).name}"
                except ValueError:
                    how = f"killed by signal {-code}"
            else:
                how = f"exited with code {code}"
            hint = ("" if code != 1 else " (if fn lives in a script, guard the launch call with "
                    "`if __name__ == \"__main__\":`)")
            failures[r] = {"summary": f"process {how} without reporting a result{hint}",
                           "traceback": "", "time": None, "secondary": False}
    return failures


def _kill_all(procs) -> None:
    for proc in procs:
        if proc.exitcode is None:
            _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        proc.join(_KILL_WAIT_S)
        if proc.exitcode is None:          # e.g. stuck in uninterruptible I/O; last resort
            proc.kill()
            proc.join(_KILL_WAIT_S)
    # Also reap anything the ranks started in their process groups.
    for proc in procs:
        if proc.pid is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                pass


def _signal_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)          # the rank leads its own process group (see _worker)
    except (ProcessLookupError, PermissionError, OSError):
        pass
    try:
        os.kill(proc.pid, sig)            # in case it had not called setpgrp yet
    except (ProcessLookupError, OSError):
        pass


def _name(cluster, rank: int) -> str:
    try:
        return f"{rank} ({cluster.devices[rank].spec.name})"
    except Exception:
        return str(rank)


def _names(cluster, ranks) -> str:
    return ", ".join(_name(cluster, r) for r in ranks)


def _result_path(workdir: Path, rank: int) -> Path:
    return workdir / f"rank{rank}.result.pt"


def _load_result(workdir: Path, rank: int):
    return torch.load(_result_path(workdir, rank), map_location="cpu", weights_only=False)


# ---------------------------------------------------------------------------------------------------
# launch: the rank side


def _worker(fn, cluster, rank, args, port, workdir, step_timeout_s, env, parent_pid) -> None:
    try:
        os.setpgrp()
    except OSError:
        pass
    _die_with_parent(parent_pid)
    faulthandler.enable()          # a rank killed by a fatal signal prints its Python stack to stderr
    os.environ.update(env)
    if sys.platform.startswith("linux"):   # every rank is on this machine: gloo's and NCCL's sockets on loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    try:
        # Cores and torch threads of this rank: autopar.cluster.emulation.cpu_shares (the rule).
        world_size = int(env["WORLD_SIZE"])
        cores = allowed_cores()
        apply_cpu_share(cpu_shares(present_cluster(cluster, world_size), cores)[rank], len(cores))
        store = dist.TCPStore(_HOST, port, None, False, timedelta(seconds=_RENDEZVOUS_TIMEOUT_S))
        init(cluster, rank=rank, world_size=world_size, store=store, step_timeout_s=step_timeout_s)
        result = _to_cpu(fn(rank, *args))
        tmp = Path(workdir) / f"rank{rank}.result.tmp"
        torch.save(result, tmp)
        os.replace(tmp, _result_path(Path(workdir), rank))
    except BaseException as exc:   # noqa: BLE001 - any failure must reach the parent
        _report(Path(workdir), rank, exc)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)                # do not run teardown that may block on dead peers
    try:
        shutdown()
    except Exception:
        pass
    # The result is saved: leave without interpreter finalization. Its C++ static destructors (gloo's
    # threads) sometimes abort ("terminate called without an active exception", SIGABRT with no
    # Python frame), which turned a finished rank into a failed launch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel kill this rank if the launching process dies (it leads its own process
    group, so a signal to the parent's group no longer reaches it)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)     # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:                      # the parent died before prctl
        os._exit(1)


def _report(workdir: Path, rank: int, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc))
    summary = "".join(traceback.format_exception_only(exc)).strip()
    secondary = isinstance(exc, getattr(dist, "DistError", ())) or bool(_SECONDARY.search(str(exc)))
    print(f"[autopar rank {rank}] {text}", file=sys.stderr, end="")
    report = {"summary": summary, "traceback": text, "time": time.time(), "secondary": secondary}
    tmp = workdir / f"rank{rank}.error.tmp"
    tmp.write_text(json.dumps(report))
    os.replace(tmp, workdir / f"rank{rank}.error.json")


def _to_cpu(obj):
    """Detached CPU copies of every tensor in a (nested) result, containers kept as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu").clone()
    if isinstance(obj, dict):
        try:
            out = type(obj)()            # dict, OrderedDict (a state_dict), ...
        except TypeError:
            out = {}
        out.update((k, _to_cpu(v)) for k, v in obj.items())
        metadata = getattr(obj, "_metadata", None)     # state_dict() version metadata
        if metadata is not None:
            try:
                out._metadata = metadata
            except AttributeError:
                pass
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
