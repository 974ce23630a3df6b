"""Communication phases, measured against predicted: per collective phase of every rank (all-reduce,
broadcast, all-gather, reduce-scatter, send/recv, and waiting for peers), for data parallelism at a
ZeRO stage, uniform data parallelism and pipelines, on the emulated demo cluster (1 / 0.5 / 0.25).

Emulated: the devices are CPU processes of this machine slowed to their speed; the links between them
are gloo's, priced by the measured emulated link (``docs/emulation.md``, measured here before the run
when the profile cache has none). Predicted: the cost model (``compiled.profile()``'s predicted phases).
Each figure is the median over the measured steps of a rank's phase, averaged over the three ranks.
The strategies of one model run in one job, steps interleaved (``autopar.cli.trainer``).

    python benchmarks/bench_comm_phases.py [--models gpt-tiny,bert-tiny,resmlp,glumlp] [--zero auto]
        [--strategies dp,uniform-dp,pp] [--steps 4] [--name comm-phases]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import md_table, write_results  # noqa: E402

MODELS = {"gpt-tiny": ("gpt-tiny", 48), "bert-tiny": ("bert-tiny", 48),
          "resmlp": ("benchmarks.bench_accuracy:resmlp", 112), "glumlp": ("benchmarks.bench_accuracy:glumlp", 48)}
PHASES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "p2p", "wait")


def run_model(name: str, zero, strategies: tuple[str, ...], steps: int) -> list[dict]:
    import torch

    from autopar.cli.trainer import RunSpec, run_comparison
    from autopar.cluster.model import builtin
    from autopar.measure.links import emulated_link_for
    from autopar.ir.plan import Plan

    torch.set_num_threads(1)
    cluster = builtin("demo")
    emulated_link_for(cluster)          # measured here, once, before the ranks plan (as the CLI's planning does)
    spec_name, gb = MODELS[name]
    spec = RunSpec(model=spec_name, cluster_dict=cluster.to_dict(), global_batch=gb, steps=steps,
                   strategies=strategies, warmup_steps=2, zero_stage=zero, track_memory=False)
    load0 = os.getloadavg()[0]
    rows = []
    for r in run_comparison(spec, cluster):
        prof = r.profile
        zero_stage = Plan.from_json(r.plan_json).zero_stage
        phases = {}
        for ph in PHASES:
            m = [prof.measured(i.rank).get(ph, 0.0) for i in prof.ranks]
            p = [i.predicted.get(ph, 0.0) for i in prof.ranks]
            phases[ph] = (sum(m) / len(m), sum(p) / len(p))
        rows.append(dict(model=name, strategy=r.strategy, zero_stage=zero_stage, phases=phases,
                         measured_step_s=statistics.median(r.step_times_s), predicted_step_s=r.predicted_step_s,
                         load=(load0, os.getloadavg()[0])))
        print(f"  {name} {r.strategy} ZeRO-{zero_stage}: " + "; ".join(
            f"{ph} {m * 1e3:.1f}/{p * 1e3:.1f} ms" for ph, (m, p) in phases.items() if m > 5e-5 or p > 5e-5),
            flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt-tiny,bert-tiny,resmlp,glumlp")
    ap.add_argument("--strategies", default="dp,uniform-dp,pp")
    ap.add_argument("--zero", default="auto", help="ZeRO stage of every strategy (auto, 0, 1, 2, 3)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--name", default="comm-phases")
    args = ap.parse_args(argv)
    zero = args.zero if args.zero == "auto" else int(args.zero)
    rows = [row for m in args.models.split(",") if m
            for row in run_model(m, zero, tuple(args.strategies.split(",")), args.steps)]
    table = []
    for r in rows:
        for ph, (m, p) in r["phases"].items():
            if m > 5e-5 or p > 5e-5:
                table.append([r["model"], r["strategy"], r["zero_stage"], ph, f"{m * 1e3:.1f}", f"{p * 1e3:.1f}",
                              f"{m / p:.2f}" if p > 0 else "not priced", f"{r['load'][0]:.1f}-{r['load'][1]:.1f}"])
    md = ("# Communication phases, measured (emulated) against predicted\n\nPer rank, median over the measured "
          "steps, averaged over the demo cluster's three ranks.\n\n"
          + md_table(["model", "strategy", "ZeRO", "phase", "measured ms", "predicted ms", "ratio", "load"], table)
          + f"\n\nCommand: `python benchmarks/bench_comm_phases.py {' '.join(argv or sys.argv[1:])}`\n")
    write_results(args.name, {"rows": rows}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
