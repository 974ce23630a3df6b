"""The plans of the benchmark scenarios as JSON files, to compare two versions of the planner.

Every zoo model the planner benchmark plans (``bench_planner.MODELS``) on every cluster of
``benchmarks/clusters/`` it reports on, and the demo's model on the demo cluster, each planned with
``autopar.plan(strategy="auto")`` on cost tables that need no timing here (roofline; a model on
``meta``). The demo's emulated CPUs still have their optimizer rate and link timed here: give both
versions one ``--cache`` folder so they plan on the same measurements (the first run measures, the
second reads). The search's wall time, which the notes of older versions carry, is left out.
Compare a commit with the checkout:

    python benchmarks/plan_snapshot.py /tmp/plans-old --rev OLD --cache /tmp/plan-tables
    python benchmarks/plan_snapshot.py /tmp/plans-new --cache /tmp/plan-tables
    diff -r /tmp/plans-old /tmp/plans-new && echo identical

``--rev REV`` plans with the committed tree ``REV`` instead of the importable one (a throwaway copy).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = ("poplar-a100", "poplar-v100-t4", "poplar-a800-v100s", "mixed-3", "hethub-768", "demo")
MODELS = ("gpt2-xl", "llama-7b", "llama-140b", "bert-large")
DEMO = ("gpt-tiny", "demo", 96)
_WALL = re.compile(r" in [0-9.eE+-]+ s\b")


def _batch(num_devices: int) -> int:
    return 1024 if num_devices > 64 else 256


def _normalised(plan_json: str) -> str:
    d = json.loads(plan_json)
    d["notes"] = [_WALL.sub("", n) for n in d.get("notes", [])]
    return json.dumps(d, indent=1, sort_keys=True) + "\n"


def snapshot(out: Path, models=MODELS, clusters=CLUSTERS) -> list[str]:
    """Write one ``MODEL@CLUSTER.json`` per scenario under ``out``; returns the names written."""
    import autopar
    import autopar.models as zoo
    from autopar.errors import PlanError

    out.mkdir(parents=True, exist_ok=True)
    jobs = [(m, c, None) for m in models for c in clusters] + [DEMO]
    written = []
    for model, cluster_name, batch in jobs:
        cluster = autopar.Cluster.from_yaml(ROOT / "benchmarks" / "clusters" / f"{cluster_name}.yaml")
        case = zoo.build(model, device="meta")
        batch = batch or _batch(len(cluster))
        name = f"{model}@{cluster_name}.json"
        try:
            p = autopar.plan(case.model, cluster, case.example_inputs, batch, measure=False)
            text = _normalised(p.to_json())
        except PlanError as e:
            text = json.dumps({"error": str(e)}) + "\n"
        (out / name).write_text(text)
        written.append(name)
        print(name, flush=True)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for the plan files")
    ap.add_argument("--rev", help="plan with this commit's tree instead of the importable autopar")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--clusters", default=",".join(CLUSTERS))
    ap.add_argument("--cache", type=Path, help="measurement cache folder ($AUTOPAR_CACHE_DIR; default: a new one)")
    args = ap.parse_args(argv)
    if args.cache:
        os.environ["AUTOPAR_CACHE_DIR"] = str(args.cache.resolve())
    if args.rev:
        from _common import tree_of

        tree = tree_of(args.rev, Path(tempfile.mkdtemp(prefix="autopar-snapshot-src-")))
        env = dict(os.environ, PYTHONPATH=str(tree))
        env.setdefault("AUTOPAR_CACHE_DIR", str(tree / "cache"))
        return subprocess.call([sys.executable, __file__, str(args.out.resolve()), "--models", args.models,
                                "--clusters", args.clusters], env=env, cwd=tree)
    os.environ.setdefault("AUTOPAR_CACHE_DIR", tempfile.mkdtemp(prefix="autopar-snapshot-"))
    snapshot(args.out, args.models.split(","), args.clusters.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
