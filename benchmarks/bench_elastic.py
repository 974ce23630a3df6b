"""Elastic restart time (issue 13): a job on three emulated CPU devices loses one (rank 1 calls
``os._exit`` in step ``--kill-at``), ``autopar.launch(max_restarts=1)`` restarts it on the other two,
``compile`` re-plans and resumes from the newest checkpoint (``checkpoint_every``); measured: the time
from the failure to the end of the first step after it, split into

- detect: the failure until launch has stopped every rank of the failed attempt;
- restart: until the new ranks enter ``train`` (spawn, imports, rendezvous);
- plan + build: ``compile`` less the load (capture, analysis, cost tables, planning on rank 0, the
  engine);
- load: ``compiled.load`` of the checkpoint, resharded onto the new plan (the slowest rank's);
- first step: the first step under the new plan (the slowest rank's).

Each repeat is one whole job; the figures are the median and IQR over repeats. The final state is
checked against a one-device run of the same steps (max relative error per tensor). Emulated devices,
on a shared machine: the load (1-minute average) is recorded before and after.

    python benchmarks/bench_elastic.py [--repeats 3] [--model mlp] [--strategy pp]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import md_table, write_results  # noqa: E402

PHASES = ("detect", "restart", "plan_build", "load", "first_step")


def make_cluster(speeds):
    from autopar.cluster.model import Cluster

    return Cluster.from_dict({"name": "elastic-" + "-".join(map(str, speeds)), "nodes": [{"devices": [
        {"device": {"name": f"cpu-{s}", "emulate": "cpu", "speed": s, "memory_GB": 2}, "count": 1}
        for s in speeds]}]})


def _sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def worker(rank: int, directory: str, model: str, batch: int, steps: int, kill_at: int, every: int,
           strategy: str, speeds: list) -> dict:
    t_entry = time.time()
    import autopar
    from autopar.models import build
    from autopar.runtime.elastic import stopped_at

    attempt = autopar.restart_count()
    case = build(model, device="cpu", seed=0)
    compiled = autopar.compile(case.model, make_cluster(speeds), case.example_inputs, batch, case.loss_fn,
                               optimizer=_sgd, strategy=strategy, measure=False,
                               checkpoint_dir=Path(directory) / "ck", checkpoint_every=every)
    t_compiled = time.time()
    if rank == 0:
        (Path(directory) / f"plan{attempt}.json").write_text(compiled.plan.to_json())
    data = [case.batch(batch, seed=1 + s) for s in range(steps)]     # the one-device run's data
    resumed = compiled.elastic.resumed
    t_first, step_s = None, []
    for s in range(compiled.step_count, steps):
        if attempt == 0 and rank == 1 and s == kill_at - 1:      # the device of rank 1 fails
            (Path(directory) / "failed_at").write_text(repr(time.time()))
            os._exit(17)
        t0 = time.time()
        compiled.step(*data[s])
        step_s.append(time.time() - t0)
        if t_first is None:
            t_first = time.time()
    state = compiled.state_dict()        # collective: every rank gathers
    return dict(attempt=attempt, t_entry=t_entry, t_compiled=t_compiled, t_first=t_first, stopped_at=stopped_at(),
                load_s=None if resumed is None else resumed.load_s,
                resumed_step=None if resumed is None else resumed.step, step_s=step_s,
                plan=compiled.plan.to_json(), state=state if rank == 0 else None,
                saved=[p.name for p in compiled.elastic.saved])


def one_device_state(model: str, batch: int, steps: int) -> dict:
    from autopar.models import build
    from autopar.runtime.engine import compute_loss

    case = build(model, device="cpu", seed=0)
    opt = _sgd(list(case.model.parameters()))
    for s in range(steps):
        inputs, targets = case.batch(batch, seed=1 + s)
        opt.zero_grad(set_to_none=True)
        compute_loss(case.model(*inputs), targets, case.loss_fn).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in case.model.state_dict().items()}


def max_rel_error(got: dict, ref: dict) -> float:
    out = 0.0
    for k, r in ref.items():
        scale = r.double().abs().max().item()
        diff = (got[k].double() - r.double()).abs().max().item()
        out = max(out, diff / scale if scale > 0 else diff)
    return out


def phases_of(results: list, failed_at: float) -> dict:
    """The restart's phases (seconds) from the ranks of the restarted attempt."""
    r0 = results[0]
    load = max(r["load_s"] for r in results)
    first = max(r["t_first"] for r in results)
    compiled = max(r["t_compiled"] for r in results)
    out = dict(detect=r0["stopped_at"] - failed_at, restart=min(r["t_entry"] for r in results) - r0["stopped_at"],
               plan_build=compiled - min(r["t_entry"] for r in results) - load, load=load,
               first_step=first - compiled)
    out["total"] = first - failed_at
    return out


_PLAN_ALONE = """
import json, sys, time
t0 = time.perf_counter()
import autopar, autopar.api, autopar.planner.entry, autopar.runtime.engine, torch.distributed.checkpoint
from autopar.models import build
t1 = time.perf_counter()
sys.path.insert(0, {here!r})
from bench_elastic import make_cluster
case = build({model!r}, device="cpu", seed=0)
t2 = time.perf_counter()
autopar.plan(case.model, make_cluster({speeds!r}), case.example_inputs, {batch}, case.loss_fn, strategy={strategy!r},
             measure=False, optimizer="sgd")
print(json.dumps(dict(imports=t1 - t0, model=t2 - t1, plan=time.perf_counter() - t2)))
"""


def plan_alone(args, speeds) -> dict:
    """Seconds of a cold process's imports, model build and ``autopar.plan`` (analysis, cost tables, planner)
    for the cluster left after the failure: what rank 0's compile spends before building its engine."""
    import subprocess

    code = _PLAN_ALONE.format(here=os.path.dirname(os.path.abspath(__file__)), model=args.model,
                              speeds=[s for i, s in enumerate(speeds) if i != 1], batch=args.global_batch,
                              strategy=args.strategy)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_once(args, speeds) -> dict:
    import autopar
    from autopar.ir.plan import Plan

    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as d:
        t0 = time.time()
        results = autopar.launch(worker, make_cluster(speeds), d, args.model, args.global_batch, args.steps,
                                 args.kill_at, args.every, args.strategy, speeds, max_restarts=1)
        wall = time.time() - t0
        failed_at = float((Path(d) / "failed_at").read_text())
        before = Plan.from_json((Path(d) / "plan0.json").read_text())
        ck_bytes = sum(f.stat().st_size for f in (Path(d) / "ck").rglob("*") if f.is_file())
    plan = Plan.from_json(results[0]["plan"])
    return dict(phases=phases_of(results, failed_at), wall_s=wall, resumed_step=results[0]["resumed_step"],
                redone=args.kill_at - 1 - results[0]["resumed_step"], plan=results[0]["plan"],
                stages=[s.num_layers for s in plan.stages], rank_batch=dict(plan.rank_batch),
                stages_before=[s.num_layers for s in before.stages], rank_batch_before=dict(before.rank_batch),
                step_s=results[0]["step_s"], saved=results[0]["saved"], checkpoint_bytes=ck_bytes,
                state=results[0]["state"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--strategy", default="pp")
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-at", type=int, default=5, help="the step (1-based) in which rank 1's device fails")
    ap.add_argument("--every", type=int, default=2, help="checkpoint_every")
    ap.add_argument("--speeds", default="1.0,0.5,0.75", help="emulated device speeds; rank 1 fails")
    ap.add_argument("--measured-links", action="store_true",
                    help="plan on this machine's measured emulated links (default: nominal, deterministic plans)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not write benchmarks/results")
    args = ap.parse_args(argv)
    if not args.measured_links:
        os.environ["AUTOPAR_EMULATED_LINK"] = "nominal"      # the ranks inherit it
    from autopar.cli.trainer import spread

    speeds = [float(x) for x in args.speeds.split(",")]
    load0 = os.getloadavg()[0]
    runs = []
    for i in range(args.repeats):
        runs.append(run_once(args, speeds))
        p = runs[-1]["phases"]
        print(f"repeat {i}: total {p['total']:.2f} s = " + " + ".join(f"{k} {p[k]:.2f}" for k in PHASES)
              + f" (wall {runs[-1]['wall_s']:.1f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    alone = [plan_alone(args, speeds) for _ in range(args.repeats)]
    load = (load0, os.getloadavg()[0])
    ref = one_device_state(args.model, args.global_batch, args.steps)
    errors = [max_rel_error(r.pop("state"), ref) for r in runs]
    stats = {k: spread([r["phases"][k] for r in runs]) for k in (*PHASES, "total")}
    alone_stats = {k: spread([a[k] for a in alone]) for k in ("imports", "model", "plan")}
    # the restarted job's steps after its first, split by whether the step ended in a checkpoint save
    saving = {True: [], False: []}
    for r in runs:
        for i, t in enumerate(r["step_s"][1:], start=1):
            saving[(r["resumed_step"] + 1 + i) % args.every == 0].append(t)
    save_cost = {k: spread(v) for k, v in saving.items() if v}
    rows = [[k.replace("_", " + " if k == "plan_build" else " "), f"{s.median:.2f}", f"{s.q1:.2f}-{s.q3:.2f}",
             f"{s.min:.2f}-{s.max:.2f}"] for k, s in stats.items()]
    r0 = runs[0]
    md = ("# Elastic restart: failure to the first step after it (emulated devices)\n\n"
          f"{args.model} (strategy {args.strategy}, roofline tables, "
          f"{'measured' if args.measured_links else 'nominal'} links), global batch {args.global_batch}, SGD + "
          f"momentum, on three emulated CPU devices at speeds {args.speeds} in one node; the device of rank 1 "
          f"fails (os._exit) in step {args.kill_at} of {args.steps}, checkpoint_every={args.every}; "
          f"autopar.launch(max_restarts=1) restarts on the other two, compile re-plans (layers per stage "
          f"{r0['stages_before']} -> {r0['stages']}, rank batch {r0['rank_batch_before']} -> {r0['rank_batch']}) "
          f"and resumes from the step-{r0['resumed_step']} checkpoint: step {args.kill_at}, in flight when the "
          f"device failed, is done again, as are the {r0['redone']} completed step(s) after that checkpoint. "
          f"{args.repeats} whole jobs; seconds, median and IQR over them.\n\n"
          + md_table(["phase", "median s", "IQR s", "min-max s"], rows)
          + "\n\nFor scale, measured apart in a fresh process (same model, the two devices left, "
            f"{args.repeats} times): imports of torch and autopar's modules (a restarted rank pays them partly in "
            f"restart, partly in plan + build) {alone_stats['imports'].median:.2f} s (IQR "
            f"{alone_stats['imports'].q1:.2f}-{alone_stats['imports'].q3:.2f}), building the model "
            f"{alone_stats['model'].median:.2f} s, autopar.plan (capture, analysis, cost tables, planner) "
            f"{alone_stats['plan'].median:.2f} s (IQR {alone_stats['plan'].q1:.2f}-{alone_stats['plan'].q3:.2f}); "
            "the rest of plan + build is the plan's broadcast, each rank's own capture and lowering, and the "
            "engine build."
          + ("\n\nSteps of the restarted job after its first: those that end in a synchronous checkpoint save "
             f"{save_cost[True].median:.3f} s median (IQR {save_cost[True].q1:.3f}-{save_cost[True].q3:.3f}, "
             f"{save_cost[True].num} steps), the others {save_cost[False].median:.3f} s (IQR "
             f"{save_cost[False].q1:.3f}-{save_cost[False].q3:.3f}, {save_cost[False].num} steps)."
             if len(save_cost) == 2 else "")
          + f"\n\nFinal state against one device stepping the same {args.steps} global batches: max relative "
            f"error per tensor {max(errors):.2e} (api.md: <= 1e-4 for SGD + momentum). Checkpoints written: "
            f"{r0['checkpoint_bytes'] / 2**20:.1f} MiB on disk at the end ({', '.join(r0['saved'])} by the "
            f"restarted job). Emulated devices; machine load (1-minute average) {load[0]:.1f} before, "
            f"{load[1]:.1f} after, on {os.cpu_count()} cores.\n\n"
          + f"Command: `python benchmarks/bench_elastic.py --repeats {args.repeats} --model {args.model} "
            f"--strategy {args.strategy} --global-batch {args.global_batch} --steps {args.steps} "
            f"--kill-at {args.kill_at} --every {args.every} --speeds {args.speeds}"
            f"{' --measured-links' if args.measured_links else ''}`")
    data = dict(args=vars(args), runs=runs, errors=errors, load=load, plan_alone=alone,
                save_step_s={str(k): dict(median=v.median, q1=v.q1, q3=v.q3, num=v.num) for k, v in save_cost.items()},
                phases={k: dict(median=s.median, q1=s.q1, q3=s.q3, min=s.min, max=s.max) for k, s in stats.items()})
    print(md)
    if not args.no_write:
        write_results("elastic", data, md)
    return data


if __name__ == "__main__":
    main()
