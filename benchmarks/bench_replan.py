"""Re-planning on a device slower than declared (issue 12's Must show; emulated).

Two emulated CPU devices: ``hot`` is declared at speed 1.0 but runs at ``actual_speed: 0.5``, ``full``
runs at 1.0. In one launch (the same two processes, one after the other):
- ``replan="auto"`` on the declared cluster: planned for equal speeds, the job measures its first
  steps, detects ``hot``, re-plans and switches in place (``autopar.runtime.replan``), and trains on;
- the same model compiled on the *true* cluster (``hot`` declared at 0.5) from the start.
Reported: when the switch happened and what was detected, the step time before and after the switch
against the true-speed plan's (median and IQR of the steps, each the slowest rank's wall time).

    python benchmarks/bench_replan.py [--model gpt-tiny] [--batch 96] [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import md_table, write_results  # noqa: E402


def cluster_dict(actual: bool) -> dict:
    hot = {"name": "hot", "emulate": "cpu", "speed": 1.0, "memory_GB": 4}
    hot = dict(hot, actual_speed=0.5) if actual else dict(hot, speed=0.5)
    return {"name": "hot-full", "nodes": [{"devices": [
        {"device": hot, "count": 1},
        {"device": {"name": "full", "emulate": "cpu", "speed": 1.0, "memory_GB": 4}, "count": 1}]}]}


def _steps(compiled, case, batch: int, n: int, first_seed: int) -> list[float]:
    import torch

    from autopar.runtime.communicator import ReduceOp, pg_all_reduce, pg_barrier

    out = []
    for i in range(n):
        inputs, targets = case.batch(batch, seed=first_seed + i)
        pg_barrier()
        t0 = time.perf_counter()
        compiled.step(inputs, targets)
        dt = torch.tensor([time.perf_counter() - t0])
        pg_all_reduce(dt, op=ReduceOp.MAX)
        out.append(float(dt))
    return out


def worker(rank: int, model: str, batch: int, steps: int) -> dict:
    import torch

    import autopar
    from autopar.cluster.model import Cluster
    from autopar.models import load

    run = autopar.RunConfig(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), track_memory=False)
    declared, true = Cluster.from_dict(cluster_dict(True)), Cluster.from_dict(cluster_dict(False))
    case = load(model, device="cpu", seed=0)
    auto = autopar.compile(case.model, declared, case.example_inputs, batch, case.loss_fn, run=run, strategy="dp",
                           zero_stage=0, replan="auto")
    planned = dict(auto.plan.rank_batch)
    check = auto.replanner.policy.check_after
    before = _steps(auto, case, batch, check, 0)
    after = _steps(auto, case, batch, 2 + steps, check)         # 2 warm-up steps on the new engine, as below
    report = auto.replans[0] if auto.replans else None
    case2 = load(model, device="cpu", seed=0)
    ref = autopar.compile(case2.model, true, case2.example_inputs, batch, case2.loss_fn, run=run, strategy="dp",
                          zero_stage=0)
    _steps(ref, case2, batch, 2, 0)                       # warm-up
    truth = _steps(ref, case2, batch, steps, 2)
    return dict(planned=planned, switched_to=dict(auto.plan.rank_batch), before=before, after=after, truth=truth,
                true_plan=dict(ref.plan.rank_batch), true_predicted_s=ref.plan.predicted.step_time_s,
                report=None if report is None else dict(summary=report.summary(), step=report.step,
                                                        slow=report.slow, switched=report.switched,
                                                        switch_s=report.switch_s, current_s=report.current_s,
                                                        proposed_s=report.proposed_s,
                                                        switch_cost_s=report.switch_cost_s))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--slowdown", type=float, default=3.0,
                    help="AUTOPAR_EMULATION_SLOWDOWN: room on a machine shared with other jobs (1: none)")
    args = ap.parse_args(argv)
    os.environ["AUTOPAR_EMULATION_SLOWDOWN"] = f"{args.slowdown:g}"      # the ranks inherit it

    import autopar
    from autopar.cli.trainer import spread
    from autopar.cluster.model import Cluster

    load0 = os.getloadavg()[0]
    res = autopar.launch(worker, Cluster.from_dict(cluster_dict(True)), args.model, args.batch, args.steps)[0]
    load1 = os.getloadavg()[0]
    # the check (and the switch) run inside the last step before it; the new engine warms up 2 steps, as
    # the true-speed run does
    after, truth = spread(res["after"][2:]), spread(res["truth"])
    ratio = spread(a / t for a, t in zip(res["after"][2:], res["truth"]))
    rep = res["report"] or {}
    rows = [["replan=auto, before the switch", res["planned"], f"{spread(res['before'][:-1]).median * 1e3:.1f}", "-"],
            ["replan=auto, the step that checks and switches", "-", f"{res['before'][-1] * 1e3:.1f}", "-"],
            ["replan=auto, after the switch", res["switched_to"],
             f"{after.median * 1e3:.1f} ({after.q1 * 1e3:.1f}-{after.q3 * 1e3:.1f})",
             f"{ratio.median:.3f} ({ratio.q1:.3f}-{ratio.q3:.3f})"],
            ["true speeds from the start", res["true_plan"],
             f"{truth.median * 1e3:.1f} ({truth.q1 * 1e3:.1f}-{truth.q3 * 1e3:.1f})", "1"]]
    md = "\n".join([
        "# Re-planning on a device slower than declared (emulated)",
        "",
        "Two emulated CPU devices: `hot` declared at speed 1.0, running at `actual_speed: 0.5`; `full` at 1.0. "
        f"Model {args.model}, global batch {args.batch}, strategy dp (ZeRO-0), AdamW. Load average "
        f"{load0:.1f} before, {load1:.1f} after (2 cores shared with other jobs); emulation slowdown "
        f"{args.slowdown:g} (`AUTOPAR_EMULATION_SLOWDOWN`: every emulated device {args.slowdown:g}x slower, the "
        "cost model likewise).",
        "",
        f"Check: {rep.get('summary', 'no check ran')}",
        f"Switch took {rep.get('switch_s', 0.0):.2f} s (measured, rank 0).",
        "",
        md_table(["run", "samples per rank", "step ms (median, IQR)", "after / true (IQR)"], rows),
        "",
        "Step times are measured (emulated devices), each the slowest rank's wall time; the check and the "
        "switch run at the end of the check step; the new engine's first 2 steps (warm-up) are left out, as "
        "the true-speed run's are.",
        "",
        f"Command: `python benchmarks/bench_replan.py --model {args.model} --batch {args.batch} --steps {args.steps} "
        f"--slowdown {args.slowdown:g}`",
    ])
    print(md)
    write_results("replan", dict(args=vars(args), result=res, load=[load0, load1]), md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
