"""The planning half of re-planning (``compile(..., replan="auto")``; the check, the decision and the
switch are ``autopar.runtime.replan``'s): from a measured step profile, calibration factors per device
type, the current plan re-priced and the plan re-planned on the calibrated costs.

Terms
- factors: ``autopar.cost.calibrate.fit_factors`` over the profile's samples, relative to the cost
  tables the plan was priced with (``costs``), so they apply on top of them (``calibrated``) without
  compounding. Each device *type* gets its own: a device slower than declared (``actual_speed``) gets
  forward and backward factors near declared / actual speed. The terms applied: forward, backward,
  optimizer and the per-call overhead; links keep the cluster's (and this machine's) figures.
- compute ratio of a device type: its measured over predicted forward + backward seconds; relative
  ratio: that over the least ratio of any type, so an error of the cost model common to every device
  (tables measured under other load, roofline tables) cancels and what is left is how much slower
  than the others a type runs than declared. ``slow``: the types whose relative ratio is past
  ``detect_ratio`` (``slow_devices``).
- current plan re-priced (``current_s``): a data-parallel plan re-planned with its batch shares and
  ZeRO stage pinned (the planner prices it on the calibrated costs); any other plan, the busiest
  rank's calibrated phases (``autopar.cost.step.predicted_phases``, waits left out): a lower bound.
- re-planned (``proposed_s``): the planner with the job's own options on the calibrated costs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from autopar.config import DP_STRATEGIES
from autopar.cost.calibrate import calibrated, calibrated_cluster, fit_factors, samples
from autopar.cost.step import predicted_phases
from autopar.ir.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["propose", "compute_ratios", "slow_devices"]

_APPLIED = ("forward", "backward", "optimizer", "call")


def slow_devices(compute_ratios: dict[str, float], detect_ratio: float) -> dict[str, float]:
    """The device types whose measured / predicted compute is more than ``detect_ratio`` times the least
    such ratio of any type (see the module docstring), each with that relative ratio."""
    least = min(compute_ratios.values(), default=1.0)
    return {t: f / least for t, f in compute_ratios.items() if f / least > detect_ratio}


def compute_ratios(profile, cluster: "Cluster") -> dict[str, float]:
    """Per device type, measured / predicted forward + backward seconds over the profile's ranks."""
    acc: dict[str, list[float]] = {}
    for info in profile.ranks:
        pred = info.predicted or {}
        p = pred.get("forward", 0.0) + pred.get("backward", 0.0)
        if p <= 0:
            continue
        m = profile.measured(info.rank)
        acc.setdefault(cluster.devices[info.rank].spec.name, [0.0, 0.0])
        a = acc[cluster.devices[info.rank].spec.name]
        a[0] += m.get("forward", 0.0) + m.get("backward", 0.0) + m.get("compute", 0.0)
        a[1] += p
    return {t: m / p for t, (m, p) in acc.items()}


def propose(profile, plan: Plan, costs, cluster: "Cluster", global_batch: int, config,
            plan_fn: Callable, *, detect_ratio: float = 1.25) -> dict:
    """The fields of rank 0's ``autopar.runtime.replan.Proposal`` for ``profile``, measured under
    ``plan`` priced with ``costs`` on ``cluster`` (see the module docstring); ``plan_fn(costs, cluster,
    global_batch, config) -> Plan`` is the planner with its options (``config``: a ``PlanConfig``)."""
    keys = {d.rank: d.spec.name for d in cluster.devices}
    fitted = fit_factors(samples(profile, keys, plan))
    factors = {t: {k: v for k, v in f.items() if k in _APPLIED} for t, f in fitted.items()}
    cal = calibrated(costs, factors, {t: t for t in costs.device_types})
    ratios = compute_ratios(profile, cluster)
    slow = slow_devices(ratios, detect_ratio)
    current_s = _repriced(plan, cal, cluster, global_batch, config, plan_fn)
    new = plan_fn(cal, cluster, global_batch, config)
    return dict(factors=fitted, slow=slow, current_s=float(current_s),
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
    phases = predicted_phases(plan, cal, calibrated_cluster(cluster))
    return max(sum(v for k, v in d.items() if k != "wait") for d in phases.values())
