"""What-if pins (``autopar.Pin``): the planner searches every dimension the pin leaves open and returns
the fastest predicted plan that equals the pin, or raises ``PlanError`` naming the pin it cannot meet.

Terms
- dimensions of a plan (``plan_dims``): ``tp`` (the set of TP group sizes, per device type), ``pp``
  (stages), ``dp`` (the set of members per stage), ``num_micro_batches`` (``Plan.num_micro_batches``),
  ``recompute`` (the set of the stages' flags), ``zero_stage``, ``schedule``, ``virtual_stages``
  (1: no plan has more yet), ``sequence_parallel`` (the set of the TP stages' flags).
- meeting a pin (``pin_violation``): every pinned dimension of the plan equals the pin (``tp``: every
  member of that type has that many ranks; ``dp``: every stage that many members; ``recompute``:
  every stage recomputes, none does, or every stage recomputes its attention cores ("selective":
  searched with ``cost.selective.attention_recompute_costs``, whose backward reruns them, keeping every
  activation; the stages are marked ``recompute_attention`` after); ``sequence_parallel``: True, every stage with a TP member runs
  SP and there is one; False, none does).
- the search (``plan_pinned``): the single-dimension strategies that can meet the pin, and the joint
  planner's hybrid search restricted up front: TP layouts of the pinned degree (members of another
  size idle: ``layouts.member_layouts(type_degrees=)``), groupings of the pinned stage and member
  counts (``layouts.pinned_groupings``), the pinned micro-batch count, ZeRO stage and schedule, and
  every stage recomputing when recompute is pinned on. ``sequence_parallel`` False plans with costs that
  carry no SP facts (SP neither priced nor set); True sets SP on every TP stage of the joint search
  that can run it, priced slower or not (``plan_hybrid(force_sequence_parallel=)``), and keeps the plans
  whose every TP stage runs it: where the model's blocks cannot run it, the ``PlanError`` names the pin. Each candidate is checked again with
  ``pin_violation``, so what is returned equals the pin by construction and by check.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING

from autopar.config import DP_STRATEGIES, PP_STRATEGIES, Pin, PlanConfig
from autopar.cost import tp as tp_cost
from autopar.cost.selective import attention_recompute_costs
from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan
from autopar.ir.schedule import ALL_SCHEDULES, PIPELINE_SCHEDULES
from autopar.planner.joint import SINGLE_STRATEGIES, TP_DEGREES, plan_hybrid, plan_strategy
from autopar.planner.layouts import member_groupings, member_layouts, pinned_groupings
from autopar.planner.pp import plan_pipeline
from autopar.planner.pp_virtual import VIRTUAL_COUNTS

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["plan_dims", "pin_violation", "pinned_config", "check_pin", "plan_pinned"]


def plan_dims(plan: Plan, cluster: "Cluster") -> dict:
    """The dimensions of ``plan`` (see the module docstring)."""
    tp: dict[str, set[int]] = {}
    for st in plan.stages:
        for g in st.groups:
            for r in g:
                tp.setdefault(cluster.devices[r].spec.name, set()).add(len(g))
    rank_stages = plan.stages[:getattr(plan, "rank_stages", len(plan.stages))]
    return dict(tp=tp, pp=len(rank_stages), dp={len(st.groups) for st in rank_stages},
                num_micro_batches=plan.num_micro_batches, recompute={st.recompute_mode for st in plan.stages},
                zero_stage=plan.zero_stage, schedule=plan.schedule,
                virtual_stages=int(getattr(plan, "virtual_stages", 1) or 1),
                sequence_parallel={bool(st.sequence_parallel) for st in plan.stages if any(len(g) > 1 for g in st.groups)})


def pin_violation(plan: Plan, pin: Pin, cluster: "Cluster") -> str | None:
    """None when ``plan`` meets every pinned dimension of ``pin``, else which one it misses and how."""
    d = plan_dims(plan, cluster)
    for name, want in pin.fields.items():
        have = d[name]
        if name == "tp":
            for t, sizes in have.items():
                deg = pin.tp_of(t)
                if deg is not None and sizes != {deg}:
                    return f"pin.tp: {t} members have {sorted(sizes)} ranks, pinned {deg}"
            if isinstance(want, int) and not have:
                return "pin.tp: the plan has no members"
        elif name == "sequence_parallel":
            if (want and have != {True}) or (not want and True in have):
                return f"pin.sequence_parallel: the plan's TP stages have {sorted(have) or 'none'}, pinned {want}"
        elif name in ("dp", "recompute"):
            if have != {want}:
                return f"pin.{name}: the plan has {sorted(have)}, pinned {want}"
        elif have != want:
            return f"pin.{name}: the plan has {have}, pinned {want}"
    return None


def pinned_config(config: PlanConfig) -> PlanConfig:
    """``config`` with the pin's ZeRO stage, schedule and recompute moved into its own fields (a pinned
    recompute=False plans without recomputation); ``PlanError`` where the two disagree."""
    pin = config.pin
    if pin is None:
        return config
    changes: dict = {}
    if pin.zero_stage is not None:
        if config.zero_stage not in ("auto", pin.zero_stage):
            raise PlanError(f"pin.zero_stage: {pin.zero_stage} but zero_stage={config.zero_stage!r}")
        changes["zero_stage"] = pin.zero_stage
    if pin.schedule is not None:
        if config.schedule not in ("auto", pin.schedule):
            raise PlanError(f"pin.schedule: {pin.schedule!r} but schedule={config.schedule!r}")
        changes["schedule"] = pin.schedule
    if pin.recompute is not None:
        changes["recompute"] = pin.recompute
    return config.with_(**changes) if changes else config


def check_pin(pin: Pin, costs: ModelCosts, cluster: "Cluster", global_batch: int,
              num_heads: int | None = None) -> None:
    """``PlanError`` naming the pin when no plan can meet it whatever the memory (before any search)."""
    n = len(cluster)
    units = num_heads if num_heads is not None else tp_cost.DEFAULT_NUM_UNITS
    node_sizes: dict[str, int] = {}      # per type: the most devices of it on one node
    for (_, name), size in Counter((d.node, d.spec.name) for d in cluster.devices).items():
        node_sizes[name] = max(node_sizes.get(name, 0), size)
    if isinstance(pin.tp, tuple):
        unknown = [t for t, _ in pin.tp if t not in node_sizes]
        if unknown:
            raise PlanError(f"pin.tp: no device of type {unknown} in the cluster (types {sorted(node_sizes)})")
    for t, size in node_sizes.items():
        deg = pin.tp_of(t)
        if deg is not None and deg > size:
            raise PlanError(f"pin.tp: degree {deg} for {t}, but its nodes hold at most {size} devices "
                            "(tensor-parallel groups stay inside a node)")
        if deg is not None and deg > units:
            raise PlanError(f"pin.tp: degree {deg} exceeds the model's {units} attention heads (shard units)")
    if pin.pp is not None and pin.pp > costs.num_blocks:
        raise PlanError(f"pin.pp: {pin.pp} stages but the model has {costs.num_blocks} blocks")
    least_tp = min((pin.tp_of(t) or 1) for t in node_sizes)
    used = least_tp * (pin.pp or 1) * (pin.dp or 1)
    if used > n:
        raise PlanError(f"pin: tp x pp x dp needs at least {used} devices ({pin}); the cluster has {n}")
    if pin.num_micro_batches is not None and pin.num_micro_batches > global_batch:
        raise PlanError(f"pin.num_micro_batches: {pin.num_micro_batches} micro-batches of a global batch of "
                        f"{global_batch} samples")
    if pin.dp is not None and pin.dp > global_batch:
        raise PlanError(f"pin.dp: {pin.dp} members per stage cannot all get work from {global_batch} samples")
    if pin.schedule is not None and pin.schedule not in ALL_SCHEDULES:
        raise PlanError(f"pin.schedule: the planner cannot plan {pin.schedule!r} (it plans "
                        f"{', '.join(ALL_SCHEDULES)})")
    if getattr(pin, "sequence_parallel", None) and pin.tp == 1:
        raise PlanError("pin.sequence_parallel: sequence parallelism needs tensor parallelism, but pin.tp is 1")
    if getattr(pin, "sequence_parallel", None) and not _sp_possible(costs):
        raise PlanError("pin.sequence_parallel: no block of the model can run sequence parallelism "
                        "(cost.tp.sp_blocks: no Linear pair with a token-wise region, or tables without SP facts)")
    if _pipeline_only(pin) and pin.tp not in (None, 1):
        raise PlanError(f"pin.schedule: {pin.schedule!r} is planned by the pipeline planner only so far, "
                        f"whose members are single devices; it cannot also pin {pin}")
    if _interleaved(pin) and pin.schedule not in (None, "interleaved-1f1b"):
        raise PlanError(f"pin.virtual_stages: {pin.virtual_stages} chunks per rank stage need "
                        f"schedule='interleaved-1f1b', not {pin.schedule!r}")
    if _interleaved(pin) and pin.pp == 1:
        raise PlanError("pin.virtual_stages: an interleaved schedule needs pp >= 2 rank stages, but pin.pp is 1")


def _layers_violation(plan: Plan, pp_layers) -> str | None:
    """None when ``plan``'s rank stages hold the pinned ``pp_layers`` (chunks of a rank stage summed)."""
    if pp_layers is None:
        return None
    R = getattr(plan, "rank_stages", len(plan.stages))
    have = tuple(sum(st.num_layers for st in plan.stages[r::R]) for r in range(R))
    return None if have == tuple(pp_layers) else f"pp_layers: the plan has {list(have)}, pinned {list(pp_layers)}"


def _sp_possible(costs: ModelCosts) -> bool:
    sp = tp_cost.sp_blocks(costs)
    return sp is not None and bool(sp.any())


def _pipeline_only(pin: Pin) -> bool:
    """Whether only the pipeline planner can meet the pin (schedules the joint search lacks so far:
    zero-bubble)."""
    return pin.schedule is not None and pin.schedule not in PIPELINE_SCHEDULES and not _interleaved(pin)


def _interleaved(pin: Pin) -> bool:
    """Whether the pin asks for an interleaved pipeline (several chunks per rank stage)."""
    return pin.schedule == "interleaved-1f1b" or (pin.virtual_stages or 1) > 1


def _single_could_meet(strategy: str, pin: Pin) -> bool:
    one = (None, 1)
    if getattr(pin, "sequence_parallel", None) and (strategy in DP_STRATEGIES or strategy in PP_STRATEGIES):
        return False                    # members of one device: no TP stage to run SP
    if _pipeline_only(pin) or _interleaved(pin):
        return strategy in PP_STRATEGIES and pin.tp in one and pin.dp in one
    if strategy in DP_STRATEGIES:
        return pin.pp in one and pin.tp in one and pin.schedule is None
    if strategy in PP_STRATEGIES:
        return pin.tp in one and pin.dp in one
    return pin.pp in one and pin.dp in one     # tp: one group of every rank


class _Best:
    """The fastest plan offered that meets the pin, and why the others did not."""

    def __init__(self, pin, cluster, pp_layers):
        self.pin, self.cluster, self.pp_layers = pin, cluster, pp_layers
        self.plan: Plan | None = None
        self.misses: list[str] = []

    def offer(self, p: Plan) -> None:
        why = pin_violation(p, self.pin, self.cluster) or _layers_violation(p, self.pp_layers)
        if why is not None:
            self.misses.append(why)
        elif self.plan is None or p.predicted.step_time_s < self.plan.predicted.step_time_s:
            self.plan = p


def _offer_singles(found: "_Best", costs, cluster, global_batch: int, cfg: PlanConfig, pin, strategy: str,
                   common: dict) -> None:
    """Offer the plan of every single strategy that could meet the pin (an interleaved or pipeline-only
    pin plans the pipeline at its schedule and chunk count)."""
    may_recompute = common["recompute"]
    singles = SINGLE_STRATEGIES if strategy == "auto" else (strategy,)
    for s in singles:
        if not _single_could_meet(s, pin) or (cfg.pp_layers is not None and s not in PP_STRATEGIES):
            continue
        try:
            if (_pipeline_only(pin) or _interleaved(pin)) and s == "pp":
                v = pin.virtual_stages if (pin.virtual_stages or 1) > 1 else None
                sched = pin.schedule or "interleaved-1f1b"
                found.offer(plan_pipeline(costs, cluster, global_batch, schedule=sched, schedules=(sched,),
                                          virtual_stages=v, zero_stage=0 if cfg.zero_stage == "auto" else cfg.zero_stage,
                                          memory_fraction=cfg.memory_fraction, recompute=may_recompute,
                                          pp_layers=cfg.pp_layers, num_micro=pin.num_micro_batches))
            else:
                pp = s in PP_STRATEGIES
                found.offer(plan_strategy(costs, cluster, global_batch, s, **common,
                                          pp_layers=cfg.pp_layers if pp else None,
                                          num_micro=pin.num_micro_batches if pp else None,
                                          force_recompute=bool(pin.recompute)))
        except PlanError as e:
            found.misses.append(f"{s}: {str(e)[:120]}")


def _offer_hybrids(found: "_Best", costs, cluster, global_batch: int, cfg: PlanConfig, pin, rho: float,
                   common: dict) -> None:
    """Offer the hybrid plans on the member layouts and groupings the pin allows (the joint search per
    layout, bounded by the best plan offered so far unless interleaving may beat it)."""
    tp_pin = pin.tp
    degrees = (tp_pin,) if isinstance(tp_pin, int) else TP_DEGREES
    layouts = member_layouts(costs, cluster, num_heads=cfg.num_heads, degrees=degrees, replicated_fraction=rho,
                             type_degrees=dict(tp_pin) if isinstance(tp_pin, tuple) else None)
    bound = math.inf if found.plan is None else found.plan.predicted.step_time_s
    hybrid = dict(common)
    if _interleaved(pin):     # the flat 1F1B plans, each interleaved at the pinned chunk count
        hybrid.update(schedule="1f1b", virtual_counts=(pin.virtual_stages,) if (pin.virtual_stages or 1) > 1
                      else VIRTUAL_COUNTS)
        bound = math.inf      # an interleaved variant may beat the flat plans it comes from
    if cfg.pp_layers is not None:   # that split, on groupings of as many stages
        hybrid["pp_layers"] = cfg.pp_layers
    if pin.sequence_parallel:       # SP wherever it can run, priced slower or not
        hybrid["force_sequence_parallel"] = True
    pp = pin.pp if pin.pp is not None else (len(cfg.pp_layers) if cfg.pp_layers is not None else None)
    for lay in layouts:
        groupings = None
        if pp is not None or pin.dp is not None:
            groupings = pinned_groupings(lay, costs.num_blocks, pp, pin.dp)
        elif _interleaved(pin):
            groupings = member_groupings(cluster, lay, costs.num_blocks)
        if groupings is not None:
            if _interleaved(pin):   # two rank stages or more, each with a block for every chunk
                V = pin.virtual_stages if (pin.virtual_stages or 1) > 1 else min(VIRTUAL_COUNTS)
                groupings = [g for g in groupings if 2 <= len(g.stages) <= costs.num_blocks // V]
            if not groupings:
                continue
        for x in plan_hybrid(costs, cluster, global_batch, layouts=[lay], groupings=groupings,
                             num_micro=pin.num_micro_batches, best_s=bound,
                             force_recompute=bool(pin.recompute), **hybrid):
            found.offer(x.plan)
            if found.plan is not None and not _interleaved(pin):
                bound = min(bound, found.plan.predicted.step_time_s)


def plan_pinned(costs: ModelCosts, cluster: "Cluster", global_batch: int, config: PlanConfig) -> Plan:
    """The fastest predicted plan of ``config.resolved_strategy`` that meets ``config.pin`` (see the
    module docstring); ``PlanError`` naming the pin when none does."""
    asked = config.pin
    check_pin(asked, costs, cluster, global_batch, config.num_heads)
    selective = asked.recompute == "selective"
    if selective:      # backward reruns the attention cores; the search keeps every activation
        costs = attention_recompute_costs(costs)
        config = config.with_(pin=replace(asked, recompute=False))
    pin = config.pin
    cfg = pinned_config(config)
    if getattr(pin, "sequence_parallel", None) is False:     # SP neither priced nor set anywhere
        costs = dataclasses.replace(costs, tp_sp_supported=None, _cache={})
    strategy = cfg.resolved_strategy
    rho = tp_cost.DEFAULT_REPLICATED_FRACTION if cfg.replicated_fraction is None else cfg.replicated_fraction
    # recomputation is a dimension like the others: unpinned (and not turned off by recompute=False), the
    # search may recompute where keeping does not fit or is slower; a selective pin keeps (its search
    # runs with recompute=False)
    may_recompute = bool(cfg.recompute)
    common = dict(num_heads=cfg.num_heads, zero_stage=cfg.zero_stage, schedule=cfg.schedule,
                  memory_fraction=cfg.memory_fraction, replicated_fraction=rho, recompute=may_recompute)
    found = _Best(pin, cluster, cfg.pp_layers)
    _offer_singles(found, costs, cluster, global_batch, cfg, pin, strategy, common)
    if strategy == "auto" and not _pipeline_only(pin):
        _offer_hybrids(found, costs, cluster, global_batch, cfg, pin, rho, common)
    best, misses = found.plan, found.misses
    if best is None:
        why = "; ".join(dict.fromkeys(misses))[:600]
        raise PlanError(f"pin: no plan meets {pin} on {len(cluster)} devices (it does not fit in memory, "
                        f"or no layout has those dimensions)" + (f": {why}" if why else ""))
    if selective:
        best = replace(best, stages=tuple(replace(st, recompute_attention=True) for st in best.stages))
    return replace(best, strategy=strategy if strategy != "auto" else "auto",
                   notes=(f"pinned: {asked}; the planner searched the rest",) + tuple(best.notes))
