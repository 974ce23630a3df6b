"""Throughput bounds a plan is judged against.

Terms
- type batch: the global batch scaled to a device type's share of the cluster's compute (its count
  x ``peak_flops_bf16``), largest-remainder rounding, at least 1 sample (``type_batches``); kept for
  reports, the bound itself gives every type the whole global batch.
- upper bound (``upper_bound_samples_per_s``): the sum over device types of the samples/s the joint
  planner (``plan_auto``: the best of every strategy) reaches on the homogeneous sub-cluster of that
  type alone (``Cluster.subset``) training on the *whole* global batch: each type at its best, as if
  it had the job to itself (HETHUB's "theoretical upper bound"). A type that cannot hold the model
  alone (no plan fits, whatever its micro-batches) is planned with its memory relaxed (x2, x4, ...
  x16) so it counts with what its compute reaches; ``with_all_bounds`` notes each type's part and
  any relaxation in ``Plan.notes``. What a heterogeneous plan reaches against it is its
  *efficiency*; on a homogeneous cluster the bound is the plan itself. Efficiency can pass 1
  where the mixed plan pools memory that no type has alone (a pipeline whose stages on one type
  take layers off another type's memory, ZeRO shards over every device; llama-140b on hethub-768:
  105.6%), and falls below it by the larger bubble and all-reduce share of more devices on the
  same batch.
- compute bound (``compute_bound_samples_per_s``): no communication, no bubbles, no replication:
  the sum over devices of (samples / forward+backward seconds of the whole model) at the best
  micro-batch whose activations of the lightest block fit in ``memory_fraction`` of the device
  (states are taken as sharded away): the physical limit of the cost model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from autopar.config import MEMORY_FRACTION
from autopar.cost.memory import usable_bytes
from autopar.cost.precision import priced_peak_flops
from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from autopar.cluster.model import Cluster

__all__ = ["type_batches", "upper_bound_samples_per_s", "compute_bound_samples_per_s", "with_all_bounds",
           "bound_searches", "BOUND_PARTS", "merge_bound_parts", "repeats_main", "bounds_from_main",
           "peak_flops_s", "model_flops_per_sample", "mfu", "homogeneous_cluster", "homogeneous_mfu"]

_MAX_MICRO = 4096   # micro-batch sizes tried for the compute bound (the tables grow linearly beyond)


def type_batches(cluster: "Cluster", global_batch: int) -> dict[str, int]:
    """Device type -> its type batch (see the module docstring)."""
    types = cluster.device_types()
    w = np.array([len(r) * cluster.spec_of(t).peak_flops_bf16 for t, r in types.items()], dtype=np.float64)
    exact = w / w.sum() * global_batch
    out = np.maximum(np.floor(exact).astype(int), 1)
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - np.floor(exact[i])), i))
    for i in order[: max(0, global_batch - int(out.sum()))]:
        out[i] += 1
    return {t: int(b) for t, b in zip(types, out)}


def _with_memory(cluster: "Cluster", factor: float) -> "Cluster":
    """The same cluster with every device's memory multiplied by ``factor``."""
    if factor == 1:
        return cluster
    devices = tuple(replace(d, spec=replace(d.spec, memory_bytes=int(d.spec.memory_bytes * factor)))
                    for d in cluster.devices)
    return replace(cluster, devices=devices, name=f"{cluster.name}[memory x{factor:g}]")


def upper_bound_samples_per_s(costs: ModelCosts, cluster: "Cluster", global_batch: int, *,
                              num_heads: int | None = None, zero_stage: int | Literal["auto"] = "auto",
                              schedule: str = "auto", memory_fraction: float = MEMORY_FRACTION,
                              replicated_fraction: float | None = None, cache=None,
                              details: dict | None = None, recompute: bool = False) -> float:
    """Sum over device types of ``plan_auto``'s samples/s on that type alone on the whole global batch.
    ``details``, when given, receives type -> (batch, samples/s, the sub-plan or None, memory factor:
    1 unless the type's memory had to be relaxed).
    ``recompute``: the plans may recompute activations too; whether a type holds the model alone (and
    so how much its memory is relaxed) is still decided without recomputation, so that recomputing
    every stage of a type that cannot hold the model does not lower the ceiling below its compute."""
    from autopar.planner.joint import plan_auto   # local: the planner imports nothing from here

    total = 0.0
    for t in cluster.device_types():
        batch = global_batch
        sub = cluster.subset(cluster.device_types()[t], name=f"{cluster.name}[{t}]")
        plan = None
        factor = 0
        # A type that cannot hold the model alone is planned with its memory relaxed (x2, x4, ...): the
        # bound is what its compute would reach alone, so it stays a ceiling for plans that use it.
        kw = dict(num_heads=num_heads, zero_stage=zero_stage, schedule=schedule, memory_fraction=memory_fraction,
                  replicated_fraction=replicated_fraction, cache=cache)
        for relax in (1, 2, 4, 8, 16):
            try:
                plan = plan_auto(costs, _with_memory(sub, relax), batch, **kw)
            except PlanError:
                continue
            factor = relax
            if recompute:
                with_rc = plan_auto(costs, _with_memory(sub, relax), batch, recompute=True, **kw)
                if with_rc.predicted.samples_per_s > plan.predicted.samples_per_s:
                    plan = with_rc
            break
        sps = plan.predicted.samples_per_s if plan is not None else 0.0
        if details is not None:
            details[t] = (batch, sps, plan, factor)
        total += sps
    return total


def compute_bound_samples_per_s(costs: ModelCosts, cluster: "Cluster", *, memory_fraction: float = MEMORY_FRACTION) -> float:
    """Sum over devices of their best samples/s on the whole model (see the module docstring)."""
    lightest = float(np.min(costs.act_bytes)) if costs.num_blocks else 0.0
    per_type: dict[str, float] = {}
    total = 0.0
    for d in cluster.devices:
        t = d.spec.name
        if t not in per_type:
            room = usable_bytes(d.spec, memory_fraction)
            cap = _MAX_MICRO if lightest <= 0 else int(min(_MAX_MICRO, room // lightest))
            best = 0.0
            if cap >= 1:
                sizes = sorted({1, cap} | {int(b) for b in costs.sample_batches if 1 <= b <= cap})
                for b in sizes:
                    step = costs.step_time(t, b)
                    if step > 0:
                        best = max(best, b / step)
            per_type[t] = best
        total += per_type[t]
    return total


# The peak FLOP/s MFU divides by is the one the cost model prices ``spec`` at: ``autopar.cost.precision``
# decides it for both. Kept under this name for callers that import it from here.
peak_flops_s = priced_peak_flops


def model_flops_per_sample(costs: ModelCosts) -> float:
    """Forward + backward FLOPs of one sample without recomputation (see the module docstring)."""
    return 3.0 * float(np.sum(costs.fwd_flops))


def mfu(costs: ModelCosts, cluster: "Cluster", samples_per_s: float) -> float:
    """Model FLOPs utilisation of ``samples_per_s`` on ``cluster`` (see the module docstring)."""
    peak = sum(priced_peak_flops(d.spec) for d in cluster.devices)
    return samples_per_s * model_flops_per_sample(costs) / peak if peak > 0 else 0.0


def homogeneous_cluster(cluster: "Cluster") -> "Cluster":
    """Whole nodes of the cluster's fastest type with the same summed peak (see the module docstring)."""
    types = cluster.device_types()
    fastest = max(types, key=lambda t: (priced_peak_flops(cluster.spec_of(t)), -list(types).index(t)))
    spec = cluster.spec_of(fastest)
    per_node: dict[int, int] = {}
    for r in types[fastest]:
        per_node[cluster.devices[r].node] = per_node.get(cluster.devices[r].node, 0) + 1
    size = max(per_node.values())
    total = sum(priced_peak_flops(d.spec) for d in cluster.devices)
    nodes = max(1, int(round(total / (priced_peak_flops(spec) * size))))
    from autopar.cluster.model import Cluster as _Cluster   # local: the planner takes clusters as given

    out = _Cluster.homogeneous(spec, nodes * size, size, name=f"{cluster.name}[homogeneous {fastest}]",
                               network_bandwidth_Bps=cluster.network_bandwidth_Bps,
                               network_latency_s=cluster.network_latency_s)
    intra = cluster.node_intra_Bps[next(iter(per_node))]
    return replace(out, node_intra_Bps=(intra,) * out.num_nodes) if intra is not None else out


def homogeneous_mfu(costs: ModelCosts, cluster: "Cluster", global_batch: int, *, details: dict | None = None,
                    **plan_kw) -> float:
    """The MFU ``plan_auto`` reaches on ``homogeneous_cluster(cluster)`` (0.0 when nothing fits there);
    ``plan_kw``: the planner arguments of the plan it is compared with. ``details``, when given,
    receives the cluster and the plan (None when nothing fits)."""
    from autopar.planner.joint import plan_auto   # local: the planner imports nothing from here

    homo = homogeneous_cluster(cluster)
    try:
        plan = plan_auto(costs, homo, global_batch, **plan_kw)
    except PlanError:
        plan = None
    if details is not None:
        details.update(cluster=homo, plan=plan)
    return mfu(costs, homo, plan.predicted.samples_per_s) if plan is not None else 0.0


BOUND_PARTS = ("upper", "homogeneous")


def bound_searches(costs: ModelCosts, cluster: "Cluster", global_batch: int, *, part: str = "all",
                   **plan_kw) -> tuple:
    """The planner searches the bounds need, which do not depend on the plan they judge: (upper bound,
    its per-type details, homogeneous MFU, its details); ``plan_kw``: ``upper_bound_samples_per_s``'s
    keywords. ``with_all_bounds`` takes them ready (``searched=``) when they ran elsewhere
    (``autopar.planning.side_bounds``: side processes alongside the main search).
    ``part``: one of ``BOUND_PARTS`` computes only that half (the other's entries are None and {}), so
    that the two can run apart; ``merge_bound_parts`` puts them back together."""
    if part not in ("all",) + BOUND_PARTS:
        raise ValueError(f"part: {part!r} is not 'all' or one of {BOUND_PARTS}")
    upper, details, homo_mfu, homo = None, {}, None, {}
    if part in ("all", "upper"):
        upper = upper_bound_samples_per_s(costs, cluster, global_batch, details=details, **plan_kw)
    if part in ("all", "homogeneous"):
        homo_mfu = homogeneous_mfu(costs, cluster, global_batch, details=homo, **plan_kw)
    return upper, details, homo_mfu, homo


def repeats_main(cluster: "Cluster") -> bool:
    """Whether the bounds' planner searches repeat the main search (``bounds_from_main``): one device
    type, on nodes that ``homogeneous_cluster`` rebuilds as they are."""
    return len(cluster.device_types()) == 1 and homogeneous_cluster(cluster).signature() == cluster.signature()


def bounds_from_main(main: Plan, costs: ModelCosts, cluster: "Cluster", global_batch: int,
                     kept: tuple | None, **plan_kw) -> tuple:
    """``bound_searches``'s result where it repeats the main search (``repeats_main``; ``main``:
    ``plan_auto``'s plan with the same ``plan_kw``): the homogeneous plan is ``main``, and the upper
    bound's is ``main`` or the plan that keeps every activation, whichever is faster, as
    ``upper_bound_samples_per_s`` picks. ``kept``: ``bound_searches(part="upper")`` searched without
    recomputation (None when ``plan_kw`` does not recompute: then ``main`` is that plan). A type
    whose memory had to be relaxed is searched again here, as the upper bound does."""
    homo = homogeneous_cluster(cluster)
    homogeneous = (None, {}, mfu(costs, homo, main.predicted.samples_per_s), {"cluster": homo, "plan": main})
    if kept is None:
        (t,) = cluster.device_types()
        upper = (main.predicted.samples_per_s, {t: (global_batch, main.predicted.samples_per_s, main, 1)})
    else:
        (t, (batch, sps, plan, factor)), = kept[1].items()
        if factor != 1:
            return bound_searches(costs, cluster, global_batch, **plan_kw)
        if main.predicted.samples_per_s > sps:
            plan, sps = main, main.predicted.samples_per_s
        upper = (sps, {t: (batch, sps, plan, factor)})
    return merge_bound_parts(upper + (None, {}), homogeneous)


def merge_bound_parts(upper_part: tuple, homogeneous_part: tuple) -> tuple:
    """``bound_searches``'s whole result from its ``part="upper"`` and ``part="homogeneous"`` results."""
    return upper_part[0], upper_part[1], homogeneous_part[2], homogeneous_part[3]


def with_all_bounds(plan: Plan, costs: ModelCosts, cluster: "Cluster", global_batch: int | None = None, *,
                    num_heads: int | None = None, zero_stage: int | Literal["auto"] = "auto",
                    schedule: str = "auto", memory_fraction: float = MEMORY_FRACTION,
                    replicated_fraction: float | None = None, cache=None,
                    recompute: bool = False, searched: tuple | None = None) -> Plan:
    """A copy of ``plan`` with the upper bound, the compute bound, efficiency = samples_per_s / upper
    bound, compute efficiency, MFU and homogeneous MFU set (the planner arguments should be the ones
    the plan was made with). ``searched``: ``bound_searches``'s result for these arguments, when it
    was computed already (else it is computed here)."""
    batch = plan.global_batch_size if global_batch is None else int(global_batch)
    if searched is None:
        searched = bound_searches(costs, cluster, batch, num_heads=num_heads, zero_stage=zero_stage,
                                  schedule=schedule, memory_fraction=memory_fraction,
                                  replicated_fraction=replicated_fraction, cache=cache,
                                  recompute=recompute)
    upper, details, homo_mfu, homo = searched
    compute = compute_bound_samples_per_s(costs, cluster, memory_fraction=memory_fraction)
    sps = plan.predicted.samples_per_s
    eff = sps / upper if upper > 0 else 0.0
    notes = plan.notes
    hp = homo["plan"]
    notes = notes + (f"homogeneous MFU against {len(homo['cluster'])} x {homo['cluster'].devices[0].spec.name} "
                     f"(same summed peak, whole nodes): "
                     + (f"{hp.predicted.samples_per_s:.4g} samples/s ({_chosen(hp)})" if hp is not None
                        else "no plan fits there"),)
    if len(details) > 1:
        parts = []
        for t, (_, type_sps, alone, factor) in details.items():
            how = "does not plan even with x16 memory" if alone is None else \
                _chosen(alone) + (f"; memory relaxed x{factor}: it cannot hold the model alone" if factor > 1 else "")
            parts.append(f"{t} alone {type_sps:.4g} samples/s ({how})")
        notes = notes + ("upper bound = " + " + ".join(parts),)
    return replace(plan, notes=notes, predicted=replace(
        plan.predicted, upper_bound_samples_per_s=upper, compute_bound_samples_per_s=compute, efficiency=eff,
        compute_efficiency=sps / compute if compute > 0 else 0.0, mfu=mfu(costs, cluster, sps),
        homogeneous_mfu=homo_mfu))


def _chosen(plan: Plan) -> str:
    """The planner's label of a bound's sub-plan (its "chosen: ..." note), else its strategy."""
    for n in plan.notes:
        if n.startswith("chosen: "):
            return n[len("chosen: "):].rsplit(": ", 1)[0]
    return plan.strategy
