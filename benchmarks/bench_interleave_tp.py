"""Interleaved 1F1B against 1F1B on a pipeline of tensor-parallel members (emulated; issue 14).

Four emulated CPU devices at speeds 1.0, 1.0, 0.5, 0.5 form two TP members, (0, 1) and (2, 3) (head
shares 2:2), each a rank stage of a 2-stage pipeline training a GPT of 18 blocks (embed + 16 layers +
head) on a small global batch (few micro-batches: the bubble matters). The plans are written by hand
(``autopar.compile(strategy=plan)``): 1F1B on stages of 12 / 6 blocks (in proportion to the members'
speeds), and interleaved-1f1b with V = 2 chunks per rank stage (6 / 3 / 6 / 3 blocks: the chunk split
``planner.pp_virtual.chunk_sizes`` gives), the same micro-batches. In one ``autopar.launch`` run both
step in turn (the order alternating per step), each step's wall time the slowest rank's.

Figures: per plan the median step and its IQR over the measured steps; the speedup over 1F1B as the
median (and IQR) of the paired per-step ratios, next to the cost model's predicted ratio
(``cost.pipeline.plan_timeline`` on the cost tables ``autopar.prepare`` gives on rank 0). Every figure
is emulated (measured on emulated devices) or predicted (the cost model), never native.

    python benchmarks/bench_interleave_tp.py [--steps 8] [--batch 8] [--micro 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import interleaved_steps, md_table, write_results  # noqa: E402

SPEEDS = (1.0, 0.5)          # per node of two devices: a TP member each
CLUSTER = {"name": "tp-pp-2x2-mixed", "nodes": [{"devices": [
    {"device": {"name": f"cpu-{s}", "emulate": "cpu", "speed": s, "memory_GB": 2}, "count": 2}]} for s in SPEEDS]}
MODEL = dict(num_layers=16, hidden_size=256, num_heads=4)
FLAT = (12, 6)               # blocks per rank stage
CHUNKS = (6, 3, 6, 3)        # V = 2: chunk v of rank stage p is stage 2 v + p


def plans(batch: int, micro: int):
    """The 1F1B plan and the interleaved one (see the module docstring)."""
    from autopar.cost.stage import micro_sizes
    from autopar.ir.plan import Plan, Predicted, Stage

    mb = tuple(micro_sizes(batch, micro))
    members = ((0, 1), (2, 3))

    def stages(sizes):
        out, start = [], 0
        for s, k in enumerate(sizes):
            out.append(Stage(start, start + k, groups=(members[s % 2],), micro_batches=(mb,), tp_shares=((2, 2),)))
            start += k
        return tuple(out)

    pred = Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={})
    return {"1f1b": Plan(strategy="pp", global_batch_size=batch, zero_stage=0, schedule="1f1b",
                         stages=stages(FLAT), predicted=pred),
            "interleaved-1f1b V=2": Plan(strategy="pp", global_batch_size=batch, zero_stage=0,
                                         schedule="interleaved-1f1b", stages=stages(CHUNKS), virtual_stages=2,
                                         predicted=pred)}


def worker(rank: int, steps: int, warmup: int, batch: int, micro: int) -> list[dict]:
    import torch

    import autopar
    from autopar.cluster.model import Cluster
    from autopar.models import build

    cluster = Cluster.from_dict(CLUSTER)
    runs = []
    for label, plan in plans(batch, micro).items():
        case = build("gpt-tiny", device="cpu", seed=0, **MODEL)
        compiled = autopar.compile(case.model, cluster, case.example_inputs, batch, case.loss_fn, strategy=plan,
                                   run=autopar.RunConfig(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)))
        runs.append(dict(label=label, case=case, engine=compiled.engine, times=[], losses=[]))
    interleaved_steps(runs, batch, warmup, steps)
    return [dict(label=r["label"], times=r["times"], losses=r["losses"]) for r in runs]


def predicted(batch: int, micro: int) -> dict[str, float]:
    """Each plan's predicted step seconds (the cost model on ``autopar.prepare``'s tables)."""
    from autopar.api import prepare
    from autopar.cluster.model import Cluster
    from autopar.cost.pipeline import plan_timeline
    from autopar.models import build

    cluster = Cluster.from_dict(CLUSTER)
    case = build("gpt-tiny", device="cpu", seed=0, **MODEL)
    prep = prepare(case.model, cluster, case.example_inputs)
    return {label: plan_timeline(p, prep.costs, cluster)[1] for label, p in plans(batch, micro).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    args = ap.parse_args()

    import autopar
    from autopar.cli.trainer import paired_speedup, spread
    from autopar.cluster.model import Cluster

    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    results = autopar.launch(worker, Cluster.from_dict(CLUSTER), args.steps, args.warmup, args.batch, args.micro,
                             timeout_s=1800)[0]
    wall = time.perf_counter() - t0
    pred = predicted(args.batch, args.micro)
    by = {r["label"]: r for r in results}
    base = by["1f1b"]
    rows, data = [], {"cluster": CLUSTER, "model": dict(MODEL, name="gpt-tiny"), "global_batch": args.batch,
                      "num_micro": args.micro, "steps": args.steps, "warmup": args.warmup, "wall_s": wall,
                      "load_1min": load, "runs": {}}
    for label, r in by.items():
        st, sp = spread(r["times"]), paired_speedup(r["times"], base["times"])
        ratio = pred["1f1b"] / pred[label]
        chunks = "/".join(map(str, FLAT if label == "1f1b" else CHUNKS))
        data["runs"][label] = dict(chunks=chunks, predicted_step_s=pred[label], measured_step=st.as_dict(),
                                   speedup_over_1f1b=sp.as_dict(), predicted_speedup_over_1f1b=ratio,
                                   times_s=r["times"], losses=r["losses"])
        rows.append([label, chunks, f"{st.median:.3f} [{st.q1:.3f}, {st.q3:.3f}]", f"{pred[label]:.3f}",
                     f"{sp.median:.2f}x [{sp.q1:.2f}, {sp.q3:.2f}]", f"{ratio:.2f}x"])
        print(" | ".join(rows[-1]), flush=True)
    md = ("# Interleaved 1F1B against 1F1B on tensor-parallel members (emulated, 2 rank stages x TP 2)\n\n"
          f"gpt-tiny with {MODEL['num_layers']} layers ({MODEL['num_layers'] + 2} blocks), hidden "
          f"{MODEL['hidden_size']}, global batch {args.batch} in {args.micro} micro-batches, on four emulated CPU "
          f"devices: TP member (0, 1) at speed {SPEEDS[0]} and (2, 3) at {SPEEDS[1]}, head shares 2:2. "
          f"{args.steps} measured steps per plan after {args.warmup} warm-up steps, in one run, the plans stepping "
          f"in turn; 1-min load {load:.1f} at the start (the machine is shared). Measured = emulated devices; "
          "predicted = the cost model. Speedups are the median [IQR] of paired per-step ratios against 1F1B.\n\n"
          + md_table(["plan", "blocks per stage (chunk)", "measured step s, median [IQR]", "predicted step s",
                      "measured speedup vs 1f1b", "predicted speedup"], rows) + "\n")
    write_results("interleave_tp", data, md)


if __name__ == "__main__":
    main()
