"""Elastic runs: periodic checkpoints, resuming from the newest one, and the cluster in force.

Terms (docs/elastic.md has the whole story)
- checkpoint policy: ``compile(..., checkpoint_dir=DIR, checkpoint_every=K)``, validated once
  (``checkpoint_policy``). After every step whose count ``compiled.step_count`` is a multiple of K,
  every rank saves into ``DIR/step-<count>`` (``step_path``: the naming ``autopar.checkpoint.store.latest``
  reads). Without ``checkpoint_every`` nothing is saved periodically, but compile still resumes.
  ``checkpoint_keep=N``: after each save rank 0 keeps the newest N and removes older ones and what
  interrupted saves left (``store.retain``).
- resume: at the end of ``compile``, rank 0 looks for the newest valid checkpoint in DIR
  (``store.latest``: a save that was interrupted or damaged does not count) and broadcasts its
  choice, so every rank loads the same one; ``compiled.load`` then reshards it onto the new plan and
  restores the step count, so a training loop written as ``for s in range(compiled.step_count, steps)``
  re-does exactly the steps lost since that checkpoint.
- cluster in force: the full cluster less the devices that failed (``autopar.runtime.launcher``'s
  present-devices rule). ``current_cluster()`` returns it inside a rank; ``compile`` given the full
  cluster plans for the cluster in force (``cluster_in_force``), so the same ``train`` re-plans after a
  restart whether it passes ``autopar.current_cluster()`` or the cluster it was launched with.
- attempt: ``restart_count()``, 0 for the first; under ``autopar.launch`` from AUTOPAR_RESTART_COUNT,
  under torchrun from TORCHELASTIC_RESTART_COUNT.
- resume record (``Resume``): where a compiled model resumed from, at which step, and the wall seconds
  the load took; ``compiled.elastic.resumed`` (None on a fresh start), for the restart's time split.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from autopar import env
from autopar.errors import LaunchError, PlanError
from autopar.runtime import launcher

__all__ = ["CheckpointPolicy", "Resume", "Elastic", "checkpoint_policy", "step_path", "current_cluster",
           "restart_count", "stopped_at", "cluster_in_force", "attach"]


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """Where and how often a compiled model saves itself, and how many of its checkpoints it keeps."""
    directory: Path
    every: int | None         # save after each step whose count is a multiple of this; None: never
    keep: int | None = None   # after each save, keep the newest this many (``store.retain``); None: all


@dataclass(frozen=True, slots=True)
class Resume:
    path: Path                # the checkpoint loaded
    step: int                 # compiled.step_count after loading it
    load_s: float             # wall seconds of compiled.load


def checkpoint_policy(checkpoint_dir, checkpoint_every, checkpoint_keep=None) -> CheckpointPolicy | None:
    """The validated policy of compile's ``checkpoint_dir`` / ``checkpoint_every`` / ``checkpoint_keep``
    (None: none of them)."""
    if checkpoint_dir is None:
        for name, value in (("checkpoint_every", checkpoint_every), ("checkpoint_keep", checkpoint_keep)):
            if value is not None:
                raise PlanError(f"{name}: {value!r} given without checkpoint_dir; say where the checkpoints go")
        return None
    if checkpoint_keep is not None and (isinstance(checkpoint_keep, bool) or not isinstance(checkpoint_keep, int)
                                        or checkpoint_keep < 1):
        raise PlanError(f"checkpoint_keep: {checkpoint_keep!r} must be a positive integer (checkpoints kept) or None")
    try:
        directory = Path(os.fspath(checkpoint_dir))
    except TypeError:
        raise PlanError(f"checkpoint_dir: {checkpoint_dir!r} is not a path") from None
    if directory.exists() and not directory.is_dir():
        raise PlanError(f"checkpoint_dir: {directory} exists and is not a directory")
    if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int)
                                         or checkpoint_every < 1):
        raise PlanError(f"checkpoint_every: {checkpoint_every!r} must be a positive integer (steps) or None")
    return CheckpointPolicy(directory, checkpoint_every, checkpoint_keep)


def step_path(directory, step: int) -> Path:
    """The checkpoint directory of step ``step`` under ``directory`` (what ``store.latest`` finds)."""
    return Path(directory) / f"step-{int(step)}"


def current_cluster():
    """The cluster in force in this rank: the one it was started on less the devices that failed."""
    if not launcher.is_initialized():
        raise LaunchError("current_cluster(): no job is running in this process; call it inside "
                          "autopar.launch's function or after autopar.init(cluster)")
    return launcher.context().cluster


def restart_count() -> int:
    """This attempt's number: 0 for the first run, n after the n-th restart (launch or torchrun)."""
    for name in (launcher.RESTART_ENV, "TORCHELASTIC_RESTART_COUNT"):
        value = env.read(name) if name in env.VARIABLES else os.environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise LaunchError(f"restart_count(): {name}={value!r} is not an integer") from None
    return 0


def stopped_at() -> float | None:
    """``time.time()`` at which ``launch`` stopped the failed attempt before this one (None: first run)."""
    value = env.read(launcher.STOPPED_AT_ENV)
    return float(value) if value else None


def cluster_in_force(cluster):
    """The cluster ``compile`` plans for: the cluster in force when ``cluster`` is the full cluster the
    running job was started on (a restart dropped devices), else ``cluster`` as given."""
    if not launcher.is_initialized():
        return cluster
    ctx = launcher.context()
    if ctx.full_cluster is not None and cluster is not ctx.cluster and cluster == ctx.full_cluster:
        return ctx.cluster
    return cluster


class Elastic:
    """The checkpoint policy of one compiled model and where it resumed from (``compiled.elastic``)."""

    def __init__(self, policy: CheckpointPolicy, resumed: Resume | None = None):
        self.policy = policy
        self.resumed = resumed
        self.saved: list[Path] = []     # checkpoints this compiled model wrote, in order

    def after_step(self, compiled) -> None:
        """Save when the step count reaches a multiple of ``policy.every`` (every rank, collective)."""
        every = self.policy.every
        if every is not None and compiled.step_count % every == 0:
            path = step_path(self.policy.directory, compiled.step_count)
            compiled.save(path)
            self.saved.append(path)
            if self.policy.keep is not None and compiled.rank == 0:   # the save ended with a barrier
                from autopar.checkpoint.store import retain

                retain(self.policy.directory, self.policy.keep)

    def __repr__(self) -> str:
        return (f"Elastic(directory={str(self.policy.directory)!r}, every={self.policy.every}, "
                f"keep={self.policy.keep}, resumed={self.resumed})")


def _newest(directory: Path) -> Path | None:
    """Rank 0's newest complete checkpoint in ``directory``, the same on every rank (broadcast)."""
    from autopar.checkpoint.store import latest
    from autopar.runtime.communicator import pg_broadcast_objects, pg_is_initialized

    rank = launcher.context().rank if launcher.is_initialized() else 0
    found = [None]
    if rank == 0:
        newest = latest(directory)
        found = [None if newest is None else str(newest)]
    if launcher.is_initialized() and launcher.context().world_size > 1 and pg_is_initialized():
        pg_broadcast_objects(found, src=0)
    return None if found[0] is None else Path(found[0])


def attach(compiled, policy: CheckpointPolicy | None):
    """Give ``compiled`` its policy (``compiled.elastic``) and load the newest complete checkpoint in the
    policy's directory, if any. Every rank calls it, at the end of ``compile``; returns ``compiled``."""
    if policy is None:
        return compiled
    resumed = None
    path = _newest(policy.directory)
    if path is not None:
        t0 = time.perf_counter()
        compiled.load(path)
        resumed = Resume(path, int(compiled.step_count), time.perf_counter() - t0)
    compiled.elastic = Elastic(policy, resumed)
    return compiled
