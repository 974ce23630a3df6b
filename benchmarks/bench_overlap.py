"""Overlap pays (issue 11 item 6): a data-parallel step with gradient reduction overlapping backward
(ZeRO 0/1 buckets; ZeRO-3 prefetch) against the same plan with every collective blocking, measured on
the emulated ``demo`` cluster (CPU processes at speeds 1, 0.5, 0.25) in ONE run: both engines are
compiled in the same processes and their steps interleaved (on off, off on, ...), so step ``i`` of the
two forms a pair; the speedup is the median over pairs of off/on with its quartiles. Emulated devices.

    python benchmarks/bench_overlap.py [--steps 12] [--zero 1] [--global-batch 14]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(__file__))
from _common import interleaved_steps, md_table, write_results  # noqa: E402

MODEL = "gpt-tiny"
OVERRIDES = dict(num_layers=6, hidden_size=288, num_heads=4)   # ~6.3M parameters


def make_cluster(speeds: list[float]):
    """Emulated CPU devices at ``speeds`` in one node (the demo cluster is 1, 0.5, 0.25)."""
    from autopar.cluster.model import Cluster

    return Cluster.from_dict({"name": "overlap-" + "-".join(map(str, speeds)), "nodes": [{"devices": [
        {"device": {"name": f"cpu-{s}", "emulate": "cpu", "speed": s, "memory_GB": 2}, "count": 1} for s in speeds]}]})


def worker(rank: int, global_batch: int, steps: int, warmup: int, zero_stage: int, speeds: list[float],
           overrides: dict) -> dict:
    import torch

    import autopar
    from autopar.models import build

    cluster = make_cluster(speeds)
    runs = {}
    for overlap in (True, False):
        case = build(MODEL, device="cpu", seed=0, **overrides)
        compiled = autopar.compile(case.model, cluster, case.example_inputs, global_batch, case.loss_fn,
                                   strategy="dp", zero_stage=zero_stage,
                                   run=autopar.RunConfig(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                                         overlap=overlap))
        runs[overlap] = dict(case=case, compiled=compiled, times=[], losses=[])
    interleaved_steps([runs[True], runs[False]], global_batch, warmup, steps, key="compiled")
    c = runs[True]["compiled"]
    return dict(times={str(k): v["times"] for k, v in runs.items()},
                losses={str(k): v["losses"] for k, v in runs.items()},
                plan=c.plan.to_json(), predicted_step_s=c.plan.predicted.step_time_s,
                params=sum(p.numel() for p in runs[True]["case"].model.parameters()),
                buckets=len(getattr(c.engine, "_buckets", None).buckets) if getattr(c.engine, "_buckets", None) else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--zero", type=int, default=1, choices=(0, 1, 3))
    ap.add_argument("--global-batch", type=int, default=14)
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per sample (less: comm weighs more)")
    ap.add_argument("--speeds", default="1.0,0.5,0.25", help="emulated device speeds (default: the demo's)")
    args = ap.parse_args()

    import autopar
    from autopar.cli.trainer import paired_speedup, spread
    speeds = [float(x) for x in args.speeds.split(",")]
    load0 = os.getloadavg()[0]
    overrides = dict(OVERRIDES, seq_len=args.seq_len)
    res = autopar.launch(worker, make_cluster(speeds), args.global_batch, args.steps, args.warmup, args.zero,
                         speeds, overrides)[0]
    load = (load0, os.getloadavg()[0])     # the machine is shared: its 1-minute load before and after
    on, off = res["times"]["True"], res["times"]["False"]
    s_on, s_off, sp = spread(on), spread(off), paired_speedup(on, off)
    same = res["losses"]["True"] == res["losses"]["False"]
    print(f"overlap on  {s_on.median * 1e3:.1f} ms (IQR {s_on.q1 * 1e3:.1f}-{s_on.q3 * 1e3:.1f})")
    print(f"overlap off {s_off.median * 1e3:.1f} ms (IQR {s_off.q1 * 1e3:.1f}-{s_off.q3 * 1e3:.1f})")
    print(f"off/on per pair: median {sp.median:.3f}x (IQR {sp.q1:.3f}-{sp.q3:.3f}, {sp.num} pairs); "
          f"losses identical: {same}")
    md = ("# Overlap pays: data-parallel step with overlap on vs off (emulated devices)\n\n"
          f"{MODEL} with {overrides} ({res['params']:,} parameters), strategy dp, ZeRO-{args.zero}, "
          f"global batch {args.global_batch}, on emulated CPU devices at speeds {args.speeds}; "
          f"{res['buckets']} gradient buckets. Both engines in one run, steps interleaved; {args.warmup} "
          f"warm-up steps each excluded.\n\n"
          + md_table(["overlap", "median step ms", "IQR ms", "min-max ms", "steps"],
                     [[k, f"{s.median * 1e3:.1f}", f"{s.q1 * 1e3:.1f}-{s.q3 * 1e3:.1f}",
                       f"{s.min * 1e3:.1f}-{s.max * 1e3:.1f}", s.num] for k, s in (("on", s_on), ("off", s_off))])
          + f"\n\nSpeedup of overlap on over off, per interleaved pair: median {sp.median:.3f}x "
            f"(IQR {sp.q1:.3f}-{sp.q3:.3f}, {sp.num} pairs). Losses of the two runs identical: {same}. "
            f"Predicted step (the plan, overlap as priced by the planner): {res['predicted_step_s'] * 1e3:.1f} ms. "
            f"Emulated devices. Machine load (1-minute average) {load[0]:.1f} before, {load[1]:.1f} after, on "
            f"{os.cpu_count()} cores.\n\n"
          + f"Command: `python benchmarks/bench_overlap.py --steps {args.steps} --zero {args.zero} "
            f"--global-batch {args.global_batch} --seq-len {args.seq_len} --speeds {args.speeds}`")
    tag = "demo" if speeds == [1.0, 0.5, 0.25] else "x".join(f"{s:g}" for s in speeds)
    write_results(f"overlap-zero{args.zero}-{tag}", dict(args=vars(args), result=res, load=load, on=asdict(s_on), off=asdict(s_off),
                                                   speedup=asdict(sp)), md)


if __name__ == "__main__":
    main()
