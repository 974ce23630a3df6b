"""What a cold ``autopar plan --model llama-140b --cluster hethub-768`` spends before the search, phase by
phase, in fresh processes with an empty cache dir: importing torch and autopar, building the model on
meta, capture, the first ``FakeTensorMode`` (it imports ``torch._dynamo``), annotation, blocks, cost
tables and the replicated fraction (``cli.main._prepare`` and ``api.prepare``, in their order).
Wall and CPU seconds (``time.process_time``: the process's own CPU, which other jobs' load stretches
less than wall time); median and IQR of the repeats, with the load average of each run.

    python benchmarks/bench_cold_analysis.py [--repeats 3] [--before REV]

``--before REV`` times REV's committed tree as well (unpacked under /tmp, alternating with this
checkout in every round), so both are measured under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import md_table, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "benchmarks" / "clusters" / "hethub-768.yaml"

_CHILD = r"""
import json, sys, time
T = [(time.perf_counter(), time.process_time())]
out = {}
def mark(name):
    T.append((time.perf_counter(), time.process_time()))
    out[name] = (T[-1][0] - T[-2][0], T[-1][1] - T[-2][1])
import torch; mark("import torch")
from autopar.cli.main import _planning_case, _load_cluster
from autopar.passes import capture as C, analysis as A, blocks as B
from autopar.passes.analyze import Analysis, _batch_size
from autopar.measure.tables import model_costs
from autopar.measure.tp import replicated_fraction_for
mark("import autopar")
cl = _load_cluster(sys.argv[1]); mark("load cluster")
case = _planning_case("llama-140b"); mark("build on meta")
cap = C.capture(case.model, case.example_inputs); mark("capture")
from torch._subclasses.fake_tensor import FakeTensorMode
FakeTensorMode(); mark("first FakeTensorMode")
A.annotate_pass(cap.gm, case.example_inputs); mark("annotate")
blocks = B.assign_blocks_pass(cap.gm); st, tied = B.block_stats(cap.gm, blocks); mark("blocks + stats")
an = Analysis(cap, _batch_size(case.example_inputs), blocks, st, tied)
costs = model_costs(an, cl, model=case.model, example_inputs=case.example_inputs); mark("cost tables")
replicated_fraction_for(an, case.example_inputs, costs, cl); mark("replicated fraction")
out["total"] = (T[-1][0] - T[0][0], T[-1][1] - T[0][1])
print(json.dumps(out))
"""


def _tree(rev: str) -> Path:
    """REV's committed tree under /tmp, laid out as the editable install maps it."""
    dest = Path(tempfile.gettempdir()) / f"autopar-cold-analysis-{rev}"
    if not dest.exists():
        dest.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        for pkg in ("passes", "kernels"):
            (dest / "autopar" / pkg).symlink_to(dest / pkg)
    return dest


def _run(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), AUTOPAR_CACHE_DIR=tempfile.mkdtemp(prefix="autopar-cold-"))
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", _CHILD, str(CLUSTER)], cwd=tree, env=env, check=True,
                         capture_output=True, text=True, timeout=600).stdout
    return dict(load1=load, phases=json.loads(out.strip().splitlines()[-1]))


def _stat(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return dict(median=statistics.median(values), q1=q[0], q3=q[2])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", default=None, help="a commit to time as well, alternating with this checkout")
    args = ap.parse_args(argv)
    trees = {"checkout": ROOT}
    if args.before:
        trees = {f"before ({args.before})": _tree(args.before), **trees}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            runs[name].append(_run(tree))
    phases = list(runs["checkout"][0]["phases"])
    summary = {name: {p: {kind: _stat([r["phases"][p][i] for r in rs]) for i, kind in enumerate(("wall_s", "cpu_s"))}
                      for p in phases} for name, rs in runs.items()}
    header = ["phase"] + [f"{name} {kind}" for name in trees for kind in ("wall s", "CPU s")]
    rows = []
    for p in phases:
        row = [p]
        for name in trees:
            for kind in ("wall_s", "cpu_s"):
                s = summary[name][p][kind]
                row.append(f"{s['median']:.2f} ({s['q1']:.2f}-{s['q3']:.2f})")
        rows.append(row)
    loads = {name: [round(r["load1"], 2) for r in rs] for name, rs in runs.items()}
    md = (f"# Cold analysis of llama-140b on hethub-768, before the search\n\n"
          f"Fresh processes, empty cache dir, {args.repeats} repeats each: median (IQR) seconds, native CPU "
          f"(no emulation; the cost tables are roofline predictions). Load average at each run: {loads}.\n\n"
          + md_table(header, rows))
    write_results("cold-analysis", dict(runs=runs, summary=summary, repeats=args.repeats), md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
