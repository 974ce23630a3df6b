"""The replicated fraction of tensor parallelism, measured on this CPU with the rewrite the engine runs.

Why: ``autopar.cost.tp`` prices a TP rank holding ``fraction`` of a block at ``rho + (1 - rho) *
fraction`` of the whole block's time. ``replicated_fraction_of_graph`` estimates ``rho`` from the graph
(memory-class work outside the Linear pairs at 150 FLOP per byte, a GPU's balance). On a CPU that
figure is wrong both ways: the CPU's balance is nearer 30 FLOP per byte, which makes norms and residual
adds cheaper (resmlp: 0.33 estimated, 0.10 measured), and a small shard keeps its per-operator costs
(gpt-tiny's one-head shard: 0.13 estimated from the graph's nodes, 0.4 measured). With the estimate,
the slow devices' small shards were priced 2-3x too long and their TP plans 1.6-1.8x too long.

How (``measure_replicated_fraction``): the captured graph and its TP rewrite at shares ``(1, 3)`` (TP
index 0 holds a quarter of every pair, ``passes.tp.tp_rewrite``; f / g unbound, no communication) run
forward and backward on ``batch`` samples tiled from the example inputs, single-threaded as emulated
ranks run (``autopar.runtime.emulate``), each timed by the thread's CPU time (least of ``repeats``
after a warm-up, the two taking turns so that both see the same neighbours). With ``r`` the shard's time over the whole model's, ``o`` the part of the whole
model's time in blocks without a pair or a head (from the cost tables; they run whole on every TP rank) and
``f`` the shard's fraction, ``rho = ((r - o) / (1 - o) - f) / (1 - f)``, clipped to ``[0, 0.9]``.
The shard is timed as the engine lowers it (``autopar.lowering.lower``): the rewrite with the backward
overlap (``passes.tp_overlap``), and again sequence-parallel (``passes.tp_sp.sp_rewrite``, the engine's
deferred gradient sums) where the graph has SP blocks: ``TpFractionMeasure.sp_step``. On this CPU SP
does not shrink the replicated time as the graph's count says (``cost.tp_tables``' covered work, 0.48
of gpt-tiny's SP block): what stays is per-operator cost, and SP adds its own scatters and slices
(gpt-tiny, shares (2, 1, 1): the shard's forward 0.53 of the whole model's plain, 0.60 with SP and the
overlap). ``cpu_sp_covered`` gives the planner the covered work measured so (``ModelCosts.tp_sp_covered``).
Forward and backward are measured apart (``TpFractionMeasure``: backward's is the smaller, by 0.25-0.85
on the accuracy models); the cost model prices both with one fraction, their time-weighted mean
(``TpFractionMeasure.step``), the one ``autopar.cost.tp.best_shares`` balances whole steps with.

When (``cpu_replicated_fraction``): only when every device type of the cluster is a CPU whose tables
were timed on this machine (``ModelCosts.timed_here``: "measured" or "emulated", calibrated or not:
when a calibrated cluster fell back to the graph's estimate, it priced glumlp's TP plans after
calibration at 1.8-2.1x their measured step) and the model has real
weights; otherwise None and the graph's estimate stands (GPUs, roofline tables, meta models).
Results are cached in memory and on disk (``tp_fraction.json`` in ``autopar.measure.cache.cache_dir``)
by the graph's code, parameter and input shapes, batch, torch version and machine.

Measured on this machine; every figure derived from it is a measurement of this CPU, not of any other
device.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from autopar.cluster.heap import heap_held
from autopar.measure.cache import cache_dir, load_json, machine_id, save_json, tile_batch
from autopar.cost.tp import tp_sharded_blocks

__all__ = ["TpFractionMeasure", "measure_replicated_fraction", "cpu_replicated_fraction", "MEASURE_SHARES",
           "MEASURE_BATCH", "cpu_sp_covered", "replicated_fraction_for"]

MEASURE_SHARES = (1, 3)     # TP index 0 holds a quarter of every pair
MEASURE_BATCH = 32          # samples per timed run: mid-range of the tables' micro-batches
_VERSION = 6                # in the cache key: bump when the measurement changes
_MEMO: dict[str, "TpFractionMeasure | None"] = {}


@dataclass(frozen=True, slots=True)
class TpFractionMeasure:
    forward: float          # replicated fraction of the pair blocks' forward time
    backward: float         # ... of their backward time
    fraction: float         # the timed shard's part of the pairs
    batch: int
    ratios: tuple[float, float]   # shard over whole model: forward, backward
    step: float = 0.0       # of forward plus backward (the mean weighted by the whole model's times)
    sp_step: float | None = None   # the same, sequence-parallel (None: no SP block to time)


def _scalar(out) -> torch.Tensor:
    """A scalar that depends on every floating tensor of ``out`` (what backward starts from)."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise ValueError("the graph's output has no tensor that needs a gradient")
    return sum(t.float().mean() for t in leaves)


def _run(module, params, inputs: tuple) -> tuple[float, float]:
    for p in params:
        p.grad = None
    t0 = time.thread_time()
    loss = _scalar(module(*inputs))
    t1 = time.thread_time()
    loss.backward()
    return t1 - t0, time.thread_time() - t1


def _time(modules, inputs: tuple, repeats: int) -> list[tuple[float, float]]:
    """Least forward and backward thread CPU time of each module over ``repeats`` runs after a warm-up,
    the modules taking turns (so that both see the same neighbours on a shared machine)."""
    params = [[p for p in m.parameters() if p.requires_grad] for m in modules]
    best = [[math.inf, math.inf] for _ in modules]
    for i in range(repeats + 1):
        for j, m in enumerate(modules):
            f, b = _run(m, params[j], inputs)
            if i:                               # the first run warms up
                best[j] = [min(best[j][0], f), min(best[j][1], b)]
    return [tuple(x) for x in best]


def _key(gm, inputs: tuple, batch: int, repeats: int) -> str:
    shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in gm.named_parameters()]
    ins = [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t) for t in inputs]
    text = repr((_VERSION, gm.code, shapes, ins, batch, repeats, MEASURE_SHARES, torch.__version__, machine_id(), heap_held()))
    return hashlib.sha1(text.encode()).hexdigest()


def _shard_fraction(pairs, shares: tuple[int, ...]) -> float | None:
    """The part of the pairs' columns TP index 0 holds at ``shares`` (weighted by width), None when the
    rewrite would keep a pair replicated (a member owning none of it)."""
    from autopar.passes.tp import unit_ranges

    num = den = 0.0
    for p in pairs:
        ranges = unit_ranges(p.num_units, shares, 1 if p.kind == "attention" else 8)
        if any(b == a for a, b in ranges):
            return None
        width = float(p.num_units * p.unit_features)
        num += width * (ranges[0][1] - ranges[0][0]) / p.num_units
        den += width
    return num / den if den > 0 else None


def measure_replicated_fraction(gm, example_inputs: tuple, costs, *, batch: int = MEASURE_BATCH,
                                repeats: int = 5, use_cache: bool = True) -> TpFractionMeasure | None:
    """The measured replicated fraction of ``gm`` (an analysed graph with real weights, on the CPU; see
    the module docstring), or None where it cannot be measured (no Linear pairs, a meta weight, a
    shard owning none of a pair, a graph that does not run on the tiled inputs)."""
    from autopar.passes.tp import tp_rewrite
    from autopar.passes.tp_match import find_tp_pairs
    from autopar.passes.tp_overlap import overlap_tp_backward
    from autopar.passes.tp_sp import SP_META_KEY, sp_rewrite

    if any(p.is_meta or p.device.type != "cpu" for p in gm.parameters()):
        return None
    key = _key(gm, tuple(example_inputs), int(batch), int(repeats))
    if use_cache and key in _MEMO:
        return _MEMO[key]
    pairs = find_tp_pairs(gm)
    f = _shard_fraction(pairs, MEASURE_SHARES) if pairs else None
    if f is None or not 0.0 < f < 1.0:
        _MEMO[key] = None                       # nothing to measure: not looked for again
        return None
    inputs = tile_batch(tuple(example_inputs), int(batch))
    path = cache_dir() / "tp_fraction.json"
    disk = load_json(path) if use_cache else {}
    if key in disk:
        d = disk[key]
        out = TpFractionMeasure(d["forward"], d["backward"], d["fraction"], d["batch"], tuple(d["ratios"]),
                                d["step"], d.get("sp_step"))
        _MEMO[key] = out
        return out
    threads = torch.get_num_threads()
    # The model is the user's: its gradients, buffers (batch-norm statistics) and the RNG are put back.
    grads = {p: p.grad for p in gm.parameters()}
    buffers = {name: b.detach().clone() for name, b in gm.named_buffers()}
    torch.set_num_threads(1)                    # as an emulated rank runs
    try:
        with torch.random.fork_rng(devices=[]):
            local = tp_rewrite(gm, MEASURE_SHARES, 0, pairs=pairs)
            overlap_tp_backward(local)          # as the engines run it (unbound: no communication)
            local_sp = sp_rewrite(tp_rewrite(gm, MEASURE_SHARES, 0, pairs=pairs), MEASURE_SHARES, 0,
                                  defer_param_grads=True)
            overlap_tp_backward(local_sp)
            mods = [gm, local] + ([local_sp] if local_sp.meta[SP_META_KEY].blocks else [])
            times = _time(mods, inputs, repeats)
            (whole_f, whole_b), (shard_f, shard_b) = times[:2]
    except Exception:                           # noqa: BLE001 - a graph the timing cannot run keeps the estimate
        return None
    finally:
        torch.set_num_threads(threads)
        with torch.no_grad():
            for name, b in gm.named_buffers():
                b.copy_(buffers[name])
        for p, g in grads.items():
            p.grad = g
    if not (whole_f > 0 and whole_b > 0):
        return None
    rhos, step = _fractions(costs, batch, f, (whole_f, whole_b), (shard_f, shard_b))
    sp_step = _fractions(costs, batch, f, (whole_f, whole_b), times[2])[1] if len(times) > 2 else None
    out = TpFractionMeasure(rhos[0], rhos[1], float(f), int(batch), (shard_f / whole_f, shard_b / whole_b),
                            float(step), sp_step)
    _MEMO[key] = out
    if use_cache:
        disk = load_json(path)
        disk[key] = dict(forward=out.forward, backward=out.backward, fraction=out.fraction, batch=out.batch,
                         ratios=list(out.ratios), step=out.step, sp_step=out.sp_step)
        save_json(path, disk)
    return out


def _fractions(costs, batch: int, f: float, whole: tuple, shard: tuple) -> tuple[list[float], float]:
    """(forward, backward) replicated fractions and their step mean from the whole model's and the
    shard's (forward, backward) seconds (the module docstring's formula)."""
    sharded = tp_sharded_blocks(costs)
    t = costs.device_types[0]
    rhos = []
    for s, w, table in ((shard[0], whole[0], costs.fwd_time(t, batch)), (shard[1], whole[1], costs.bwd_time(t, batch))):
        total = float(np.sum(table))
        o = float(np.sum(table[~sharded])) / total if sharded is not None and total > 0 else 0.0
        o = min(max(o, 0.0), 0.9)
        rhos.append(float(np.clip(((s / w - o) / (1.0 - o) - f) / (1.0 - f), 0.0, 0.9)))
    step = float(np.clip((rhos[0] * whole[0] + rhos[1] * whole[1]) / (whole[0] + whole[1]), min(rhos), max(rhos)))
    return rhos, step


def cpu_sp_covered(gm, example_inputs: tuple, costs, cluster) -> np.ndarray | None:
    """Per block the replicated work sequence parallelism removes, measured (``ModelCosts.tp_sp_covered``
    for ``cost.tp``'s SP blocks: ``step - sp_step`` of ``measure_replicated_fraction``, 0 elsewhere)
    where ``cpu_replicated_fraction`` measures; None otherwise (the graph's table stands). Negative
    where SP measured slower than plain (its scatters and slices on this CPU): priced so."""
    if cpu_replicated_fraction(gm, example_inputs, costs, cluster) is None:
        return None
    m = measure_replicated_fraction(gm, example_inputs, costs)
    sup = getattr(costs, "tp_sp_supported", None)
    if m is None or m.sp_step is None or sup is None or len(sup) != costs.num_blocks:
        return None
    return np.where(np.asarray(sup) > 0, m.step - m.sp_step, 0.0)


def cpu_replicated_fraction(gm, example_inputs: tuple, costs, cluster) -> float | None:
    """``measure_replicated_fraction``'s step figure where the cluster's devices are CPUs timed on this
    machine (see the module docstring), else None (the graph's estimate stands)."""
    from autopar.cost.precision import is_mixed_precision

    if gm is None or not example_inputs:
        return None
    types = cluster.device_types()
    if any(is_mixed_precision(cluster.spec_of(t)) for t in types):
        return None
    if not all(costs.timed_here(t) for t in types):     # calibrated tables were timed here too
        return None
    m = measure_replicated_fraction(gm, example_inputs, costs)
    return None if m is None else m.step


def replicated_fraction_for(analysis, example_inputs: tuple, costs, cluster):
    """(the part of each block tensor parallelism cannot shard, the costs to plan with): measured with
    the TP rewrite where ``cluster``'s devices are CPUs timed here (``cpu_replicated_fraction``; the
    costs then carry SP's measured table, ``cpu_sp_covered``), else what lies outside every Linear
    pair's region (``cost.tp_tables.replicated_fraction_of_graph``), else the block statistics'."""
    from dataclasses import replace

    from autopar.cost.tp import replicated_fraction_of, replicated_fraction_of_graph

    gm = getattr(getattr(analysis, "captured", None), "gm", None)
    rho = cpu_replicated_fraction(gm, example_inputs, costs, cluster)
    if rho is not None:
        covered = cpu_sp_covered(gm, example_inputs, costs, cluster)
        if covered is not None:    # SP's replicated work as measured here, not the graph's count
            costs = replace(costs, tp_sp_covered=covered, _cache={})
        return rho, costs
    rho = replicated_fraction_of_graph(gm) if gm is not None else None
    return (replicated_fraction_of(analysis.stats) if rho is None else rho), costs
