"""Step terms measured beyond the block tables: the optimizer step and the fixed cost of a compute call.

Terms
- optimizer step time: seconds of ``optimizer.step()`` per parameter a rank steps
  (``ModelCosts.optimizer_s_per_param``), and per tensor where it steps unflattened tensors
  (``optimizer_s_per_tensor``, ``measure_optimizer_per_tensor``). On CPU and emulated device types it is measured here
  (``measure_optimizer``: the CPU time of a step over fresh tensors of the model's parameter shapes, so
  the per-tensor overhead of torch's CPU optimizers counts as it does on that model; and over one flat
  buffer of an even ZeRO shard's size for ``optimizer_flat_s_per_param``, how data parallelism steps
  ZeRO shards; as many steppers at once as the cluster's CPU ranks that share a machine's cores,
  ``step_concurrency``, whose steps contend for its memory bandwidth), and
  emulated types are scaled like their block tables (``cpu / speed * time_scale``). On GPU types it is a
  memory-bound roofline (``optimizer_roofline_s_per_param``): the step reads and writes the optimizer
  state (with the fp32 master weights under mixed precision), reads the gradient and writes the
  weights, at ``OPTIMIZER_BANDWIDTH_EFFICIENCY`` of ``mem_bandwidth_Bps``.
- compute call: the work a rank runs between two waits, one stage's forward or backward of one
  micro-batch in a pipeline, one micro-step in data parallelism. An emulated device's clock sleeps
  after every call (``autopar.runtime.emulate``, with the factor of ``autopar.cluster.emulation``), and a call that starts after a sleep costs more CPU
  than the same call run back to back, as the block tables were timed (cold caches, re-scheduling):
  ``measure_call_overhead`` times the whole captured graph's forward call and backward call at a small
  micro-batch, hot and after a sleep, interleaved (a hot pair, then a cold pair, repeated), and keeps
  the mean difference of the least times of each (the steady clock charges the least;
  ``ModelCosts.call_overhead_s``,
  scaled like the block tables). 0 on GPU types, whose launch overheads are in the block tables.
  On clusters with emulated types the call is timed as the engines call, after the sleep the clock
  really takes (``autopar.measure.engine_call``: 20-60 ms, where this 10 ms sleep at 2 rows saw a third
  of the penalty), and that figure is the call overhead.

Measurements are cached with the block timings (``autopar.measure.cache.measure_cache_path()``).
GPU types get the roofline rate of ``autopar.cost.step.optimizer_roofline_s_per_param``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from autopar.cluster.emulation import emulation_time_scale, machine_cores
from autopar.cost.precision import is_mixed_precision
from autopar.cost.step import optimizer_roofline_s_per_param
from autopar.measure.cache import cpu_regime, graph_signature, load_json, measure_cache_path, save_json, tile_batch

__all__ = ["PER_TENSOR_PROBE", "measure_optimizer", "measure_optimizer_per_tensor", "kept_shapes",
           "step_concurrency", "flat_shard_numel", "measure_call_overhead", "step_terms"]

# At most this many parameters are allocated to time an optimizer step (larger models: a prefix).
_OPT_MAX_PARAMS = 4_000_000


def _make_optimizer(kind: str, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if kind == "sgd-nomomentum":
        return torch.optim.SGD(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3)


def _cache():
    path = measure_cache_path()
    return path, load_json(path), save_json


def measure_optimizer(optimizer: str = "adamw", shapes=None, *, repeats: int = 7, use_cache: bool = True,
                      concurrent: int = 1) -> float:
    """CPU seconds per parameter of one ``optimizer.step()`` on this CPU (with the threads torch uses
    now), over fresh tensors of ``shapes`` (default one flat vector of 1M elements; at most the first
    4M parameters' worth), state initialised, the least of ``repeats`` (what an emulated rank's steady
    clock charges, ``autopar.runtime.emulate``; the median carried the host's contention).
    ``optimizer``: "adamw", "adam", "sgd" (with momentum) or "sgd-nomomentum".

    ``concurrent``: how many ranks of the run step at once on this machine's cores (``step_concurrency``).
    That many threads, each with its own tensors, step together (a barrier before each repeat) and the
    figure is each repeat's mean of their thread CPU times: a step streams its state from memory, and
    ranks stepping at the same moment share the memory bandwidth (AdamW on 3M parameters, one thread:
    10.7 ms alone, 12.8-14.4 ms with a second stepping beside it on this 2-core machine), which one
    thread alone never sees."""
    import threading

    shapes = [tuple(int(d) for d in s) for s in (shapes if shapes is not None else [(1_000_000,)])]
    k = int(concurrent)
    if k < 1:
        raise ValueError(f"concurrent: {concurrent!r} must be an int >= 1")
    kept = kept_shapes(shapes)
    n = sum(int(np.prod(s)) if s else 1 for s in kept)
    key = f"optimizer|{optimizer}|{n}|{len(kept)}|cpu|{cpu_regime()}|min" + (f"|c{k}" if k > 1 else "")
    path, cache, save = _cache() if use_cache else (None, {}, None)
    if key not in cache:
        opts = []
        for _ in range(k):
            params = [torch.nn.Parameter(torch.zeros(s)) for s in kept]
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            opts.append(_make_optimizer(optimizer, params))
            opts[-1].step()                          # initialises the state
        ts = np.zeros((k, repeats))
        barrier = threading.Barrier(k)

        def stepper(i: int) -> None:
            for r in range(repeats):
                barrier.wait()
                t0 = time.thread_time()
                opts[i].step()
                ts[i, r] = time.thread_time() - t0

        if k == 1:
            stepper(0)
        else:
            workers = [threading.Thread(target=stepper, args=(i,), daemon=True) for i in range(k)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        cache[key] = float(ts.mean(axis=0).min()) / max(n, 1)
        if use_cache:
            save(path, cache)
    return float(cache[key])


def kept_shapes(shapes) -> list[tuple[int, ...]]:
    """The prefix of ``shapes`` ``measure_optimizer`` allocates (at most the first 4M parameters' worth)."""
    kept, n = [], 0
    for s in shapes:
        size = int(np.prod(s)) if s else 1
        if kept and n + size > _OPT_MAX_PARAMS:
            break
        kept.append(tuple(s))
        n += size
    return kept


# The per-tensor probe: this many tensors of this many elements against one flat buffer of them all.
PER_TENSOR_PROBE = (64, 256)


def measure_optimizer_per_tensor(optimizer: str, shapes, *, concurrent: int = 1) -> tuple[float, float]:
    """(seconds per parameter, seconds per tensor) of ``optimizer.step()`` over unflattened tensors of
    ``shapes`` on this CPU: the mean rate over those tensors (``measure_optimizer``), and what a tensor
    costs beyond its elements: ``PER_TENSOR_PROBE`` small tensors against one flat buffer of their size,
    the difference over their count (at least 0; both with ``concurrent``). Torch's CPU optimizers loop
    over tensors: AdamW pays tens of microseconds per tensor, which a model-mean rate per element spreads
    over the big tensors and a stage of a few small tensors (a head) then misses. The probe is small so
    the per-element noise of the two timings (a few % of a model's 4M-element step, tens of
    microseconds per tensor when divided by a model's 20-50 tensors) does not drown the term."""
    kept = kept_shapes([tuple(int(d) for d in s) for s in shapes])
    mixed = measure_optimizer(optimizer, kept, concurrent=concurrent)
    if len(kept) < 2:
        return mixed, 0.0
    count, size = PER_TENSOR_PROBE
    many = measure_optimizer(optimizer, [(size,)] * count, concurrent=concurrent)
    one = measure_optimizer(optimizer, [(size * count,)], concurrent=concurrent)
    return mixed, max(0.0, (many - one) * size)


def step_concurrency(cluster) -> int:
    """How many ranks of ``cluster`` step their optimizer at once on one machine's cores: the most CPU
    (or emulated CPU) ranks of one node, at most this machine's cores (``measure_optimizer``)."""
    per_node: dict[int, int] = {}
    for d in cluster.devices:
        if not is_mixed_precision(d.spec):
            per_node[d.node] = per_node.get(d.node, 0) + 1
    return max(1, min(max(per_node.values(), default=1), machine_cores()))


def measure_call_overhead(analysis, example_inputs: tuple, *, micro_batch: int = 2, gap_s: float = 0.01,
                          repeats: int = 15, use_cache: bool = True) -> float:
    """CPU seconds a compute call costs beyond its hot time when it starts after a ``gap_s`` sleep (see
    the module docstring), at least 0. Cached per graph (its blocks' signatures) and CPU thread count.
    Runs forward and backward on the captured graph, so it leaves the model's ``.grad`` cleared."""
    from autopar.passes.split import flat_inputs

    if not gap_s > 0:
        raise ValueError(f"gap_s: {gap_s!r} must be > 0 (the sleep a cold call starts after)")
    sig = graph_signature(analysis)
    key = f"call|{sig}|b{micro_batch}|g{gap_s}|cpu|{cpu_regime()}|min|interleaved"
    path, cache, save = _cache() if use_cache else (None, {}, None)
    if key not in cache:
        gm = analysis.captured.gm
        flat = flat_inputs(gm, tile_batch(tuple(example_inputs), micro_batch))
        held: list = []

        def fwd():
            held[:] = [o for o in torch.utils._pytree.tree_flatten(gm(*flat))[0]
                       if isinstance(o, torch.Tensor) and o.requires_grad]

        def bwd():
            if held:
                torch.autograd.backward(held, [torch.ones_like(o) for o in held])
            held.clear()

        # Hot and cold calls interleaved, so both series see the same moments of the host: timed as two
        # series one after the other, the difference of their least times moved 0-1.5 ms between two
        # processes on a loaded machine (bert-tiny: 0.51 and 0.0 ms), which a pipeline's every call pays
        # (x 48 on a quarter-speed device at slowdown 2).
        times = {0.0: ([], []), gap_s: ([], [])}
        fwd()
        bwd()
        for _ in range(repeats):
            for gap in (0.0, gap_s):
                for fn, ts in zip((fwd, bwd), times[gap]):
                    if gap:
                        time.sleep(gap)
                    t0 = time.thread_time()
                    fn()
                    ts.append(time.thread_time() - t0)
        hot = (min(times[0.0][0]), min(times[0.0][1]))
        cold = (min(times[gap_s][0]), min(times[gap_s][1]))
        gm.zero_grad(set_to_none=True)
        cache[key] = max(0.0, ((cold[0] - hot[0]) + (cold[1] - hot[1])) / 2)
        if use_cache:
            save(path, cache)
    return float(cache[key])


def flat_shard_numel(analysis, cluster) -> int:
    """Elements of the flat buffer the flat rate is timed on: an even ZeRO shard of the model over the
    cluster (at least 64k, at most 4M). The rate per parameter depends on the size (a shard that fits
    in the CPU's caches steps faster than one that streams from memory: AdamW on this machine, 10 ns
    per parameter at 1M, less on a 73k shard), so a fixed 1M buffer over-priced small models' shards."""
    params = float(sum(s.params for s in analysis.stats))
    return int(min(_OPT_MAX_PARAMS, max(65_536, params / max(1, len(cluster)))))


def step_terms(analysis, cluster, *, model=None, example_inputs=None, optimizer: str = "adamw",
               measured: bool = False) -> dict[str, dict[str, float]]:
    """The ``ModelCosts`` fields ``optimizer_s_per_param``, ``optimizer_flat_s_per_param``,
    ``optimizer_s_per_tensor`` (``measure_optimizer_per_tensor``; with real weights only) and
    ``call_overhead_s``, each per device type of ``cluster`` (see the module docstring), and
    ``call_kinds`` (``EngineCalls.kinds``), as keyword arguments. ``measured``: the block tables of CPU /
    emulated types were measured here (then the call overhead is measured too, else it is 0); a model
    without real weights has its optimizer timed on the flat buffer. On a cluster with emulated types the
    call overhead is this machine's engine call after the clock's sleep, timed on a fixed probe network
    (``autopar.measure.engine_call.measure_machine_calls``), else ``measure_call_overhead`` of the model."""

    types = cluster.device_types()
    specs = {t: cluster.spec_of(t) for t in types}
    cpu_types = [t for t, s in specs.items() if not is_mixed_precision(s)]
    mixed = not cpu_types      # GPU-only clusters train in mixed precision (autopar.cost.profile)
    opt, flat, call, per_tensor, restart = {}, {}, {}, {}, {}
    cpu_opt = cpu_flat = cpu_call = cpu_tensor = cpu_bucket = 0.0
    kinds: dict[str, float] = {}
    if cpu_types:
        real = model is not None and not any(p.is_meta for p in model.parameters())
        shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad] if real else None
        k = step_concurrency(cluster)
        cpu_flat = measure_optimizer(optimizer, [(flat_shard_numel(analysis, cluster),)], concurrent=k)
        cpu_opt = cpu_flat
        if shapes:
            cpu_opt, cpu_tensor = measure_optimizer_per_tensor(optimizer, shapes, concurrent=k)
    scale = emulation_time_scale(len(cluster))
    fastest = max((specs[t].speed for t in cpu_types if specs[t].is_emulated), default=None)
    if cpu_types and measured and fastest is not None and scale / fastest > 1:
        from autopar.measure.engine_call import measure_machine_calls

        calls = measure_machine_calls(sleep_factor=scale / fastest - 1)      # the machine's, not the model's
        cpu_call, cpu_bucket, kinds = calls.per_call_s, calls.bucket_s, calls.kinds()
    elif cpu_types and measured and real and example_inputs is not None:
        cpu_call = measure_call_overhead(analysis, example_inputs)
    for t, spec in specs.items():
        if t in cpu_types:
            speed = spec.speed / scale if spec.is_emulated else 1.0
            opt[t], flat[t], call[t] = cpu_opt / speed, cpu_flat / speed, cpu_call / speed
            if cpu_tensor:
                per_tensor[t] = cpu_tensor / speed
            if cpu_bucket and spec.is_emulated:      # only an emulated clock pauses and sleeps
                restart[t] = cpu_bucket / speed
        else:
            opt[t] = flat[t] = optimizer_roofline_s_per_param(spec, optimizer, mixed_precision=mixed)
            call[t] = 0.0
    return {"optimizer_s_per_param": opt, "optimizer_flat_s_per_param": flat, "call_overhead_s": call,
            "optimizer_s_per_tensor": per_tensor, "bucket_restart_s": restart, "call_kinds": kinds}
