"""Where a data-parallel micro-step's CPU time goes on the emulated demo cluster, per rank: what the
emulated clock charged in the run against the cost model's tables and call overhead, and the engine's
own micro-step against the plain graph on the same rows, hot and after a sleep.

Emulated: three CPU processes of this machine at 1 / 0.5 / 0.25 (``autopar.launch`` of the built-in
``demo`` cluster, pinned as every run is); figures are native CPU milliseconds of one rank's thread (the
clock stretches them by ``time_scale / speed``). Predicted: the cost tables and
``ModelCosts.call_overhead`` (``autopar.measure.engine_call``), divided by the same factor.

A diagnosis, not a speed benchmark: it reads the clock's per-position least CPU time
(``EmulatedClock._least_cpu``, what the steady clock charges) and calls the data-parallel engine's
``_micro_step`` with its clock swapped for a ``NullClock``; both are private to the runtime and may move.
ZeRO-3 skips the engine-against-plain part (its weights are gathered only inside a step).

    PYTHONPATH=. python benchmarks/bench_engine_call.py [--model bert-tiny] [--zero-stage auto|0-3] [--gap 0.04]
        [--overlap on|off]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def worker(rank: int, model_name: str, batch: int, gap: float, zero, repeats: int = 12, overlap: bool = True) -> dict:
    import autopar
    from autopar.cluster.model import builtin
    from autopar.runtime.base import compute_loss
    from autopar.runtime.emulate import NullClock

    case = autopar.models.load(model_name, device="cpu", seed=0)
    cluster = builtin("demo")
    targets = case.batch(int(case.example_inputs[0].shape[0]), seed=0)[1]
    run = autopar.RunConfig(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), track_memory=False,
                            overlap=overlap)
    compiled = autopar.compile(case.model, cluster, case.example_inputs, batch, case.loss_fn, run=run,
                               strategy="dp", example_targets=targets, zero_stage=zero)
    data = [case.batch(batch, seed=s) for s in range(6)]
    for inputs, tgt in data:
        compiled.step(inputs, tgt)
    eng, clock = compiled.engine, compiled.engine.clock
    out = {"rank": rank, "charged_ms": [1e3 * x for x in getattr(clock, "_least_cpu", [])],
           "factor": getattr(clock, "time_scale", 1.0) / (getattr(clock, "speed", None) or 1.0)}
    if rank == 0:
        c, st = compiled.costs, compiled.plan.stages[0]
        out["predicted_ms"] = {}
        for g, mbs in enumerate(st.micro_batches):
            t = cluster.devices[st.groups[g][0]].spec.name
            out["predicted_ms"][st.groups[g][0]] = [
                (int(x), 1e3 * float(c.fwd_time(t, x).sum() + c.bwd_time(t, x).sum()), 1e3 * c.call_overhead(t))
                for x in mbs]
    if getattr(eng, "_micro", None) and eng.zero_stage < 3:
        inputs = eng._check_batch(data[0][0] if isinstance(data[0][0], tuple) else (data[0][0],), data[0][1])
        rows, tgt = eng._micro[0], data[0][1]
        local, target = [eng._take(x, rows) for x in inputs], eng._take(tgt, rows)
        eng.clock = NullClock()

        def engine_step():
            eng._micro_step(inputs, tgt, rows)

        def plain():
            (compute_loss(eng.gm(*local), target, eng.loss_fn) * 0.5).backward()

        times = {(n, g): [] for n in ("engine", "plain") for g in (0.0, gap)}
        for _ in range(repeats):
            for g in (0.0, gap):
                for name, fn in (("engine", engine_step), ("plain", plain)):
                    if g:
                        time.sleep(g)
                    t0 = time.thread_time()
                    fn()
                    times[(name, g)].append(time.thread_time() - t0)
        eng.clock = clock
        out["rows"] = rows.stop - rows.start
        out["least_ms"] = {f"{n}@{g:g}": 1e3 * min(v) for (n, g), v in times.items()}
    return out


def main(argv=None) -> None:
    import autopar
    from autopar.cluster.model import builtin

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert-tiny")
    ap.add_argument("--global-batch", type=int, default=48)
    ap.add_argument("--zero-stage", default="auto")
    ap.add_argument("--gap", type=float, default=0.04, help="the sleep before a cold call, seconds")
    ap.add_argument("--overlap", choices=("on", "off"), default="on",
                    help="RunConfig.overlap: the gradient buckets' all-reduce during the last backward")
    args = ap.parse_args(argv)
    zero = args.zero_stage if args.zero_stage == "auto" else int(args.zero_stage)
    res = autopar.launch(worker, builtin("demo"), args.model, args.global_batch, args.gap, zero, 12,
                         args.overlap == "on")
    pred = res[0]["predicted_ms"]
    print(f"{args.model} dp zero={zero} overlap {args.overlap} on the demo cluster (emulated), native CPU ms per "
          f"step's micro-steps; load {os.getloadavg()[0]:.1f}")
    for r in res:
        f = r["factor"]
        mbs = pred.get(r["rank"], pred.get(str(r["rank"]))) or []
        rows = "+".join(str(x) for x, _, _ in mbs)
        tables, call = sum(t for _, t, _ in mbs), sum(c for _, _, c in mbs)
        charged = r["charged_ms"]
        line = (f"rank {r['rank']} ({rows} rows): charged {sum(charged[:-1]):.2f} in {len(charged) - 1} block(s)"
                f" | predicted tables {tables / f:.2f} + call {call / f:.2f} = {(tables + call) / f:.2f}")
        if "least_ms" in r:
            m = r["least_ms"]
            line += (f" | hot engine {m['engine@0']:.2f} plain {m['plain@0']:.2f}; after {args.gap:g} s "
                     f"engine {m[f'engine@{args.gap:g}']:.2f} plain {m[f'plain@{args.gap:g}']:.2f}")
        print(line)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
