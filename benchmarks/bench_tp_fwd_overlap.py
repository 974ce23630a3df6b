"""Forward TP overlap (issue 14, build 6): a sequence-parallel TP stage's forward with f's all-gather and
g's reduce-scatter chunked against the GEMMs (``passes.tp_fwd_overlap``, forced:
``tp_overlap_forward=True``) against the same plan unchunked, on two emulated CPU devices (real
processes over gloo) in ONE run.

Why on CPU: ``RunConfig.overlap_forward`` auto keeps the chunking off on gloo, since gloo's collective
runs on the rank's own core; this measures what forcing it there costs or saves (emulated devices:
compute is stretched to the device speed by sleeping, gloo's collectives are not, so a collective in
flight during the sleep is hidden in emulation where a busy core would not hide it). The GPU figure
(NCCL) is not measured here.

Both forms are built in the same processes (the TP engine on a hand-written SP plan, lowered with
``tp_overlap_forward`` True / False, SP's all-gather bound as ``runtime.tp_comm.GroupAllGather`` in both);
each repeat times one forward on the global batch inside a compute block, a barrier before, alternating
on/off, off/on. Reported: the forward's wall time (max over ranks), median and IQR, and the paired ratio.

    python benchmarks/bench_tp_fwd_overlap.py [--repeats 15] [--speeds 1.0,1.0] [--seq-len 256]
    python benchmarks/bench_tp_fwd_overlap.py --check-exact     # chunked == unchunked on gloo processes
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import md_table, write_results  # noqa: E402

MODEL = "llama-tiny"
OVERRIDES = dict(num_layers=4, hidden_size=384, num_heads=6)


def make_cluster(speeds: list[float]):
    from autopar.cluster.model import Cluster

    return Cluster.from_dict({"name": "tp-fwd-overlap-" + "-".join(map(str, speeds)), "nodes": [{"devices": [
        {"device": {"name": f"cpu-{s}", "emulate": "cpu", "speed": s, "memory_GB": 2}, "count": 1} for s in speeds]}]})


def worker(rank: int, global_batch: int, repeats: int, warmup: int, speeds: list[float], shares: list[int],
           overrides: dict) -> dict:
    import torch

    from autopar.ir.plan import Plan, Predicted, Stage
    from autopar.lowering import lower
    from autopar.models import build
    from autopar.passes.analyze import analyze
    from autopar.passes.meta import BLOCK
    from autopar.passes.tp_fwd_overlap import FusedRowScatter
    from autopar.passes.tp_sp_comm import SPModule
    from autopar.runtime.communicator import pg_all_reduce, pg_barrier
    from autopar.runtime.emulate import clock_for, emulation_time_scale
    from autopar.runtime.engine import EngineInputs
    from autopar.runtime.recorder import recorded_step
    from autopar.runtime.tp import TensorParallelEngine
    from autopar.runtime.tp_comm import GroupAllGather

    cluster = make_cluster(speeds)
    runs = {}
    for chunked in (True, False):
        case = build(MODEL, device="cpu", seed=0, **overrides)
        gm = analyze(case.model, case.example_inputs).captured.gm
        num_blocks = max(int(n.meta[BLOCK]) + 1 for n in gm.graph.nodes if BLOCK in n.meta)
        plan = Plan(strategy="tp", global_batch_size=global_batch, zero_stage=0, schedule="none",
                    stages=(Stage(0, num_blocks, groups=(tuple(range(len(speeds))),), micro_batches=((global_batch,),),
                                  tp_shares=(tuple(shares),), sequence_parallel=True),),
                    predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))
        clock = clock_for(cluster.devices[rank], time_scale=emulation_time_scale(len(speeds)))
        engine = TensorParallelEngine(EngineInputs(
            gm=gm, model=case.model, plan=plan, loss_fn=case.loss_fn,
            optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.0), rank=rank, world_size=len(speeds),
            device=torch.device("cpu"), clock=clock), lower(plan, gm, rank, tp_overlap_forward=chunked))
        for m in engine.gm.modules():
            if isinstance(m, SPModule):
                m.sp.all_gather = GroupAllGather(engine.tp_group)
        runs[chunked] = dict(case=case, engine=engine, fwd=[],
                             rows=sum(isinstance(m, FusedRowScatter) for m in engine.gm.modules()))
    inputs, _ = runs[True]["case"].batch(global_batch, seed=1)
    for rep in range(warmup + repeats):
        for chunked in ((True, False) if rep % 2 == 0 else (False, True)):
            run = runs[chunked]
            clock = run["engine"].clock
            pg_barrier()
            with torch.no_grad(), recorded_step(clock):
                t0 = time.perf_counter()
                with clock.compute("forward"):
                    run["engine"].gm(*inputs)
                dt = time.perf_counter() - t0
            vals = torch.zeros(len(speeds), dtype=torch.float64)
            vals[rank] = dt
            pg_all_reduce(vals)
            if rep >= warmup:
                run["fwd"].append(float(vals.max()))
    return dict(fwd={str(k): v["fwd"] for k, v in runs.items()}, rows={str(k): v["rows"] for k, v in runs.items()},
                tokens=int(inputs[0].numel()), hidden=overrides["hidden_size"])


def exact_worker(rank: int, shares: list[int]) -> dict:
    """``--check-exact``: gpt-tiny's SP TP module for this rank chunked and unchunked (both with
    ``GroupAllGather`` bound), one forward and backward each in fp32 and under CPU autocast bf16: the
    losses and the largest relative gradient difference over the parameters."""
    import torch

    from autopar.models import build
    from autopar.passes.analyze import analyze
    from autopar.passes.tp import tp_rewrite
    from autopar.passes.tp_fwd_overlap import overlap_tp_forward
    from autopar.passes.tp_overlap import overlap_tp_backward
    from autopar.passes.tp_sp import sp_rewrite
    from autopar.passes.tp_sp_comm import bind_sp_collectives
    from autopar.runtime.tp_comm import GroupAllGather, GroupAllReduce, GroupReduceScatter

    case = build("gpt-tiny", seed=0)
    gm = analyze(case.model, case.example_inputs).captured.gm
    mods = []
    for chunked in (False, True):
        local = sp_rewrite(tp_rewrite(gm, tuple(shares), rank), tuple(shares), rank)
        overlap_tp_backward(local)
        if chunked:
            overlap_tp_forward(local)
        bind_sp_collectives(local, GroupAllReduce(None), GroupAllGather(None), GroupReduceScatter(None))
        mods.append(local)
    inputs, targets = case.batch(3, seed=1)
    out = {}
    for autocast in (False, True):
        res = []
        for m in mods:
            m.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = case.loss_fn(m(*inputs), targets)
            loss.backward()
            res.append((float(loss.detach()), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
        err = max(((res[1][1][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in res[0][1].items())
        out["bf16" if autocast else "fp32"] = dict(loss_unchunked=res[0][0], loss_chunked=res[1][0],
                                                   max_rel_grad_diff=err, grads=len(res[0][1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--speeds", default="1.0,1.0", help="emulated device speeds")
    ap.add_argument("--shares", default="3,3", help="TP head shares per device (the model has 6 heads)")
    ap.add_argument("--check-exact", action="store_true",
                    help="instead: gpt-tiny (4 heads) chunked vs unchunked on gloo, losses and gradients")
    args = ap.parse_args()

    import autopar
    from autopar.cli.trainer import paired_speedup, spread

    speeds = [float(x) for x in args.speeds.split(",")]
    shares = [int(x) for x in args.shares.split(",")]
    if args.check_exact:     # gpt-tiny has 4 heads: shares 3,1 unless given
        shares = shares if sum(shares) == 4 else [3, 1]
        for rank, res in enumerate(autopar.launch(exact_worker, make_cluster(speeds), shares)):
            print(f"rank {rank}, shares {shares}: {res}")
        return
    overrides = dict(OVERRIDES, seq_len=args.seq_len)
    load0 = os.getloadavg()[0]
    res = autopar.launch(worker, make_cluster(speeds), args.global_batch, args.repeats, args.warmup, speeds,
                         shares, overrides)[0]
    load = (load0, os.getloadavg()[0])
    on, off = spread(res["fwd"]["True"]), spread(res["fwd"]["False"])
    ratio = paired_speedup(res["fwd"]["True"], res["fwd"]["False"])     # off / on: > 1 means chunking saves
    ms = lambda s: f"{s.median * 1e3:.2f}"                                    # noqa: E731
    iqr = lambda s: f"{s.q1 * 1e3:.2f}-{s.q3 * 1e3:.2f}"                       # noqa: E731
    line = (f"forward chunked {ms(on)} ms (IQR {iqr(on)}), unchunked {ms(off)} ms (IQR {iqr(off)}); "
            f"unchunked/chunked {ratio.median:.3f}x (IQR {ratio.q1:.3f}-{ratio.q3:.3f}); load {load[0]:.1f}-{load[1]:.1f}")
    print(line)
    cmd = "python benchmarks/bench_tp_fwd_overlap.py " + " ".join(sys.argv[1:])
    md = (f"# Forward TP overlap on emulated CPU devices (gloo), EMULATED\n\n"
          f"`{cmd}`: {MODEL} {overrides}, SP TP over {len(speeds)} emulated devices (speeds {speeds}, shares "
          f"{shares}), global batch {args.global_batch} ({res['tokens']} tokens), {res['rows']['True']} row "
          f"Linears fused with their g (and as many f's chunked); {args.repeats} paired repeats after {args.warmup} warm-up, one run; load average "
          f"{load[0]:.1f} before, {load[1]:.1f} after.\n\n"
          + md_table(["form", "forward median ms", "IQR ms"],
                     [["chunked (k=4, forced)", ms(on), iqr(on)], ["unchunked", ms(off), iqr(off)]])
          + f"\n\nunchunked / chunked (paired): {ratio.median:.3f}x (IQR {ratio.q1:.3f}-{ratio.q3:.3f}). "
          "On gloo the auto rule keeps the chunking off (RunConfig.overlap_forward=None); NCCL is not measured.\n")
    write_results("tp_fwd_overlap-gloo", dict(args=vars(args), result=res, load=load), md)


if __name__ == "__main__":
    main()
