"""Per-device cost: the forward and backward time of every block on every device type of a cluster.

Three sources, in order of preference (``ModelCosts.sources`` records which one each type got):

1. **measured** on a real local device of that type (a CUDA GPU whose name matches, or this CPU):
   in situ, as a training step runs the blocks (``measure_blocks``): the whole graph, split into its
   blocks, forward with autograd on and every block's activations alive, then one whole backward,
   each block's share read from hooks (warm-up, repeats, min or median); results are cached on disk
   keyed by the graph's block signatures, micro-batch, device name, threads and dtype.
2. **emulated**: an emulated CPU device (``emulate: cpu, speed: s``) costs the CPU measurement divided
   by ``s`` and multiplied by the run's emulation time scale (``autopar.cluster.emulation.emulation_time_scale``), which
   the runtime's clocks use too. This is emulation: the figures say so wherever they are printed.
3. **roofline** transfer for device types not at hand: per block and op class (matmul, attention,
   memory-bound), ``max(FLOPs / peak, bytes / bandwidth)`` divided by a per-class efficiency, plus a
   per-op overhead. Efficiencies are calibrated by non-negative least squares (scipy ``nnls``) from
   what was measured on this machine (``calibrate``), or default to typical GPU figures.

A fourth input, Triton kernel timings from ``autopar tune`` (``kernels.timing``), replaces the
roofline time of the nodes a tuned kernel covers when a tuning cache exists for that device.

GPU device types are costed for mixed-precision training (bf16 peak, 2-byte activations; activation
memory is halved when every device of the cluster is a GPU); CPU and emulated devices for fp32. The
rule lives in ``autopar.cost.precision``, which the MFU of ``autopar.planner.bounds`` uses too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from autopar.cluster.emulation import emulation_time_scale
from autopar.cost.measure_cache import (
    cache_dir, graph_signature, load_json, measure_cache_path, save_json, tile_batch,
)
from autopar.cost.precision import is_mixed_precision, priced_peak_flops
from autopar.cost.tp import tp_memory_replicated_per_block, tp_pairs_per_block
from autopar.cost.tp_tables import tp_graph_tables_of
from autopar.ir.costs import OPTIMIZER_STATE_BYTES, ModelCosts
from autopar.passes.meta import BLOCK, COST

__all__ = ["Efficiency", "DEFAULT_GPU_EFFICIENCY", "model_costs", "param_tensors_per_block", "roofline_features",
           "calibrate", "measure_blocks", "MEASURE_VERSION", "cache_dir", "DEFAULT_SAMPLE_BATCHES",
           "kernel_adjustments"]

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


# -- measurement ---------------------------------------------------------------------------------
def measure_blocks(analysis, model, example_inputs: tuple, batches, *, device: torch.device | None = None,
                   repeats: int = 5, use_cache: bool = True, progress=None,
                   stat: str = "min", min_time_s: float = 0.3) -> dict[int, np.ndarray]:
    """Measured forward and backward seconds of every block at each micro-batch in ``batches``, as a
    training step runs them (in situ).

    Returns {micro_batch: array (2, num_blocks)} (row 0 forward, row 1 backward). Each repeat runs the
    whole graph, split into its blocks, forward with autograd on (every block's saved activations kept
    alive until the backward, as in a step), then one whole backward from the outputs (gradients
    accumulated into the parameters' ``.grad``, as a micro-step after the first does). A block's forward
    is the clock from its forward pre-hook to the next block's (the last: to the end of the forward);
    its backward is the clock from when its outputs' gradients are complete (tensor hooks) to when the
    preceding block's are (the first: to the end of the backward), so the blocks add up to the whole
    forward and the whole backward. Each block takes ``stat`` over the repeats ("min", default: the
    uncontended time, robust when other processes share the cores, and what an emulated device's
    steady CPU-time clock charges; or "median"), then the rows are scaled so that they add up to the
    same statistic of the whole forward and of the whole backward of the unsplit graph run without
    hooks, once after every hooked run (the hooks, the split's module calls and the clock reads cost
    time a step does not spend: the hooked totals ran 0-14% above on gpt-tiny and resmlp at 16
    samples here, and session 6 saw 20%), so the hooks give the split between blocks only. Identical blocks (``struct_hash``)
    share the mean of their in-situ times. A row is made non-decreasing in the micro-batch (a larger
    micro-batch never costs less; timing noise at small ones otherwise inverts neighbours).
    Not counted: the loss (the graph's outputs get unit gradients), which a step runs after the graph.

    ``repeats`` is the least number of timed runs per micro-batch; small graphs run more, until their
    timed runs add up to ``min_time_s`` (at most ``_MAX_REPEATS``): the least of a few 10 ms runs
    moved by 40% between two processes on a loaded machine, which the planner then took as the model.
    """
    from torch.fx.passes.split_module import split_module

    gm = analysis.captured.gm
    device = device or torch.device("cpu")
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    # One CPU thread (how emulated ranks run): the thread's CPU time, what their clocks measure, and
    # blind to the time other processes take the core; otherwise wall time (GPUs, threaded CPUs).
    clock = time.thread_time if device.type == "cpu" and threads() == 1 else time.perf_counter
    n = len(analysis.blocks)
    cache_file = measure_cache_path()
    cache = load_json(cache_file) if use_cache else {}
    sig = graph_signature(analysis)
    split = subs = None
    out: dict[int, np.ndarray] = {}
    for b in batches:
        k = _key(sig, b, dev_name, threads())
        if k not in cache:
            if split is None:
                split = split_module(gm, model, lambda node: node.meta[BLOCK], keep_original_order=True)
                subs = {int(name.split("_")[1]): mod for name, mod in split.named_children()
                        if name.startswith("submod_")}
            res = _in_situ(split, subs, n, tile_batch(example_inputs, b), repeats, sync, clock, stat, min_time_s,
                           whole=gm)
            groups: dict[str, list[int]] = {}
            for s in analysis.stats:
                groups.setdefault(s.struct_hash, []).append(s.index)
            for idx in groups.values():
                res[:, idx] = res[:, idx].mean(axis=1, keepdims=True)
            cache[k] = res.tolist()
            if progress is not None:
                progress()
        out[b] = np.array(cache[k], float).reshape(2, n)
    for lo, hi in zip(sorted(out), sorted(out)[1:]):
        out[hi] = np.maximum(out[hi], out[lo])
    if use_cache:
        save_json(cache_file, cache)
    return out


_WARMUP = 2
_MAX_REPEATS = 40


def _in_situ(split, subs: dict, n: int, inputs: tuple, repeats: int, sync, clock, stat: str,
             min_time_s: float = 0.0, whole=None) -> np.ndarray:
    """(2, n) forward / backward seconds of the blocks of ``split`` on ``inputs`` (``measure_blocks``).
    ``whole``: the unsplit graph, run without hooks after every hooked run; its totals are what the
    rows are scaled to (else the hooked runs' own)."""
    fwd_marks: list[tuple[float, int]] = []
    grad_marks: dict[int, float] = {}

    def stamp() -> float:
        sync()
        return clock()

    def on_grad(i: int):
        def hook(_grad):
            grad_marks[i] = stamp()        # the last of its outputs' gradients completes the block's
        return hook

    def pre(i: int):
        return lambda m, args: fwd_marks.append((stamp(), i))

    def post(i: int):
        def hook(m, args, result):
            for o in torch.utils._pytree.tree_flatten(result)[0]:
                if isinstance(o, torch.Tensor) and o.requires_grad:
                    o.register_hook(on_grad(i))
        return hook

    hooks = [h for i, mod in subs.items()
             for h in (mod.register_forward_pre_hook(pre(i)), mod.register_forward_hook(post(i)))]
    fwd_runs, bwd_runs, fwd_total, bwd_total = [], [], [], []
    plain_fwd, plain_bwd = [], []

    def run_once(module) -> tuple[float, float, float]:   # forward with grad, then one whole backward
        t0 = stamp()
        outs = [o for o in torch.utils._pytree.tree_flatten(module(*inputs))[0]
                if isinstance(o, torch.Tensor) and o.requires_grad]
        t1 = stamp()
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return t0, t1, stamp()

    def plain() -> None:       # the graph as a step runs it: one module, no hooks
        t0, t1, t2 = run_once(whole)
        plain_fwd.append(t1 - t0)
        plain_bwd.append(t2 - t1)

    try:
        r = -1
        while True:          # the first runs warm up (allocations of a new size), then the timed ones
            r += 1
            timed = len(fwd_total)
            if timed >= max(1, repeats) and (timed >= _MAX_REPEATS or sum(fwd_total) + sum(bwd_total)
                                              + sum(plain_fwd) + sum(plain_bwd) >= min_time_s):
                break
            fwd_marks.clear()
            grad_marks.clear()
            t0, t1, t2 = run_once(split)
            if whole is not None:
                plain()
            if r < _WARMUP:
                plain_fwd.clear()
                plain_bwd.clear()
                continue
            f = np.zeros(n)
            marks = sorted(fwd_marks) + [(t1, -1)]
            f[marks[0][1]] += marks[0][0] - t0        # before the first block: the graph's own glue
            for (ta, i), (tb, _) in zip(marks, marks[1:]):
                f[i] += tb - ta
            g = np.zeros(n)
            order = sorted((t, i) for i, t in grad_marks.items())   # last block first
            if order:
                g[order[0][1]] += order[0][0] - t1    # the outputs' gradients up to the last block's
                for (ta, i), (tb, _) in zip(order, order[1:] + [(t2, -1)]):
                    g[i] += tb - ta
            fwd_runs.append(f)
            bwd_runs.append(g)
            fwd_total.append(t1 - t0)
            bwd_total.append(t2 - t1)
    finally:
        for h in hooks:
            h.remove()
        split.zero_grad(set_to_none=True)
        if whole is not None:
            whole.zero_grad(set_to_none=True)
    pick = np.min if stat == "min" else np.median
    res = np.stack([pick(np.stack(fwd_runs), axis=0), pick(np.stack(bwd_runs), axis=0)])
    if plain_fwd:       # hooks and the split's calls cost time a step does not spend: the totals unhooked
        fwd_total, bwd_total = plain_fwd, plain_bwd
    for row, total in ((0, fwd_total), (1, bwd_total)):
        s = res[row].sum()
        if s > 0:
            res[row] *= float(pick(total)) / s
    return res


def threads() -> int:
    return torch.get_num_threads()


# Bumped whenever what a cached table means changes (v3: rows scaled to the unhooked whole graph's
# totals; v2: in situ, whole graph with grad, scaled to the hooked runs' totals; v1 were isolated
# per-block timings keyed by the block alone).
MEASURE_VERSION = "insitu-v3"


def _key(sig: str, b: int, dev: str, nthreads: int) -> str:
    return (f"{MEASURE_VERSION}|{sig}|b{b}|{dev}|t{nthreads}|fp32"
            + ("|cpu-time" if dev == "cpu" and nthreads == 1 else ""))


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


def kernel_adjustments(analysis, device_name: str, spec, eff: Efficiency, dtype=torch.bfloat16) -> np.ndarray | None:
    """Per block (forward, backward) seconds to add at the analysis batch size when the nodes that a
    tuned Triton kernel covers run that kernel instead of what the roofline assumed: the kernel's tuned
    time (``autopar tune`` cache, ``kernels.timing``) minus those nodes' memory-bound roofline time.
    None when the tuning cache knows nothing of ``device_name``."""
    from autopar.kernels.cache import read_cache
    from autopar.kernels.timing import kernel_time_s
    from autopar.passes.triton_patterns import find_kernel_patterns

    # The tuning cache is keyed by the CUDA device name ("NVIDIA H200"); presets are "H200-141GB".
    known = list(read_cache())
    token = device_name.split("-")[0].lower()
    names = [d for d in known if d == device_name] or [d for d in known if token and token in d.lower()]
    if not names:
        return None
    device_name = names[0]
    gm = analysis.captured.gm
    nodes = {n.name: n for n in gm.graph.nodes}
    out = np.zeros((2, len(analysis.stats)))
    found = False
    for m in find_kernel_patterns(gm):
        if m.input_shape is None:
            continue
        kf = kernel_time_s(m.kernel, m.input_shape, dtype, device_name=device_name)
        kb = kernel_time_s(m.kernel + ".bwd", m.input_shape, dtype, device_name=device_name)
        if kf is None:
            continue
        found = True
        covered = [nodes[x] for x in m.node_names if x in nodes and COST in nodes[x].meta]
        block = covered[-1].meta[BLOCK] if covered else None
        if block is None:
            continue
        act = sum(n.meta[COST].act_bytes for n in covered) * 0.5  # bf16 on GPUs
        roof = act / spec.mem_bandwidth_Bps * eff.memory + len(covered) * eff.op_overhead_s
        out[0, block] += kf - roof
        out[1, block] += (kb if kb is not None else 2 * kf) - 2 * roof
    return out if found else None


def _tp_pairs(analysis, num_blocks: int) -> np.ndarray | None:
    """The Linear pairs tensor parallelism shards per block (``cost.tp.tp_pairs_per_block``), or None
    where the analysis has no graph to match them on."""
    gm = getattr(getattr(analysis, "captured", None), "gm", None)
    return None if gm is None else tp_pairs_per_block(gm, num_blocks)


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


def _add_tracking(fwd_table: dict, bwd_table: dict, batches, stats, speeds: dict[str, float],
                  residual_s: dict[int, tuple[float, float]]) -> None:
    """Add ``residual_s`` (``engine_call.measure_tracking``: {micro-batch: (forward s, backward s)} of a
    whole micro-step) to the tables of ``speeds``' types (``{type: the divisor of their tables}``), each
    block its share of the graph's operators (``BlockStats.num_ops``; evenly where none are counted), in
    place."""
    ops = np.array([float(s.num_ops) for s in stats])
    share = ops / ops.sum() if ops.sum() > 0 else np.full(len(ops), 1.0 / max(1, len(ops)))
    rf = np.array([residual_s[int(b)][0] for b in batches])[:, None] * share[None, :]
    rb = np.array([residual_s[int(b)][1] for b in batches])[:, None] * share[None, :]
    for t, speed in speeds.items():
        fwd_table[t] = np.asarray(fwd_table[t], dtype=np.float64) + rf / speed
        bwd_table[t] = np.asarray(bwd_table[t], dtype=np.float64) + rb / speed


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


def model_costs(analysis, cluster, *, model=None, example_inputs=None, optimizer: str = "adamw",
                sample_batches=DEFAULT_SAMPLE_BATCHES, measure: bool | None = None,
                efficiency: Efficiency | None = None, progress=None, use_kernel_times: bool = True,
                calibration="auto", precision: str | None = None, loss_fn=None,
                example_targets=None, tracking=None) -> ModelCosts:
    """Cost tables of ``analysis`` (``passes.analyze.Analysis``) on every device type of ``cluster``.

    ``precision`` (``"fp32" | "bf16" | "fp16"``, a plan's ``precision=``): given other than fp32, the byte
    fields are what the runtime keeps under autocast (``cost.precision.precision_bytes``: fp32 weights
    plus autocast's copies, fp32 gradients and state, each block's saved activations and sent values at
    their autocast dtypes). Times stay the device rule's: GPUs at their bf16 peak, CPUs (and emulated
    devices) at their fp32 time, whose autocast is no faster here (``docs/precision.md``). None or
    ``"fp32"``: the device rule for bytes too (bf16 bytes on an all-GPU cluster, fp32 otherwise).

    ``calibration``: correction factors ``{device key: {term: factor}}`` (``autopar.cost.calibrate``)
    applied to the tables; ``"auto"`` (default): this machine's, from the profile cache
    (``autopar.cost.measure_cache.load_calibration``); None: none.

    ``measure``: time blocks on this machine for emulated / local device types (default: when the model
    has real weights). Without measurement, emulated devices fall back to a roofline of the nominal CPU.

    ``loss_fn`` with ``example_targets`` (the targets of ``example_inputs``' rows): the loss's forward
    and backward are timed too and added to the last block of the measured tables
    (``autopar.cost.loss``); without them the tables hold the model alone.

    ``tracking`` (``autopar.cost.engine_call.measure_tracking``'s: a callable returning a fresh memory
    meter and the CPU-time clock an emulated rank reads under it; None, default: not priced): what the
    rank's memory tracking adds to a micro-step's charged CPU time beyond the meter's own estimate, added
    to the measured tables of emulated types (whose ranks step under the meter), spread over the blocks
    by their operator counts.
    """
    stats = analysis.stats
    batches = np.array(sorted(sample_batches), dtype=float)
    on_meta = model is None or any(p.is_meta for p in model.parameters())
    if measure is None:
        measure = not on_meta
    types = cluster.device_types()
    fwd_table, bwd_table, sources = {}, {}, {}
    measured = None
    need_cpu = any(not is_mixed_precision(cluster.spec_of(t)) for t in types)
    if measure and need_cpu and not on_meta:
        measured = measure_blocks(analysis, model, example_inputs, [int(b) for b in batches], progress=progress)

    emu_scale = emulation_time_scale(len(cluster))
    speeds = {}         # measured types: the divisor of this CPU's times
    for t in types:
        spec = cluster.spec_of(t)
        if not is_mixed_precision(spec):
            # An emulated device runs at speed / time_scale of this CPU (autopar.runtime.emulate).
            speed = spec.speed / emu_scale if spec.is_emulated else 1.0
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
        eff = efficiency or DEFAULT_GPU_EFFICIENCY
        f, b_ = _roofline_table(analysis, spec, batches, eff)
        sources[t] = "roofline"
        adj = kernel_adjustments(analysis, spec.name, spec, eff) if use_kernel_times else None
        if adj is not None:  # tuned Triton kernels replace the roofline of the nodes they cover
            scale = (batches / analysis.batch_size)[:, None]
            f = np.maximum(f + adj[0] * scale, f * 0.05)
            b_ = np.maximum(b_ + adj[1] * scale, b_ * 0.05)
            sources[t] = "roofline + tuned Triton kernels"
        fwd_table[t], bwd_table[t] = f, b_
    if speeds and loss_fn is not None and example_targets is not None:   # the loss, on the last block
        from autopar.cost.loss import add_loss_to_tables, measure_loss

        add_loss_to_tables(fwd_table, bwd_table, batches,
                           measure_loss(analysis, model, example_inputs, loss_fn, example_targets, batches), speeds)
    emulated = {t: v for t, v in speeds.items() if cluster.spec_of(t).is_emulated}
    if emulated and tracking is not None:       # what the memory meter costs an emulated rank (engine_call)
        from autopar.cost.engine_call import measure_tracking

        _add_tracking(fwd_table, bwd_table, batches, stats, emulated,
                      measure_tracking(analysis, example_inputs, [int(b) for b in batches], tracking=tracking,
                                       loss_fn=loss_fn, example_targets=example_targets))
    per = analysis.batch_size
    # Mixed-precision training keeps activations in bf16 on GPUs; a cluster with CPU devices stays fp32.
    all_gpu = all(is_mixed_precision(cluster.spec_of(t)) for t in types)
    # Mixed precision (ZeRO paper accounting, 16 bytes per parameter): bf16 weights (2) and gradients (2),
    # fp32 master weights (4) with the optimizer state, which ZeRO-1 shards together.
    act_scale = 0.5 if all_gpu else 1.0
    weight_bytes_per_param = 2 if all_gpu else 4
    opt_bytes = OPTIMIZER_STATE_BYTES.get(optimizer, 8) + (4 if all_gpu else 0)
    from autopar.cost.step import step_terms  # optimizer step and per-call overhead per type

    terms = step_terms(analysis, cluster, model=model, example_inputs=example_inputs, optimizer=optimizer,
                       measured=measured is not None)
    costs = ModelCosts(
        block_names=tuple(s.name for s in stats),
        params=np.array([s.params for s in stats], float),
        param_bytes=np.array([s.params * weight_bytes_per_param for s in stats], float),
        act_bytes=np.array([s.saved_bytes / per * act_scale for s in stats], float),
        out_bytes=np.array([s.cut_bytes / per * act_scale for s in stats], float),
        fwd_flops=np.array([s.fwd_flops / per for s in stats], float),
        sample_batches=batches, fwd_table=fwd_table, bwd_table=bwd_table,
        optimizer_bytes_per_param=opt_bytes, grad_bytes_per_param=weight_bytes_per_param,
        tied_groups=analysis.tied_groups, sources=sources,
        output_bytes=_output_bytes(analysis) * act_scale, **terms,
        tp_pairs=_tp_pairs(analysis, len(stats)), **_tp_memory(analysis, len(stats)),
        param_tensors=param_tensors_per_block(analysis, len(stats)),
        **tp_graph_tables_of(analysis, len(stats)),   # SP and backward-overlap tables (cost.tp_tables)
    )
    if precision not in (None, "fp32"):
        from dataclasses import replace

        from autopar.cost.precision import precision_bytes

        costs = replace(costs, **precision_bytes(analysis, example_inputs, precision,
                                                 OPTIMIZER_STATE_BYTES.get(optimizer, 8)))
    if calibration == "auto":
        from autopar.cost.measure_cache import load_calibration

        calibration = load_calibration()
    if calibration:
        from autopar.cost.calibrate import calibrated, device_key

        keys = {t: device_key(cluster.spec_of(t), emu_scale) for t in types}
        costs = calibrated(costs, calibration, keys)
    return costs
