"""Mixed precision on this CPU: forward + backward time and saved-for-backward bytes of zoo models at
fp32, bf16 and fp16 autocast, measured in ONE run with the precisions interleaved step by step (fp32,
bf16, fp16, fp32, ...), so the ratios compare neighbours; each ratio is the median over rounds of
t(precision) / t(fp32) with its quartiles. Native CPU (not emulated), 1 thread (the machine is shared).

It supports the cost model's choice for emulated devices (``autopar.cost.precision``): they are priced
at their fp32 measurement at every precision. That is right only if this CPU's autocast is about as
fast as fp32; the ratios below say how far off that is. The predicted saved bytes are those of
``autopar.cost.precision.autocast_bytes`` (a fake-tensor run); the measured are autograd's
saved-tensor hooks on the real forward (each storage once, parameters not counted).

    python benchmarks/bench_precision.py [--rounds 15] [--batch 16]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import md_table, write_results  # noqa: E402

MODELS = ("mlp-tiny", "gpt-tiny", "llama-tiny", "bert-tiny")
PRECISIONS = ("fp32", "bf16", "fp16")


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def measure(name: str, batch: int, rounds: int) -> dict:
    import torch

    from autopar.cost.precision import autocast_bytes
    from autopar.models import build
    from autopar.passes.analyze import analyze
    from autopar.runtime.engine import compute_loss
    from autopar.runtime.precision import autocast_forward, precision_loss

    case = build(name, seed=0)
    x, y = case.batch(batch, seed=1)
    gm = analyze(case.model, x).captured.gm
    runs = {}
    for p in PRECISIONS:
        m = copy.deepcopy(gm)
        if p != "fp32":
            autocast_forward(m, p, torch.device("cpu"))
        runs[p] = (m, precision_loss(case.loss_fn, p, torch.device("cpu")) if case.loss_fn else None)

    def step(p):
        m, loss_fn = runs[p]
        t0 = time.perf_counter()
        compute_loss(m(*x), y, loss_fn).backward()
        m.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for p in PRECISIONS:          # warm-up
        step(p)
    times = {p: [] for p in PRECISIONS}
    for _ in range(rounds):
        for p in PRECISIONS:
            times[p].append(step(p))
    ratios = {p: quartiles([a / b for a, b in zip(times[p], times["fp32"])]) for p in PRECISIONS[1:]}

    def saved(p):
        m, _ = runs[p]
        params = {t.untyped_storage().data_ptr() for t in m.parameters()}
        seen = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(*x)
        return sum(seen.values())

    mem = {}
    for p in PRECISIONS:
        pred = autocast_bytes(gm, x, p)
        mem[p] = {"measured": saved(p), "predicted": float(pred.saved.sum() + pred.weight_copies.sum())}
    return {"fwd_bwd_s": {p: statistics.median(times[p]) for p in PRECISIONS}, "ratio_vs_fp32": ratios,
            "saved_bytes": mem}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    results = {name: measure(name, args.batch, args.rounds) for name in MODELS}
    rows = []
    for name, r in results.items():
        for p in PRECISIONS:
            q = r["ratio_vs_fp32"].get(p)
            mem = r["saved_bytes"][p]
            rows.append([name, p, f"{r['fwd_bwd_s'][p] * 1e3:.2f}",
                         "1" if q is None else f"{q[1]:.2f} [{q[0]:.2f}, {q[2]:.2f}]",
                         f"{mem['measured']:,}", f"{mem['predicted']:,.0f}",
                         f"{mem['measured'] / r['saved_bytes']['fp32']['measured']:.2f}"])
    md = (f"# Mixed precision on this CPU (native, 1 thread, batch {args.batch}, {args.rounds} interleaved rounds)\n\n"
          + md_table(["model", "precision", "fwd+bwd ms (median)", "time / fp32: median [q1, q3]",
                      "saved bytes measured", "saved bytes predicted", "saved / fp32"], rows) + "\n")
    write_results("precision", {"config": vars(args), "results": results}, md)
    print(md)


if __name__ == "__main__":
    main()
