"""The planning front of a cold ``autopar plan``: from interpreter start until the cost tables exist
(imports, the model built on meta, capture, analysis, cost tables: ``cli.main._prepare`` as the command
runs it), in fresh processes, llama-140b on hethub-768 by default. The search that follows is not
timed here (``bench_planner_cold.py`` times the whole command).

Sides, alternating in every round so that all see the same load:
- ``before``: a source tree given by ``--before`` (a commit, unpacked under /tmp as the editable install
  lays it out, or an existing ``/tmp/autopar-src-NAME`` folder), an empty cache directory;
- ``after``: this checkout (or ``--after``), an empty cache directory: cold;
- ``after, warm analysis``: the same, in a cache directory whose analysis entry an earlier process
  wrote (``passes.analysis_cache``): what a second plan of the same model (another cluster, batch or
  strategy) pays. It does not count as cold.

Each run reports its wall seconds (measured outside: process start to exit, the child leaving through
``os._exit`` as ``autopar plan`` does), its own CPU seconds (which other jobs' load stretches less),
the analysis and cost-table seconds ``_prepare`` reports, and whether ``torch._dynamo`` was imported.
Median and IQR per side; the 1-minute load at each run's start.

    python benchmarks/bench_plan_front.py --before c745274 [--after REV] [--repeats 5]

Writes ``benchmarks/results/plan_front.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import md_table, tree_of, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, resource, sys
from autopar.cli import main as M
cluster = M._load_cluster(sys.argv[1])
case, prep = M._prepare(sys.argv[2], cluster)
r = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps(dict(cpu_s=r.ru_utime + r.ru_stime, analysis_s=prep.analyze_s, tables_s=prep.profile_s,
                      dynamo="torch._dynamo" in sys.modules, blocks=len(prep.analysis.stats))))
sys.stdout.flush()
os._exit(0)
"""


def front_run(tree: Path | None, cache: str, args) -> dict:
    """One planning front in a fresh process on ``tree`` (None: this checkout) with ``cache`` as
    ``$AUTOPAR_CACHE_DIR``."""
    env = dict(os.environ, AUTOPAR_CACHE_DIR=cache)
    cwd = ROOT
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
        cwd = tree
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, str(args.cluster), args.model], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"front run failed on {tree or 'this checkout'}:\n{done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), wall_s=wall, load=load)


def _spread(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return dict(median=statistics.median(xs), q1=q[0], q3=q[2], all=xs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="a commit, or NAME of an existing /tmp/autopar-src-NAME")
    ap.add_argument("--after", default=None, help="the same for 'after' (default: this checkout)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="llama-140b")
    ap.add_argument("--cluster", default=str(ROOT / "benchmarks" / "clusters" / "hethub-768.yaml"))
    args = ap.parse_args(argv)
    before, after = tree_of(args.before), (tree_of(args.after) if args.after else None)
    warm_cache = tempfile.mkdtemp(prefix="autopar-front-warm-")
    front_run(after, warm_cache, args)      # writes the analysis entry the warm side reads
    sides = {"before": [], "after": [], "after, warm analysis": []}
    for _ in range(args.repeats):
        sides["before"].append(front_run(before, tempfile.mkdtemp(prefix="autopar-front-"), args))
        sides["after"].append(front_run(after, tempfile.mkdtemp(prefix="autopar-front-"), args))
        sides["after, warm analysis"].append(front_run(after, warm_cache, args))
        print(*(f"{k}: {v[-1]['wall_s']:.2f} s" for k, v in sides.items()), flush=True)
    after_name = args.after or "this checkout"
    stats = {k: {m: _spread([r[m] for r in v]) for m in ("wall_s", "cpu_s", "analysis_s", "tables_s")}
             for k, v in sides.items()}
    rows = []
    for k, v in sides.items():
        s = stats[k]
        rows.append([f"{k} ({args.before if k == 'before' else after_name})",
                     f"{s['wall_s']['median']:.2f} ({s['wall_s']['q1']:.2f}-{s['wall_s']['q3']:.2f})",
                     f"{s['cpu_s']['median']:.2f} ({s['cpu_s']['q1']:.2f}-{s['cpu_s']['q3']:.2f})",
                     f"{s['analysis_s']['median']:.2f}", f"{s['tables_s']['median']:.2f}",
                     "yes" if all(r["dynamo"] for r in v) else "no" if not any(r["dynamo"] for r in v) else "some",
                     f"{min(r['load'] for r in v):.1f}-{max(r['load'] for r in v):.1f}"])
    loads = [r["load"] for v in sides.values() for r in v]
    md = [f"# Planning front: `{args.model}` on `{Path(args.cluster).name}`, interpreter start to cost tables", "",
          f"`python benchmarks/bench_plan_front.py --before {args.before}"
          f"{f' --after {args.after}' if args.after else ''} --repeats {args.repeats}`: fresh processes "
          f"running `cli.main._prepare` as `autopar plan` does, sides alternating in each round; 1-minute load "
          f"{min(loads):.1f}-{max(loads):.1f} (other jobs share the 2 cores). Wall: process start to exit, "
          "measured outside; CPU: the process's own; analysis and cost tables: as `_prepare` reports them. "
          "Median (IQR) of the repeats. Native CPU timings; nothing here is predicted.", "",
          md_table(["side", "wall s", "CPU s", "analysis s", "cost tables s", "torch._dynamo imported", "load"],
                   rows), "",
          f"Cold speedup of the median wall: {stats['before']['wall_s']['median'] / stats['after']['wall_s']['median']:.2f}x, "
          f"CPU {stats['before']['cpu_s']['median'] / stats['after']['cpu_s']['median']:.2f}x. "
          "The warm side read its annotations from a cache an earlier process wrote: not a cold figure."]
    write_results("plan_front", dict(before=args.before, after=after_name, model=args.model,
                                     cluster=Path(args.cluster).name, sides=sides, stats=stats), "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
