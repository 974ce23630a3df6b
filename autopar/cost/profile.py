"""Per-device cost tables from the model's facts and given time measurements: the forward and
backward time of every block on every device type of a cluster, and the ``ModelCosts`` they make.

Three sources of a type's time table, in order of preference (``ModelCosts.sources`` records which):

1. **measured** on a real local device of that type (``autopar.measure.blocks``, in situ: the tables
   come in as ``measured``);
2. **emulated**: an emulated CPU device (``emulate: cpu, speed: s``) costs the CPU measurement divided
   by ``s`` and multiplied by the run's emulation time scale (``emulation_scale``, which the runtime's
   clocks use too). This is emulation: the figures say so wherever they are printed.
3. **roofline** transfer for device types not at hand: per block and op class (matmul, attention,
   memory-bound), ``max(FLOPs / peak, bytes / bandwidth)`` divided by a per-class efficiency, plus a
   per-op overhead. Efficiencies are fitted by non-negative least squares (scipy ``nnls``) from
   what was measured on this machine (``calibrate``), or default to typical GPU figures.

A fourth input, Triton kernel timings from ``autopar tune``, replaces the roofline time of the nodes a
tuned kernel covers (``kernel_adjust``, read by ``autopar.measure.tables``).

GPU device types are costed for mixed-precision training (bf16 peak, 2-byte activations; activation
memory is halved when every device of the cluster is a GPU); CPU and emulated devices for fp32. The
rule lives in ``autopar.cost.precision``, which the MFU of ``autopar.planner.bounds`` uses too.

Pure: nothing here times, reads a file or the environment; ``autopar.measure.tables.model_costs``
decides what to measure and calls ``time_tables`` and ``costs_of`` (``model_facts`` and ``tp_tables``
from the graph, joined with the measured ``TimeTables``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from autopar.cost.precision import is_mixed_precision, priced_peak_flops
from autopar.cost.tp import tp_memory_replicated_per_block, tp_pairs_per_block
from autopar.cost.tp_tables import tp_graph_tables_of
from autopar.ir.costs import OPTIMIZER_STATE_BYTES, ModelCosts
from autopar.ir.tables import ModelFacts, TimeTables, TpTables
from autopar.passes.meta import BLOCK

__all__ = ["Efficiency", "DEFAULT_GPU_EFFICIENCY", "DEFAULT_SAMPLE_BATCHES", "param_tensors_per_block",
           "roofline_features", "calibrate", "time_tables", "model_facts", "tp_tables", "costs_of"]

DEFAULT_SAMPLE_BATCHES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Inverse efficiencies (1 / fraction of peak reached) per term of the roofline, and a per-op
    overhead in seconds. Terms: matmul and attention FLOPs (or their activation traffic, whichever
    binds), memory-bound activation traffic, and weight traffic (weights read forward; read and their
    gradient written backward), which large weights (an embedding, an LM head) make expensive."""
    matmul: float
    attention: float
    memory: float
    weights: float
    op_overhead_s: float
    matmul_call_s: float = 0.0   # extra fixed cost per matmul / attention call (small GEMMs are slower)

    def as_array(self) -> np.ndarray:
        return np.array([self.matmul, self.attention, self.memory, self.weights, self.op_overhead_s,
                         self.matmul_call_s])


# Typical large-model training on current GPUs: ~60% of peak on GEMMs, ~45% on fused attention,
# ~75% of HBM bandwidth on memory-bound kernels, ~4 us per kernel launch.
DEFAULT_GPU_EFFICIENCY = Efficiency(matmul=1 / 0.6, attention=1 / 0.45, memory=1 / 0.75, weights=1 / 0.75,
                                    op_overhead_s=4e-6, matmul_call_s=0.0)
_NEUTRAL = np.array([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])


# -- roofline ------------------------------------------------------------------------------------
def roofline_features(stats, micro_batch: float, batch_size: int, peak_flops: float, bandwidth_Bps: float,
                      bytes_scale: float = 1.0, backward: bool = False) -> np.ndarray:
    """Feature vector [matmul s, attention s, memory s, weights s, num_ops, matmul/attention ops] of one
    block at ``micro_batch``;
    the predicted time is its dot product with ``Efficiency.as_array()``.

    ``stats`` is a ``passes.blocks.BlockStats`` measured at ``batch_size`` samples; FLOPs and activation
    bytes scale linearly with the micro-batch, weight bytes do not.
    """
    scale = micro_batch / batch_size
    flops = dict(stats.bwd_flops_by_class if backward else stats.flops_by_class)
    act = dict(stats.bytes_by_class)
    params = {c: (r, g) for c, r, g in stats.param_bytes_by_class}
    mult = 2.0 if backward else 1.0  # backward reads activations and writes their gradients
    out = []
    for cls in ("matmul", "attention", "memory"):
        f = flops.get(cls, 0.0) * scale
        b = act.get(cls, 0.0) * bytes_scale * mult * scale
        if cls != "memory":  # a GEMM's weight traffic overlaps its compute: inside the roofline max
            r, g = params.get(cls, (0.0, 0.0))
            b += (r + (g if backward else 0.0)) * bytes_scale
        out.append(max(f / peak_flops, b / bandwidth_Bps))
    # Memory-bound ops' weights (embedding lookups, norms): read forward; read again and the full
    # gradient written backward (an embedding's dense gradient, a tied weight owned elsewhere).
    r, g = params.get("memory", (0.0, 0.0))
    out.append((r + (g if backward else 0.0)) * bytes_scale / bandwidth_Bps)
    out.append(stats.num_ops * mult)
    ops = dict(stats.ops_by_class)
    out.append((ops.get("matmul", 0) + ops.get("attention", 0)) * mult)
    return np.array(out)


def calibrate(features: np.ndarray, times_s: np.ndarray) -> Efficiency:
    """Fit the inverse efficiencies and the per-op overhead to measured times (non-negative least
    squares, weighted by relative error so small and large blocks count alike)."""
    from scipy.optimize import nnls

    a = np.asarray(features, float)
    t = np.asarray(times_s, float)
    w = 1.0 / np.maximum(t, 1e-9)
    x, _ = nnls(a * w[:, None], t * w)
    used = (a > 0).any(axis=0)
    x = np.where(used, x, _NEUTRAL)  # a term the data never exercised keeps a neutral value
    return Efficiency(*[float(v) for v in x])


# -- the cost tables -----------------------------------------------------------------------------
def _roofline_table(analysis, spec, batches, eff: Efficiency) -> tuple[np.ndarray, np.ndarray]:
    peak = priced_peak_flops(spec)
    bytes_scale = 0.5 if is_mixed_precision(spec) else 1.0
    fwd = np.zeros((len(batches), len(analysis.stats)))
    bwd = np.zeros_like(fwd)
    x = eff.as_array()
    for bi, b in enumerate(batches):
        for s in analysis.stats:
            ff = roofline_features(s, b, analysis.batch_size, peak, spec.mem_bandwidth_Bps, bytes_scale)
            fb = roofline_features(s, b, analysis.batch_size, peak, spec.mem_bandwidth_Bps, bytes_scale, True)
            fwd[bi, s.index] = ff @ x
            bwd[bi, s.index] = fb @ x
    return fwd, bwd


def _tp_pairs(analysis, num_blocks: int) -> np.ndarray | None:
    """The Linear pairs tensor parallelism shards per block (``cost.tp.tp_pairs_per_block``), or None
    where the analysis has no graph to match them on."""
    gm = getattr(getattr(analysis, "captured", None), "gm", None)
    return None if gm is None else tp_pairs_per_block(gm, num_blocks)


def _vocab_ends(analysis, num_blocks: int) -> dict:
    """The LM heads and token embeddings tensor parallelism shards per block (``cost.tp_tables``;
    ``TpTables`` fields), none where the analysis has no graph."""
    from autopar.cost.tp_tables import tp_embeddings_per_block, tp_heads_per_block

    gm = getattr(getattr(analysis, "captured", None), "gm", None)
    if gm is None:
        return {}
    return dict(tp_heads=tp_heads_per_block(gm, num_blocks), tp_embeddings=tp_embeddings_per_block(gm, num_blocks))


def param_tensors_per_block(analysis, num_blocks: int) -> np.ndarray | None:
    """Trainable parameter tensors per block of ``analysis``'s graph, each counted once in the block of
    its first use (as ``passes.blocks`` assigns a parameter's count), for the optimizer's per-tensor
    term (``ModelCosts.param_tensors``); None where the analysis has no graph."""
    gm = getattr(getattr(analysis, "captured", None), "gm", None)
    if gm is None:
        return None
    out, seen = np.zeros(num_blocks), set()
    for n in gm.graph.nodes:
        if BLOCK not in n.meta:
            continue
        if n.op == "call_module":
            ps = list(gm.get_submodule(n.target).parameters())
        elif n.op == "get_attr":
            obj = gm
            for part in str(n.target).split("."):
                obj = getattr(obj, part, None)
            ps = [obj] if isinstance(obj, torch.nn.Parameter) else []
        else:
            continue
        for p in ps:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out[min(int(n.meta[BLOCK]), num_blocks - 1)] += 1
    return out


def _tp_memory(analysis, num_blocks: int) -> dict:
    """``ModelCosts``' per-block TP memory fractions (``cost.tp.tp_memory_replicated_per_block``)."""
    gm = getattr(getattr(analysis, "captured", None), "gm", None)
    got = None if gm is None else tp_memory_replicated_per_block(gm, num_blocks)
    return {} if got is None else {"tp_param_replicated": got[0], "tp_act_replicated": got[1]}


def _output_bytes(analysis) -> float:
    """Bytes per sample of the captured graph's output tensors (what the loss function reads)."""
    from autopar.passes.meta import TENSOR

    total = 0.0
    for node in analysis.captured.graph.nodes:
        if node.op == "output":
            for v in node.all_input_nodes:
                ti = v.meta.get(TENSOR)
                total += float(ti.nbytes) if ti is not None else 0.0
    return total / max(1, analysis.batch_size)



def time_tables(analysis, cluster, batches, *, measured: dict[int, np.ndarray] | None = None,
                emulation_scale: float = 1.0, efficiency: Efficiency | None = None,
                kernel_adjust: dict[str, np.ndarray] | None = None) -> tuple[dict, dict, dict, dict]:
    """(forward table, backward table, sources, speeds) of every device type of ``cluster`` at the
    micro-batches ``batches``: GPU types by the roofline (plus ``kernel_adjust[type]``, the tuned
    Triton kernels' per-block seconds at the analysis batch, ``autopar.measure.tables``); CPU and
    emulated types from ``measured`` (``autopar.measure.blocks.measure_blocks``: this CPU's seconds per
    micro-batch) divided by their speed (an emulated device's ``speed / emulation_scale``), or without
    it a roofline of the nominal CPU. ``speeds``: the divisor of each type whose table was measured."""
    batches = np.asarray(batches, dtype=float)
    fwd_table, bwd_table, sources, speeds = {}, {}, {}, {}
    for t in cluster.device_types():
        spec = cluster.spec_of(t)
        if not is_mixed_precision(spec):
            # An emulated device runs at speed / time_scale of this CPU (autopar.runtime.emulate).
            speed = spec.speed / emulation_scale if spec.is_emulated else 1.0
            if measured is not None:
                fwd_table[t] = np.stack([measured[int(b)][0] for b in batches]) / speed
                bwd_table[t] = np.stack([measured[int(b)][1] for b in batches]) / speed
                sources[t] = "emulated" if spec.is_emulated else "measured"
                speeds[t] = speed
                continue
            from autopar.cluster.devices import CPU_NOMINAL

            f, b_ = _roofline_table(analysis, CPU_NOMINAL, batches, efficiency or Efficiency(1, 1, 1, 1, 1e-5, 0.0))
            fwd_table[t], bwd_table[t] = f / speed, b_ / speed
            sources[t] = "roofline (nominal CPU)"
            continue
        f, b_ = _roofline_table(analysis, spec, batches, efficiency or DEFAULT_GPU_EFFICIENCY)
        sources[t] = "roofline"
        adj = (kernel_adjust or {}).get(t)
        if adj is not None:  # tuned Triton kernels replace the roofline of the nodes they cover
            scale = (batches / analysis.batch_size)[:, None]
            f = np.maximum(f + adj[0] * scale, f * 0.05)
            b_ = np.maximum(b_ + adj[1] * scale, b_ * 0.05)
            sources[t] = "roofline + tuned Triton kernels"
        fwd_table[t], bwd_table[t] = f, b_
    return fwd_table, bwd_table, sources, speeds


def model_facts(analysis, cluster, *, optimizer: str = "adamw", precision: str | None = None,
                example_inputs=None) -> ModelFacts:
    """What ``analysis``' graph says of the model for ``cluster`` (``autopar.ir.tables.ModelFacts``):
    bytes at the cluster's precision rule, or at ``precision`` (see ``autopar.measure.tables.model_costs``)."""
    stats = analysis.stats
    per = analysis.batch_size
    # Mixed-precision training keeps activations in bf16 on GPUs; a cluster with CPU devices stays fp32.
    all_gpu = all(is_mixed_precision(cluster.spec_of(t)) for t in cluster.device_types())
    # Mixed precision (ZeRO paper accounting, 16 bytes per parameter): bf16 weights (2) and gradients (2),
    # fp32 master weights (4) with the optimizer state, which ZeRO-1 shards together.
    act_scale = 0.5 if all_gpu else 1.0
    weight_bytes_per_param = 2 if all_gpu else 4
    facts = dict(
        block_names=tuple(s.name for s in stats),
        params=np.array([s.params for s in stats], float),
        param_bytes=np.array([s.params * weight_bytes_per_param for s in stats], float),
        act_bytes=np.array([s.saved_bytes / per * act_scale for s in stats], float),
        out_bytes=np.array([s.cut_bytes / per * act_scale for s in stats], float),
        fwd_flops=np.array([s.fwd_flops / per for s in stats], float),
        optimizer_bytes_per_param=OPTIMIZER_STATE_BYTES.get(optimizer, 8) + (4 if all_gpu else 0),
        grad_bytes_per_param=weight_bytes_per_param, tied_groups=analysis.tied_groups,
        output_bytes=_output_bytes(analysis) * act_scale,
        param_tensors=param_tensors_per_block(analysis, len(stats)),
        attn_fwd_flops=np.array([dict(s.flops_by_class).get("attention", 0.0) / per for s in stats], float))
    if precision not in (None, "fp32"):
        from autopar.cost.precision import precision_bytes

        facts.update(precision_bytes(analysis, example_inputs, precision, OPTIMIZER_STATE_BYTES.get(optimizer, 8)))
    return ModelFacts(**facts)


def tp_tables(analysis) -> TpTables:
    """What tensor parallelism shards and overlaps per block of ``analysis``' graph
    (``autopar.ir.tables.TpTables``; empty without a graph)."""
    n = len(analysis.stats)
    return TpTables(tp_pairs=_tp_pairs(analysis, n), **_vocab_ends(analysis, n), **_tp_memory(analysis, n),
                    **tp_graph_tables_of(analysis, n))   # SP and backward-overlap tables (cost.tp_tables)


def costs_of(analysis, cluster, times: TimeTables, *, optimizer: str = "adamw", precision: str | None = None,
             example_inputs=None) -> ModelCosts:
    """The ``ModelCosts`` of ``analysis`` on ``cluster`` with the time tables ``times``: the model's
    facts and TP tables from the graph (``model_facts``, ``tp_tables``) joined with them."""
    return ModelCosts.of(model_facts(analysis, cluster, optimizer=optimizer, precision=precision,
                                     example_inputs=example_inputs), times, tp_tables(analysis))
