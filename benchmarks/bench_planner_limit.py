"""Planner against the physical limit: llama-140b on hethub-768 at global batch 1024 (issue 14), PREDICTED
by the cost model (roofline tables; nothing runs a model).

Each repeat is a cold ``autopar.plan`` in a fresh process with an empty cache directory (no plan
cache, no profile cache): model build on the meta device, analysis, cost tables, planning and bounds.
Reports MFU (model FLOP/s over the cluster's summed bf16 peak), homogeneous MFU (the planner on whole
nodes of the fastest type with the same summed peak), efficiency against the compute bound (no
communication, no bubbles) and against the upper bound (each type alone, summed), the per-stage
breakdown of ``autopar plan --explain``, and the cold planning wall time (median and IQR of repeats).

Usage::

    python benchmarks/bench_planner_limit.py [--repeats 3]

Writes ``benchmarks/results/planner_limit.json`` and ``planner_limit.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import autopar, autopar.models as zoo
from autopar.cluster.model import load
from autopar.api import prepare, model_num_heads, plan_from_costs
from autopar.planner.explain import explain_stages
cluster = load(sys.argv[1])
case = zoo.build(sys.argv[2], device="meta")
prep = prepare(case.model, cluster, case.example_inputs)
tm = {}
p = plan_from_costs(prep.costs, cluster, int(sys.argv[3]), num_heads=model_num_heads(case.model),
                    replicated_fraction=prep.replicated_fraction, timings=tm)
total = time.perf_counter() - t0
pr = p.predicted
rows = [dict(stage=r.stage, blocks=list(r.blocks), devices=r.devices, compute_s=r.compute_s, p2p_s=r.p2p_s,
             bubble_s=r.bubble_s, sync_s=r.sync_s, optimizer_s=r.optimizer_s, memory=r.memory_fraction)
        for r in explain_stages(p, prep.costs, cluster)]
print(json.dumps(dict(total_s=total, analyze_s=prep.analyze_s, profile_s=prep.profile_s, plan_s=tm["plan_s"],
                      bounds_s=tm["bounds_s"], samples_per_s=pr.samples_per_s, step_time_s=pr.step_time_s,
                      mfu=pr.mfu, homogeneous_mfu=pr.homogeneous_mfu, compute_efficiency=pr.compute_efficiency,
                      efficiency=pr.efficiency, compute_bound=pr.compute_bound_samples_per_s,
                      upper_bound=pr.upper_bound_samples_per_s, breakdown=pr.breakdown,
                      chosen=[n for n in p.notes if n.startswith("chosen")], stages=rows)))
"""


def cold_plan(cluster: str, model: str, batch: int) -> dict:
    env = dict(os.environ, AUTOPAR_CACHE_DIR=tempfile.mkdtemp(prefix="autopar-cold-"))
    out = subprocess.run([sys.executable, "-c", _CHILD, cluster, model, str(batch)], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster", default=str(ROOT / "benchmarks" / "clusters" / "hethub-768.yaml"))
    ap.add_argument("--model", default="llama-140b")
    ap.add_argument("--global-batch", type=int, default=1024)
    args = ap.parse_args(argv)
    runs = [cold_plan(args.cluster, args.model, args.global_batch) for _ in range(args.repeats)]
    times = sorted(r["total_s"] for r in runs)
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    last = runs[-1]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    result = dict(scenario=dict(model=args.model, cluster=Path(args.cluster).name, global_batch=args.global_batch),
                  machine=f"{platform.platform()}, {os.cpu_count()} CPUs, load {load:.1f}", commit=commit,
                  cold_plan_s=dict(median=statistics.median(times), iqr=[q[0], q[2]], all=times),
                  parts_s={k: last[k] for k in ("analyze_s", "profile_s", "plan_s", "bounds_s")}, **{
                      k: last[k] for k in ("samples_per_s", "step_time_s", "mfu", "homogeneous_mfu",
                                           "compute_efficiency", "efficiency", "compute_bound", "upper_bound",
                                           "breakdown", "chosen", "stages")})
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "planner_limit.json").write_text(json.dumps(result, indent=2) + "\n")
    n = len(last["stages"])
    step = last["step_time_s"]

    def share(key):
        return sum(r[key] for r in last["stages"]) / n / step if n and step else 0.0

    md = [f"# Planner against the physical limit (PREDICTED by the cost model)", "",
          f"{args.model} on {Path(args.cluster).name}, global batch {args.global_batch}; {result['machine']}; "
          f"commit {commit}; `python benchmarks/bench_planner_limit.py --repeats {args.repeats}`.", "",
          "- MFU: model FLOP/s (forward + backward, no recomputation) over the cluster's summed bf16 peak.",
          "- homogeneous MFU: the planner on whole nodes of the fastest type with the same summed peak.",
          "- eff. vs compute: samples/s over the compute bound (every device on the whole model at its best "
          "micro-batch, no communication, no bubbles, no TP replication).",
          "- eff. vs upper: over the sum of each device type alone on the whole batch.", "",
          "| MFU | homog. MFU | eff. vs compute | eff. vs upper | samples/s | cold plan s (median, IQR) | target |",
          "|---|---|---|---|---|---|---|",
          f"| {last['mfu']:.1%} | {last['homogeneous_mfu']:.1%} | {last['compute_efficiency']:.1%} | "
          f"{last['efficiency']:.1%} | {last['samples_per_s']:.4g} | {statistics.median(times):.1f} "
          f"({q[0]:.1f}-{q[2]:.1f}) | >= 65% vs compute, MFU within 5% of homog., <= 5 s |", "",
          f"Parts of the last cold run (s): " + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in result["parts_s"].items()),
          "", f"Chosen: {last['chosen'][0] if last['chosen'] else '-'}", "",
          "## Where the step goes (autopar plan --explain; mean over stages, share of the step)", "",
          "| compute | p2p | bubble | sync (DP all-reduce) | optimizer |", "|---|---|---|---|---|",
          f"| {share('compute_s'):.1%} | {share('p2p_s'):.1%} | {share('bubble_s'):.1%} | {share('sync_s'):.1%} | "
          f"{share('optimizer_s'):.1%} |", "",
          "| stage | blocks | devices | compute s | p2p s | bubble s | sync s | optimizer s | memory |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in last["stages"]:
        md.append(f"| {r['stage']} | {r['blocks'][0]}:{r['blocks'][1]} | {r['devices']} | {r['compute_s']:.4g} | "
                  f"{r['p2p_s']:.3g} | {r['bubble_s']:.4g} | {r['sync_s']:.3g} | {r['optimizer_s']:.3g} | "
                  f"{r['memory']:.0%} |")
    (RESULTS / "planner_limit.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
