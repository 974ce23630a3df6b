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
  depend on the plan, so they start first (``bounds=``: the API layer hands
  ``autopar.planning.side_bounds.start_bound_searches``, side processes on a large cluster when a second
  CPU is there) and the main search runs meanwhile.
- pure: the planner opens no file, starts no process and reads no clock or environment variable;
  what it needs of this machine is handed in (``bounds=``, ``cache=``, ``clock=``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from autopar.config import DP_STRATEGIES, PP_STRATEGIES, PlanConfig
from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan
from autopar.ir.pauses import gc_paused
from autopar.planner.bounds import BOUND_PARTS, bound_searches, bounds_from_main, repeats_main, with_all_bounds
from autopar.planner.cache import PlanStore
from autopar.planner.dp import plan_dp
from autopar.planner.joint import plan_auto, plan_strategy
from autopar.planner.pins import plan_pinned

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["plan_with_config", "check_request", "in_process_bounds"]


def check_request(cluster: "Cluster", global_batch: int) -> None:
    """``PlanError`` naming the argument unless the global batch is a positive integer and the cluster
    has a device: what every planning call checks before any costly work."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global_batch_size: {global_batch!r} is not a positive integer")
    if len(cluster) < 1:
        raise PlanError("cluster: has no devices")


def in_process_bounds(costs: ModelCosts, cluster: "Cluster", global_batch: int, *, parts=BOUND_PARTS,
                      **plan_kw) -> tuple[Callable[[], tuple], Callable[[], None], bool]:
    """The bounds' searches (those of ``parts``) run in this process when asked (``plan_with_config``'s
    default ``bounds``): (``result()``, ``cancel()``, False)."""
    part = "all" if set(parts) == set(BOUND_PARTS) else parts[0]
    return (lambda: bound_searches(costs, cluster, global_batch, part=part, **plan_kw)), (lambda: None), False


def plan_with_config(costs: ModelCosts, cluster: "Cluster", global_batch: int, config: PlanConfig, *,
                     timings: dict | None = None, clock: Callable[[], float] | None = None,
                     bounds: Callable = in_process_bounds, cache: PlanStore | None = None) -> Plan:
    """Run the planner of ``config.resolved_strategy`` on ``costs`` and attach the bounds.

    ``bounds(costs, cluster, global_batch, **plan_kw) -> (result(), cancel(), side)`` starts the bounds'
    searches (``autopar.planner.bounds.bound_searches``) before the main search; ``cache``: where the
    joint planner keeps its plans (``autopar.planner.cache.PlanStore``; None: nowhere). ``timings``,
    when given with a ``clock`` (seconds, e.g. ``time.perf_counter``), receives the seconds of the
    planner (``plan_s``) and of the bounds (``bounds_s``: the planner run again on each device type
    alone and on the homogeneous cluster; what was left to wait for after the main search when
    ``bounds`` ran them elsewhere). Raises ``PlanError`` naming the argument when the global batch or
    the cluster cannot be planned, or when nothing fits."""
    check_request(cluster, global_batch)
    if not isinstance(config, PlanConfig):
        raise PlanError(f"config: {config!r} is not a PlanConfig")
    if timings is not None and clock is None:
        raise PlanError("timings: given without a clock to time the planner with")
    start = clock() if clock is not None else 0.0
    strategy = config.resolved_strategy
    tp_kw: dict = dict(num_heads=config.num_heads)
    if config.replicated_fraction is not None:
        tp_kw["replicated_fraction"] = config.replicated_fraction
    bound_kw = dict(schedule=config.schedule, recompute=config.recompute, memory_fraction=config.memory_fraction,
                    cache=cache, **tp_kw)
    # On one device type the bounds' searches are the main one's (``bounds.repeats_main``): only the
    # upper bound's plan that keeps every activation is searched apart, and only when the main may recompute.
    reuse = strategy == "auto" and config.pin is None and config.zero_stage == "auto" and repeats_main(cluster)
    with gc_paused():   # the searches make many small objects; a collection would walk torch's too
        if not reuse:
            searched, cancel, _side = bounds(costs, cluster, global_batch, **bound_kw)
        elif config.recompute:
            searched, cancel, _side = bounds(costs, cluster, global_batch, parts=("upper",),
                                             **{**bound_kw, "recompute": False})
        else:
            searched, cancel = (lambda: None), (lambda: None)
        try:
            p = _plan(costs, cluster, global_batch, config, strategy, tp_kw, cache)
        except BaseException:
            cancel()
            raise
        planned = clock() if clock is not None else 0.0
        found = bounds_from_main(p, costs, cluster, global_batch, searched(), **bound_kw) if reuse else searched()
        p = with_all_bounds(p, costs, cluster, global_batch, searched=found, **bound_kw)
    if timings is not None:
        timings.update(plan_s=planned - start, bounds_s=clock() - planned)
    return p


def _plan(costs: ModelCosts, cluster: "Cluster", global_batch: int, config: PlanConfig, strategy: str,
          tp_kw: dict, cache: PlanStore | None) -> Plan:
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
    return plan_auto(costs, cluster, global_batch, schedule=config.schedule, cache=cache, **common, **tp_kw)
