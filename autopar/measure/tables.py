"""The cost tables of a model on a cluster, measured where this machine can: the measurement layer's
one entry for ``autopar.plan``, ``compile`` and the CLI.

``model_costs`` decides what to time (the blocks in situ on this CPU for CPU and emulated types, the
loss, the memory meter's price, the optimizer step and the call terms), reads the Triton tuning cache
and this machine's calibration, then builds the tables with the pure cost model
(``autopar.cost.profile.time_tables`` and ``costs_of``, ``autopar.cost.calibrate.calibrated``).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from autopar.cluster.emulation import emulation_time_scale
from autopar.cost.precision import is_mixed_precision
from autopar.cost.profile import DEFAULT_GPU_EFFICIENCY, DEFAULT_SAMPLE_BATCHES, Efficiency, costs_of, time_tables
from autopar.ir.costs import ModelCosts
from autopar.ir.tables import TimeTables
from autopar.measure.blocks import measure_blocks
from autopar.passes.meta import BLOCK, COST

__all__ = ["model_costs", "kernel_adjustments", "rank_threads"]


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


@contextlib.contextmanager
def rank_threads(cluster):
    """torch's intra-op threads, while this machine times tables for ``cluster``, as its CPU ranks run
    them here (``autopar.cluster.emulation.cpu_shares``: one thread per emulated rank, a native CPU rank
    its share of the cores; the fewest when they differ). The process that plans keeps its own count
    otherwise: timed with every core, the tables of an emulated device were not what its one-thread
    rank runs, and a plan made from a shell priced another step than ``compile`` in the ranks."""
    from autopar.cluster.emulation import cpu_shares

    shares = [s for s in cpu_shares(cluster) if s is not None]
    old = torch.get_num_threads()
    if shares:
        torch.set_num_threads(min(s.num_threads for s in shares))
    try:
        yield
    finally:
        torch.set_num_threads(old)


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
    (``autopar.measure.cache.load_calibration``); None: none.

    ``measure``: time blocks on this machine for emulated / local device types (default: when the model
    has real weights). Without measurement, emulated devices fall back to a roofline of the nominal CPU.

    ``loss_fn`` with ``example_targets`` (the targets of ``example_inputs``' rows): the loss's forward
    and backward are timed too and added to the last block of the measured tables
    (``autopar.measure.loss``); without them the tables hold the model alone.

    ``tracking`` (``autopar.measure.engine_call.measure_tracking``'s: a callable returning a fresh memory
    meter and the CPU-time clock an emulated rank reads under it; None, default: not priced): what the
    rank's memory tracking adds to a micro-step's charged CPU time beyond the meter's own estimate, added
    to the measured tables of emulated types (whose ranks step under the meter), spread over the blocks
    by their operator counts.

    CPU and emulated tables are timed at the thread count the cluster's ranks run with (``rank_threads``).
    """
    with rank_threads(cluster):
        stats = analysis.stats
        batches = np.array(sorted(sample_batches), dtype=float)
        on_meta = model is None or any(p.is_meta for p in model.parameters())
        if measure is None:
            measure = not on_meta
        types = cluster.device_types()
        measured = None
        need_cpu = any(not is_mixed_precision(cluster.spec_of(t)) for t in types)
        if measure and need_cpu and not on_meta:
            measured = measure_blocks(analysis, model, example_inputs, [int(b) for b in batches], progress=progress)
        emu_scale = emulation_time_scale(len(cluster))
        adjust = {t: kernel_adjustments(analysis, t, cluster.spec_of(t), efficiency or DEFAULT_GPU_EFFICIENCY)
                  for t in types if use_kernel_times and is_mixed_precision(cluster.spec_of(t))}
        fwd_table, bwd_table, sources, speeds = time_tables(analysis, cluster, batches, measured=measured,
                                                            emulation_scale=emu_scale, efficiency=efficiency,
                                                            kernel_adjust=adjust)
        if speeds and loss_fn is not None and example_targets is not None:   # the loss, on the last block
            from autopar.measure.loss import add_loss_to_tables, measure_loss

            add_loss_to_tables(fwd_table, bwd_table, batches,
                               measure_loss(analysis, model, example_inputs, loss_fn, example_targets, batches), speeds)
        emulated = {t: v for t, v in speeds.items() if cluster.spec_of(t).is_emulated}
        if emulated and tracking is not None:       # what the memory meter costs an emulated rank (engine_call)
            from autopar.measure.engine_call import measure_tracking

            _add_tracking(fwd_table, bwd_table, batches, stats, emulated,
                          measure_tracking(analysis, example_inputs, [int(b) for b in batches], tracking=tracking,
                                           loss_fn=loss_fn, example_targets=example_targets))
        from autopar.measure.step import step_terms  # optimizer step and per-call overhead per type

        terms = step_terms(analysis, cluster, model=model, example_inputs=example_inputs, optimizer=optimizer,
                           measured=measured is not None)
        times = TimeTables(sample_batches=batches, fwd_table=fwd_table, bwd_table=bwd_table, sources=sources, **terms)
        costs = costs_of(analysis, cluster, times, optimizer=optimizer, precision=precision,
                         example_inputs=example_inputs)
        return _with_calibration(costs, cluster, types, emu_scale, calibration)


def _with_calibration(costs: ModelCosts, cluster, types, emu_scale: float, calibration) -> ModelCosts:
    """``costs`` with the correction factors of ``calibration`` applied ("auto": this machine's, from the
    profile cache; None or empty: as they are)."""
    if calibration == "auto":
        from autopar.measure.cache import load_calibration

        calibration = load_calibration()
    if not calibration:
        return costs
    from autopar.cost.calibrate import calibrated, device_key

    keys = {t: device_key(cluster.spec_of(t), emu_scale) for t in types}
    return calibrated(costs, calibration, keys)
