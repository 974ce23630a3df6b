"""Capture + analysis of every zoo model: wall time, peak memory (RSS), parameters and FLOPs against the
analytic counts. Big models are analysed on the meta device (no weights allocated).

    python benchmarks/bench_analysis.py [--models llama-140b,...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import json

sys.path.insert(0, __import__("os").path.dirname(__file__))
from _common import md_table, write_results  # noqa: E402

_CHILD = r"""
import json, resource, sys, time
import autopar.models as zoo
from autopar.passes.analyze import analyze
name = sys.argv[1]
case = zoo.build(name, device="cpu" if "tiny" in name else "meta")
t0 = time.perf_counter()
a = analyze(case.model, case.example_inputs)
dt = time.perf_counter() - t0
exp = case.fwd_flops_per_sample_expected
print(json.dumps(dict(model=name, capture=a.method, analyze_s=dt, blocks=len(a.blocks),
    distinct_blocks=len(a.distinct_blocks()), params=a.total_params, params_expected=case.num_params_expected,
    fwd_flops_per_sample=a.fwd_flops / a.batch_size, fwd_flops_expected=exp,
    flops_ratio=(a.fwd_flops / a.batch_size / exp) if exp else None,
    peak_rss_GiB=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)))
"""


def main() -> None:
    import autopar.models as zoo

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(zoo.names()))
    args = ap.parse_args()
    rows, results = [], []
    for name in args.models.split(","):
        # One process per model so the peak memory is that model's alone (it includes torch's ~0.4 GiB).
        out = subprocess.run([sys.executable, "-c", _CHILD, name], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        results.append(r)
        ratio = f"{r['flops_ratio']:.4f}" if r["flops_ratio"] else "-"
        rows.append([name, r["capture"], f"{r['params']:,}", "yes" if r["params"] == r["params_expected"] else "NO",
                     ratio, f"{r['blocks']} ({r['distinct_blocks']} distinct)", f"{r['analyze_s']:.2f}",
                     f"{r['peak_rss_GiB']:.2f}"])
        print(" | ".join(rows[-1]), flush=True)
    md = "# Capture + analysis of the zoo\n\n" + md_table(
        ["model", "capture", "parameters", "exact", "fwd FLOPs / analytic", "blocks", "wall s", "peak RSS GiB"], rows)
    write_results("analysis", dict(models=results), md)


if __name__ == "__main__":
    main()
