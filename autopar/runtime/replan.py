"""Re-planning from measurements (``compile(..., replan="auto")``, api.md): after a few steps the job
compares what it measured with what its plan predicted, re-plans with the calibrated costs, and, when
another plan is predicted faster by more than the cost of switching, switches to it in place.

Terms
- check step (``ReplanPolicy.check_after``): the step after which the job looks, once; the first
  ``warmup`` steps are left out of the profile it looks at (emulated clocks settle, caches warm).
- proposal (``Proposal``): what rank 0 works out from the profile (``autopar.planner.replan.propose``:
  calibration factors from the measured phases, the plan re-planned on the calibrated costs):
  the device types whose compute, measured over predicted, runs more than ``ReplanPolicy.detect_ratio``
  times that of the type closest to its prediction (``slow``: ``autopar.planner.replan.slow_devices``),
  the current plan's step re-priced on the calibrated costs
  (``current_s``), the new plan (JSON) and its predicted step (``proposed_s``).
- switch cost (``switch_cost_s``): saving this rank's state, building the new plan's engine (measured:
  as long as this rank's ``compile`` took) and loading the state resharded: ``state_bytes`` written and
  read at ``ReplanPolicy.copy_Bps``, plus the build. The largest over ranks counts.
- decision (``decide``): switch when the new plan is faster by at least ``min_gain`` of the current
  step and the time it saves over the ``horizon_steps`` that follow is more than the switch cost.
- switch (``Replanner.switch``): ``compiled.save`` into a temporary directory (rank 0 makes it and
  tells the others: the ranks share this machine's file system), the new plan's engine built by
  ``rebuild(plan)`` inside the same processes, ``load`` of the saved state resharded onto it
  (``autopar.runtime.checkpointing``), and the compiled job takes the new engine, plan and meter: the
  same ``Compiled`` object continues exactly.
- report (``ReplanReport``): what was detected and decided, on every rank; ``Compiled.replans``.

The calibration the check fits is applied to this job's re-plan only; it is not written to the
profile cache (a throttled device of one run is not this machine's device type for the next one).

Emulation: ``actual_speed`` in the cluster file (``autopar.cluster.schema``) makes an emulated device
run slower than the speed the planner sees, which is how this is shown and tested on one machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.errors import PlanError

__all__ = ["REPLAN_MODES", "ReplanPolicy", "Proposal", "ReplanReport", "decide", "switch_cost_s", "adopt",
           "Replanner"]

REPLAN_MODES = ("off", "auto")


@dataclass(frozen=True, slots=True)
class ReplanPolicy:
    """When and how eagerly a job re-plans (see the module docstring)."""
    check_after: int = 4          # look after this many steps (within api.md's five)
    warmup: int = 1               # steps left out of the profile looked at
    detect_ratio: float = 1.25    # measured / predicted compute beyond this (or below its inverse): detected
    min_gain: float = 0.05        # the new plan must be at least this much faster per step
    horizon_steps: int = 500      # steps the gain is counted over against the switch cost (the job's rest)
    copy_Bps: float = 500e6       # bytes per second a rank saves and loads its state at

    def __post_init__(self):
        if not (isinstance(self.check_after, int) and isinstance(self.warmup, int)
                and 0 <= self.warmup < self.check_after):
            raise PlanError(f"ReplanPolicy.check_after/warmup: {self.check_after!r}/{self.warmup!r} must be "
                            "integers with 0 <= warmup < check_after")
        if not self.detect_ratio > 1:
            raise PlanError(f"ReplanPolicy.detect_ratio: {self.detect_ratio!r} must be > 1")
        if not 0 <= self.min_gain < 1:
            raise PlanError(f"ReplanPolicy.min_gain: {self.min_gain!r} must be in [0, 1)")
        if not (isinstance(self.horizon_steps, int) and self.horizon_steps > 0):
            raise PlanError(f"ReplanPolicy.horizon_steps: {self.horizon_steps!r} must be a positive integer")
        if not self.copy_Bps > 0:
            raise PlanError(f"ReplanPolicy.copy_Bps: {self.copy_Bps!r} must be > 0")


@dataclass(frozen=True, slots=True)
class Proposal:
    """Rank 0's reading of the profile (see the module docstring)."""
    factors: dict                 # device type -> {term: factor} from the profile (applied to the re-plan)
    slow: dict                    # device type -> measured / predicted compute, beyond detect_ratio
    current_s: float              # the current plan re-priced on the calibrated costs
    proposed_s: float             # the re-planned plan's predicted step
    plan_json: str | None         # the re-planned plan (None: the planner found nothing)
    strategy: str = ""
    rank_batch: dict = field(default_factory=dict)
    costs: Any = None             # rank 0: the calibrated cost tables (not sent to the other ranks)


@dataclass(frozen=True, slots=True)
class ReplanReport:
    """What a check found and did (see the module docstring)."""
    step: int
    slow: dict
    measured_step_s: float        # the median measured step over the steps looked at
    current_s: float
    proposed_s: float
    switch_cost_s: float
    switched: bool
    reason: str
    old_rank_batch: dict = field(default_factory=dict)
    new_rank_batch: dict = field(default_factory=dict)
    switch_s: float = 0.0         # measured: how long the switch took on this rank

    def summary(self) -> str:
        slow = ", ".join(f"{t} x{r:.2f}" for t, r in self.slow.items()) or "none"
        head = (f"replan after step {self.step}: devices off their prediction: {slow}; current plan "
                f"{self.current_s * 1e3:.1f} ms (predicted, calibrated; measured {self.measured_step_s * 1e3:.1f} ms), "
                f"re-planned {self.proposed_s * 1e3:.1f} ms, switch cost {self.switch_cost_s:.2f} s")
        return f"{head}: {'switched' if self.switched else 'kept'} ({self.reason})"


def switch_cost_s(state_bytes: float, build_s: float, policy: ReplanPolicy) -> float:
    """One rank's switch cost (see the module docstring)."""
    return 2 * float(state_bytes) / policy.copy_Bps + float(build_s)


def decide(current_s: float, proposed_s: float, switch_s: float, policy: ReplanPolicy) -> tuple[bool, str]:
    """Whether to switch, and why (see the module docstring). Pure."""
    if not proposed_s < current_s:
        return False, "no faster plan"
    gain = current_s - proposed_s
    if gain < policy.min_gain * current_s:
        return False, f"gain {gain / current_s:.1%} per step is under {policy.min_gain:.0%}"
    saved = gain * policy.horizon_steps
    if saved <= switch_s:
        return False, f"{saved:.2f} s saved over {policy.horizon_steps} steps is not more than the switch"
    return True, f"{gain / current_s:.1%} faster per step, {saved:.2f} s saved over {policy.horizon_steps} steps"


class Replanner:
    """The check and the switch of one compiled job (see the module docstring).

    ``propose(profile) -> Proposal`` runs on rank 0 (it holds the cost tables); ``rebuild(plan_json) ->
    Compiled`` builds the new plan's engine on every rank (``compile`` with the plan given); ``build_s``
    is how long this rank's compile took."""

    def __init__(self, policy: ReplanPolicy, propose: Callable[[Any], Proposal],
                 rebuild: Callable[[str], Any], build_s: float):
        self.policy = policy
        self.propose = propose
        self.rebuild = rebuild
        self.build_s = float(build_s)
        self.done = False

    def after_step(self, compiled) -> ReplanReport | None:
        """Called by ``Compiled.step`` on every rank after each step: the check, once, at its step."""
        if self.done or compiled.step_count < self.policy.check_after:
            return None
        self.done = True
        from autopar.runtime.communicator import pg_all_gather_objects, pg_broadcast_objects
        from autopar.runtime.state import engine_pieces

        steps = self.policy.check_after - self.policy.warmup
        profile = compiled.profile(last=steps)
        payload: list = [None]
        costs = None
        if compiled.rank == 0:
            try:
                prop = self.propose(profile)
                costs = prop.costs
                payload = [replace(prop, costs=None)]
            except Exception as exc:  # noqa: BLE001 - every rank must learn the same outcome
                payload = [exc]
        pg_broadcast_objects(payload)
        state_bytes = sum(p.tensor.numel() * p.tensor.element_size() for p in engine_pieces(compiled.engine))
        cost = max(pg_all_gather_objects(switch_cost_s(state_bytes, self.build_s, self.policy)))
        times = sorted(profile.step_times_s())
        measured = times[len(times) // 2] if times else 0.0
        prop = payload[0]
        old_batch = dict(compiled.plan.rank_batch)
        if isinstance(prop, BaseException):
            report = ReplanReport(compiled.step_count, {}, measured, 0.0, 0.0, cost, False,
                                  f"re-planning failed: {str(prop)[:200]}", old_batch)
        else:
            go, why = decide(prop.current_s, prop.proposed_s, cost, self.policy) if prop.plan_json else \
                (False, "the planner found no plan")
            report = ReplanReport(compiled.step_count, dict(prop.slow), measured, prop.current_s, prop.proposed_s,
                                  cost, go, why, old_batch, dict(prop.rank_batch))
            if go:
                t0 = time.perf_counter()
                self.switch(compiled, prop.plan_json)
                compiled.costs = costs          # rank 0: profile() now predicts with the calibrated tables
                report = replace(report, switch_s=time.perf_counter() - t0)
        compiled.replans.append(report)
        return report

    def switch(self, compiled, plan_json: str) -> None:
        """Move ``compiled`` onto the plan ``plan_json`` in place (see the module docstring)."""
        from autopar.runtime.communicator import pg_barrier, pg_broadcast_objects

        # inside a private directory (mkdtemp: 0700, a name no one can guess), so the save's own
        # temporaries beside its target are private too
        where = [tempfile.mkdtemp(prefix="autopar-replan-") if compiled.rank == 0 else None]
        pg_broadcast_objects(where)
        state = os.path.join(where[0], "state")
        try:
            compiled.save(state)
            fresh = self.rebuild(plan_json)
            fresh.load(state)
            adopt(compiled, fresh)
            pg_barrier()
        finally:
            if compiled.rank == 0:
                shutil.rmtree(where[0], ignore_errors=True)


def adopt(compiled, fresh) -> None:
    """``compiled`` takes ``fresh``'s plan, engine, meter and cost tables (its own history stays)."""
    step_count = compiled.step_count
    for name in ("plan", "engine", "memory", "costs"):
        setattr(compiled, name, getattr(fresh, name))
    compiled.step_count = step_count
