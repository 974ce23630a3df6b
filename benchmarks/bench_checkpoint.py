"""Save and load time and bytes per rank of ``compiled.save`` / ``compiled.load``, against model size.

Each model size runs one job of three real processes (``autopar.launch``) on an emulated cluster of
three CPU devices (speeds 1.0 / 0.5 / 0.25: save and load run outside the emulated clock, so their
times are this machine's native CPU and disk time, on ranks of an emulated cluster). The job compiles
an ``mlp`` (8 layers, the hidden size varied) as data parallel at ZeRO-3 (memory-proportional shares,
uneven), takes a step, then per repeat:
- ``save``: ``compiled.save(DIR)`` (the checkpoint complete on disk, fsynced);
- ``load``: ``compiled.load(DIR)`` into the same plan;
- ``reshard``: ``compiled.load(DIR)`` into a second compile of the model as a pipeline (``strategy="pp"``);
- ``async``: ``compiled.save(DIR2, async_save=True)`` then one training step while it writes: the time
  until ``save`` returns (the snapshot) and until ``handle.wait()`` returns (the step and the write).
Per rank: the median and IQR of each time over the repeats, the bytes it wrote (its DCP files), its
own share of the state (parameters and optimizer state it holds), and the tracked peak of new tensor
bytes during save and load (``autopar.runtime.memory.TrackedMeter``) against one layer's bytes.

    python benchmarks/bench_checkpoint.py [--hidden 256 512 1024 2048] [--repeats 3]
    python benchmarks/bench_checkpoint.py --recovery   # then benchmarks/bench_elastic.py's main, if present

Results: ``benchmarks/results/checkpoint.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import md_table, write_results  # noqa: E402

SPEEDS = (1.0, 0.5, 0.25)
GLOBAL_BATCH = 12
NUM_LAYERS = 8


def cluster_dict(memory_gb: float = 4.0) -> dict:
    return {"nodes": [{"device": {"name": f"cpu-{i}", "emulate": "cpu", "speed": s, "memory_GB": memory_gb},
                       "count": 1} for i, s in enumerate(SPEEDS)]}


def _quartiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    if len(xs) == 1:
        return {"median": xs[0], "q1": xs[0], "q3": xs[0]}
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2]}


def rank_job(rank: int, hidden: int, root: str, repeats: int) -> dict:
    """One rank of one model size (inside ``autopar.launch``)."""
    import torch

    import autopar
    from autopar.cluster.model import Cluster
    from autopar.runtime.checkpointing import piece_bytes
    from autopar.runtime.communicator import pg_barrier
    from autopar.runtime.memory import TrackedMeter
    from autopar.runtime.state import engine_pieces

    torch.manual_seed(0)
    cluster = Cluster.from_dict(cluster_dict())
    case = autopar.models.build("mlp", device="cpu", num_layers=NUM_LAYERS, hidden_size=hidden)
    optimizer = lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-6)   # noqa: E731
    a = autopar.compile(case.model, cluster, case.example_inputs, GLOBAL_BATCH, case.loss_fn, strategy="dp",
                        zero_stage=3, measure=False, optimizer=optimizer)
    inputs, targets = case.batch(GLOBAL_BATCH, seed=1)
    a.step(inputs, targets)
    layer = max(p.numel() for p in case.model.parameters()) * 4 + hidden * 4     # one Linear: weight and bias
    share = piece_bytes(engine_pieces(a.engine))
    out = {"rank": rank, "params": sum(p.numel() for p in case.model.parameters()), "share_bytes": share,
           "layer_bytes": layer, "save_s": [], "load_s": [], "reshard_s": []}
    directory = Path(root) / f"h{hidden}"

    def timed(fn) -> tuple[float, int]:
        pg_barrier()
        with TrackedMeter(rank=rank) as meter:
            t0 = time.perf_counter()
            fn()
            pg_barrier()
            dt = time.perf_counter() - t0
        return dt, meter.peak_bytes

    peaks = {"save": 0, "load": 0, "reshard": 0}
    for _ in range(repeats):
        dt, peak = timed(lambda: a.save(directory))
        out["save_s"].append(dt)
        peaks["save"] = max(peaks["save"], peak)
        dt, peak = timed(lambda: a.load(directory))
        out["load_s"].append(dt)
        peaks["load"] = max(peaks["load"], peak)
    out["written_bytes"] = sum(f.stat().st_size for f in directory.glob(f"__{rank}_*.distcp"))
    out["num_files"] = len(list(directory.glob(f"__{rank}_*.distcp")))
    out["async_return_s"], out["async_total_s"] = [], []
    for i in range(repeats):            # async: the save returns after the snapshot; a step runs meanwhile
        pg_barrier()
        t0 = time.perf_counter()
        handle = a.save(Path(root) / f"h{hidden}-async", async_save=True)
        out["async_return_s"].append(time.perf_counter() - t0)
        a.step(inputs, targets)
        manifest = handle.wait()
        out["async_total_s"].append(time.perf_counter() - t0)
        assert manifest.step == a.step_count - 1, (manifest.step, a.step_count)
    a = None            # the first job goes before the second is built
    case_b = autopar.models.build("mlp", device="cpu", num_layers=NUM_LAYERS, hidden_size=hidden, seed=5)
    b = autopar.compile(case_b.model, cluster, case_b.example_inputs, GLOBAL_BATCH, case_b.loss_fn, strategy="pp",
                        measure=False, optimizer=optimizer)
    out["reshard_plan"] = f"{b.plan.strategy}: stages {[st.num_layers for st in b.plan.stages]}"
    b.step(inputs, targets)           # so the load overwrites existing optimizer state too
    out["reshard_share_bytes"] = piece_bytes(engine_pieces(b.engine))
    for _ in range(repeats):
        dt, peak = timed(lambda: b.load(directory))
        out["reshard_s"].append(dt)
        peaks["reshard"] = max(peaks["reshard"], peak)
    out["peak_bytes"] = peaks
    return out


def run_size(hidden: int, repeats: int, root: str) -> list[dict]:
    import autopar
    from autopar.cluster.model import Cluster

    return autopar.launch(rank_job, Cluster.from_dict(cluster_dict()), hidden, root, repeats, step_timeout_s=600.0)


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--recovery", action="store_true",
                        help="then run benchmarks/bench_elastic.py's main (time from failure to the next step)")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="autopar-bench-ckpt-")
    rows, raw = [], []
    try:
        for hidden in args.hidden:
            before = _load()
            results = run_size(hidden, args.repeats, root)
            after = _load()
            for r in results:
                r.update(hidden=hidden, load_before=before, load_after=after,
                         **{k.replace("_s", ""): _quartiles(r[k]) for k in ("save_s", "load_s", "reshard_s",
                                                                            "async_return_s", "async_total_s")})
                raw.append(r)
                q = {k: r[k.replace("_s", "")] for k in ("save_s", "load_s", "reshard_s", "async_return_s",
                                                           "async_total_s")}
                rows.append([hidden, f"{r['params'] / 1e6:.2f}M", r["rank"], f"{r['share_bytes'] / 2**20:.2f}",
                             f"{r['written_bytes'] / 2**20:.2f}", r["num_files"],
                             *(f"{q[k]['median']:.3f} ({q[k]['q1']:.3f}-{q[k]['q3']:.3f})"
                               for k in ("save_s", "load_s", "reshard_s", "async_return_s", "async_total_s")),
                             f"{r['peak_bytes']['save'] / 2**20:.2f} / {r['peak_bytes']['load'] / 2**20:.2f} / "
                             f"{r['peak_bytes']['reshard'] / 2**20:.2f}", f"{r['layer_bytes'] / 2**20:.2f}",
                             f"{before} -> {after}"])
            print(f"hidden {hidden}: done (load {before} -> {after})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    md = ("# compiled.save / compiled.load: time and bytes per rank against model size\n\n"
          f"mlp, {NUM_LAYERS} layers, AdamW; saved as data parallel ZeRO-3 on 3 EMULATED CPU devices (speeds "
          f"{'/'.join(str(s) for s in SPEEDS)}, memory-proportional shares), loaded into the same plan (load) "
          f"and into a pipeline plan (reshard: {raw[-1]['reshard_plan'] if raw else '?'}). Real processes "
          "(autopar.launch); save and load run outside the emulated clock, so times are NATIVE CPU and disk "
          f"time of this shared machine, median (IQR) of {args.repeats} repeats, machine load (1/5/15-min) "
          "before -> after each size in the last column. Peak: tracked new tensor bytes during save / load / "
          "reshard (TrackedMeter; DCP's reads of a saved chunk are not tracked, each is at most one layer), "
          "against one layer's bytes: no rank gathers the full state.\n\n")
    md += md_table(["hidden", "params", "rank", "own share MiB", "written MiB", "files", "save s", "load s",
                    "reshard s", "async save: returns s", "async save + 1 step: done s",
                    "peak MiB save/load/reshard", "layer MiB", "load avg"], rows)
    write_results("checkpoint", {"model": "mlp", "num_layers": NUM_LAYERS, "repeats": args.repeats,
                                 "speeds_emulated": SPEEDS, "rows": raw}, md)
    if args.recovery:
        elastic = Path(__file__).with_name("bench_elastic.py")
        if elastic.exists():
            import importlib.util

            spec = importlib.util.spec_from_file_location("bench_elastic", elastic)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.argv = [str(elastic)]
            module.main()
        else:
            print("--recovery: benchmarks/bench_elastic.py is not there yet; nothing to run")


if __name__ == "__main__":
    main()
