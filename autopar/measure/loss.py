"""The loss function's time, which the block tables leave out.

The engines call ``loss_fn(output, target)`` after the last block's forward and run its backward
before the last block's (data parallelism: in every micro-step; a pipeline: on the last stage), so
its seconds belong to the last block. ``measure_loss`` times it on this CPU at each sample micro-batch
of the tables: the model's output at that batch (computed once, without gradients, then detached as a
leaf that requires them), the loss forward and its backward into that leaf, each the least of
``repeats`` thread-CPU times (what an emulated rank's steady clock charges, as the block tables).
``add_loss_to_tables`` adds them, scaled like the tables (``cpu / speed * time_scale`` on emulated
types), to the last block's forward and backward columns of CPU / emulated device types; GPU types'
roofline tables stay as they are (a loss is a few small kernels there). Cross-entropy over 16 samples
of the tiny transformers' vocabulary takes 0.7-0.9 ms here (forward + backward), which a pipeline's
last stage pays once per micro-batch.

Cached with the block timings (``autopar.measure.cache.measure_cache_path()``), per graph, loss
function (its qualified name), target shape / dtype, micro-batch and CPU thread count.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from autopar.measure.cache import cpu_regime, graph_signature, load_json, measure_cache_path, save_json, tile_batch

__all__ = ["measure_loss", "add_loss_to_tables"]


def _loss_name(loss_fn) -> str:
    return f"{getattr(loss_fn, '__module__', '')}.{getattr(loss_fn, '__qualname__', type(loss_fn).__name__)}"


def _leaves(out):
    """The model output with every floating tensor detached into a leaf that requires grad."""
    def leaf(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.detach().requires_grad_(True)
        return t
    return torch.utils._pytree.tree_map(leaf, out)


def measure_loss(analysis, model, example_inputs: tuple, loss_fn, example_targets, batches, *,
                 repeats: int = 5, use_cache: bool = True) -> dict[int, tuple[float, float]]:
    """{micro-batch: (forward s, backward s)} of ``loss_fn(model(*inputs), targets)`` on this CPU
    (see the module docstring). ``example_targets``: the targets of ``example_inputs``' rows (batch
    dimension 0), tiled to each batch like the inputs."""
    if loss_fn is None or example_targets is None:
        return {}
    sig = graph_signature(analysis)
    tgt = example_targets if isinstance(example_targets, torch.Tensor) else None
    what = f"{tuple(tgt.shape)}|{tgt.dtype}" if tgt is not None else type(example_targets).__name__
    path = measure_cache_path()
    cache = load_json(path) if use_cache else {}
    out, changed = {}, False
    for b in (int(x) for x in batches):
        key = f"loss|{sig}|{_loss_name(loss_fn)}|{what}|b{b}|cpu|{cpu_regime()}|min"
        if key not in cache:
            inputs = tile_batch(tuple(example_inputs), b)
            targets = tile_batch((example_targets,), b)[0]
            with torch.no_grad():
                base = model(*inputs)
            fwd, bwd = [], []
            for _ in range(repeats + 1):             # the first is a warm-up
                y = _leaves(base)
                t0 = time.thread_time()
                loss = loss_fn(y, targets)
                t1 = time.thread_time()
                if loss.requires_grad:
                    loss.backward()
                t2 = time.thread_time()
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
            cache[key] = [float(min(fwd[1:])), float(min(bwd[1:]))]
            changed = True
        out[b] = (float(cache[key][0]), float(cache[key][1]))
    if use_cache and changed:
        save_json(path, cache)
    return out


def add_loss_to_tables(fwd_table: dict, bwd_table: dict, batches, loss_s: dict[int, tuple[float, float]],
                       speeds: dict[str, float]) -> None:
    """Add ``loss_s`` (``measure_loss``) to the last block of each table of ``speeds``' device types
    (``{type: speed}``, the divisor the block tables were scaled by), in place."""
    if not loss_s:
        return
    lf = np.array([loss_s[int(b)][0] for b in batches])
    lb = np.array([loss_s[int(b)][1] for b in batches])
    for t, speed in speeds.items():
        f, b_ = np.array(fwd_table[t], dtype=np.float64), np.array(bwd_table[t], dtype=np.float64)
        f[:, -1] += lf / speed
        b_[:, -1] += lb / speed
        fwd_table[t], bwd_table[t] = f, b_
