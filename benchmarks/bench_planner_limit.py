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

# -- where the efficiency goes (PREDICTED: the cost model and simulator that chose the plan) ------------

def _member_speeds(costs, cluster, plan, tp_comm: bool) -> float:
    """Sum over the plan's members of their samples/s on the whole model at their micro-batches, TP
    members with their replicated work (and their all-reduces when ``tp_comm``): what the members
    reach if every stage were balanced and nothing waited."""
    import dataclasses

    import numpy as np

    from autopar.cost import tp as tp_cost

    rho = plan.predicted.breakdown.get("tp_replicated_fraction")
    total = 0.0
    for st in plan.stages:
        for g, ranks in enumerate(st.groups):
            xs = [x for x in st.micro_batches[g] if x > 0]
            if not xs:
                continue
            t = 0.0
            for x in xs:
                if len(ranks) > 1 and st.tp_shares:
                    kind = tp_cost.group_kind(cluster, ranks, st.tp_shares[g])
                    if not tp_comm:      # every collective free, SP's own links too
                        kind = dataclasses.replace(kind, alpha_s=0.0, beta_s_per_byte=0.0,
                                                   sp_link=None if kind.sp_link is None else (0.0,) * 4)
                    f, b = tp_cost.kind_block_times(costs, kind, float(x), rho, bool(st.sequence_parallel))
                else:
                    name = cluster.devices[ranks[0]].spec.name
                    f, b = costs.fwd_time(name, float(x)), costs.bwd_time(name, float(x))
                t += float(np.sum(f) + np.sum(b))
            total += sum(xs) / t
    return total


def _device_speeds(costs, cluster, plan) -> float:
    """Sum over the plan's ranks of their samples/s on the whole model alone (no TP) at their
    member's micro-batches."""
    import numpy as np

    total = 0.0
    for st in plan.stages:
        for g, ranks in enumerate(st.groups):
            xs = [x for x in st.micro_batches[g] if x > 0]
            for r in ranks:
                name = cluster.devices[r].spec.name
                t = sum(float(np.sum(costs.fwd_time(name, float(x))) + np.sum(costs.bwd_time(name, float(x))))
                        for x in xs)
                total += sum(xs) / t if t > 0 else 0.0
    return total


def waterfall(plan, costs, cluster) -> list[dict]:
    """From the compute bound down to the plan's samples/s, one factor at a time, each PREDICTED:
    rows of (step, samples/s after it, points of the compute bound it costs). Every samples/s is an
    ideal throughput of the plan's own devices and members: idle devices (the compute bound of the
    devices the plan uses), micro-batch size (each device on the whole model at its member's
    micro-batches), TP replication (a TP member's ranks each computing the unsharded part whole),
    TP communication (the members' all-reduces inside blocks), stage imbalance (the busiest stage's
    compute over a micro-batch round bounds the step), pipeline bubble and p2p (the simulated
    schedule's step), after the schedule (gradient all-reduce, optimizer step, ZeRO gather)."""
    from autopar.cost.pipeline import plan_timeline
    from autopar.planner.bounds import compute_bound_samples_per_s

    B = plan.global_batch_size
    c0 = compute_bound_samples_per_s(costs, cluster)
    used = sorted({r for st in plan.stages for r in st.ranks})
    c_used = compute_bound_samples_per_s(costs, cluster.subset(used)) if len(used) < len(cluster) else c0
    timeline, step = plan_timeline(plan, costs, cluster)
    busiest = max(timeline.busy_s)
    steps = [("compute bound (every device on the whole model, best micro-batch)", c0),
             ("idle devices (the plan leaves them out)", c_used),
             ("micro-batch size (each device at its member's micro-batches)", _device_speeds(costs, cluster, plan)),
             ("TP replication (unsharded work computed whole on every TP rank)",
              _member_speeds(costs, cluster, plan, tp_comm=False)),
             ("TP communication (the collectives inside every block, less what the overlaps hide)",
              _member_speeds(costs, cluster, plan, tp_comm=True)),
             ("stage imbalance (the busiest stage's compute bounds the step)", B / busiest),
             ("pipeline bubble and p2p (the simulated schedule)", B / timeline.step_time_s),
             ("after the schedule (gradient all-reduce, optimizer, ZeRO gather)", B / step)]
    out, prev = [], c0
    for name, sps in steps:
        out.append(dict(step=name, samples_per_s=sps, lost_points=(prev - sps) / c0, of_bound=sps / c0))
        prev = sps
    return out


def what_ifs(costs, cluster, batch: int, num_heads, rho: float, c0: float, bubble_points: float) -> list[dict]:
    """Priced what-ifs (PREDICTED): the joint planner rerun with one input changed, efficiency against
    the same compute bound ``c0``. Which of them the runtime runs today is said in each row. Sequence
    parallelism and the backward and forward TP overlaps are in the plan itself now (``cost.tp``,
    ``cost.tp_fwd``): their rows are ablations (the plan without each), not what-ifs."""
    import contextlib
    import dataclasses
    import importlib.util

    from autopar.cost import joint as joint_cost
    from autopar.cost import tp as tp_cost
    from autopar.cost import tp_fwd
    from autopar.cost.memory import tp_span_factors
    from autopar.planner.joint import plan_auto

    def run(label, built, c=costs, cl=cluster, r=rho, patch=contextlib.nullcontext, **kw):
        try:
            with patch():
                p = plan_auto(c, cl, batch, num_heads=num_heads, replicated_fraction=r, **kw)
                wf = waterfall(p, c, cl)
        except Exception as e:   # a what-if that plans nothing says so
            return dict(what_if=label, built=built, of_bound=0.0, chosen=f"no plan: {e}"[:200])
        return dict(what_if=label, built=built, of_bound=p.predicted.samples_per_s / c0,
                    samples_per_s=p.predicted.samples_per_s, chosen=p.notes[0],
                    sp_stages=sum(bool(st.sequence_parallel) for st in p.stages),
                    lost=", ".join(f"{r['step'].split(' (')[0]} {r['lost_points']:.1%}" for r in wf[1:]
                                   if r["lost_points"] >= 0.0005))

    @contextlib.contextmanager
    def no_overlap():
        old, tp_cost.TP_BACKWARD_OVERLAP = tp_cost.TP_BACKWARD_OVERLAP, False
        try:
            yield
        finally:
            tp_cost.TP_BACKWARD_OVERLAP = old

    @contextlib.contextmanager
    def fwd_patterns(on: bool, patterns=None):
        old = tp_fwd.TP_FORWARD_OVERLAP, tp_fwd.FWD_OVERLAP_PATTERNS
        tp_fwd.TP_FORWARD_OVERLAP = on
        tp_fwd.FWD_OVERLAP_PATTERNS = old[1] if patterns is None else frozenset(patterns)
        try:
            yield
        finally:
            tp_fwd.TP_FORWARD_OVERLAP, tp_fwd.FWD_OVERLAP_PATTERNS = old

    @contextlib.contextmanager
    def sp_time_only():
        old = joint_cost.tp_span_factors
        joint_cost.tp_span_factors = lambda c, r, f: tp_span_factors(c, r, f, sequence_parallel=False)
        try:
            yield
        finally:
            joint_cost.tp_span_factors = old

    have = lambda m: importlib.util.find_spec(m) is not None   # noqa: E731
    sp_built, ov_built = have("autopar.passes.tp_sp"), have("autopar.passes.tp_overlap")
    fwd_built = have("autopar.passes.tp_fwd_overlap")
    priced = sorted(tp_fwd.FWD_OVERLAP_PATTERNS)
    no_sp = dataclasses.replace(costs, tp_sp_supported=None, _cache={})
    rows = [run("ablation: without sequence parallelism (Stage.sequence_parallel never set)", sp_built, c=no_sp),
            run("ablation: without the backward TP overlap (every backward collective exposed)", ov_built,
                patch=no_overlap),
            run(f"ablation: without the forward TP overlap (chunked collective-matmul, priced patterns "
                f"{', '.join(priced)}: every forward collective exposed)", fwd_built,
                patch=lambda: fwd_patterns(False))]
    if "bwd_ag_row" not in tp_fwd.FWD_OVERLAP_PATTERNS:
        rows.append(run("g's backward all-gather chunked under the row's input-gradient GEMM too (bwd_ag_row: "
                        "passes.tp_fwd_overlap's (c), not in cost.tp_fwd.FWD_OVERLAP_PATTERNS)",
                        fwd_built, patch=lambda: fwd_patterns(True, (*priced, "bwd_ag_row"))))
    rows += [run("activation recomputation allowed (Stage.recompute; auto leaves it off by default)", True,
                 recompute=True),
             run("ablation: SP's activations not in the joint search's memory caps (SP time only)", sp_built,
                 patch=sp_time_only)]
    rows.append(dict(what_if="interleaved 1F1B with 2 virtual stages in the hybrid search: the bubble row "
                             "halved on the same plan (arithmetic ceiling, memory not priced)", built=False,
                     of_bound=None, points=bubble_points / 2))
    return rows


_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import autopar, autopar.models as zoo
from autopar.cluster.model import load
from autopar.api import prepare, model_num_heads, plan_from_costs
from autopar.planner.explain import explain_stages
sys.path.insert(0, sys.argv[5])
from bench_planner_limit import waterfall, what_ifs
cluster = load(sys.argv[1])
case = zoo.build(sys.argv[2], device="meta")
prep = prepare(case.model, cluster, case.example_inputs)
tm = {}
heads = model_num_heads(case.model)
p = plan_from_costs(prep.costs, cluster, int(sys.argv[3]), num_heads=heads,
                    replicated_fraction=prep.replicated_fraction, timings=tm)
total = time.perf_counter() - t0
pr = p.predicted
rows = [dict(stage=r.stage, blocks=list(r.blocks), devices=r.devices, compute_s=r.compute_s, p2p_s=r.p2p_s,
             bubble_s=r.bubble_s, sync_s=r.sync_s, optimizer_s=r.optimizer_s, memory=r.memory_fraction)
        for r in explain_stages(p, prep.costs, cluster)]
wf = waterfall(p, prep.costs, cluster)
extra = {}
if sys.argv[4] == "whatif":
    bubble = next(r["lost_points"] for r in wf if r["step"].startswith("pipeline bubble"))
    extra["what_ifs"] = what_ifs(prep.costs, cluster, int(sys.argv[3]), heads, prep.replicated_fraction,
                                 pr.compute_bound_samples_per_s, bubble)
print(json.dumps(dict(total_s=total, analyze_s=prep.analyze_s, profile_s=prep.profile_s, plan_s=tm["plan_s"],
                      bounds_s=tm["bounds_s"], samples_per_s=pr.samples_per_s, step_time_s=pr.step_time_s,
                      mfu=pr.mfu, homogeneous_mfu=pr.homogeneous_mfu, compute_efficiency=pr.compute_efficiency,
                      efficiency=pr.efficiency, compute_bound=pr.compute_bound_samples_per_s,
                      upper_bound=pr.upper_bound_samples_per_s, breakdown=pr.breakdown,
                      chosen=[n for n in p.notes if n.startswith("chosen")],
                      bound_notes=[n for n in p.notes if n.startswith(("homogeneous", "upper bound"))],
                      stages=rows, waterfall=wf, sp_stages=sum(bool(st.sequence_parallel) for st in p.stages),
                      **extra)))
"""


def cold_plan(cluster: str, model: str, batch: int, whatif: bool = False) -> dict:
    env = dict(os.environ, AUTOPAR_CACHE_DIR=tempfile.mkdtemp(prefix="autopar-cold-"))
    out = subprocess.run([sys.executable, "-c", _CHILD, cluster, model, str(batch), "whatif" if whatif else "-",
                          str(ROOT / "benchmarks")], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster", default=str(ROOT / "benchmarks" / "clusters" / "hethub-768.yaml"))
    ap.add_argument("--model", default="llama-140b")
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--no-what-ifs", action="store_true", help="skip the re-planned what-ifs (minutes)")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    runs = [cold_plan(args.cluster, args.model, args.global_batch,
                      whatif=not args.no_what_ifs and i == args.repeats - 1) for i in range(args.repeats)]
    times = sorted(r["total_s"] for r in runs)
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    last = runs[-1]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    result = dict(scenario=dict(model=args.model, cluster=Path(args.cluster).name, global_batch=args.global_batch),
                  machine=f"{platform.platform()}, {os.cpu_count()} CPUs, load {load0:.1f} before, {load:.1f} after",
                  commit=commit, cold_plan_s=dict(median=statistics.median(times), iqr=[q[0], q[2]], all=times),
                  parts_s={k: last[k] for k in ("analyze_s", "profile_s", "plan_s", "bounds_s")}, **{
                      k: last.get(k) for k in ("samples_per_s", "step_time_s", "mfu", "homogeneous_mfu",
                                               "compute_efficiency", "efficiency", "compute_bound", "upper_bound",
                                               "breakdown", "chosen", "bound_notes", "stages", "waterfall",
                                               "what_ifs", "sp_stages")})
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "planner_limit.json").write_text(json.dumps(result, indent=2) + "\n")
    n = len(last["stages"])
    step = last["step_time_s"]

    def share(key):
        return sum(r[key] for r in last["stages"]) / n / step if n and step else 0.0

    mfu_gap = last["mfu"] / last["homogeneous_mfu"] - 1 if last["homogeneous_mfu"] else float("nan")
    md = ["# Planner against the physical limit (PREDICTED by the cost model)", "",
          f"{args.model} on {Path(args.cluster).name}, global batch {args.global_batch}; {result['machine']}; "
          f"commit {commit}; `python benchmarks/bench_planner_limit.py --repeats {args.repeats}`. Every figure "
          f"but the planning wall time is predicted (roofline tables, the planner's simulator); nothing runs "
          f"the model.", "",
          "- MFU: model FLOP/s (forward + backward, no recomputation) over the cluster's summed bf16 peak.",
          "- homogeneous MFU: the planner on whole nodes of the fastest type with the same summed peak.",
          "- eff. vs compute: samples/s over the compute bound (every device on the whole model at its best "
          "micro-batch, no communication, no bubbles, no TP replication).",
          "- eff. vs upper: over the sum of each device type alone on the whole batch.", "",
          "| MFU | homog. MFU | MFU vs homog. | eff. vs compute | eff. vs upper | samples/s | "
          "cold plan s (median, IQR) | target |",
          "|---|---|---|---|---|---|---|---|",
          f"| {last['mfu']:.1%} | {last['homogeneous_mfu']:.1%} | {mfu_gap:+.1%} | {last['compute_efficiency']:.1%} | "
          f"{last['efficiency']:.1%} | {last['samples_per_s']:.4g} | {statistics.median(times):.1f} "
          f"({q[0]:.1f}-{q[2]:.1f}) | >= 65% vs compute, MFU within 5% of homog., <= 5 s |", "",
          "Parts of the last cold run (s): " + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in result["parts_s"].items()),
          "", f"Chosen: {last['chosen'][0] if last['chosen'] else '-'}; sequence parallelism on "
          f"{last.get('sp_stages', 0)} of its {len(last['stages'])} stages", ""]
    md += [f"- {x}" for x in last.get("bound_notes") or []]
    md += ["", "## Where the efficiency goes (PREDICTED; points of the compute bound)", "",
           "From the compute bound to the plan, one factor at a time (`waterfall` in this script): each row's "
           "samples/s is an ideal throughput of the plan's own devices and members with that factor and the "
           "ones above it priced.", "",
           "| step | samples/s | of the compute bound | points lost here |", "|---|---|---|---|"]
    for r in last["waterfall"]:
        md.append(f"| {r['step']} | {r['samples_per_s']:.4g} | {r['of_bound']:.1%} | {r['lost_points']:.1%} |")
    if last.get("what_ifs"):
        md += ["", "## What the next builds would buy (PREDICTED what-ifs; not claims)", "",
               "The joint planner rerun with one input changed (`what_ifs` in this script), efficiency against "
               "the same compute bound. *Built* says whether the runtime runs it today.", "",
               "| what-if | built | eff. vs compute | where the rest goes (points) | chosen |", "|---|---|---|---|---|"]
        for r in last["what_ifs"]:
            eff = f"{r['of_bound']:.1%}" if r.get("of_bound") is not None else \
                f"<= +{r['points']:.1%} points"
            md.append(f"| {r['what_if']} | {'yes' if r['built'] else 'no'} | {eff} | {r.get('lost', '-')} | "
                      f"{r.get('chosen', '-')} |")
    md += ["", "## Where the step goes (autopar plan --explain; mean over stages, share of the step)", "",
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
