"""What a compute call costs an emulated rank beyond its blocks' hot timings, timed as the engines call.

Why: the block tables (``autopar.measure.blocks.measure_blocks``) take the least of hot repeats, one
run right after the other. An emulated rank never runs hot: its clock sleeps after every compute block
(``autopar.runtime.emulate``: ``target - wall``, i.e. ``cpu x (time_scale / speed - 1)``, tens of
milliseconds), and the call after the sleep starts with cold caches. On bert-tiny dp on the demo cluster
(native, load 3-4, ``/tmp``-style launch script) a micro-step's engine code itself added 0-0.65 ms to the
plain graph's forward + loss + backward (13.08 vs 13.11 ms at 32 rows, 3.57 vs 2.92 ms at 3 rows, least of
12 hot runs in the rank's own process), while the same call after a 40 ms sleep cost 0.5-1.5 ms more,
and in the forward (the backward right after it runs hot). ``autopar.measure.step.measure_call_overhead``
priced that start after a 10 ms sleep at 2 rows: 0.14 ms there, 0.2-0.3 ms alone on one core, against
0.6-1.2 ms after 40-160 ms (the penalty grows with the sleep up to ~40 ms, then stays).

What (``measure_engine_calls``, ``EngineCalls``): the captured graph run as the engines run a call, at
``micro_batch`` rows tiled from the example inputs:
- the loss (``loss_fn`` on the tiled targets, else the outputs' sum) weighted by the micro-batch's share
  of the batch, as every engine weights it, and the backward accumulating into the gradients already
  there (the data-parallel engine's ``.grad`` are views of one flat buffer, kept between steps);
- the data-parallel engine's call, a micro-step: forward, loss and backward as one compute block, after a
  sleep (``micro_step_s``: its least minus the least hot micro-step);
- the pipeline engine's calls: a stage's forward (with the loss on the last stage) after a sleep, the
  micro-step's own forward, and its backward after another sleep (``forward_s``, ``backward_s``);
- hot and cold runs interleaved (a hot micro-step, a cold one, a cold backward), so all
  see the same moments of the host; the median over ``repeats`` of each repeat's cold minus hot time;
- the sleep: ``call_gap_s``, what the clock of the cluster's fastest emulated type sleeps after the hot
  micro-step (``time_scale / speed - 1`` times it), within 40-50 ms (the penalty stops growing near 40 ms;
  the clock's real sleeps are 2-23x a call's CPU time, tens of milliseconds);
- a backward paused half-way (``bucket_s``): the data-parallel engine's last backward is paused at every
  gradient bucket's launch (``autopar.runtime.dp_overlap``: the clock settles, i.e. sleeps, before the
  all-reduce is issued), and the rest of that backward starts cold; timed as a backward whose middle
  parameter's gradient hook sleeps ``bucket_gap_s`` (the clock's settling of half the hot backward),
  against the hot backward right before it. resmlp at load 1.1: 0.70 and 0.41 ms; in resmlp dp runs on
  the demo cluster (load 1.1-1.4) overlap on charged the micro-step 6.0 / 6.9 ms more than overlap off
  on the speed-1 rank (84 rows) and 1.7 / 8.3 ms on the speed-0.5 rank (28 rows), 16 buckets: 0.1-0.5
  ms a launch. Not priced yet (see docs/insitu-profile.md);
- 2 rows: the penalty is a refill of caches and hardly depends on the rows, and the small call keeps the
  hosts' noise small against it (at 8 rows two measurements at load 3 gave 0 and 3.3 ms on resmlp, at 2 rows
  1.3 and 2.1; bert-tiny 0.68 and 0.59, gpt-tiny 0.73 and 0.58 ms).

The machine probe (``measure_machine_calls``, what the cost model prices): the same measurement on a
fixed small network (``_ProbeNet``: embeddings, six pre-norm MLP blocks, a vocabulary head and its
token loss; about 3 ms a hot micro-step at 2 rows, gpt-tiny's is 4-5 ms), ``MACHINE_REPEATS`` times,
once per machine. The cold start is mostly the host's (code paths, caches and predictors refilled
after an idle gap); on a model's own graph the median over 11 repeats is a small difference of two
noisy times, and the noise grows with the model. Four measurements in a row (emulation off, one core,
sleep factor 5): gpt-tiny (5 ms hot) per call 0.64-0.75 ms, while resmlp and glumlp
(18-24 ms hot) gave 0.70-1.97 and 0.51-2.22 ms, their kinds in random order (resmlp's cached figure
once priced a data-parallel micro-step at 0 and a stage backward at twice the median). A figure cached
that way is a fixed error of one model that no calibration on another can carry. The probe gives
every model the machine's figure: 0.39-0.74 ms per call in three measurements (backward 0.88-0.96,
bucket restart 0.71-0.75); a two-block probe measured less (0.34-0.68): the start grows somewhat with
the code a call runs, which the probe prices as a gpt-tiny-sized network's. Calibration's ``call``
term refines it per device type.

Priced (``autopar.cost.step``): ``call_overhead_s`` is ``EngineCalls.per_call_s`` (the median of the three
call kinds) scaled like the block tables, and ``call_kinds`` each kind's part of it (``EngineCalls.kinds``:
a data-parallel micro-step is priced at the micro-step's figure, a stage's forward and backward calls at
theirs; bert-tiny at 2 rows, one core, load 0.2: micro-step 1.10-1.29 ms, forward 0.82-0.92, backward
0.90-1.05, five measurements: the micro-step's cold start is its forward's and its backward's); a call's
CPU time is stretched as its blocks'. Every planner
prices it per compute call already (one per data-parallel micro-step, one per pipeline forward and one
per backward), and
``autopar.cost.step.predicted_phases`` lays a data-parallel micro-step's out in ``forward``, where the
recorder measures it (``autopar.runtime.recorder``: a micro-step's block is forward until the graph's
forward hook fires). Not measured here: the tensor-parallel and ZeRO-3 engines split a micro-step into
several blocks (the clock settles before each collective), and each block after a collective starts
cold again; those calls are priced as one.

Cached in ``measure.json`` (``autopar.measure.cache``) by the graph (the machine probe: its
version and repeats), micro-batch, sleep, loss, CPU threads and ``machine_id()``, so another machine
measures its own. Emulated figures only: GPU types
pay none of this (``call_overhead_s`` 0 there).

Memory tracking (``measure_tracking``): an emulated rank steps under its memory meter
(``autopar.runtime.memory.TrackedMeter``, a Python dispatch mode: a call per operator), and its clock
stretches the CPU time less what the meter estimates the tracking cost (operators dispatched times a
per-operator cost probed once per process on a 4-element add). The estimate falls short on real
operators: gpt-tiny micro-steps at 13-32 rows (440 operators, one thread, load 6) cost 11-14 us per
operator under tracking against the probe's 7.2, a residual of 1.6-2.9 ms per micro-step (13-18% of
it), which the clock then stretches; in demo dp runs, tracking on against off in the same ranks charged
20-25% more CPU per step (``docs/insitu-profile.md``). ``measure_tracking`` times that
residual as a rank is charged: the micro-step (forward with the loss, then backward) plain, and under
a fresh meter read through the clock's own CPU time less the tracking (``tracking``, a callable the
caller gives, ``autopar.runtime.memory``'s: the cost model does not import the runtime), each after a
sleep of ``gap_s`` (a rank's every call starts after its clock's sleep, and the tracking's Python code
and data start cold too: at 32 rows, load 8-10, the residual was 1.9-4.7 ms after a 0.1 s sleep
against 1.9-2.3 hot, noisy; demo dp ranks charged 3.6-5.5 ms more per micro-step at 19-32 rows with
tracking on), interleaved, the median of the paired differences per phase, at the smallest, a middle and the largest sample
micro-batch (the residual grows with the rows: the operators' caches refill after every Python call),
linear in the rows between them. ``autopar.measure.tables.model_costs`` adds it to emulated types'
tables, spread over the blocks by their operator counts, and scaled like them. Cached like the calls,
by graph, micro-batch, loss, threads and machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from autopar.ir.costs import CALL_KINDS   # the kinds' order: micro-step, forward, backward
from autopar.measure.cache import cpu_regime, graph_signature, load_json, machine_id, measure_cache_path, save_json, tile_batch

__all__ = ["EngineCalls", "measure_engine_calls", "measure_machine_calls", "MACHINE_REPEATS", "call_gap_s", "CALL_GAP_RANGE_S", "CALL_MICRO_BATCH",
           "bucket_gap_s", "BUCKET_GAP_RANGE_S", "measure_tracking", "tracking_batches", "KIND_OUTLIER"]

# The sleep a cold call is timed after, in seconds: at least / at most (``call_gap_s``).
CALL_GAP_RANGE_S = (0.04, 0.05)
# The sleep a bucket launch's pause is timed with (``bucket_gap_s``): the clock settles the backward
# done since its last settle, shorter than a call's gap (resmlp dp on the demo cluster: 16 buckets)
BUCKET_GAP_RANGE_S = (0.005, 0.05)
# Rows the calls are timed at: the penalty is a cache refill and hardly depends on the rows (bert-tiny
# after a 40 ms sleep: 0.86, 1.18, 0.84 ms at 2, 8, 32 rows; load 3.6, one core).
CALL_MICRO_BATCH = 2
# A kind of call timed more than this many times the median of the three is capped there (``EngineCalls``)
KIND_OUTLIER = 2.0
_VERSION = 4
# The machine probe (``measure_machine_calls``): its repeats, and the version of its network (``_ProbeNet``)
MACHINE_REPEATS = 31
_PROBE_VERSION = 1


@dataclass(frozen=True, slots=True)
class EngineCalls:
    """CPU seconds a call costs beyond its hot time when it starts after ``gap_s`` of sleep (see the
    module docstring), on this CPU, at ``micro_batch`` rows; ``hot_s`` the hot micro-step."""
    micro_step_s: float     # the data-parallel engine's call: forward + loss + backward
    forward_s: float        # the pipeline engine's forward call
    backward_s: float       # the pipeline engine's backward call
    hot_s: float
    gap_s: float
    micro_batch: int
    # a backward resumed after a pause half-way, as a gradient bucket's launch pauses the data-parallel
    # engine's last backward (autopar.runtime.dp_overlap): its cold restart, per launch
    bucket_s: float = 0.0

    @property
    def per_call_s(self) -> float:
        """One figure per compute call (``ModelCosts.call_overhead_s``, which every planner charges per
        call: one per data-parallel micro-step, one per pipeline forward and one per backward): the
        median of the three call kinds (``kinds`` gives each kind's part), so one disturbed kind does
        not move it."""
        return float(sorted(self._kinds_s())[1])

    def _kinds_s(self) -> tuple[float, float, float]:
        """The three kinds' figures, each at most ``KIND_OUTLIER`` times their median: a host's burst
        that outlasts a kind's repeats (seen once: a stage backward's 5.8 ms against 0.9 and 0.7 ms
        for the other two, in a fresh planning process, load 0.6) is not a call's cost."""
        raw = (max(0.0, self.micro_step_s), max(0.0, self.forward_s), max(0.0, self.backward_s))
        cap = KIND_OUTLIER * sorted(raw)[1]
        return tuple(min(x, cap) for x in raw)

    def kinds(self) -> dict[str, float]:
        """``ModelCosts.call_kinds``: each kind of call (``autopar.ir.costs.CALL_KINDS``) as a factor on
        ``per_call_s``; {} when that is 0."""
        per = self.per_call_s
        if not per > 0:
            return {}
        return {k: v / per for k, v in zip(CALL_KINDS, self._kinds_s())}

    def to_dict(self) -> dict:
        return {"micro_step_s": self.micro_step_s, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "hot_s": self.hot_s, "gap_s": self.gap_s, "micro_batch": self.micro_batch,
                "bucket_s": self.bucket_s}


def call_gap_s(hot_s: float, sleep_factor: float) -> float:
    """The sleep after a call of ``hot_s`` CPU seconds on a clock that stretches CPU time by
    ``sleep_factor + 1`` (``time_scale / speed``), within ``CALL_GAP_RANGE_S``."""
    lo, hi = CALL_GAP_RANGE_S
    return float(min(hi, max(lo, hot_s * max(0.0, float(sleep_factor)))))


def bucket_gap_s(backward_s: float, sleep_factor: float) -> float:
    """The sleep of the clock's settling at a bucket launch half-way through a backward of ``backward_s``
    CPU seconds (half of it stretched by ``sleep_factor``), within ``BUCKET_GAP_RANGE_S``."""
    lo, hi = BUCKET_GAP_RANGE_S
    return float(min(hi, max(lo, 0.5 * backward_s * max(0.0, float(sleep_factor)))))


def _loss_of(out, loss_fn, targets):
    if loss_fn is not None and targets is not None:
        return loss_fn(out, targets)
    leaves = [o for o in torch.utils._pytree.tree_flatten(out)[0]
              if isinstance(o, torch.Tensor) and o.requires_grad]
    return sum(o.float().sum() for o in leaves) if leaves else None


def _micro_step(gm, example_inputs: tuple, micro_batch: int, loss_fn, example_targets):
    """(forward, backward) of one micro-step of ``gm`` at ``micro_batch`` rows: the forward with the loss
    (``loss_fn`` on the tiled targets; None: the outputs summed), kept for the backward that follows."""
    from autopar.passes.split import flat_inputs

    flat = flat_inputs(gm, tile_batch(tuple(example_inputs), micro_batch))
    targets = tile_batch((example_targets,), micro_batch)[0] if loss_fn is not None else None
    held: list = []

    def forward() -> None:
        loss = _loss_of(gm(*flat), loss_fn, targets)
        held[:] = [] if loss is None else [loss * 0.5]     # weighted by the micro-batch's share

    def backward() -> None:
        if held:
            held.pop().backward()

    return forward, backward


def _paired(cold: list, hot: list) -> float:
    """The median of the repeats' cold-minus-hot differences, at least 0: each pair ran at the same moment
    of the host, so the host's drift between repeats cancels (differences of the least times moved by
    1-2.6 ms between two measurements of resmlp at load 3)."""
    import statistics

    return max(0.0, float(statistics.median(c - h for c, h in zip(cold, hot))))


def measure_engine_calls(analysis, example_inputs: tuple, *, sleep_factor: float, loss_fn=None,
                         example_targets=None, micro_batch: int = CALL_MICRO_BATCH, repeats: int = 11,
                         use_cache: bool = True) -> EngineCalls:
    """The calls' cost after the clock's sleep on ``analysis``' own graph (see the module docstring),
    cached. ``sleep_factor``: the fastest emulated type's ``time_scale / speed - 1`` (the sleep is
    ``call_gap_s`` of the hot micro-step). Runs the captured graph, so the model's ``.grad`` are cleared
    afterwards. The cost model prices the machine's figure instead (``measure_machine_calls``)."""
    with_loss = loss_fn is not None and example_targets is not None
    key = (f"engine-call|v{_VERSION}|{graph_signature(analysis)}|b{int(micro_batch)}|s{float(sleep_factor):.3g}"
           f"|loss{int(with_loss)}|cpu|{cpu_regime()}|{machine_id()}")
    return _cached_calls(key, lambda: (analysis.captured.gm, example_inputs, loss_fn if with_loss else None,
                                       example_targets),
                         sleep_factor=sleep_factor, micro_batch=micro_batch, repeats=repeats, use_cache=use_cache)


class _ProbeNet(torch.nn.Module):
    """The machine probe's network: token embeddings, six pre-norm MLP blocks and a vocabulary head,
    the usual operators of a training step (``measure_machine_calls``)."""

    def __init__(self, vocab: int = 256, width: int = 64, depth: int = 6):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(depth + 1))
        self.ups = torch.nn.ModuleList(torch.nn.Linear(width, 4 * width) for _ in range(depth))
        self.downs = torch.nn.ModuleList(torch.nn.Linear(4 * width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            x = x + down(torch.nn.functional.gelu(up(norm(x))))
        return self.head(self.norms[-1](x))


def _token_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def measure_machine_calls(*, sleep_factor: float, micro_batch: int = CALL_MICRO_BATCH,
                          repeats: int = MACHINE_REPEATS, use_cache: bool = True) -> EngineCalls:
    """The calls' cost after the clock's sleep on this machine (see the module docstring, machine
    probe): ``measure_engine_calls``' measurement on a fixed small network (``_ProbeNet``, 16 tokens a
    row, its loss included) rather than the model's graph, ``repeats`` times; cached per machine, sleep
    factor, rows and CPU threads. Leaves the global RNG as it found it."""
    key = (f"engine-call-machine|v{_VERSION}|probe{_PROBE_VERSION}|b{int(micro_batch)}|s{float(sleep_factor):.3g}"
           f"|r{int(repeats)}|cpu|{cpu_regime()}|{machine_id()}")
    return _cached_calls(key, _probe_call, sleep_factor=sleep_factor, micro_batch=micro_batch, repeats=repeats,
                         use_cache=use_cache)


def _probe_call() -> tuple:
    """(graph, example inputs, loss, targets) of the machine probe, built without touching the global RNG."""
    from torch import fx

    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gm = fx.symbolic_trace(_ProbeNet())
    tokens = torch.randint(0, 256, (2, 16), generator=g)
    return gm, (tokens,), _token_loss, torch.randint(0, 256, (2, 16), generator=g)


def _cached_calls(key: str, build, *, sleep_factor: float, micro_batch: int, repeats: int,
                  use_cache: bool) -> EngineCalls:
    """``EngineCalls`` under ``key`` in the measure cache, else measured (see ``measure_engine_calls``) on
    what ``build()`` gives, ``(graph, example inputs, loss function or None, targets)``, and cached."""
    if not sleep_factor > 0:
        raise ValueError(f"sleep_factor: {sleep_factor!r} must be > 0 (an emulated clock sleeps after a call)")
    if int(repeats) < 1:
        raise ValueError(f"repeats: {repeats!r} must be an int >= 1")
    path = measure_cache_path()
    cache = load_json(path) if use_cache else {}
    if key not in cache:
        gm, example_inputs, loss_fn, example_targets = build()
        forward, backward = _micro_step(gm, example_inputs, int(micro_batch), loss_fn, example_targets)

        def timed(fn) -> float:
            t0 = time.thread_time()
            fn()
            return time.thread_time() - t0

        for _ in range(3):                                      # warm-up; gradients exist from here on
            forward()
            backward()
        pause = {"on": False}
        params = [p for p in gm.parameters() if p.requires_grad]
        mid = params[len(params) // 2] if params else None

        def paused(_p) -> None:                 # the bucket launch's pause: the clock's settling sleep
            if pause["on"]:
                pause["on"] = False
                time.sleep(bucket_gap)

        hook = mid.register_post_accumulate_grad_hook(paused) if mid is not None else None
        hot_f, hot_b, cold_step, cold_f, cold_b, hot_b2, resumed = [], [], [], [], [], [], []
        gap = None
        try:
            for _ in range(int(repeats)):
                hot_f.append(timed(forward))
                hot_b.append(timed(backward))
                if gap is None:
                    gap = call_gap_s(hot_f[0] + hot_b[0], sleep_factor)
                    bucket_gap = bucket_gap_s(hot_b[0], sleep_factor)
                time.sleep(gap)                 # a micro-step after the sleep: its forward is the stage forward's
                cold_f.append(timed(forward))   # call too (the loss in it, as on a last stage)
                cold_step.append(cold_f[-1] + timed(backward))
                forward()
                time.sleep(gap)                 # a stage backward after the sleep
                cold_b.append(timed(backward))
                forward()                       # a backward paused half-way (thread time: the sleep is not in it)
                hot_b2.append(timed(backward))  # against the hot backward right before it
                forward()
                pause["on"] = True
                resumed.append(timed(backward))
        finally:
            if hook is not None:
                hook.remove()
        gm.zero_grad(set_to_none=True)
        hot = [f + b for f, b in zip(hot_f, hot_b)]
        cache[key] = EngineCalls(_paired(cold_step, hot), _paired(cold_f, hot_f), _paired(cold_b, hot_b),
                                 min(hot), float(gap), int(micro_batch),
                                 _paired(resumed, hot_b2)).to_dict()
        if use_cache:
            save_json(path, cache)
    return EngineCalls(**cache[key])


_TRACKING_VERSION = 2


def tracking_batches(batches) -> list[int]:
    """The micro-batches ``measure_tracking`` times of ``batches`` (sorted): the smallest, the one in the
    middle and the largest."""
    bs = sorted({int(b) for b in batches})
    return sorted({bs[0], bs[len(bs) // 2], bs[-1]}) if bs else []


def measure_tracking(analysis, example_inputs: tuple, batches, *, tracking, loss_fn=None, example_targets=None,
                     repeats: int = 7, gap_s: float = CALL_GAP_RANGE_S[0],
                     use_cache: bool = True) -> dict[int, tuple[float, float]]:
    """{micro-batch: (forward s, backward s)} of CPU time an emulated clock charges a micro-step under
    memory tracking beyond the same micro-step untracked (see the module docstring), at every micro-batch
    of ``batches``: measured at ``tracking_batches(batches)``, linear in the rows between them (the ends'
    values beyond them), each at least 0. ``tracking``: a callable returning ``(meter, cpu_time)``, a fresh
    meter (a context manager that tracks while entered) and the CPU-time clock an emulated clock reads
    under it; ``gap_s``: the sleep before every timed micro-step (0: hot). Runs the captured graph, so the
    model's ``.grad`` are cleared afterwards."""
    import numpy as np

    if int(repeats) < 1:
        raise ValueError(f"repeats: {repeats!r} must be an int >= 1")
    if not gap_s >= 0:
        raise ValueError(f"gap_s: {gap_s!r} must be >= 0")
    want = [int(b) for b in batches]
    if not want:
        return {}
    sig = graph_signature(analysis)
    with_loss = loss_fn is not None and example_targets is not None
    path = measure_cache_path()
    cache = load_json(path) if use_cache else {}
    changed = False
    measured: dict[int, tuple[float, float]] = {}
    gm = analysis.captured.gm
    for b in tracking_batches(want):
        key = (f"tracking|v{_TRACKING_VERSION}|{sig}|b{b}|g{float(gap_s):.3g}|loss{int(with_loss)}|cpu"
               f"|{cpu_regime()}|{machine_id()}")
        if key not in cache:
            forward, backward = _micro_step(gm, example_inputs, b, loss_fn if with_loss else None, example_targets)

            def timed(cpu) -> tuple[float, float]:
                if gap_s > 0:
                    time.sleep(gap_s)
                t0 = cpu()
                forward()
                t1 = cpu()
                backward()
                return t1 - t0, cpu() - t1

            for _ in range(2):                       # warm-up, untracked then tracked
                forward()
                backward()
            meter, cpu = tracking()
            with meter:
                timed(cpu)
            plain, tracked = [], []
            for _ in range(int(repeats)):
                plain.append(timed(time.thread_time))
                meter, cpu = tracking()
                with meter:
                    tracked.append(timed(cpu))
            cache[key] = [_paired([t[i] for t in tracked], [p[i] for p in plain]) for i in (0, 1)]
            changed = True
        measured[b] = (float(cache[key][0]), float(cache[key][1]))
    if changed:
        gm.zero_grad(set_to_none=True)
        if use_cache:
            save_json(path, cache)
    xs = sorted(measured)
    out = {}
    for b in want:
        out[b] = tuple(max(0.0, float(np.interp(b, xs, [measured[x][i] for x in xs]))) for i in (0, 1))
    return out
