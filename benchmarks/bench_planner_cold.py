"""Cold planning time, before and after: ``autopar plan --model llama-140b --cluster hethub-768.yaml
--global-batch 1024`` as a user runs it, end to end (interpreter start, imports, model build on the meta
device, analysis, cost tables, planning, bounds and the printed plan), in fresh processes, two ways:

- "cold": an empty cache directory (no plan cache, no analysis cache, no profile cache);
- "no plan cache": the process starts with no plan cache, as issue 14 defines cold, but with what an
  earlier run of the same model by the same tree left in its cache directory (the analysis cache,
  ``passes.analysis_cache``, and the profile caches): a copy of a seed run's directory without its
  ``plans/`` folder, fresh for every run. The seed runs once per side before the timed rounds.

The plans' figures are PREDICTED by the cost model (roofline tables; nothing runs a model).

"before" is a source tree of an older commit (``git archive``, with ``autopar.passes`` and
``autopar.kernels`` linked into its package as the editable install maps them), unpacked under a
temporary folder of its own name (two runs at once do not share it), "after" this checkout. Runs
alternate before/after so that both see the same load; each reports the median and IQR of its wall
times, its CPU seconds, and the chosen plan's figures (samples/s, MFU, homogeneous MFU, efficiency
against the compute bound and the upper bound) so that a faster planner shows it chose no worse a plan.

Usage::

    python benchmarks/bench_planner_cold.py --before e73fe6d [--after 2eb972a] [--repeats 3] [--after-only]
                                            [--results planner_cold]

``--after REV`` times a committed tree of REV instead of this checkout (whose uncommitted edits,
other people's work in progress among them, would otherwise be timed as "after").

Writes ``benchmarks/results/<results>.json`` and ``.md`` (default ``planner_cold``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import resource
import shutil
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


@functools.cache
def _temp() -> Path:
    """This run's own temporary folder: source trees, cache directories, plans (removed at the end)."""
    return Path(tempfile.mkdtemp(prefix="autopar-bench-cold-"))


def unpacked(rev: str) -> Path:
    """The commit ``rev`` unpacked under this run's temporary folder (``_common.tree_of``)."""
    return tree_of(rev, Path(tempfile.mkdtemp(prefix=f"src-{rev}-", dir=_temp())))


def seeded_cache(seed: str | None) -> str:
    """A fresh cache directory: empty (``seed`` None), or a copy of ``seed`` without its plan cache."""
    cache = tempfile.mkdtemp(prefix="cache-", dir=_temp())
    if seed is not None:
        shutil.copytree(seed, cache, dirs_exist_ok=True, ignore=shutil.ignore_patterns("plans", "*.json.tmp*"))
    return cache


def cold_run(tree: Path | None, args, entry: str = "module", seed: str | None = None, cache: str | None = None) -> dict:
    """One ``autopar plan`` in a fresh process on ``tree`` (None: this checkout), in a fresh cache
    directory (``seeded_cache(seed)``) or in ``cache`` (the seed runs). ``entry``: "module" runs
    ``python -m autopar`` (``autopar/__main__.py``: ``main()``), "run" the tree's
    ``autopar.cli.main.run()`` (``main()``, then an exit without the interpreter's teardown)."""
    cache = cache or seeded_cache(seed)
    out = Path(tempfile.mkdtemp(prefix="out-", dir=_temp())) / "plan.json"
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


def _row(label: str, cold: list[dict], warm: list[dict]) -> str:
    def med(v, k):
        xs = [r[k] for r in v if r.get(k) is not None]
        return statistics.median(xs) if xs else math.nan

    def wall(v):
        if not v:
            return "- | - | -"
        w = _spread([r["wall_s"] for r in v])
        return f"{w['median']:.1f} ({w['iqr'][0]:.1f}-{w['iqr'][1]:.1f}) | {', '.join(f'{x:.1f}' for x in w['all'])} | " \
               f"{med(v, 'cpu_s'):.1f}"

    last = (cold or warm)[-1]
    return (f"| {label} | {wall(cold)} | {wall(warm)} | {med(cold, 'planning_s'):.1f} | {med(cold, 'bounds_s'):.1f} | "
            f"{last['samples_per_s']:.6g} | {last['mfu']:.1%} | {last['homogeneous_mfu']:.1%} | "
            f"{last['compute_efficiency']:.1%} | {last['efficiency']:.1%} |")


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
                         "interleaved as a third side (cold only)")
    ap.add_argument("--after-only", action="store_true",
                    help="rerun this checkout only; keep the before runs of the last results file")
    ap.add_argument("--results", default="planner_cold", help="results file name under benchmarks/results")
    args = ap.parse_args(argv)
    sides = ["before", "after"] + (["after, run()"] if args.with_run_entry else [])
    cold: dict[str, list[dict]] = {k: [] for k in sides}
    warm: dict[str, list[dict]] = {k: [] for k in sides}     # "no plan cache"
    trees = {"before": None if args.after_only else unpacked(args.before),
             "after": unpacked(args.after) if args.after else None}
    trees["after, run()"] = trees["after"]
    timed = [k for k in sides if not (args.after_only and k == "before")]
    if args.after_only:
        prev = json.loads((RESULTS / f"{args.results}.json").read_text())
        if prev.get("before") != args.before:
            raise SystemExit(f"{args.results}.json holds before runs of {prev.get('before')}, not {args.before}")
        cold["before"] = prev["sides"]["before"]["runs"]
        warm["before"] = prev["sides"]["before"].get("no_plan_cache", {}).get("runs", [])
    seeds = {}
    for k in ("before", "after"):
        if k in timed:          # an untimed run of the same model leaves the caches the warm runs copy
            seeds[k] = tempfile.mkdtemp(prefix=f"seed-{k}-", dir=_temp())
            cold_run(trees[k], args, cache=seeds[k])
    for _ in range(args.repeats):
        for k in timed:
            entry = "run" if k == "after, run()" else "module"
            cold[k].append(cold_run(trees[k], args, entry=entry))
            if k in seeds:
                warm[k].append(cold_run(trees[k], args, seed=seeds[k]))
        print(*(f"{k}: cold {cold[k][-1]['wall_s']:.1f} s" + (f", no plan cache {warm[k][-1]['wall_s']:.1f} s"
                                                              if warm[k] else "") for k in timed), flush=True)
    commit = args.after or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                          text=True).stdout.strip()
    result = dict(scenario=dict(model=args.model, cluster=Path(args.cluster).name, global_batch=args.global_batch),
                  machine=f"{platform.platform()}, {os.cpu_count()} CPUs", before=args.before, after=commit,
                  sides={k: dict(wall_s=_spread([r["wall_s"] for r in cold[k]]), runs=cold[k],
                                 no_plan_cache=dict(wall_s=_spread([r["wall_s"] for r in warm[k]]), runs=warm[k])
                                 if warm[k] else None) for k in sides})
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.results}.json").write_text(json.dumps(result, indent=2) + "\n")
    loads = {k: [r["load"] for r in cold[k] + warm[k]] for k in sides}
    md = [f"# Cold `autopar plan`: {args.model} on {Path(args.cluster).stem}, global batch {args.global_batch}", "",
          f"`python benchmarks/bench_planner_cold.py --before {args.before}"
          f"{f' --after {args.after}' if args.after else ''} --repeats {args.repeats}"
          f"{' --after-only' if args.after_only else ''}` (after: "
          f"{'commit ' + commit if args.after else 'this checkout at ' + commit}); {result['machine']}, "
          "1-minute load at the start of each run "
          + ", ".join(f"{min(v):.1f}-{max(v):.1f} ({k})" for k, v in loads.items() if v)
          + " (shared by other jobs). Each run is a fresh `python -m autopar plan ... --json`, timed from outside "
          "(interpreter start to exit; CPU s: the process's own user + system seconds, which the other jobs' load "
          "stretches less than the wall time). Cold: an empty cache directory. No plan cache: the process starts "
          "without a plan cache (issue 14's cold) but with the analysis and profile caches an earlier run of the "
          "same model by the same tree left (a fresh copy each run). "
          + ("The before runs are kept from the last interleaved run. " if args.after_only
             else "Before and after alternate. ") + "Plan figures are PREDICTED by the cost model.", "",
          "| | cold wall s, median (IQR) | cold runs | cold CPU s | no plan cache wall s, median (IQR) | "
          "no plan cache runs | no plan cache CPU s | planning s | bounds s | samples/s | MFU | homog. MFU | "
          "eff. vs compute | eff. vs upper |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in sides:
        md.append(_row(f"{k} ({args.before if k == 'before' else commit})", cold[k], warm[k]))
    b, a = (statistics.median(r["wall_s"] for r in cold[k]) for k in ("before", "after"))
    md += ["", f"Speedup of the cold median: {b / a:.2f}x"]
    if warm["before"] and warm["after"]:
        wb, wa = (statistics.median(r["wall_s"] for r in warm[k]) for k in ("before", "after"))
        md[-1] += f"; of the no-plan-cache median: {wb / wa:.2f}x"
    md[-1] += ". Target (issue 14): <= 5 s."
    md.append("")
    if args.with_run_entry:
        r = statistics.median(x["wall_s"] for x in cold["after, run()"])
        md += ["\"after, run()\": the after tree started through `autopar.cli.main.run()` (the same plan, then an exit "
               "without the interpreter's teardown; what `python -m autopar` gives once `autopar/__main__.py` calls "
               f"`run()`): median {r:.1f} s, {b / r:.2f}x the before median.", ""]
    md += ["Last run's own report (`autopar plan`'s last line):", "",
           f"- before: {cold['before'][-1]['printed']}", f"- after: {cold['after'][-1]['printed']}", ""]
    if warm["after"]:
        md += [f"- after, no plan cache: {warm['after'][-1]['printed']}", ""]
    md += [f"Chosen before: {cold['before'][-1]['chosen']}", "", f"Chosen after: {cold['after'][-1]['chosen']}"]
    (RESULTS / f"{args.results}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    shutil.rmtree(_temp(), ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
