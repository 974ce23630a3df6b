"""Calibration: correction factors per (device type, cost term) fitted from measured step profiles,
so that later plans on this machine price what this machine really does.

Terms
- cost term: what a factor corrects in ``ModelCosts``:
  - ``forward`` / ``backward``: the block time tables (``fwd_table`` / ``bwd_table``), multiplied;
  - ``optimizer``: the optimizer step's seconds per parameter (both the per-tensor and the flat rate),
    multiplied;
  - ``call``: seconds added to every compute call (``call_overhead_s``): the step time no phase of the
    cost model covers (``other`` in ``autopar.ir.profile``: Python, slicing rows, copies outside the
    compute blocks), shared out over the rank's compute calls;
  - ``comm``: the rank's collectives and messages (their transfer, waits split off), applied to the
    cluster rather than to the tables: ``calibrated_cluster`` divides each node's intra-node link
    bandwidth by its devices' largest factor (the planners price communication from the cluster's
    links, ``autopar.cost.comm``); links between nodes are left as the cluster says.
- sample: one rank's measured and predicted seconds of one term in one profile (``samples``), the
  measured figure the median over the profile's steps. ``compute`` (forward and backward not told
  apart) samples both ``forward`` and ``backward``.
- factor of a (device type, term): the ratio of the summed measured to the summed predicted seconds of
  its samples (least squares of ``measured ~ factor x predicted`` weighted by ``1 / predicted``), 1.0
  with no sample; ``call``: the median over samples of the extra seconds per call.
- the fit starts from predictions made *without* calibration (``autopar.cost.profile.model_costs``
  with ``calibration=None``), so factors never compound.
- device type key (``device_key``): the cluster's device type name; for an emulated device also its
  speed and the run's emulation time scale, which change what its tables mean.

Factors are persisted per machine (``autopar.cost.measure_cache.save_calibration``): measured on the
machine that runs, never carried over from another (``machine_id``).

Pure functions of their arguments; tested on synthetic profiles.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["TERMS", "Sample", "samples", "fit_factors", "calibrated", "calibrated_cluster", "device_key",
           "calls_per_step"]

TERMS = ("forward", "backward", "optimizer", "call", "comm")
_COMM = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "p2p")
_MIN_PREDICTED_S = 1e-6


@dataclass(frozen=True, slots=True)
class Sample:
    device_type: str
    term: str
    measured_s: float
    predicted_s: float      # for "call": the number of compute calls the measured seconds are shared over


def device_key(spec, time_scale: float) -> str:
    """The key of a device type's factors (see the module docstring)."""
    if getattr(spec, "is_emulated", False):
        return f"{spec.name}|emulated x{float(spec.speed):g}|scale {float(time_scale):g}"
    return str(spec.name)


def calls_per_step(plan, rank: int) -> int:
    """Compute calls a rank of ``plan`` makes per step: one per data-parallel micro-step (two per
    pipeline micro-batch: forward and backward), plus the optimizer step."""
    for stage in plan.stages:
        for g, members in enumerate(stage.groups):
            if rank in members:
                n = sum(1 for x in stage.micro_batches[g] if x > 0)
                return (n if plan.num_stages == 1 else 2 * n) + 1
    return 0


def samples(profile, keys: Mapping[int, str], plan=None) -> list[Sample]:
    """The samples of a ``StepProfile`` (``autopar.ir.profile``), each rank under ``keys[rank]``; with
    ``plan``, the ``call`` samples too (``calls_per_step``)."""
    out = []
    for info in profile.ranks:
        if info.rank not in keys or not info.predicted:
            continue
        k = keys[info.rank]
        meas = profile.measured(info.rank)
        pred = info.predicted
        if meas.get("compute", 0.0) > 0:       # forward and backward not told apart: one ratio for both
            m = meas.get("compute", 0.0) + meas.get("forward", 0.0) + meas.get("backward", 0.0)
            p = pred.get("forward", 0.0) + pred.get("backward", 0.0)
            out += [Sample(k, "forward", m, p), Sample(k, "backward", m, p)]
        else:
            out += [Sample(k, t, meas.get(t, 0.0), pred.get(t, 0.0)) for t in ("forward", "backward")]
        out.append(Sample(k, "optimizer", meas.get("optimizer", 0.0), pred.get("optimizer", 0.0)))
        out.append(Sample(k, "comm", sum(meas.get(c, 0.0) for c in _COMM), sum(pred.get(c, 0.0) for c in _COMM)))
        if plan is not None:
            calls = calls_per_step(plan, info.rank)
            if calls:
                out.append(Sample(k, "call", meas.get("other", 0.0), float(calls)))
    return out


def fit_factors(data: Iterable[Sample]) -> dict[str, dict[str, float]]:
    """Per device type key, the factor of every term its samples cover (see the module docstring)."""
    acc: dict[tuple[str, str], list[Sample]] = {}
    for s in data:
        if s.term not in TERMS:
            raise ValueError(f"fit_factors: unknown term {s.term!r}; terms are {', '.join(TERMS)}")
        if s.predicted_s > _MIN_PREDICTED_S and s.measured_s >= 0:
            acc.setdefault((s.device_type, s.term), []).append(s)
    out: dict[str, dict[str, float]] = {}
    for (k, term), ss in sorted(acc.items()):
        if term == "call":
            value = statistics.median(s.measured_s / s.predicted_s for s in ss)
        else:
            value = sum(s.measured_s for s in ss) / sum(s.predicted_s for s in ss)
        out.setdefault(k, {})[term] = float(value)
    return out


def calibrated(costs, factors: Mapping[str, Mapping[str, float]], keys: Mapping[str, str]):
    """``costs`` (an ``autopar.ir.ModelCosts``) with ``factors`` applied: device type ``t`` takes the
    factors of ``keys[t]`` (types without factors are unchanged; ``sources`` says which were)."""
    fwd, bwd = dict(costs.fwd_table), dict(costs.bwd_table)
    opt, flat = dict(costs.optimizer_s_per_param), dict(costs.optimizer_flat_s_per_param)
    call, sources = dict(costs.call_overhead_s), dict(costs.sources)
    for t in costs.device_types:
        f = factors.get(keys.get(t, t))
        if not f:
            continue
        fwd[t] = np.asarray(fwd[t]) * f.get("forward", 1.0)
        bwd[t] = np.asarray(bwd[t]) * f.get("backward", 1.0)
        if t in opt:
            opt[t] = opt[t] * f.get("optimizer", 1.0)
        if t in flat:
            flat[t] = flat[t] * f.get("optimizer", 1.0)
        call[t] = call.get(t, 0.0) + f.get("call", 0.0)
        sources[t] = f"{sources.get(t, '')} + calibrated".lstrip(" +")
    return replace(costs, fwd_table=fwd, bwd_table=bwd, optimizer_s_per_param=opt, optimizer_flat_s_per_param=flat,
                   call_overhead_s=call, sources=sources, _cache={})


def calibrated_cluster(cluster, factors: Mapping[str, Mapping[str, float]] | None = None):
    """``cluster`` for planning with each node's intra-node link bandwidth divided by the largest
    ``comm`` factor among its devices (``factors``, default this machine's from the profile cache);
    unchanged without such factors. Links between nodes keep the cluster's network figures."""
    from autopar.cluster.emulation import emulation_time_scale

    if factors is None:
        from autopar.cost.measure_cache import load_calibration

        factors = load_calibration()
    scale = emulation_time_scale(len(cluster))
    comm = {d.rank: float(factors.get(device_key(d.spec, scale), {}).get("comm", 1.0)) for d in cluster.devices}
    if all(f == 1.0 for f in comm.values()):
        return cluster
    node_intra = []
    for n in range(cluster.num_nodes):
        members = [d for d in cluster.devices if d.node == n]
        base = cluster.node_intra_bandwidth_Bps(n, tuple(d.spec for d in members))
        node_intra.append(base / max(comm[d.rank] for d in members))
    return replace(cluster, node_intra_Bps=tuple(node_intra))
