"""The planning half of re-planning (``compile(..., replan="auto")``; the check, the decision and the
switch are ``autopar.runtime.replan``'s): from a measured step profile, calibration factors per device
type, the current plan re-priced and the plan re-planned on the calibrated costs.

Terms
- factors: relative to the cost tables the plan was priced with (``costs``), so they apply on top of
  them (``calibrated``) without compounding. Each device *type* gets its own: forward, backward and
  optimizer all take the type's compute ratio (below), so a device slower than declared
  (``actual_speed``) gets factors near declared / actual speed on every compute term; the per-call
  overhead is ``autopar.cost.calibrate.fit_factors``' over the profile's samples; links keep the
  cluster's (and this machine's) figures. One ratio for every compute term, not a factor fitted per
  term: a check reads a few steps, and per-term fits from them are noisy (in a loaded test run the
  per-term factors priced a 2x slower device's re-plan 0.1% faster than the plan it had, and kept it).
- compute ratio of a device type: its measured over predicted seconds of all its compute phases
  (forward, backward, undivided compute and optimizer; sleep folded in); relative ratio: that over the
  least ratio of any type, so an error of the cost model common to every device (tables measured under
  other load, roofline tables) cancels and what is left is how much slower than the others a type
  runs than declared. ``slow``: the types whose relative ratio is past ``detect_ratio``
  (``slow_devices``). All the compute, not forward + backward alone: a device slower than declared is
  slower in every phase, and an emulated clock repays in later blocks (less sleep) what a block
  overran on a loaded host (``autopar.runtime.emulate``, debt), which moves time between phases of a
  step but keeps their sum. Forward + backward alone missed a 2x slower device in CI (threaded
  ranks, two test workers on two cores).
- current plan re-priced (``current_s``): a data-parallel plan re-planned with its batch shares and
  ZeRO stage pinned (the planner prices it on the calibrated costs); any other plan, the busiest
  rank's calibrated phases (``autopar.cost.step.predicted_phases``, waits left out): a lower bound.
- re-planned (``proposed_s``): the planner with the job's own options on the calibrated costs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from autopar.config import DP_STRATEGIES
from autopar.cost.calibrate import calibrated, fit_factors, samples
from autopar.cost.step import predicted_phases
from autopar.ir.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["propose", "compute_ratios", "slow_devices"]

_SPEED = ("forward", "backward", "optimizer")      # the terms a type's compute ratio scales
_COMPUTE = ("forward", "backward", "compute", "optimizer")


def slow_devices(compute_ratios: dict[str, float], detect_ratio: float) -> dict[str, float]:
    """The device types whose measured / predicted compute is more than ``detect_ratio`` times the least
    such ratio of any type (see the module docstring), each with that relative ratio."""
    least = min(compute_ratios.values(), default=1.0)
    return {t: f / least for t, f in compute_ratios.items() if f / least > detect_ratio}


def compute_ratios(profile, cluster: "Cluster") -> dict[str, float]:
    """Per device type, measured / predicted seconds of the compute phases (``_COMPUTE``) over the
    profile's ranks (see the module docstring)."""
    acc: dict[str, list[float]] = {}
    for info in profile.ranks:
        pred = info.predicted or {}
        p = sum(pred.get(k, 0.0) for k in _COMPUTE)
        if pred.get("forward", 0.0) + pred.get("backward", 0.0) + pred.get("compute", 0.0) <= 0:
            continue          # an idle rank: nothing to compare
        m = profile.measured(info.rank)
        a = acc.setdefault(cluster.devices[info.rank].spec.name, [0.0, 0.0])
        a[0] += sum(m.get(k, 0.0) for k in _COMPUTE)
        a[1] += p
    return {t: m / p for t, (m, p) in acc.items()}


def propose(profile, plan: Plan, costs, cluster: "Cluster", global_batch: int, config,
            plan_fn: Callable, *, detect_ratio: float = 1.25) -> dict:
    """The fields of rank 0's ``autopar.runtime.replan.Proposal`` for ``profile``, measured under
    ``plan`` priced with ``costs`` on ``cluster`` (the cluster as planned, with this machine's figures
    attached: ``autopar.measure.machine.machine_cluster``; see the module docstring); ``plan_fn(costs,
    cluster, global_batch, config) -> Plan`` is the planner with its options (``config``: a
    ``PlanConfig``), on that cluster as given."""
    keys = {d.rank: d.spec.name for d in cluster.devices}
    fitted = fit_factors(samples(profile, keys, plan))
    ratios = compute_ratios(profile, cluster)
    factors = {t: {**({"call": f["call"]} if "call" in f else {}),
                   **({k: ratios[t] for k in _SPEED} if t in ratios else {})} for t, f in fitted.items()}
    for t, r in ratios.items():
        factors.setdefault(t, {k: r for k in _SPEED})
    cal = calibrated(costs, factors, {t: t for t in costs.device_types})
    slow = slow_devices(ratios, detect_ratio)
    current_s = _repriced(plan, cal, cluster, global_batch, config, plan_fn)
    new = plan_fn(cal, cluster, global_batch, config)
    return dict(factors=factors, slow=slow, current_s=float(current_s),
                proposed_s=float(new.predicted.step_time_s), plan_json=new.to_json(), strategy=new.strategy,
                rank_batch=dict(new.rank_batch), costs=cal)


def _repriced(plan: Plan, cal, cluster, global_batch: int, config, plan_fn) -> float:
    if plan.strategy in DP_STRATEGIES and plan.num_stages == 1:
        try:
            pinned = config.with_(strategy=plan.strategy, dp_batch=dict(plan.rank_batch), zero_stage=plan.zero_stage,
                                  pin=None)
            return float(plan_fn(cal, cluster, global_batch, pinned).predicted.step_time_s)
        except Exception:  # noqa: BLE001 - a pin the planner cannot meet: the lower bound below
            pass
    phases = predicted_phases(plan, cal, cluster)
    return max(sum(v for k, v in d.items() if k != "wait") for d in phases.values())
