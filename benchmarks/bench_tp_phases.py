"""Per rank and phase, measured against predicted seconds of tensor-parallel (and pipeline) steps.

Emulated: the built-in ``demo`` cluster (speeds 1 / 0.5 / 0.25, CPU processes of this machine);
predicted: the cost model (``compiled.profile()``, ``autopar.cost.step.predicted_phases``), before
calibration (``AUTOPAR_CALIBRATION=off``). Each figure is the median over the measured steps of a
phase's seconds on a rank (emulation sleep folded into the compute phases); the load average at the
start and the end of each model's run is printed and written next to the figures: on a shared
2-core machine the fastest emulated rank overruns its targets above a load of about 6.

    python benchmarks/bench_tp_phases.py [--models resmlp,glumlp,gpt-tiny,bert-tiny] [--strategies tp] [--steps 4]

To compare two versions of the cost model on the same tables, run it from two trees of the
repository (``git archive COMMIT | tar -x -C DIR``) with one ``AUTOPAR_CACHE_DIR``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import md_table, write_results  # noqa: E402


def run(name: str, strategies: tuple[str, ...], steps: int) -> list[dict]:
    from bench_accuracy import MODELS
    from autopar.cli.trainer import RunSpec, run_comparison, spread
    from autopar.cluster.model import builtin
    from autopar.ir.plan import Plan

    cluster = builtin("demo")
    spec_name, gb = MODELS[name]
    load0 = os.getloadavg()[0]
    spec = RunSpec(model=spec_name, cluster_dict=cluster.to_dict(), global_batch=gb, steps=steps,
                   strategies=strategies, warmup_steps=2)
    results = run_comparison(spec, cluster)
    load1 = os.getloadavg()[0]
    out = []
    for r in results:
        plan = Plan.from_json(r.plan_json)
        ratio = spread(t / r.predicted_step_s for t in r.step_times_s)
        prof = r.profile
        ranks = []
        for info in prof.ranks:
            ranks.append(dict(rank=info.rank, device=info.device_type,
                              phases={g.key: [g.measured_s, g.predicted_s] for g in prof.compare(info.rank)}))
        out.append(dict(model=name, strategy=r.strategy, load=[load0, load1], measured_s=r.step_spread.median,
                        predicted_s=r.predicted_step_s, ratio=ratio.as_dict(),
                        rho=plan.predicted.breakdown.get("tp_replicated_fraction"),
                        layout=[dict(blocks=[st.block_start, st.block_stop], groups=st.groups,
                                     tp_shares=st.tp_shares) for st in plan.stages],
                        ranks=ranks))
        print(f"{name} {r.strategy}: measured {r.step_spread.median * 1e3:.1f} ms, predicted "
              f"{r.predicted_step_s * 1e3:.1f} ms, ratio {ratio.median:.3f} (load {load0:.1f}-{load1:.1f})", flush=True)
    return out


def markdown(rows: list[dict]) -> str:
    parts = ["# TP / pipeline steps per rank and phase (emulated demo cluster, before calibration)", "",
             "Measured / predicted ms per rank (median over steps; emulated devices; predicted by the cost "
             "model). Load: load average at the start and end of the model's run (2 cores, shared).", ""]
    phases = ("forward", "backward", "optimizer", "all_reduce", "all_gather", "reduce_scatter", "p2p", "wait")
    for row in rows:
        shares = "; ".join(f"blocks {s['blocks'][0]}-{s['blocks'][1]} {s['groups']} {s['tp_shares'] or ''}"
                           for s in row["layout"])
        rho = "-" if row["rho"] is None else f"{row['rho']:.3f}"
        parts += [f"## {row['model']} {row['strategy']}: {row['measured_s'] * 1e3:.1f} / "
                  f"{row['predicted_s'] * 1e3:.1f} ms, ratio {row['ratio']['median']:.3f} "
                  f"(IQR {row['ratio']['q1']:.3f}-{row['ratio']['q3']:.3f}), rho {rho}, "
                  f"load {row['load'][0]:.1f}-{row['load'][1]:.1f}", "", shares, ""]
        table = []
        for rk in row["ranks"]:
            table.append([rk["rank"], rk["device"]] + [
                f"{rk['phases'][p][0] * 1e3:.1f} / {rk['phases'][p][1] * 1e3:.1f}" if p in rk["phases"] else "-"
                for p in phases])
        parts += [md_table(["rank", "device", *phases], table), ""]
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resmlp,glumlp,gpt-tiny,bert-tiny")
    ap.add_argument("--strategies", default="tp")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--name", default="tp-phases")
    args = ap.parse_args()
    os.environ.setdefault("AUTOPAR_CALIBRATION", "off")
    rows = []
    for m in args.models.split(","):
        rows += run(m, tuple(args.strategies.split(",")), args.steps)
    write_results(args.name, {"rows": rows, "command": " ".join(sys.argv)}, markdown(rows))


if __name__ == "__main__":
    main()
