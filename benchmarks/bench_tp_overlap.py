"""TP backward overlap (issue 14 item 6): a tensor-parallel rank's backward with f's all-reduce
overlapping the column weight gradients (``passes.tp_overlap``) against the same plan with it
blocking after them, on two emulated CPU devices (real processes over gloo) in ONE run.

Both forms are built in the same processes (the TP engine on a hand-written plan, the program lowered
with ``tp_overlap=True / False``, as ``compile`` lowers it from ``RunConfig.overlap``); each repeat runs
one forward on the global batch in a compute block, a barrier, then the backward in its own compute
block (so its emulated time, sleep included, ends inside the timing), alternating on/off, off/on.
Measured per repeat: the backward's wall time (max over the ranks), and on every rank the time spent
inside f's backward collectives: blocking calls (off) or issue plus wait (on), the exposed part. The hidden
fraction is ``1 - exposed_on / collective_off`` (medians), with the backward saving ``off - on``
beside it. Emulated devices: compute is stretched to the device speed, gloo's collectives are not.

    python benchmarks/bench_tp_overlap.py [--repeats 15] [--speeds 1.0,0.5] [--seq-len 128] [--sp]

``--sp``: the same stage with sequence parallelism (``Stage.sequence_parallel``): f's backward
collective is then a padded reduce-scatter along the sequence (``SeqContext.start_reduce_scatter``,
``runtime.tp_comm.GroupReduceScatter``), timed the same way; results go to ``tp_overlap-sp``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import md_table, write_results  # noqa: E402

MODEL = "gpt-tiny"
OVERRIDES = dict(num_layers=4, hidden_size=384, num_heads=6)


def make_cluster(speeds: list[float]):
    from autopar.cluster.model import Cluster

    return Cluster.from_dict({"name": "tp-overlap-" + "-".join(map(str, speeds)), "nodes": [{"devices": [
        {"device": {"name": f"cpu-{s}", "emulate": "cpu", "speed": s, "memory_GB": 2}, "count": 1} for s in speeds]}]})


def worker(rank: int, global_batch: int, repeats: int, warmup: int, speeds: list[float], shares: list[int],
           overrides: dict, time_scale: float | None, sp: bool = False) -> dict:
    import torch

    from autopar.ir.plan import Plan, Predicted, Stage
    from autopar.lowering import lower
    from autopar.models import build
    from autopar.passes.analyze import analyze
    from autopar.passes.meta import BLOCK
    from autopar.passes.tp import CopyToGroup, bind_all_reduce
    from autopar.runtime.emulate import clock_for, emulation_time_scale
    from autopar.runtime.engine import EngineInputs
    from autopar.runtime.tp import TensorParallelEngine
    from autopar.runtime.communicator import emulation_paused, pg_all_gather_objects, pg_all_reduce, pg_barrier
    from autopar.runtime.recorder import recorded_step
    from autopar.passes.tp_sp_comm import SeqGatherToGroup, SPModule
    from autopar.runtime.tp_comm import GroupAllReduce, GroupReduceScatter

    class Timed(GroupAllReduce):
        """The engine's own group all-reduce, timing f's backward collectives (blocking or waited)."""
        __slots__ = ("spent", "live")

        def __init__(self, group):
            super().__init__(group)
            self.spent, self.live = 0.0, False

        # The emulated clock settles the compute before a collective (it sleeps to its target): pause
        # first, so that only the collective (and the wait for the peer) is timed, never that sleep.
        def __call__(self, tensor):
            with emulation_paused():
                t0 = time.perf_counter()
                super().__call__(tensor)
                if self.live:
                    self.spent += time.perf_counter() - t0

        def start(self, tensor):        # issuing counts too: a backend may block in it
            with emulation_paused():
                t0 = time.perf_counter()
                wait = super().start(tensor)
                self.spent += time.perf_counter() - t0

            def timed():
                with emulation_paused():
                    t0 = time.perf_counter()
                    wait()
                    self.spent += time.perf_counter() - t0
            return timed

    class TimedRS(GroupReduceScatter):
        """The engine's own group reduce-scatter (SP's f backward), timed into ``meter.spent``."""
        __slots__ = ("meter",)

        def __init__(self, group, meter):
            super().__init__(group)
            self.meter = meter

        def __call__(self, output, tensor):
            with emulation_paused():
                t0 = time.perf_counter()
                super().__call__(output, tensor)
                if self.meter.live:
                    self.meter.spent += time.perf_counter() - t0

        def start(self, output, tensor):
            with emulation_paused():
                t0 = time.perf_counter()
                wait = super().start(output, tensor)
                self.meter.spent += time.perf_counter() - t0

            def timed():
                with emulation_paused():
                    t0 = time.perf_counter()
                    wait()
                    self.meter.spent += time.perf_counter() - t0
            return timed

    cluster = make_cluster(speeds)
    num_blocks = None
    runs = {}
    for overlap in (True, False):
        case = build(MODEL, device="cpu", seed=0, **overrides)
        gm = analyze(case.model, case.example_inputs).captured.gm
        num_blocks = max(int(n.meta[BLOCK]) + 1 for n in gm.graph.nodes if BLOCK in n.meta)
        plan = Plan(strategy="tp", global_batch_size=global_batch, zero_stage=0, schedule="none",
                    stages=(Stage(0, num_blocks, groups=(tuple(range(len(speeds))),), micro_batches=((global_batch,),),
                                  tp_shares=(tuple(shares),), sequence_parallel=sp),),
                    predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))
        clock = clock_for(cluster.devices[rank], time_scale=time_scale or emulation_time_scale(len(speeds)))
        engine = TensorParallelEngine(EngineInputs(
            gm=gm, model=case.model, plan=plan, loss_fn=case.loss_fn,
            optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.0), rank=rank, world_size=len(speeds),
            device=torch.device("cpu"), clock=clock), lower(plan, gm, rank, tp_overlap=overlap))
        timed = Timed(engine.tp_group)
        bind_all_reduce(engine.gm, timed)
        for m in engine.gm.modules():     # SP: f's backward reduce-scatter (the forward g's is not timed)
            if isinstance(m, SPModule):
                m.sp.reduce_scatter_into = TimedRS(engine.tp_group, timed)
        fs = [m for m in engine.gm.modules() if isinstance(m, (CopyToGroup, SeqGatherToGroup))]
        runs[overlap] = dict(case=case, engine=engine, timed=timed, bwd=[], comm=[], per_rank=[], bwd_clock=[], num_f=len(fs),
                             fused=sum(type(m).__name__ == "FusedColumns" for m in engine.gm.modules()))
    inputs, targets = runs[True]["case"].batch(global_batch, seed=1)
    stats0 = {}
    for rep in range(warmup + repeats):
        if rep == warmup:
            stats0 = {k: v["engine"].clock.stats() for k, v in runs.items()}
        for overlap in ((True, False) if rep % 2 == 0 else (False, True)):
            run = runs[overlap]
            engine, timed = run["engine"], run["timed"]
            clock = engine.clock
            engine.gm.zero_grad(set_to_none=True)
            with recorded_step(clock):
                with clock.compute("forward"):
                    loss = run["case"].loss_fn(engine.gm(*inputs), targets)
                pg_barrier()
                timed.spent, timed.live = 0.0, True
                t0, b0 = time.perf_counter(), clock.stats()
                with clock.compute("backward"):
                    loss.backward()
                dt = time.perf_counter() - t0
                b1 = clock.stats()
                if rep >= warmup:
                    run["bwd_clock"].append((b1.compute_s - b0.compute_s, b1.slept_s - b0.slept_s,
                                             b1.overrun_s - b0.overrun_s, b1.num_blocks - b0.num_blocks))
                timed.live = False
            vals = torch.zeros(len(speeds), 2, dtype=torch.float64)
            vals[rank] = torch.tensor([dt, timed.spent], dtype=torch.float64)
            pg_all_reduce(vals)                          # every rank's pair, on every rank
            if rep >= warmup:
                run["bwd"].append(float(vals[:, 0].max()))
                run["comm"].append(float(vals[:, 1].max()))
                run["per_rank"].append(vals.tolist())
    clocks = {}     # per repeat of the measured ones: thread CPU measured, slept, overrun (seconds)
    for k, v in runs.items():
        a, b = stats0[k], v["engine"].clock.stats()
        clocks[str(k)] = [(b.compute_s - a.compute_s) / repeats, (b.slept_s - a.slept_s) / repeats,
                          (b.overrun_s - a.overrun_s) / repeats]
    for k, v in runs.items():        # the backward alone: mean thread CPU, slept, overrun per repeat
        clocks[str(k) + "-backward"] = [sum(x[i] for x in v["bwd_clock"]) / repeats for i in range(3)]
    clocks = pg_all_gather_objects(clocks)
    e = runs[True]["engine"]
    return dict(bwd={str(k): v["bwd"] for k, v in runs.items()}, comm={str(k): v["comm"] for k, v in runs.items()},
                per_rank={str(k): v["per_rank"] for k, v in runs.items()}, clocks=clocks,
                fused={str(k): v["fused"] for k, v in runs.items()}, num_f={str(k): v["num_f"] for k, v in runs.items()},
                plan=e.plan.to_json(), shares=e.plan.stages[0].tp_shares,
                rows=int(inputs[0].numel()), hidden=overrides["hidden_size"], time_scale=e.clock.time_scale,
                sp_blocks=list(e.sp_blocks_applied))


def single_rank_cpu(shares: list[int], overrides: dict, global_batch: int, repeats: int) -> dict:
    """The backward's thread CPU time on one TP rank (the last, in this process, one torch thread, no
    communication), fused against unfused: whether the fused node computes any more than autograd."""
    import statistics

    import torch

    from autopar.models import build
    from autopar.passes.analyze import analyze
    from autopar.passes.tp import tp_rewrite
    from autopar.passes.tp_overlap import overlap_tp_backward

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    case = build(MODEL, device="cpu", seed=0, **overrides)
    gm = analyze(case.model, case.example_inputs).captured.gm
    plain = tp_rewrite(gm, tuple(shares), len(shares) - 1)
    fused = tp_rewrite(gm, tuple(shares), len(shares) - 1)
    overlap_tp_backward(fused)
    inputs, targets = case.batch(global_batch, seed=1)
    cpu: dict[str, list[float]] = {"unfused": [], "fused": []}
    for rep in range(repeats + 2):
        pairs = (("unfused", plain), ("fused", fused))
        for name, m in (pairs if rep % 2 == 0 else pairs[::-1]):
            m.zero_grad(set_to_none=True)
            loss = case.loss_fn(m(*inputs), targets)
            t0 = time.thread_time()
            loss.backward()
            if rep >= 2:
                cpu[name].append(time.thread_time() - t0)
    torch.set_num_threads(threads)
    return {k: dict(min=min(v), median=statistics.median(v)) for k, v in cpu.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--speeds", default="1.0,0.5", help="emulated device speeds")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="emulation time scale (default: the standard factor, 2 for two ranks on two cores); "
                         "larger absorbs a loaded machine's contention")
    ap.add_argument("--shares", default="4,2", help="TP head shares per device (the model has 6 heads)")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism on the stage (f: reduce-scatter)")
    args = ap.parse_args()

    import autopar
    from autopar.cli.trainer import paired_speedup, spread

    speeds = [float(x) for x in args.speeds.split(",")]
    overrides = dict(OVERRIDES, seq_len=args.seq_len)
    load0 = os.getloadavg()[0]
    shares = [int(x) for x in args.shares.split(",")]
    cpu = single_rank_cpu(shares, overrides, args.global_batch, 10)
    res = autopar.launch(worker, make_cluster(speeds), args.global_batch, args.repeats, args.warmup, speeds,
                         shares, overrides, args.time_scale, args.sp)[0]
    load = (load0, os.getloadavg()[0])
    on, off = spread(res["bwd"]["True"]), spread(res["bwd"]["False"])
    c_on, c_off = spread(res["comm"]["True"]), spread(res["comm"]["False"])
    sp = paired_speedup(res["bwd"]["True"], res["bwd"]["False"])
    hidden = 1.0 - c_on.median / c_off.median if c_off.median > 0 else float("nan")
    saved = off.median - on.median
    ms = lambda s: f"{s.median * 1e3:.2f}"                                    # noqa: E731
    iqr = lambda s: f"{s.q1 * 1e3:.2f}-{s.q3 * 1e3:.2f}"                       # noqa: E731
    print(f"backward on {ms(on)} ms (IQR {iqr(on)}), off {ms(off)} ms (IQR {iqr(off)}); off/on {sp.median:.3f}x "
          f"(IQR {sp.q1:.3f}-{sp.q3:.3f}); f collective off {ms(c_off)} ms, exposed on {ms(c_on)} ms: "
          f"hidden {hidden:.1%}; load {load[0]:.1f}-{load[1]:.1f}")
    coll = "reduce-scatter" if args.sp else "all-reduce"
    sp_note = f"; SP blocks {res['sp_blocks']}" if args.sp else ""
    md = (f"# TP{' + SP' if args.sp else ''} backward overlap: f's {coll} during the column weight gradients, "
          "on vs off (emulated)\n\n"
          f"{MODEL} with {overrides}, strategy tp over {len(speeds)} emulated CPU devices at speeds {args.speeds} "
          f"(shares {res['shares']}), global batch {args.global_batch} ({res['rows']} rows of {res['hidden']} "
          f"features per f {coll}{sp_note}), emulation time scale {res['time_scale']:g}; {res['fused']['True']} fused f modules with the overlap on, "
          f"{res['fused']['False']} off. Real processes over gloo; emulated compute. Both forms in one run, "
          f"repeats alternating, {args.warmup} warm-up repeats each excluded; every figure is the max over "
          f"the ranks of a repeat, then the median (IQR) over {on.num} repeats.\n\n"
          + md_table(["overlap", "backward ms", "IQR ms", "f collective ms (off: blocking; on: exposed issue + wait)", "IQR ms"],
                     [["on", ms(on), iqr(on), ms(c_on), iqr(c_on)], ["off", ms(off), iqr(off), ms(c_off), iqr(c_off)]])
          + "\n\nPer rank (median ms over repeats):\n\n"
          + md_table(["rank", "speed", "backward on", "backward off", "f collective off (blocking)", "exposed on (issue + wait)"],
                     [[r, speeds[r]] + [f"{spread([rep[r][i] for rep in res['per_rank'][k]]).median * 1e3:.2f}"
                                         for k, i in (("True", 0), ("False", 0), ("False", 1), ("True", 1))]
                      for r in range(len(speeds))])
          + "\n\nEmulated clocks per rank, mean per repeat (whole repeat: forward and backward), on / off: "
            "thread CPU measured, slept, overrun ms: "
          + "; ".join(f"rank {r}: " + " / ".join(
                f"{c[k][0] * 1e3:.1f}, {c[k][1] * 1e3:.1f}, {c[k][2] * 1e3:.1f}" for k in ("True", "False"))
                for r, c in enumerate(res["clocks"]))
          + "; the backward alone: " + "; ".join(f"rank {r}: " + " / ".join(
                f"{c[k][0] * 1e3:.1f}, {c[k][1] * 1e3:.1f}, {c[k][2] * 1e3:.1f}" for k in ("True-backward", "False-backward"))
                for r, c in enumerate(res["clocks"]))
          + "\n\nOne TP rank (the last) alone in this process, one torch thread, no communication: its "
            "backward's thread CPU (native), min / median of 10: unfused "
          + " / ".join(f"{cpu['unfused'][q] * 1e3:.1f}" for q in ("min", "median")) + " ms, fused "
          + " / ".join(f"{cpu['fused'][q] * 1e3:.1f}" for q in ("min", "median")) + " ms."
          + f"\n\nBackward off/on per pair: median {sp.median:.3f}x (IQR {sp.q1:.3f}-{sp.q3:.3f}). "
            f"Hidden fraction of the backward collective: 1 - exposed_on / collective_off = {hidden:.1%}; "
            f"backward saved {saved * 1e3:.2f} ms of {c_off.median * 1e3:.2f} ms of collective. "
            f"Machine load (1-minute average) {load[0]:.1f} before, {load[1]:.1f} after, on {os.cpu_count()} cores. "
            "A rank's collective time includes waiting for its peer to arrive (its lateness, which the load "
            "varies from run to run): the overlap hides a rank's own transfer and a late peer up to the "
            "weight-gradient time, not a peer that is later still.\n\n"
            "Rule for the cost model (per fused f, per micro-batch): exposed = max(0, t_collective - "
            "t_weight_grad), t_weight_grad the weight (and bias) gradient GEMMs of the columns that f feeds on "
            "that rank; the input-gradient GEMMs precede the collective and hide nothing.\n\n"
          + f"Command: `python benchmarks/bench_tp_overlap.py --repeats {args.repeats} --warmup {args.warmup} "
            f"--global-batch {args.global_batch} --seq-len {args.seq_len} --speeds {args.speeds} --shares {args.shares}"
            + (f" --time-scale {args.time_scale:g}" if args.time_scale else "") + (" --sp" if args.sp else "") + "`")
    default = speeds == [1.0, 0.5] and shares == [4, 2]
    name = "tp_overlap" if default else "tp_overlap-" + "x".join(f"{x:g}" for x in speeds)
    name += "-sp" if args.sp else ""
    write_results(name, dict(args=vars(args), result=res, single_rank_cpu=cpu, load=load, on=asdict(on), off=asdict(off),
                                     comm_on=asdict(c_on), comm_off=asdict(c_off), speedup=asdict(sp),
                                     hidden_fraction=hidden), md)


if __name__ == "__main__":
    main()
