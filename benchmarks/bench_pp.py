"""Heterogeneous pipeline parallel (HETHUB-style) vs the Megatron-style uniform split.

Predicted (cost model): llama-7b and gpt2-xl on mixed-3 and the Poplar clusters, `pp` vs `uniform-pp`.
Measured: a 12-block GPT (embed + 10 layers + head) on two emulated devices at speeds 1.0 and 0.5,
heterogeneous vs uniform split in the same run, with measured/predicted step time.

    python benchmarks/bench_pp.py [--skip-run] [--steps 6] [--timeline]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import md_table, write_results  # noqa: E402

CLUSTERS = ["mixed-3", "poplar-a100", "poplar-v100-t4", "poplar-a800-v100s"]
MODELS = {"llama-7b": 256, "gpt2-xl": 512}   # name -> global batch (sequences)
TWO = {"name": "pp-2", "nodes": [{"devices": [
    {"device": {"name": "fast", "emulate": "cpu", "speed": 1.0, "memory_GB": 2}, "count": 1},
    {"device": {"name": "slow", "emulate": "cpu", "speed": 0.5, "memory_GB": 2}, "count": 1}]}]}


def predicted() -> tuple[list, list]:
    from autopar.api import prepare, plan_from_costs
    from autopar.cluster.model import Cluster
    from autopar.config import PP_STRATEGIES
    from autopar.models import build

    here = os.path.dirname(os.path.abspath(__file__))
    rows, out = [], []
    for model, gb in MODELS.items():
        case = build(model, device="meta")
        for cname in CLUSTERS:
            cluster = Cluster.from_yaml(os.path.join(here, "clusters", f"{cname}.yaml"))
            prep = prepare(case.model, cluster, case.example_inputs)
            res = {}
            for s in PP_STRATEGIES:
                t0 = time.perf_counter()
                try:
                    p = plan_from_costs(prep.costs, cluster, gb, strategy=s, replicated_fraction=prep.replicated_fraction)
                    res[s] = dict(samples_per_s=p.predicted.samples_per_s, layers=[st.num_layers for st in p.stages],
                                  schedule=p.schedule, micro=p.num_micro_batches, efficiency=p.predicted.efficiency,
                                  bubble=p.predicted.breakdown.get("bubble_fraction"), plan_s=time.perf_counter() - t0)
                except ValueError as exc:
                    res[s] = dict(error=str(exc)[:200])
            pp, un = res["pp"], res["uniform-pp"]
            if "error" in pp:
                rows.append([model, cname, gb, "does not fit", "-", "-", "-", "-", "-"])
            else:
                sp = f"{pp['samples_per_s'] / un['samples_per_s']:.2f}x" if "samples_per_s" in un else "n/a"
                rows.append([model, cname, gb, f"{pp['samples_per_s']:.2f}", "/".join(map(str, pp["layers"])),
                             f"{pp['schedule']} M={pp['micro']}", f"{pp['efficiency']:.1%}", sp, f"{pp['plan_s']:.2f}"])
            print(" | ".join(map(str, rows[-1])), flush=True)
            out.append(dict(model=model, cluster=cname, global_batch=gb, results=res))
    return rows, out


def measured(steps: int, timeline: bool) -> dict:
    from autopar.cluster.model import Cluster
    from autopar.ir.plan import Plan
    from autopar.cli.trainer import RunSpec, run_comparison

    cluster = Cluster.from_dict(TWO)
    spec = RunSpec(model="gpt-tiny", cluster_dict=cluster.to_dict(), global_batch=64, steps=steps,
                   strategies=("pp", "uniform-pp"), model_overrides=(("num_layers", 10),), zero_stage=0)
    res = {r.strategy: r for r in run_comparison(spec, cluster)}
    out = {}
    for s, r in res.items():
        p = Plan.from_json(r.plan_json)
        out[s] = dict(split=[st.num_layers for st in p.stages], micro=p.num_micro_batches, schedule=p.schedule,
                      measured_samples_per_s=64 / r.measured_step_s, predicted_samples_per_s=64 / r.predicted_step_s,
                      measured_over_predicted=r.measured_step_s / r.predicted_step_s, losses=r.losses)
    out["speedup_measured"] = out["pp"]["measured_samples_per_s"] / out["uniform-pp"]["measured_samples_per_s"]
    out["speedup_predicted"] = out["pp"]["predicted_samples_per_s"] / out["uniform-pp"]["predicted_samples_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-run", action="store_true")
    ap.add_argument("--skip-predicted", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeline", action="store_true", help="also write the predicted timeline PNG of the llama-7b mixed-3 plan")
    args = ap.parse_args()
    md = "# Heterogeneous pipeline (HETHUB-style) vs uniform-pp (Megatron-style)\n\n"
    data = {}
    if not args.skip_predicted:
        rows, pred = predicted()
        data["predicted"] = pred
        md += ("Predicted by the cost model (roofline transfer).\n\n" + md_table(
            ["model", "cluster", "global batch", "pp samples/s", "layers per stage", "schedule", "efficiency",
             "vs uniform-pp", "plan s"], rows))
    if not args.skip_run:
        m = measured(args.steps, args.timeline)
        data["measured_two_devices"] = m
        md += ("\n\n## Measured: 12-block GPT on two emulated devices (speeds 1.0 and 0.5)\n\n" + md_table(
            ["strategy", "split", "schedule", "measured samples/s", "predicted samples/s", "measured/predicted step"],
            [[s, "/".join(map(str, m[s]["split"])), f"{m[s]['schedule']} M={m[s]['micro']}",
              f"{m[s]['measured_samples_per_s']:.1f}", f"{m[s]['predicted_samples_per_s']:.1f}",
              f"{m[s]['measured_over_predicted']:.2f}"] for s in ("pp", "uniform-pp")])
            + f"\n\nspeedup of pp over uniform-pp measured in the same run: {m['speedup_measured']:.2f}x "
              f"(predicted {m['speedup_predicted']:.2f}x; ideal 1.5x). Emulated devices.")
        print(f"two devices: pp {m['pp']['split']} over uniform-pp {m['uniform-pp']['split']}: measured "
              f"{m['speedup_measured']:.2f}x, predicted {m['speedup_predicted']:.2f}x; measured/predicted "
              f"{m['pp']['measured_over_predicted']:.2f} / {m['uniform-pp']['measured_over_predicted']:.2f}")
    write_results("pp", data, md)


if __name__ == "__main__":
    main()
