"""Interleaved 1F1B (and ZB-H1) against 1F1B on a 4-stage emulated pipeline where the bubble matters.

Four emulated CPU devices at mixed speeds (1.0, 1.0, 0.5, 0.5) train a GPT of 18 blocks (embed + 16
layers + head) on a small global batch, so a pipeline has few micro-batches and its bubble is a large
part of the step. In one ``autopar.launch`` run every schedule is
compiled (``strategy="pp"``, ``pp_layers=PP_LAYERS``: four stages of 6/6/3/3 blocks, and ``schedule=``
each of 1f1b, interleaved-1f1b, zb-h1: the planner's best plan under that schedule, its micro-batch
count and, interleaved, its chunk split of those stages), and they step in turn (the order
alternates per step), each step's wall time the slowest rank's. The interleaved plan runs twice: with
the pipeline's deferred send waits (the default) and with every send waited at once
(``PipelineEngine.overlap_sends = False``), which is the send-overlap on/off measurement.

Figures: per schedule the median step and its IQR over the measured steps; the speedup over 1F1B as
the median (and IQR) of the paired per-step ratios, next to the cost model's predicted ratio. Every
figure is emulated (measured on emulated devices) or predicted (the cost model), never native.

    python benchmarks/bench_interleave.py [--steps 12] [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import interleaved_steps, md_table, write_results  # noqa: E402

SPEEDS = (1.0, 1.0, 0.5, 0.5)
CLUSTER = {"name": "pp-4-mixed", "nodes": [{"devices": [
    {"device": {"name": f"cpu-{s}", "emulate": "cpu", "speed": s, "memory_GB": 2}, "count": 1}]} for s in SPEEDS]}
# (label, schedule, overlap_sends)
RUNS = (("1f1b", "1f1b", True), ("interleaved-1f1b", "interleaved-1f1b", True),
        ("interleaved-1f1b, blocking sends", "interleaved-1f1b", False), ("zb-h1", "zb-h1", True))
MODEL = dict(num_layers=16, hidden_size=256, num_heads=4)
PP_LAYERS = [6, 6, 3, 3]   # four stages, blocks in proportion to the speeds; interleaving re-cuts each into chunks


def worker(rank: int, steps: int, warmup: int, batch: int) -> list[dict]:
    """Every rank: ``autopar.compile`` each schedule of ``RUNS`` (rank 0 plans, on its one pinned core, as
    the cost model measures), then the plans step in turn."""
    import torch

    import autopar
    from autopar.cluster.model import Cluster
    from autopar.models import build

    cluster = Cluster.from_dict(CLUSTER)
    runs = []
    for label, schedule, overlap in RUNS:
        case = build("gpt-tiny", device="cpu", seed=0, **MODEL)
        compiled = autopar.compile(case.model, cluster, case.example_inputs, batch, case.loss_fn,
                                   run=autopar.RunConfig(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
                                   strategy="pp", zero_stage=0, schedule=schedule, pp_layers=PP_LAYERS)
        compiled.engine.overlap_sends = overlap
        runs.append(dict(label=label, case=case, engine=compiled.engine, plan=compiled.plan, times=[], losses=[]))
    interleaved_steps(runs, batch, warmup, steps)
    return [dict(label=r["label"], plan_json=r["plan"].to_json(), times=r["times"], losses=r["losses"])
            for r in runs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()

    import autopar
    from autopar.cli.trainer import paired_speedup, spread
    from autopar.cluster.model import Cluster
    from autopar.ir.plan import Plan

    t0 = time.perf_counter()
    results = autopar.launch(worker, Cluster.from_dict(CLUSTER), args.steps, args.warmup, args.batch,
                             timeout_s=1800)[0]
    wall = time.perf_counter() - t0
    by = {r["label"]: r for r in results}
    base = by["1f1b"]
    base_pred = Plan.from_json(base["plan_json"]).predicted.step_time_s
    rows, data = [], {"cluster": CLUSTER, "model": dict(MODEL, name="gpt-tiny"), "global_batch": args.batch,
                      "steps": args.steps, "warmup": args.warmup, "wall_s": wall, "pp_layers": PP_LAYERS, "runs": {}}
    for label, _, _ in RUNS:
        r = by[label]
        p = Plan.from_json(r["plan_json"])
        st = spread(r["times"])
        sp = paired_speedup(r["times"], base["times"])
        pred = base_pred / p.predicted.step_time_s
        chunks = "/".join(str(s.num_layers) for s in p.stages)
        data["runs"][label] = dict(schedule=p.schedule, virtual_stages=p.virtual_stages, chunks=chunks,
                                   num_micro=p.num_micro_batches, predicted_step_s=p.predicted.step_time_s,
                                   predicted_bubble=p.predicted.breakdown.get("bubble_fraction"),
                                   measured_step=st.as_dict(), speedup_over_1f1b=sp.as_dict(),
                                   predicted_speedup_over_1f1b=pred, times_s=r["times"], losses=r["losses"])
        rows.append([label, f"{p.schedule} V={p.virtual_stages} M={p.num_micro_batches}", chunks,
                     f"{st.median:.3f} [{st.q1:.3f}, {st.q3:.3f}]", f"{p.predicted.step_time_s:.3f}",
                     f"{sp.median:.2f}x [{sp.q1:.2f}, {sp.q3:.2f}]", f"{pred:.2f}x"])
        print(" | ".join(rows[-1]), flush=True)
    il, blk = by["interleaved-1f1b"], by["interleaved-1f1b, blocking sends"]
    ov = paired_speedup(il["times"], blk["times"])
    data["send_overlap_speedup"] = ov.as_dict()
    md = ("# Interleaved 1F1B and ZB-H1 against 1F1B (emulated, 4 stages)\n\n"
          f"gpt-tiny with {MODEL['num_layers']} layers ({MODEL['num_layers'] + 2} blocks), hidden "
          f"{MODEL['hidden_size']}, global batch {args.batch}, on four emulated CPU devices at speeds "
          f"{', '.join(map(str, SPEEDS))}; each schedule is the pp planner's best plan under it. "
          f"{args.steps} measured steps per schedule after {args.warmup} warm-up steps, all in one run, "
          "the schedules stepping in turn. Measured = emulated devices; predicted = the cost model. "
          "Speedups are the median [IQR] of paired per-step ratios against 1F1B.\n\n"
          + md_table(["run", "plan", "blocks per stage (chunk)", "measured step s, median [IQR]",
                      "predicted step s", "measured speedup vs 1f1b", "predicted speedup"], rows)
          + f"\n\nSend overlap (interleaved-1f1b, deferred send waits vs every send waited at once): "
            f"{ov.median:.3f}x [{ov.q1:.3f}, {ov.q3:.3f}] (the cost model assumes the deferred waits: "
            "sends take no worker time).\n")
    write_results("interleave", data, md)


if __name__ == "__main__":
    main()
