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

The emulated link (``autopar.cluster.links.EmulatedLink``; the rule: ``docs/emulation.md``)
- ``measure_emulated_link(layout)``: gloo between ``len(layout)`` ranks on this machine, each a thread
  with its own gloo process group over one in-process store, pinned to core ``layout[i]`` of the
  machine's cores (the cores ``autopar.cluster.emulation.cpu_shares`` gives the ranks of a run: gloo
  copies on the rank's own cores, so two ranks on one core share its time). Per operation, one
  ``LATENCY_BYTES`` message (the latency: the median over operations of the per-step time) and
  ``BANDWIDTH_BYTES`` messages (the bandwidth that makes ``autopar.cost.comm``'s formula give the
  median time), every op timed ``repeats`` times after one warm-up, the slowest rank's time.
  Under 2 s on this 2-core machine.
- ``emulated_link_for(cluster)``: this machine's link for the cluster's core layout, from the cache
  (``autopar.cost.measure_cache.load_link``), measured and cached the first time; None when the
  cluster has no node of emulated devices without a declared link, or with
  ``AUTOPAR_EMULATED_LINK=nominal`` (the nominal ``LinkModel`` figures then price it, as before).
- ``calibrated_cluster(cluster)`` attaches it (the planner and ``compiled.profile()`` price the run
  with it); a ``comm`` factor then divides its bandwidths instead of the node's nominal link.

Pure functions of their arguments; tested on synthetic profiles.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["TERMS", "Sample", "samples", "fit_factors", "calibrated", "calibrated_cluster", "device_key",
           "calls_per_step", "measure_emulated_link", "emulated_link_for", "EMULATED_LINK_ENV", "LATENCY_BYTES",
           "BANDWIDTH_BYTES"]

TERMS = ("forward", "backward", "optimizer", "call", "comm")
_COMM = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "p2p")
_MIN_PREDICTED_S = 1e-6
EMULATED_LINK_ENV = "AUTOPAR_EMULATED_LINK"
LATENCY_BYTES = 4096
BANDWIDTH_BYTES = 16 * 1024 * 1024


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
    """``cluster`` for planning: with ``factors`` None, this machine's factors (profile cache) and its
    measured emulated link (``emulated_link_for``) attached; each ``comm`` factor (the largest among a
    node's devices) divides the node's link bandwidth: the emulated link's where it has one, else the
    intra-node link's. Explicit ``factors`` apply to the cluster's own links only. Unchanged (the same
    object) when there is nothing to apply. Links between nodes keep the cluster's network figures."""
    from autopar.cluster.emulation import emulated_link_nodes, emulation_time_scale, with_emulated_link

    link = None
    if factors is None:
        from autopar.cost.measure_cache import load_calibration

        factors = load_calibration()
        link = emulated_link_for(cluster)
    scale = emulation_time_scale(len(cluster))
    comm = {d.rank: float(factors.get(device_key(d.spec, scale), {}).get("comm", 1.0)) for d in cluster.devices}
    linked = set(emulated_link_nodes(cluster)) if link is not None else set()
    node_intra = list(cluster.node_intra_Bps)
    for n in range(cluster.num_nodes):
        members = [d for d in cluster.devices if d.node == n]
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


def _layout_key(layout: tuple[int, ...], cores: int) -> str:
    return f"ranks {len(layout)}|cores {'|'.join(map(str, layout))} of {cores}"


def emulated_link_for(cluster):
    """This machine's measured link for ``cluster``'s emulated ranks (see the module docstring)."""
    import os

    from autopar.cluster.emulation import emulated_link_nodes, link_layout, machine_cores
    from autopar.cluster.links import EmulatedLink
    from autopar.cost.measure_cache import load_link, save_link

    if os.environ.get(EMULATED_LINK_ENV, "").lower() in ("nominal", "off", "0", "no"):
        return None
    nodes = emulated_link_nodes(cluster)
    if not nodes:
        return None
    cores = machine_cores()
    layout = link_layout(cluster, nodes[0], range(cores))
    key = _layout_key(layout, cores)
    found = load_link(key)
    if found is None:
        found = measure_emulated_link(layout).to_json()
        save_link(key, found)
    return EmulatedLink.from_json(found, nodes)


def measure_emulated_link(layout, *, repeats: int = 5, nbytes: int = BANDWIDTH_BYTES) -> "EmulatedLink":
    """The gloo link between ``len(layout)`` ranks pinned to cores ``layout`` (see the module docstring)."""
    import os
    import sys
    import threading
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from autopar.cluster.emulation import allowed_cores, machine_cores
    from autopar.cluster.links import LINK_OPS, EmulatedLink

    layout = tuple(int(c) for c in layout)
    n = len(layout)
    if n < 2:
        raise ValueError(f"measure_emulated_link: layout {layout} needs at least two ranks")
    cores = sorted(allowed_cores()) if len(allowed_cores()) >= machine_cores() else list(range(machine_cores()))
    store = dist.HashStore()
    barrier = threading.Barrier(n)
    times: dict[tuple[str, int], list[float]] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(rank: int) -> None:
        try:
            try:       # this thread, and the gloo threads its process group starts, on the rank's core
                os.sched_setaffinity(threading.get_native_id(), {cores[layout[rank] % len(cores)]})
            except (AttributeError, OSError):
                pass
            pg = dist.ProcessGroupGloo(dist.PrefixStore("autopar-link", store), rank, n, timedelta(seconds=60))
            for size in (LATENCY_BYTES, nbytes):
                numel = max(n, size // 4 // n * n)
                full, shard = torch.ones(numel), torch.ones(numel // n)
                ops = {
                    "all_reduce": lambda: pg.allreduce([full]).wait(),
                    "all_gather": lambda: pg._allgather_base(full, shard).wait(),
                    "reduce_scatter": lambda: pg._reduce_scatter_base(shard, full).wait(),
                    "broadcast": lambda: pg.broadcast([full]).wait(),
                    "p2p": lambda: (pg.send([full], 1, 0).wait() if rank == 0 else
                                    pg.recv([full], 0, 0).wait() if rank == 1 else None),
                }
                for op in LINK_OPS:
                    for i in range(repeats + 1):
                        barrier.wait()
                        t0 = time.perf_counter()
                        ops[op]()
                        dt = time.perf_counter() - t0
                        if i:
                            with lock:
                                times.setdefault((op, size, i), []).append(dt)
        except BaseException as exc:  # noqa: BLE001 - reported after the threads joined
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)     # the ranks are threads here: no 5 ms waits for the GIL between them
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    if errors:
        raise errors[0]

    def median(op: str, size: int) -> float:
        return statistics.median(max(times[(op, size, i)]) for i in range(1, repeats + 1))

    # per op: (message steps, bytes moved per ranks' full buffer) of autopar.cost.comm's formula
    shape = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n), "all_gather": (n - 1, (n - 1) / n),
             "reduce_scatter": (n - 1, (n - 1) / n), "broadcast": (n - 1, 1.0), "p2p": (1, 1.0)}
    latency = statistics.median(median(op, LATENCY_BYTES) / shape[op][0] for op in LINK_OPS)
    full_bytes = max(n, nbytes // 4 // n * n) * 4
    bandwidth = []
    for op in LINK_OPS:
        steps, moved = shape[op]
        t = max(median(op, nbytes) - steps * latency, 0.1 * median(op, nbytes))
        bandwidth.append((op, moved * full_bytes / t))
    return EmulatedLink(latency, tuple(bandwidth), (), "|".join(map(str, layout)))
