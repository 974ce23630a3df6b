"""Cold planning time, before and after: ``autopar plan --model llama-140b --cluster hethub-768.yaml
--global-batch 1024`` as a user runs it (a fresh process, an empty cache directory: no plan cache, no
profile cache), end to end: interpreter start, imports, model build on the meta device, analysis,
cost tables, planning, bounds and the printed plan. The plans' figures are PREDICTED by the cost model
(roofline tables; nothing runs a model).

"before" is a source tree of an older commit (``git archive``, with ``autopar.passes`` and
``autopar.kernels`` linked into its package as the editable install maps them), "after" this
checkout. Runs alternate before/after so that both see the same load; each side reports the median
and IQR of its wall times, and the chosen plan's figures (samples/s, MFU, homogeneous MFU,
efficiency against the compute bound and the upper bound) so that a faster planner shows it chose no
worse a plan.

Usage::

    python benchmarks/bench_planner_cold.py --before e73fe6d [--after 2eb972a] [--repeats 3] [--after-only]

``--after REV`` times a committed tree of REV instead of this checkout (whose uncommitted edits,
other people's work in progress among them, would otherwise be timed as "after").

Writes ``benchmarks/results/planner_cold.json`` and ``planner_cold.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import tree_of  # noqa: E402
RESULTS = ROOT / "benchmarks" / "results"


def cold_run(tree: Path | None, args, entry: str = "module") -> dict:
    """One cold ``autopar plan`` in a fresh process on ``tree`` (None: this checkout). ``entry``:
    "module" runs ``python -m autopar`` (``autopar/__main__.py``: ``main()``), "run" the tree's
    ``autopar.cli.main.run()`` (``main()``, then an exit without the interpreter's teardown)."""
    cache = tempfile.mkdtemp(prefix="autopar-cold-")
    out = Path(cache) / "plan.json"
    env = dict(os.environ, AUTOPAR_CACHE_DIR=cache)
    cwd = ROOT
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
        cwd = tree
    head = [sys.executable, "-m", "autopar"] if entry == "module" else \
        [sys.executable, "-c", "import sys; sys.argv[0] = 'autopar'; from autopar.cli.main import run; run()"]
    cmd = head + ["plan", "--model", args.model, "--cluster", args.cluster,
                  "--global-batch", str(args.global_batch), "--json", str(out)]
    load = os.getloadavg()[0]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)   # the child's own CPU seconds
    if done.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{done.stderr[-2000:]}")
    d = json.loads(out.read_text())
    pr = d["predicted"]
    tail = [ln for ln in done.stdout.splitlines() if ln.startswith("planning ")]
    return dict(wall_s=wall, cpu_s=cpu, load=load, planning_s=d.get("planning_s"), bounds_s=d.get("bounds_s"),
                printed=tail[-1] if tail else "", samples_per_s=pr["samples_per_s"], mfu=pr.get("mfu"),
                homogeneous_mfu=pr.get("homogeneous_mfu"), compute_efficiency=pr.get("compute_efficiency"),
                efficiency=pr.get("efficiency"),
                chosen=next((n for n in d.get("notes", []) if n.startswith("chosen")), ""))


def _spread(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return dict(median=statistics.median(xs), iqr=[q[0], q[2]], all=xs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the commit to compare with")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster", default=str(ROOT / "benchmarks" / "clusters" / "hethub-768.yaml"))
    ap.add_argument("--model", default="llama-140b")
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--after", default=None, help="a commit to time as 'after' (default: this checkout)")
    ap.add_argument("--with-run-entry", action="store_true",
                    help="also time the after tree through autopar.cli.main.run() (the quick exit), "
                         "interleaved as a third side")
    ap.add_argument("--after-only", action="store_true",
                    help="rerun this checkout only; keep the before runs of the last planner_cold.json")
    args = ap.parse_args(argv)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    if args.with_run_entry:
        runs["after, run()"] = []
    after_tree = tree_of(args.after) if args.after else None
    if args.after_only:
        prev = json.loads((RESULTS / "planner_cold.json").read_text())
        if prev.get("before") != args.before:
            raise SystemExit(f"planner_cold.json holds before runs of {prev.get('before')}, not {args.before}")
        runs["before"] = prev["sides"]["before"]["runs"]
        for _ in range(args.repeats):
            runs["after"].append(cold_run(after_tree, args))
            if args.with_run_entry:
                runs["after, run()"].append(cold_run(after_tree, args, entry="run"))
            print(*(v[-1]["wall_s"] for k, v in runs.items() if k != "before"), flush=True)
    else:
        tree = tree_of(args.before)
        for _ in range(args.repeats):
            runs["before"].append(cold_run(tree, args))
            runs["after"].append(cold_run(after_tree, args))
            if args.with_run_entry:
                runs["after, run()"].append(cold_run(after_tree, args, entry="run"))
            print(*(v[-1]["wall_s"] for v in runs.values()), flush=True)
    commit = args.after or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                          text=True).stdout.strip()
    result = dict(scenario=dict(model=args.model, cluster=Path(args.cluster).name, global_batch=args.global_batch),
                  machine=f"{platform.platform()}, {os.cpu_count()} CPUs", before=args.before, after=commit,
                  sides={k: dict(wall_s=_spread([r["wall_s"] for r in v]), runs=v) for k, v in runs.items()})
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "planner_cold.json").write_text(json.dumps(result, indent=2) + "\n")
    load_b = [r["load"] for r in runs["before"]]
    load_a = [r["load"] for k, v in runs.items() if k != "before" for r in v]
    md = ["# Cold `autopar plan`: llama-140b on hethub-768, global batch 1024", "",
          f"`python benchmarks/bench_planner_cold.py --before {args.before}"
          f"{f' --after {args.after}' if args.after else ''} --repeats {args.repeats}"
          f"{' --after-only' if args.after_only else ''}` (after: "
          f"{'commit ' + commit if args.after else 'this checkout at ' + commit}); {result['machine']}, "
          f"1-minute load at the "
          f"start of each run {min(load_b):.1f}-{max(load_b):.1f} (before), {min(load_a):.1f}-{max(load_a):.1f} "
          f"(after) (shared by other jobs). Each run is a fresh `python -m autopar plan ... --json` with an "
          f"empty cache directory, timed from outside (interpreter start to exit; CPU s: the process's own "
          f"user + system seconds, which the other jobs' load stretches less than the wall time); "
          + ("the before runs are kept from the last interleaved run. " if args.after_only
             else "before and after alternate. ") + "Plan figures are PREDICTED by the cost model.", "",
          "| | cold wall s (median) | IQR | runs | CPU s (median) | planning s | bounds s | samples/s | MFU | "
          "homog. MFU | eff. vs compute | eff. vs upper |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for side, v in runs.items():
        w = result["sides"][side]["wall_s"]
        last = v[-1]
        md.append(f"| {side} ({args.before if side == 'before' else commit}) | {w['median']:.1f} | "
                  f"{w['iqr'][0]:.1f}-{w['iqr'][1]:.1f} | {', '.join(f'{x:.1f}' for x in w['all'])} | "
                  f"{statistics.median(r.get('cpu_s', math.nan) for r in v):.1f} | "
                  f"{statistics.median(r['planning_s'] for r in v):.1f} | "
                  f"{statistics.median(r['bounds_s'] for r in v):.1f} | {last['samples_per_s']:.6g} | "
                  f"{last['mfu']:.1%} | {last['homogeneous_mfu']:.1%} | {last['compute_efficiency']:.1%} | "
                  f"{last['efficiency']:.1%} |")
    b, a = (statistics.median(r["wall_s"] for r in runs[k]) for k in ("before", "after"))
    md += ["", f"Speedup of the median: {b / a:.2f}x. Target (issue 14): <= 5 s.", ""]
    if args.with_run_entry:
        r = statistics.median(x["wall_s"] for x in runs["after, run()"])
        md += ["\"after, run()\": the after tree started through `autopar.cli.main.run()` (the same plan, then an exit "
               "without the interpreter's teardown; what `python -m autopar` gives once `autopar/__main__.py` calls "
               f"`run()`): median {r:.1f} s, {b / r:.2f}x the before median.", ""]
    md += [
           "Last run's own report (`autopar plan`'s last line):", "",
           f"- before: {runs['before'][-1]['printed']}", f"- after: {runs['after'][-1]['printed']}", "",
           f"Chosen before: {runs['before'][-1]['chosen']}", "", f"Chosen after: {runs['after'][-1]['chosen']}"]
    (RESULTS / "planner_cold.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
