"""The planner's one entry point: a ``PlanConfig`` and prepared cost tables in, a ``Plan`` with its
bounds out. ``autopar.api`` builds the config from the user's arguments and calls ``plan_with_config``.

Terms
- resolved strategy: ``PlanConfig.resolved_strategy`` (``auto`` with pinned batch shares is ``dp``,
  with pinned layers ``pp``); it picks the planner: ``autopar.planner.dp`` for the data-parallel
  strategies, ``autopar.planner.joint.plan_strategy`` for ``pp``/``uniform-pp``/``tp``, the joint
  search ``plan_auto`` for ``auto``; a ``PlanConfig.pin`` goes to ``autopar.planner.pins.plan_pinned``
  (that strategy's search restricted to the pin).
- bounds: ``autopar.planner.bounds.with_all_bounds``, the one definition of the upper bound, the
  compute bound and the efficiency every plan the user sees carries. Their planner searches do not
  depend on the plan, so they start first (``autopar.planner.bound_worker``: in a second process on a
  large cluster when a second CPU is there) and the main search runs meanwhile.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from autopar.config import DP_STRATEGIES, PP_STRATEGIES, PlanConfig
from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan
from autopar.ir.pauses import gc_paused
from autopar.planner.bound_worker import start_bound_searches
from autopar.planner.bounds import with_all_bounds
from autopar.planner.dp import plan_dp
from autopar.planner.joint import plan_auto, plan_strategy
from autopar.planner.pins import plan_pinned

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["plan_with_config", "check_request"]


def check_request(cluster: "Cluster", global_batch: int) -> None:
    """``PlanError`` naming the argument unless the global batch is a positive integer and the cluster
    has a device: what every planning call checks before any costly work."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global_batch_size: {global_batch!r} is not a positive integer")
    if len(cluster) < 1:
        raise PlanError("cluster: has no devices")


def plan_with_config(costs: ModelCosts, cluster: "Cluster", global_batch: int, config: PlanConfig, *,
                     timings: dict | None = None) -> Plan:
    """Run the planner of ``config.resolved_strategy`` on ``costs`` and attach the bounds.

    ``timings``, when given, receives the wall seconds of the planner (``plan_s``) and of the bounds
    (``bounds_s``: the planner run again on each device type alone and on the homogeneous cluster;
    when ``bound_worker.side_process_worthwhile(cluster)`` those ran in a second process during the
    main search and ``bounds_s`` is only what was left to wait for after it). Raises ``PlanError``
    naming the argument when the global batch or the cluster cannot be planned, or when nothing fits."""
    check_request(cluster, global_batch)
    if not isinstance(config, PlanConfig):
        raise PlanError(f"config: {config!r} is not a PlanConfig")
    start = time.perf_counter()
    strategy = config.resolved_strategy
    tp_kw: dict = dict(num_heads=config.num_heads)
    if config.replicated_fraction is not None:
        tp_kw["replicated_fraction"] = config.replicated_fraction
    bound_kw = dict(schedule=config.schedule, recompute=config.recompute, memory_fraction=config.memory_fraction,
                    **tp_kw)
    with gc_paused():   # the searches make many small objects; a collection would walk torch's too
        searched, cancel, _side = start_bound_searches(costs, cluster, global_batch, **bound_kw)
        try:
            p = _plan(costs, cluster, global_batch, config, strategy, tp_kw)
        except BaseException:
            cancel()
            raise
        planned = time.perf_counter()
        p = with_all_bounds(p, costs, cluster, global_batch, searched=searched(), **bound_kw)
    if timings is not None:
        timings.update(plan_s=planned - start, bounds_s=time.perf_counter() - planned)
    return p


def _plan(costs: ModelCosts, cluster: "Cluster", global_batch: int, config: PlanConfig, strategy: str,
          tp_kw: dict) -> Plan:
    """The plan of ``config``'s planner, without bounds."""
    common = dict(zero_stage=config.zero_stage, recompute=config.recompute, memory_fraction=config.memory_fraction)
    if config.pin is not None:
        return plan_pinned(costs, cluster, global_batch, config)
    if strategy in DP_STRATEGIES:
        return plan_dp(costs, cluster, global_batch, strategy=strategy, dp_batch=config.dp_batch_map, **common)
    if strategy in PP_STRATEGIES:
        return plan_strategy(costs, cluster, global_batch, strategy, schedule=config.schedule,
                             pp_layers=config.pp_layers, **common)
    if strategy == "tp":
        return plan_strategy(costs, cluster, global_batch, "tp", schedule=config.schedule, **common, **tp_kw)
    return plan_auto(costs, cluster, global_batch, schedule=config.schedule, **common, **tp_kw)
