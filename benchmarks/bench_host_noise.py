"""How steady this machine's CPU time is: the floor under every emulated measured/predicted figure.

An emulated device (``autopar.runtime.emulate``) charges each compute block the least thread CPU time
seen at its position over the run's steps (the steady clock), and the cost model's CPU tables take the
least of their hot repeats (``autopar.measure.blocks.measure_blocks``). Both estimate one quantity, the
block's uncontended CPU time, from a few samples. This benchmark times one fixed piece of work (a
gpt-tiny micro-step: forward, loss and backward at 16 rows, one thread), pinned to each core at once as
a run's ranks are, for ``--seconds``; every repetition times it twice: hot (right after the previous
run, as the tables time it) and after a sleep (``--gap``, as an emulated rank's clock sleeps between
blocks). From those samples:

- the spread of single samples (median / least);
- the least of W consecutive samples, for W = 8, 16, 32 (the clock's minimum after W steps), as a
  coefficient of variation over the run's windows;
- the noise floor of a measured/predicted ratio: two windows drawn at random, the least of W_run
  after-sleep samples over the least of W_table hot samples (the clock's charge over the table's
  figure for the same work; 12 and 12 by default), and the same for two after-sleep windows (a run
  against a run, A/A). Reported: the median ratio, its IQR, and the share within 10% and 25% of 1.

Nothing here is emulated or predicted: every figure is this machine's CPU time. A ratio here is what a
perfect cost model would still show against an emulated run of a single block.

    python benchmarks/bench_host_noise.py [--seconds 60] [--gap 0.1] [--name host_noise]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import md_table, write_results  # noqa: E402

import numpy as np  # noqa: E402

WINDOWS = (8, 16, 32)


def _sample(core: int, seconds: float, gap_s: float, rows: int, conn) -> None:
    """In a process pinned to ``core``: (hot, after-sleep) thread CPU seconds of one micro-step, for
    ``seconds``."""
    import torch

    from autopar.models import load

    try:
        os.sched_setaffinity(0, {core})
    except (AttributeError, OSError):
        pass
    torch.set_num_threads(1)
    case = load("gpt-tiny", device="cpu")
    (x,), y = case.make_batch(rows, 0, "cpu")

    def step() -> float:
        t0 = time.thread_time()
        case.loss_fn(case.model(x), y).backward()
        return time.thread_time() - t0

    for _ in range(5):
        step()
    out = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        hot = step()
        time.sleep(gap_s)
        out.append((hot, step()))
    conn.send(out)
    conn.close()


def window_cv(x: np.ndarray, w: int) -> float:
    mins = np.array([x[i:i + w].min() for i in range(0, len(x) - w + 1, w)])
    return float(mins.std() / mins.mean()) if len(mins) > 1 else float("nan")


def ratio_floor(num: np.ndarray, den: np.ndarray, w_num: int, w_den: int, draws: int = 2000,
                seed: int = 0) -> dict:
    """Least of ``w_num`` consecutive ``num`` samples over least of ``w_den`` consecutive ``den``
    samples, both windows drawn at random: median, IQR and the shares within 10% / 25% of 1."""
    rng = np.random.default_rng(seed)
    r = np.array([num[a:a + w_num].min() / den[b:b + w_den].min()
                  for a, b in zip(rng.integers(0, len(num) - w_num + 1, draws),
                                  rng.integers(0, len(den) - w_den + 1, draws))])
    return dict(median=float(np.median(r)), q1=float(np.quantile(r, 0.25)), q3=float(np.quantile(r, 0.75)),
                within10=float(np.mean(np.abs(r - 1) <= 0.10)), within25=float(np.mean(np.abs(r - 1) <= 0.25)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="sampling time per core (all cores at once)")
    ap.add_argument("--gap", type=float, default=0.1, help="sleep before each after-sleep sample, seconds")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--window-table", type=int, default=12, help="hot samples the table's least is taken of")
    ap.add_argument("--window-run", type=int, default=12, help="after-sleep samples the clock's least is taken of")
    ap.add_argument("--name", default="host_noise")
    args = ap.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    load0 = os.getloadavg()[0]
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for c in cores:
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_sample, args=(c, args.seconds, args.gap, args.rows, send))
        p.start()
        pipes.append(recv)
        procs.append(p)
    samples = {c: np.array(r.recv()) for c, r in zip(cores, pipes)}
    for p in procs:
        p.join()
    rows, data = [], {}
    for c, s in samples.items():
        hot, cold = s[:, 0], s[:, 1]
        tab = ratio_floor(cold, hot, args.window_run, args.window_table)
        aa = ratio_floor(cold, cold, args.window_run, args.window_run, seed=1)
        data[c] = dict(num=len(s), hot_min_s=float(hot.min()), hot_median_s=float(np.median(hot)),
                       cold_min_s=float(cold.min()), cold_median_s=float(np.median(cold)),
                       window_cv={f"hot_{w}": window_cv(hot, w) for w in WINDOWS} |
                       {f"cold_{w}": window_cv(cold, w) for w in WINDOWS},
                       run_over_table=tab, run_over_run=aa)
        d = data[c]
        rows.append([c, d["num"], f"{d['hot_min_s'] * 1e3:.2f} / {d['hot_median_s'] * 1e3:.2f}",
                     f"{d['cold_min_s'] * 1e3:.2f} / {d['cold_median_s'] * 1e3:.2f}",
                     ", ".join(f"{d['window_cv'][f'cold_{w}']:.1%}" for w in WINDOWS),
                     f"{tab['median']:.3f} ({tab['q1']:.3f}-{tab['q3']:.3f}); {tab['within10']:.0%} / {tab['within25']:.0%}",
                     f"{aa['median']:.3f} ({aa['q1']:.3f}-{aa['q3']:.3f}); {aa['within10']:.0%} / {aa['within25']:.0%}"])
    load1 = os.getloadavg()[0]
    md = (f"# Host timing noise: the floor under emulated measured/predicted figures\n\n"
          f"One fixed piece of work (gpt-tiny micro-step, {args.rows} rows, forward + loss + backward, one thread, "
          f"thread CPU time), pinned to each core at once, for {args.seconds:g} s: a hot sample, then a "
          f"{args.gap * 1e3:g} ms sleep and an after-sleep sample, repeated. Load average {load0:.1f} at the start, "
          f"{load1:.1f} at the end. Nothing is emulated or predicted here.\n\n"
          + md_table(["core", "repetitions", "hot least / median ms", "after sleep least / median ms",
                      f"cv of the least of W after-sleep samples (W = {', '.join(map(str, WINDOWS))})",
                      f"clock (least of {args.window_run} after sleep) / table (least of {args.window_table} hot): "
                      "median (IQR); share within 10% / 25%",
                      f"run / run (least of {args.window_run} each): median (IQR); within 10% / 25%"], rows)
          + "\n\nA ratio column is what a perfect cost model would show for one block's emulated time on this "
          "machine, from the noise of CPU time alone.\n\n"
          f"Command: `python benchmarks/bench_host_noise.py --seconds {args.seconds:g} --gap {args.gap:g} "
          f"--rows {args.rows} --name {args.name}`\n")
    write_results(args.name, dict(seconds=args.seconds, gap_s=args.gap, rows=args.rows, load=[load0, load1],
                                  window_table=args.window_table, window_run=args.window_run,
                                  cores={str(c): d for c, d in data.items()}), md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
