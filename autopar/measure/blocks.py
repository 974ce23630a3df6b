"""Block times measured in situ: the forward and backward seconds of every block of a captured graph
as a training step runs them, on this machine (a CPU, or a CUDA GPU whose name matches), cached on
disk keyed by the graph's block signatures, micro-batch, device name, threads and dtype
(``autopar.measure.cache``). ``autopar.measure.tables`` turns them into a cluster's time tables."""

from __future__ import annotations

import time

import numpy as np
import torch

from autopar.cluster.heap import heap_held
from autopar.measure.cache import graph_signature, load_json, measure_cache_path, save_json, tile_batch
from autopar.passes.grad_fusion import PlainSink, fused_copy
from autopar.passes.meta import BLOCK

__all__ = ["measure_blocks", "threads", "MEASURE_VERSION"]


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
    hooks (its linears' weight gradients accumulated inside their GEMMs, ``passes.grad_fusion``, as the
    engines run it), once after every hooked run (the hooks, the split's module calls and the clock reads cost
    time a step does not spend: the hooked totals ran 0-14% above on gpt-tiny and resmlp at 16
    samples here, up to 20% on a loaded host), so the hooks give the split between blocks only. Identical blocks (``struct_hash``)
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
    split = subs = whole = None
    out: dict[int, np.ndarray] = {}
    for b in batches:
        k = _key(sig, b, dev_name, threads())
        if k not in cache:
            if split is None:
                split = split_module(gm, model, lambda node: node.meta[BLOCK], keep_original_order=True)
                subs = {int(name.split("_")[1]): mod for name, mod in split.named_children()
                        if name.startswith("submod_")}
                # the whole graph as the engines run it: weight gradients accumulated in their GEMMs
                whole = fused_copy(gm, PlainSink(p for p in gm.parameters() if p.requires_grad))[0]
            res = _in_situ(split, subs, n, tile_batch(example_inputs, b), repeats, sync, clock, stat, min_time_s,
                           whole=whole)
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
            f, g = _block_rows(n, fwd_marks, grad_marks, t0, t1, t2)
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
    if plain_fwd:       # hooks and the split's calls cost time a step does not spend: the totals unhooked
        fwd_total, bwd_total = plain_fwd, plain_bwd
    return _scaled_rows(fwd_runs, bwd_runs, fwd_total, bwd_total, stat)


def _block_rows(n: int, fwd_marks, grad_marks, t0: float, t1: float, t2: float) -> tuple[np.ndarray, np.ndarray]:
    """One run's per-block forward and backward seconds from its marks: forward from each block's start
    to the next's (the graph's glue before the first block counted in it), backward from each block's
    last output gradient to the next (last block first; the outputs' gradients in the last block's)."""
    f = np.zeros(n)
    marks = sorted(fwd_marks) + [(t1, -1)]
    f[marks[0][1]] += marks[0][0] - t0
    for (ta, i), (tb, _) in zip(marks, marks[1:]):
        f[i] += tb - ta
    g = np.zeros(n)
    order = sorted((t, i) for i, t in grad_marks.items())
    if order:
        g[order[0][1]] += order[0][0] - t1
        for (ta, i), (tb, _) in zip(order, order[1:] + [(t2, -1)]):
            g[i] += tb - ta
    return f, g


def _scaled_rows(fwd_runs, bwd_runs, fwd_total, bwd_total, stat: str) -> np.ndarray:
    """(2, n): the runs' per-block rows by ``stat`` (min or median), each row scaled to its totals'."""
    pick = np.min if stat == "min" else np.median
    res = np.stack([pick(np.stack(fwd_runs), axis=0), pick(np.stack(bwd_runs), axis=0)])
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
MEASURE_VERSION = "insitu-v4"


def _key(sig: str, b: int, dev: str, nthreads: int) -> str:
    return (f"{MEASURE_VERSION}|{sig}|b{b}|{dev}|t{nthreads}|fp32"
            + ("|cpu-time" if dev == "cpu" and nthreads == 1 else "") + ("|held" if heap_held() else ""))
