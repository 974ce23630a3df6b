"""Planner benchmark: predicted throughput of ``auto`` against every single-dimension strategy and
baseline, efficiency against both bounds, planning wall time, and how planning time scales with the
number of devices and of blocks.

Usage (a few minutes on 2 CPU cores)::

    python benchmarks/bench_planner.py                 # everything
    python benchmarks/bench_planner.py --quick         # fewer scenarios, smaller scaling sweep

Writes ``benchmarks/results/planner.json``, ``planner.md`` and ``planner_scaling.png``.

Cost tables: ``autopar.measure.tables.model_costs`` on the fake-tensor analysis of each zoo model built on
the meta device (roofline per device type); the scaling sweep uses Llama-shaped tables built from the
model's arithmetic (``llama_like_costs``) so that only the planner is timed. All figures are
predictions of the cost model; nothing here runs a model. Planning times are medians of ``--repeats``
runs with the plan cache off.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopar.planner.bounds import (  # noqa: E402
    compute_bound_samples_per_s, homogeneous_mfu, mfu, upper_bound_samples_per_s,
)
from autopar.cluster.model import Cluster  # noqa: E402
from autopar.ir.costs import ModelCosts  # noqa: E402
from autopar.errors import PlanError  # noqa: E402
from autopar.planner.joint import SINGLE_STRATEGIES, plan_auto, plan_strategy  # noqa: E402

CLUSTERS = ("poplar-a100", "poplar-v100-t4", "poplar-a800-v100s", "mixed-3", "hethub-768", "demo")
MODELS = {"gpt2-xl": 25, "llama-7b": 32, "llama-140b": 96, "bert-large": 16}   # zoo name -> heads
RESULTS = ROOT / "benchmarks" / "results"


def global_batch(cluster: Cluster) -> int:
    return 1024 if len(cluster) > 64 else 256


def analysis_costs(model: str, clusters: dict[str, Cluster], cache: dict) -> dict[str, ModelCosts]:
    """Cost tables of a zoo model on every cluster (one analysis, one table per cluster)."""
    import autopar.models as zoo
    from autopar.passes.analyze import analyze

    if model not in cache:
        case = zoo.build(model, device="meta")
        cache[model] = (case, analyze(case.model, case.example_inputs))
    case, analysis = cache[model]
    try:
        from autopar.measure.tables import model_costs
    except ImportError:   # pragma: no cover - before the profiler existed
        model_costs = None
    out = {}
    for name, cluster in clusters.items():
        if model_costs is not None:
            out[name] = model_costs(analysis, cluster, model=case.model)
        else:
            out[name] = _roofline_from_stats(analysis, cluster)
    return out


def _roofline_from_stats(analysis, cluster: Cluster, efficiency: float = 0.5) -> ModelCosts:
    per = analysis.batch_size
    st = analysis.stats
    flops = np.array([s.fwd_flops / per for s in st])
    bwd = np.array([s.bwd_flops / per for s in st])
    sb = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 64.0])
    fwd_t, bwd_t = {}, {}
    for t in cluster.device_types():
        peak = cluster.spec_of(t).peak_flops_bf16 * efficiency
        fwd_t[t] = np.outer(sb, flops / peak) + 20e-6
        bwd_t[t] = np.outer(sb, bwd / peak) + 20e-6
    params = np.array([s.params for s in st], float)
    return ModelCosts(block_names=tuple(s.name for s in st), params=params, param_bytes=2 * params,
                      act_bytes=np.array([s.saved_bytes / per / 2 for s in st]),
                      out_bytes=np.array([s.cut_bytes / per / 2 for s in st]), fwd_flops=flops,
                      sample_batches=sb, fwd_table=fwd_t, bwd_table=bwd_t, optimizer_bytes_per_param=12,
                      grad_bytes_per_param=2)


def llama_like_costs(cluster: Cluster, num_layers: int, hidden: int = 4096, ffn: int = 11008,
                     vocab: int = 32000, seq: int = 4096, efficiency: float = 0.5) -> ModelCosts:
    """Roofline tables of a Llama-shaped model (embedding, ``num_layers`` layers, head) from its
    arithmetic: time = FLOPs / (efficiency x peak) + 20 us, activations 34 s h bytes per layer and
    sample, 16 bytes of states per parameter."""
    h, s = hidden, seq
    layer_params = 4 * h * h + 3 * h * ffn + 2 * h
    params = np.array([vocab * h] + [layer_params] * num_layers + [vocab * h + h], float)
    flops = np.array([0.0] + [2 * layer_params * s + 4 * s * s * h] * num_layers + [2 * vocab * h * s], float)
    sb = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 64.0])
    fwd = {t: np.outer(sb, flops / (cluster.spec_of(t).peak_flops_bf16 * efficiency)) + 20e-6
           for t in cluster.device_types()}
    return ModelCosts(
        block_names=("embed", *(f"layers.{i}" for i in range(num_layers)), "head"), params=params,
        param_bytes=2 * params, act_bytes=np.array([2 * s * h] + [34 * s * h] * num_layers + [6 * s * vocab], float),
        out_bytes=np.array([2 * s * h] * (num_layers + 1) + [4.0], float), fwd_flops=flops, sample_batches=sb,
        fwd_table=fwd, bwd_table={t: 2 * v for t, v in fwd.items()}, optimizer_bytes_per_param=12,
        grad_bytes_per_param=2)


def _timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def scenario(cluster_name: str, cluster: Cluster, model: str, costs: ModelCosts, heads: int, repeats: int) -> dict:
    B = global_batch(cluster)
    row = {"cluster": cluster_name, "model": model, "devices": len(cluster), "global_batch": B,
           "device_types": {t: len(r) for t, r in cluster.device_types().items()}, "strategies": {}}
    try:
        auto, wall = _timed(lambda: plan_auto(costs, cluster, B, num_heads=heads), repeats)
    except PlanError as e:
        row["error"] = str(e)[:300]
        return row
    row["strategies"]["auto"] = {"samples_per_s": auto.predicted.samples_per_s, "plan_s": wall,
                                 "chosen": auto.notes[0], "zero_stage": auto.zero_stage,
                                 "num_stages": auto.num_stages,
                                 "peak_memory_GiB": _peak_by_type(auto, cluster)}
    for strategy in SINGLE_STRATEGIES:
        try:
            p, w = _timed(lambda: plan_strategy(costs, cluster, B, strategy, num_heads=heads), 1)
        except PlanError as e:
            row["strategies"][strategy] = {"error": str(e)[:200]}
            continue
        row["strategies"][strategy] = {"samples_per_s": p.predicted.samples_per_s, "plan_s": w,
                                       "speedup_of_auto": auto.predicted.samples_per_s / p.predicted.samples_per_s}
    (upper, bound_s) = _timed(lambda: upper_bound_samples_per_s(costs, cluster, B, num_heads=heads), 1)
    compute = compute_bound_samples_per_s(costs, cluster)
    homo: dict = {}
    row["mfu"] = mfu(costs, cluster, auto.predicted.samples_per_s)
    row["homogeneous_mfu"], homo_s = _timed(lambda: homogeneous_mfu(costs, cluster, B, details=homo, num_heads=heads), 1)
    row["homogeneous_cluster"] = f"{len(homo['cluster'])} x {homo['cluster'].devices[0].spec.name}"
    row.update(upper_bound_samples_per_s=upper, compute_bound_samples_per_s=compute, bounds_s=bound_s + homo_s,
               efficiency=auto.predicted.samples_per_s / upper if upper else None,
               compute_efficiency=auto.predicted.samples_per_s / compute if compute else None,
               tokens_per_s=auto.predicted.samples_per_s * _seq(model))
    return row


def _seq(model: str) -> int:
    import autopar.models as zoo

    cfg = zoo.config_of(model)
    return int(getattr(cfg, "seq_len", getattr(cfg, "max_seq_len", getattr(cfg, "block_size", 1))))


def _peak_by_type(plan, cluster: Cluster) -> dict[str, float]:
    out: dict[str, float] = {}
    for r, v in plan.predicted.memory_bytes.items():
        t = cluster.devices[r].spec.name
        out[t] = max(out.get(t, 0.0), v / 2**30)
    return out


def mixed_cluster(num_devices: int) -> Cluster:
    """Half A100-80GB, half V100S-32GB, 8 to a node (one type per node)."""
    half = num_devices // 2
    per = min(8, half)
    return Cluster.from_dict({"name": f"mix-{num_devices}", "nodes": [
        {"device": "A100-80GB", "count": per, "repeat": half // per},
        {"device": "V100S-32GB", "count": per, "repeat": half // per}]})


def scaling(device_counts, block_counts, repeats: int) -> dict:
    out = {"devices": [], "blocks": []}
    for n in device_counts:
        cluster = mixed_cluster(n)
        costs = llama_like_costs(cluster, 32)
        B = max(64, n)
        p, wall = _timed(lambda: plan_auto(costs, cluster, B, num_heads=32), repeats)
        out["devices"].append({"devices": n, "blocks": costs.num_blocks, "global_batch": B, "plan_s": wall,
                               "samples_per_s": p.predicted.samples_per_s})
        print(f"  scaling devices={n}: {wall:.2f} s", flush=True)
    cluster = mixed_cluster(64)
    for k in block_counts:
        costs = llama_like_costs(cluster, k - 2)
        p, wall = _timed(lambda: plan_auto(costs, cluster, 256, num_heads=32), repeats)
        out["blocks"].append({"devices": 64, "blocks": k, "global_batch": 256, "plan_s": wall,
                              "samples_per_s": p.predicted.samples_per_s})
        print(f"  scaling blocks={k}: {wall:.2f} s", flush=True)
    return out


def plot(scale: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    d = scale["devices"]
    axes[0].loglog([x["devices"] for x in d], [x["plan_s"] for x in d], "o-", base=2)
    axes[0].set_xlabel("devices (half A100-80GB, half V100S-32GB; 34 blocks)")
    axes[0].set_ylabel("planning wall time (s)")
    b = scale["blocks"]
    axes[1].plot([x["blocks"] for x in b], [x["plan_s"] for x in b], "o-")
    axes[1].set_xlabel("blocks (64 devices)")
    axes[1].set_ylabel("planning wall time (s)")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("autopar joint planner (strategy auto): planning time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(result: dict) -> str:
    lines = ["# Planner benchmark (predicted by the cost model)", "",
             f"Machine: {result['machine']['platform']}, {result['machine']['cpus']} CPUs; torch "
             f"{result['machine']['torch']}; commit {result['machine']['commit']}.", "",
             "MFU: model FLOP/s (forward + backward, no recomputation) over the cluster's summed peak (bf16 "
             "for accelerators, fp32 for CPUs: the precision the cost model prices). homog. MFU: the planner on "
             "whole nodes of the fastest type alone with the same summed peak. eff. vs compute: samples/s over "
             "the compute bound (no communication, no bubbles). eff. vs upper: over the sum of each device type "
             "alone on the whole batch.", "",
             "| cluster | model | batch | MFU | homog. MFU | eff. vs compute | eff. vs upper | auto samples/s | "
             + " | ".join(f"x {s}" for s in SINGLE_STRATEGIES) + " | plan s | chosen |",
             "|" + "---|" * (10 + len(SINGLE_STRATEGIES))]
    for r in result["scenarios"]:
        if "error" in r:
            lines.append(f"| {r['cluster']} | {r['model']} | {r['global_batch']} | does not fit | | | | | "
                         + " | ".join("" for _ in SINGLE_STRATEGIES) + " | | |")
            continue
        a = r["strategies"]["auto"]
        sp = []
        for s in SINGLE_STRATEGIES:
            x = r["strategies"].get(s, {})
            sp.append(f"{x['speedup_of_auto']:.2f}" if "speedup_of_auto" in x else "-")
        eff = f"{r['efficiency']:.1%}" if r.get("efficiency") else "-"
        ceff = f"{r['compute_efficiency']:.1%}" if r.get("compute_efficiency") else "-"
        chosen = a["chosen"][len("chosen: "):].split(": ")[0]
        hm = f"{r['homogeneous_mfu']:.1%}" if r.get("homogeneous_mfu") else "-"
        lines.append(f"| {r['cluster']} | {r['model']} | {r['global_batch']} | {r['mfu']:.1%} | {hm} | {ceff} | "
                     f"{eff} | {a['samples_per_s']:.4g} | " + " | ".join(sp) + f" | {a['plan_s']:.2f} | {chosen} |")
    lines += ["", "x S: speedup of auto over strategy S (- : S does not fit or does not apply).", "",
              "## Planning time scaling", "", "| devices | blocks | plan s |", "|---|---|---|"]
    for x in result["scaling"]["devices"] + result["scaling"]["blocks"]:
        lines.append(f"| {x['devices']} | {x['blocks']} | {x['plan_s']:.2f} |")
    return "\n".join(lines) + "\n"


def machine() -> dict:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = "?"
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "cpus": os.cpu_count(), "commit": commit}


_AB_CHILD = r"""
import json, sys, time, os, tempfile
os.environ["AUTOPAR_CACHE_DIR"] = tempfile.mkdtemp()
import numpy as np
from autopar.cluster.model import Cluster
from autopar.ir.costs import ModelCosts
from autopar.planner.joint import plan_auto
import scipy.interpolate   # imported before the clock: one tree imports it with the planner, the other on use
exec(sys.argv[3])   # llama_like_costs and mixed_cluster, the same source on both trees
kind, n = sys.argv[1], int(sys.argv[2])
if kind == "devices":
    cluster = mixed_cluster(n); costs = llama_like_costs(cluster, 32); B = max(64, n)
else:
    cluster = mixed_cluster(64); costs = llama_like_costs(cluster, n - 2); B = 256
t0, c0 = time.perf_counter(), time.process_time()
p = plan_auto(costs, cluster, B, num_heads=32)
print(json.dumps(dict(wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0,
                      samples_per_s=p.predicted.samples_per_s, blocks=costs.num_blocks, global_batch=B)))
"""


def _ab_point(tree, kind: str, n: int, funcs: str) -> dict:
    env, cwd = dict(os.environ), ROOT
    if tree is not None:
        env["PYTHONPATH"], cwd = str(tree), tree
    out = subprocess.run([sys.executable, "-c", _AB_CHILD, kind, str(n), funcs], env=env, cwd=cwd,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def scaling_ab(rev: str, device_counts, block_counts, repeats: int) -> dict:
    """``scaling``'s sweep, each point in fresh processes on this checkout and on ``rev``'s tree, alternating
    (median CPU seconds of ``repeats`` each)."""
    import inspect

    from bench_planner_cold import _tree   # noqa: E402 - the benchmarks folder is on sys.path when run

    tree = _tree(rev)
    funcs = inspect.getsource(llama_like_costs) + "\n" + inspect.getsource(mixed_cluster)
    out = {"devices": [], "blocks": []}
    for kind, counts in (("devices", device_counts), ("blocks", block_counts)):
        for n in counts:
            now, old = [], []
            for _ in range(repeats):
                old.append(_ab_point(tree, kind, n, funcs))
                now.append(_ab_point(None, kind, n, funcs))
            med = lambda xs, k: statistics.median(x[k] for x in xs)   # noqa: E731
            out[kind].append({"devices": n if kind == "devices" else 64, "blocks": now[-1]["blocks"],
                              "global_batch": now[-1]["global_batch"], "plan_s": med(now, "wall_s"),
                              "cpu_s": med(now, "cpu_s"), "samples_per_s": now[-1]["samples_per_s"],
                              "before_cpu_s": med(old, "cpu_s"), "before_samples_per_s": old[-1]["samples_per_s"]})
            print(f"  scaling {kind}={n}: {med(now, 'cpu_s'):.2f} s CPU (before {med(old, 'cpu_s'):.2f})", flush=True)
    return out


def scaling_only(args) -> int:
    """The full scaling sweep alone, with the previous record's times (``planner.json``) beside it;
    ``--render-only`` re-renders planner_scaling.md from planner_scaling.json."""
    if args.render_only:
        result = json.loads((args.out / "planner_scaling.json").read_text())
    else:
        prev_path = args.out / "planner.json"
        prev = json.loads(prev_path.read_text()) if prev_path.exists() else {}
        prev_scale = prev.get("scaling", {"devices": [], "blocks": []})
        prev_commit = prev.get("machine", {}).get("commit", "?")
        sweep = ((8, 16, 32, 64, 128, 256, 512, 1024), (12, 34, 66, 98, 128))
        scale = (scaling_ab(args.before, *sweep, args.repeats) if args.before else scaling(*sweep, args.repeats))
        result = {"benchmark": "planner-scaling", "machine": machine(), "load_at_end": os.getloadavg()[0],
                  "scaling": scale, "previous": {"commit": prev_commit, "scaling": prev_scale},
                  "repeats": args.repeats, "before": args.before}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "planner_scaling.json").write_text(json.dumps(result, indent=2, default=str))
        plot(scale, args.out / "planner_scaling.png")
    md = scaling_markdown(result)
    (args.out / "planner_scaling.md").write_text(md)
    print(md)
    return 0


def scaling_markdown(result: dict) -> str:
    m, scale, rev, reps = result["machine"], result["scaling"], result.get("before"), result["repeats"]
    prev_commit, prev_scale = result["previous"]["commit"], result["previous"]["scaling"]
    earlier = {("d", x["devices"]): x["plan_s"] for x in prev_scale["devices"]}
    earlier.update({("b", x["blocks"]): x["plan_s"] for x in prev_scale["blocks"]})
    md = ["# Planning time against devices and blocks (plan_auto, cache off; plans PREDICTED by the cost model)", "",
          f"`python benchmarks/bench_planner.py --scaling-only --repeats {reps}"
          f"{(' --before ' + rev) if rev else ''}`; {m.get('platform', '')}, commit {m.get('commit', '?')}, "
          f"1-minute load {result['load_at_end']:.1f} at the end (a shared machine). Devices: half A100-80GB, half "
          f"V100S-32GB, a Llama-shaped model of 34 blocks (32 layers); blocks: 64 such devices. "
          + (f"Each point runs in fresh processes on this checkout and on {rev}'s source tree, alternating; "
             f"'CPU s' is plan_auto's CPU time there (median of {reps}), 'wall s' this checkout's wall time. "
             if rev else f"Wall seconds, median of {reps}. ")
          + f"'earlier wall s' is the sweep of the last full `bench_planner.py` run (commit {prev_commit}, "
          f"planner.json), on another day's load and before the pipeline planner searched interleaved and "
          f"zero-bubble schedules: not comparable.", ""]
    if rev:
        md += [f"| devices | blocks | CPU s | {rev} CPU s | speedup | wall s | earlier wall s | samples/s | "
               f"{rev} samples/s |", "|---|---|---|---|---|---|---|---|---|"]
    else:
        md += ["| devices | blocks | wall s | earlier wall s | samples/s |", "|---|---|---|---|---|"]
    for kind, rows in (("d", scale["devices"]), ("b", scale["blocks"])):
        for x in rows:
            old = earlier.get((kind, x["devices"] if kind == "d" else x["blocks"]))
            old = "-" if old is None else f"{old:.2f}"
            if rev:
                md.append(f"| {x['devices']} | {x['blocks']} | {x['cpu_s']:.2f} | {x['before_cpu_s']:.2f} | "
                          f"{x['before_cpu_s'] / x['cpu_s']:.2f}x | {x['plan_s']:.2f} | {old} | "
                          f"{x['samples_per_s']:.4g} | {x['before_samples_per_s']:.4g} |")
            else:
                md.append(f"| {x['devices']} | {x['blocks']} | {x['plan_s']:.2f} | {old} | {x['samples_per_s']:.4g} |")
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer scenarios and a smaller scaling sweep")
    ap.add_argument("--repeats", type=int, default=3, help="planning runs per timing (median)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--before", metavar="REV",
                    help="with --scaling-only: also time every sweep point on the source tree of commit REV "
                         "(fresh processes, alternating with this checkout)")
    ap.add_argument("--render-only", action="store_true",
                    help="with --scaling-only: re-render planner_scaling.md from planner_scaling.json")
    ap.add_argument("--scaling-only", action="store_true",
                    help="only the planning-time sweep over devices and blocks (planner_scaling.json/.md/.png), "
                         "next to the sweep of the last full run (planner.json)")
    args = ap.parse_args(argv)
    if args.scaling_only:
        return scaling_only(args)
    clusters_names = ("poplar-v100-t4", "mixed-3", "hethub-768") if args.quick else CLUSTERS
    models = ("gpt2-xl", "llama-140b") if args.quick else tuple(MODELS)
    clusters = {}
    for name in clusters_names:
        path = ROOT / "benchmarks" / "clusters" / f"{name}.yaml"
        clusters[name] = Cluster.from_yaml(path) if path.exists() else Cluster.from_yaml(ROOT / "autopar" / "clusters" / f"{name}.yaml")
    analyses: dict = {}
    rows = []
    for model in models:
        t0 = time.perf_counter()
        tables = analysis_costs(model, clusters, analyses)
        print(f"{model}: analysis + tables {time.perf_counter() - t0:.1f} s", flush=True)
        for name, cluster in clusters.items():
            big = len(cluster) > 64
            row = scenario(name, cluster, model, tables[name], MODELS[model], 1 if big else args.repeats)
            a = row["strategies"].get("auto", {})
            print(f"  {name:<18} {model:<11} auto {a.get('samples_per_s', float('nan')):10.4g} samples/s "
                  f"MFU {row.get('mfu') or float('nan'):.3f} homog. {row.get('homogeneous_mfu') or float('nan'):.3f} "
                  f"vs compute {row.get('compute_efficiency') or float('nan'):.3f} "
                  f"eff {row.get('efficiency') or float('nan'):.3f} plan {a.get('plan_s', float('nan')):.2f} s",
                  flush=True)
            rows.append(row)
    if args.quick:
        scale = scaling((8, 32, 128, 512), (12, 34, 66), 1)
    else:
        scale = scaling((8, 16, 32, 64, 128, 256, 512, 1024), (12, 34, 66, 98, 128), 1)
    result = {"benchmark": "planner", "machine": machine(), "scenarios": rows, "scaling": scale,
              "config": {"clusters": list(clusters_names), "models": list(models), "repeats": args.repeats,
                         "global_batch": "1024 above 64 devices, else 256", "cache": "off"}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planner.json").write_text(json.dumps(result, indent=2, default=str))
    (args.out / "planner.md").write_text(markdown(result))
    plot(scale, args.out / "planner_scaling.png")
    print(f"wrote {args.out / 'planner.json'}, planner.md, planner_scaling.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
