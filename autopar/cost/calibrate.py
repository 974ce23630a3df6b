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
    cluster rather than to the tables: ``calibrated_cluster`` slows each node's intra-node link by its
    devices' largest factor (a measured emulated link: every time it prices; a nominal link: its
    bandwidth; the planners price communication from the cluster's links, ``autopar.cost.comm``);
    links between nodes are left as the cluster says.
- sample: one rank's measured and predicted seconds of one term in one profile (``samples``), the
  measured figure the median over the profile's steps. ``compute`` (forward and backward not told
  apart) samples both ``forward`` and ``backward``.
- factor of a (device type, term): the ratio of the summed measured to the summed predicted seconds of
  its samples (least squares of ``measured ~ factor x predicted`` weighted by ``1 / predicted``), 1.0
  with no sample; ``call``: the least over samples of the extra seconds per call. ``other`` is not all
  per call: a data-parallel step's holds per-step work that grows with the model (resmlp: ~12 ms per
  rank per step, ~5 ms per call over its 2-3 calls, against 0.1-0.2 ms per call in its pipelines;
  emulated), and the median of such samples, charged on every call, priced a pipeline's 17-33
  calls per rank 25-35% over its measured step after calibration (accuracy-s8-after, -after-2). The
  plan that spreads ``other`` thinnest bounds what a call costs.
- shrinkage: a term the calibration run barely exercised says little about another model, where it
  may weigh much more (communication on a small, latency-bound model against a large, bandwidth-bound
  one): a factor counts in proportion to its evidence ``e`` = the number of samples x the term's share
  of the device type's predicted seconds (all timed terms), as ``factor = ratio ** (e / (e +
  PRIOR_SHARE))``, then clamped to ``FACTOR_BOUNDS``. A term that is half the step keeps ~96% of its
  log-ratio from one sample; one that is 1% of it keeps a third, and more with more samples.
- machine factors (``fit_machine_factors``: what ``autopar train --calibrate`` and the accuracy benchmark
  save for later plans of *other* models): one calibration model's error is part the machine's and part
  its own, and only the machine's part carries over. Per device type key: one ``compute`` factor for
  forward and backward together (the profile splits a data-parallel micro-step between them by wall
  time, and a step pays their sum), ``optimizer`` and ``comm``, each ``exp(TRANSFER_WEIGHT x m)`` with m
  the median of the samples' log ratios weighted by predicted seconds (a median: one strategy that the
  model prices badly, such as resmlp's pipeline stage holding only the head, 0.51-0.84 on the 0.25
  device, does not move the machine's figure); ``call`` ``TRANSFER_WEIGHT`` x ``fit_factors``'. Why
  0.5: across the accuracy benchmark's four models (three runs of it; emulated), each device type's
  compute ratio scattered between models by 0.03-0.18 in log (mean ~0.1), about as much as the
  offset the models shared (0.98-1.18), so one model tells about half of what the machine does.
  ``fit_factors`` (all of a profile's ratio) stays what re-planning uses: it re-prices the same model.
- the fit starts from predictions made *without* calibration (``autopar.measure.tables.model_costs``
  with ``calibration=None``), so factors never compound.
- device type key (``device_key``): the cluster's device type name; for an emulated device also its
  speed and the run's emulation time scale, which change what its tables mean.

Factors are persisted per machine (``autopar.measure.cache.save_calibration``): measured on the
machine that runs, never carried over from another (``machine_id``).

The emulated link (what ``calibrated_cluster`` attaches): ``autopar.measure.links``; this machine's
factors and link together: ``autopar.measure.machine``.

Pure functions of their arguments; tested on synthetic profiles.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["TERMS", "PRIOR_SHARE", "FACTOR_BOUNDS", "Sample", "samples", "fit_factors", "calibrated",
           "fit_machine_factors", "TRANSFER_WEIGHT", "MACHINE_TERMS",
           "calibrated_cluster", "device_key", "calls_per_step"]

TERMS = ("forward", "backward", "optimizer", "call", "comm")
_COMM = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "p2p")
_MIN_PREDICTED_S = 1e-6
# fit_factors: a term's factor is shrunk toward 1 (in log) by weight e / (e + PRIOR_SHARE), e = its samples
# x its share of the predicted time; and kept within FACTOR_BOUNDS, a guard against absurd fits only:
# tables that were never measured here (a roofline of the nominal CPU, what re-planning may start from)
# are legitimately 4-10x off, and a bound that binds there makes every device type look alike.
PRIOR_SHARE = 0.02
FACTOR_BOUNDS = (1 / 64, 64.0)
# fit_machine_factors: the share of one calibration model's log-ratio taken as the machine's (module docstring)
TRANSFER_WEIGHT = 0.5
MACHINE_TERMS = ("compute", "optimizer", "call", "comm")


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


def samples(profile, keys: Mapping[int, str], plan=None, *, pooled: bool = False) -> list[Sample]:
    """The samples of a ``StepProfile`` (``autopar.ir.profile``), each rank under ``keys[rank]``; with
    ``plan``, the ``call`` samples too (``calls_per_step``); ``pooled``: a rank's forward and backward as
    one ``compute`` sample (``fit_machine_factors``)."""
    out = []
    for info in profile.ranks:
        if info.rank not in keys or not info.predicted:
            continue
        k = keys[info.rank]
        meas = profile.measured(info.rank)
        pred = info.predicted
        m = meas.get("compute", 0.0) + meas.get("forward", 0.0) + meas.get("backward", 0.0)
        p = pred.get("forward", 0.0) + pred.get("backward", 0.0)
        if pooled:
            out.append(Sample(k, "compute", m, p))
        elif meas.get("compute", 0.0) > 0:       # forward and backward not told apart: one ratio for both
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


def fit_factors(data: Iterable[Sample], *, prior_share: float = PRIOR_SHARE,
                bounds: tuple[float, float] = FACTOR_BOUNDS) -> dict[str, dict[str, float]]:
    """Per device type key, the factor of every term its samples cover (see the module docstring):
    the ratio of summed measured to summed predicted seconds, shrunk toward 1 by the term's evidence
    (``prior_share``) and kept within ``bounds``."""
    lo, hi = bounds
    if not 0 < lo <= 1 <= hi:
        raise ValueError(f"fit_factors: bounds {bounds} must satisfy 0 < low <= 1 <= high")
    if not prior_share >= 0:
        raise ValueError(f"fit_factors: prior_share {prior_share!r} must be >= 0")
    acc: dict[tuple[str, str], list[Sample]] = {}
    for s in data:
        if s.term not in TERMS:
            raise ValueError(f"fit_factors: unknown term {s.term!r}; terms are {', '.join(TERMS)}")
        if s.predicted_s > _MIN_PREDICTED_S and s.measured_s >= 0:
            acc.setdefault((s.device_type, s.term), []).append(s)
    # per key: predicted seconds of every timed term (what a term's share is taken of)
    total: dict[str, float] = {}
    for (k, term), ss in acc.items():
        if term != "call":
            total[k] = total.get(k, 0.0) + sum(s.predicted_s for s in ss)
    out: dict[str, dict[str, float]] = {}
    for (k, term), ss in sorted(acc.items()):
        if term == "call":      # the least per call: "other" also holds per-step work (module docstring)
            value = min(s.measured_s / s.predicted_s for s in ss)
        else:
            pred = sum(s.predicted_s for s in ss)
            raw = sum(s.measured_s for s in ss) / pred
            evidence = len(ss) * pred / total[k]       # samples x the term's share of the predicted time
            weight = evidence / (evidence + prior_share) if evidence > 0 else 0.0
            value = math.exp(weight * math.log(raw)) if raw > 0 else lo
            value = min(max(value, lo), hi)
        out.setdefault(k, {})[term] = float(value)
    return out


def fit_machine_factors(data: Iterable[Sample], *, weight: float = TRANSFER_WEIGHT,
                        bounds: tuple[float, float] = FACTOR_BOUNDS) -> dict[str, dict[str, float]]:
    """This machine's factors, from the samples (``samples(..., pooled=True)``) of one calibration model,
    for the plans of other models (see the module docstring, machine factors): per device type key, for
    ``compute`` (given to both ``forward`` and ``backward``), ``optimizer`` and ``comm``, ``exp(weight x
    m)`` where m is the median of the samples' log(measured / predicted) weighted by their predicted
    seconds; ``call``: ``weight`` x ``fit_factors``' figure. Kept within ``bounds``."""
    lo, hi = bounds
    if not 0 <= weight <= 1:
        raise ValueError(f"fit_machine_factors: weight {weight!r} must be within [0, 1]")
    acc: dict[tuple[str, str], list[Sample]] = {}
    calls = []
    for s in data:
        if s.term not in MACHINE_TERMS:
            raise ValueError(f"fit_machine_factors: unknown term {s.term!r}; terms are {', '.join(MACHINE_TERMS)}")
        if s.term == "call":
            calls.append(s)
        elif s.predicted_s > _MIN_PREDICTED_S and s.measured_s > 0:
            acc.setdefault((s.device_type, s.term), []).append(s)
    out: dict[str, dict[str, float]] = {}
    for (k, term), ss in sorted(acc.items()):
        logs = sorted((math.log(s.measured_s / s.predicted_s), s.predicted_s) for s in ss)
        half, run, median = 0.5 * sum(w for _, w in logs), 0.0, logs[-1][0]
        for x, w in logs:
            run += w
            if run >= half:
                median = x
                break
        value = min(max(math.exp(weight * median), lo), hi)
        for t in (("forward", "backward") if term == "compute" else (term,)):
            out.setdefault(k, {})[t] = float(value)
    for k, f in fit_factors(calls).items():
        out.setdefault(k, {})["call"] = float(weight * f["call"])
    return out


def calibrated(costs, factors: Mapping[str, Mapping[str, float]], keys: Mapping[str, str]):
    """``costs`` (an ``autopar.ir.ModelCosts``) with ``factors`` applied: device type ``t`` takes the
    factors of ``keys[t]`` (types without factors are unchanged; ``sources`` says which were)."""
    fwd, bwd = dict(costs.fwd_table), dict(costs.bwd_table)
    opt, flat = dict(costs.optimizer_s_per_param), dict(costs.optimizer_flat_s_per_param)
    call, sources = dict(costs.call_overhead_s), dict(costs.sources)
    per_tensor = dict(costs.optimizer_s_per_tensor)
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
        if t in per_tensor:
            per_tensor[t] = per_tensor[t] * f.get("optimizer", 1.0)
        call[t] = call.get(t, 0.0) + f.get("call", 0.0)
        sources[t] = f"{sources.get(t, '')} + calibrated".lstrip(" +")
    return replace(costs, fwd_table=fwd, bwd_table=bwd, optimizer_s_per_param=opt, optimizer_flat_s_per_param=flat,
                   call_overhead_s=call, sources=sources, optimizer_s_per_tensor=per_tensor, _cache={})


def calibrated_cluster(cluster, factors: Mapping[str, Mapping[str, float]], *, time_scale: float = 1.0,
                       link=None):
    """``cluster`` for planning with ``factors`` (keyed by ``device_key`` at ``time_scale``, the run's
    emulation time scale) and an emulated ``link`` (``autopar.cluster.links.EmulatedLink``, measured by
    ``autopar.measure.links``; None: the cluster's own links) attached: each ``comm`` factor (the largest
    among a node's devices) slows the node's link: the emulated link's every time
    (``EmulatedLink.scaled``) where it has one, else the intra-node link's bandwidth. Unchanged (the
    same object) when there is nothing to apply. Links between nodes keep the cluster's network figures.
    This machine's factors and link: ``autopar.measure.machine.machine_cluster``."""
    from autopar.cluster.emulation import emulated_link_nodes, with_emulated_link

    comm = {d.rank: float(factors.get(device_key(d.spec, time_scale), {}).get("comm", 1.0)) for d in cluster.devices}
    linked = set(emulated_link_nodes(cluster)) if link is not None else set()
    node_intra = list(cluster.node_intra_Bps)
    for n, members in enumerate(cluster.node_devices()):
        f = max(comm[d.rank] for d in members)
        if f == 1.0:
            continue
        if n in linked:
            link = link.scaled(f)      # one link for its nodes: the largest factor among them counts
        else:
            node_intra[n] = cluster.node_intra_bandwidth_Bps(n, tuple(d.spec for d in members)) / f
    out = cluster if tuple(node_intra) == tuple(cluster.node_intra_Bps) else replace(
        cluster, node_intra_Bps=tuple(node_intra))
    return with_emulated_link(out, link) if link is not None else out
