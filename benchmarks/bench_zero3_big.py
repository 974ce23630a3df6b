"""ZeRO-3 data parallelism trains a model larger than one device: a residual MLP of about 84M parameters
(width 1024, 10 blocks; fp32 training state 16 bytes a parameter, 2.5x one device) on 4 emulated
devices of 0.5 GB, ``strategy="dp", zero_stage=3``. Built on ``meta``; each rank materialises and keeps
its shard. Reports each rank's tracked peak against its device's limit and the plan's prediction, its
process's peak resident set above the resident set it started the rank with (Linux: ``VmHWM`` of
``/proc/self/status``, reset before the steps through ``clear_refs``), and the final state's largest
relative difference from one device (no limit) on the whole batch, AdamW. The resident set also holds
what the tracked bytes leave out: freed blocks the emulated rank's heap keeps for the next step
(``autopar.cluster.heap``: as a GPU's caching allocator, but without its size-class pools), and buffers
allocated outside the operators (gloo's).

    python benchmarks/bench_zero3_big.py [--steps 2] [--batch 8]

Writes ``benchmarks/results/zero3-big.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WIDTH, DEPTH, MEMORY_GB = 1024, 10, 0.5
CLUSTER = {"name": "four-half-gb", "nodes": [{"device": {"name": "cpu-half-gb", "emulate": "cpu", "speed": 1.0,
                                                         "memory_GB": MEMORY_GB}, "count": 4}]}


def _model(device: str):
    import torch
    from bench_accuracy import ResMLP

    with torch.device(device):
        return ResMLP(width=WIDTH, depth=DEPTH)


def _batch(n: int, step: int):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(n, WIDTH, generator=g),), torch.randint(0, 10, (n,), generator=g)


def _optimizer(params):
    import torch

    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def _resident() -> dict[str, int]:
    """VmRSS and VmHWM of this process in bytes ({} where /proc is not Linux's)."""
    try:
        with open("/proc/self/status") as f:
            return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f)
                    if k in ("VmRSS", "VmHWM")}
    except OSError:
        return {}


def _reset_resident_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rank(rank: int, batch: int, steps: int) -> dict:
    import torch

    import autopar

    start = _resident().get("VmRSS", 0)
    compiled = autopar.compile(_model("meta"), autopar.current_cluster(), _batch(2, 0)[0], batch,
                               torch.nn.functional.cross_entropy, optimizer=_optimizer, seed=5, strategy="dp",
                               zero_stage=3)
    meter = compiled.memory
    build_peak = meter.peak_bytes
    meter.reset_peak()
    build_rss = _resident().get("VmHWM", 0) - start
    reset = _reset_resident_peak()
    for s in range(steps):
        compiled.step(*_batch(batch, s))
    step_rss = _resident().get("VmHWM", 0) - start if reset else None
    state = compiled.state_dict()
    return dict(build_peak=build_peak, step_peak=meter.peak_bytes, limit=meter.limit_bytes,
                build_rss=build_rss, step_rss=step_rss,
                predicted=compiled.plan.predicted.memory_bytes[rank], plan=compiled.plan.summary(),
                state={k: v.detach().clone() for k, v in state.items()} if rank == 0 else None)


def _oracle(batch: int, steps: int) -> dict:
    import torch

    import autopar

    model = autopar.materialize(_model("meta"), seed=5)
    opt = _optimizer(list(model.parameters()))
    for s in range(steps):
        inputs, targets = _batch(batch, s)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(*inputs), targets).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    import autopar
    from _common import md_table, write_results
    from autopar.cli.check import state_rel_errors

    cluster = autopar.Cluster.from_dict(CLUSTER)
    params = sum(p.numel() for p in _model("meta").parameters())
    ranks = autopar.launch(_rank, cluster, args.batch, args.steps, timeout_s=900)
    errors = state_rel_errors(ranks[0]["state"], _oracle(args.batch, args.steps))
    def rss(m, key):
        return "-" if m[key] is None else f"{m[key] / 2**20:.0f}"

    rows = [[r, f"{m['build_peak'] / 2**20:.0f}", f"{m['step_peak'] / 2**20:.0f}", f"{m['predicted'] / 2**20:.0f}",
             f"{m['limit'] / 2**20:.0f}", f"{m['step_peak'] / m['predicted']:.2f}", rss(m, "build_rss"), rss(m, "step_rss"),
             "-" if m["step_rss"] is None else f"{m['step_rss'] / m['predicted']:.2f}"] for r, m in enumerate(ranks)]
    worst = max(errors, key=errors.get)
    out = dict(params=params, state_bytes=16 * params, device_bytes=ranks[0]["limit"], steps=args.steps,
               batch=args.batch, max_rel_error=errors[worst], worst_tensor=worst,
               ranks=[{k: v for k, v in m.items() if k != "state"} for m in ranks])
    text = (f"# ZeRO-3 on 4 emulated devices of {MEMORY_GB} GB: a residual MLP of {params / 1e6:.1f}M parameters\n\n"
            f"`python benchmarks/bench_zero3_big.py --steps {args.steps} --batch {args.batch}`. Emulated devices "
            f"(CPU processes with a memory limit). Training state {16 * params / 2**30:.2f} GiB = "
            f"{16 * params / ranks[0]['limit']:.2f}x one device.\n\n"
            + md_table(["rank", "build peak MiB", "step peak MiB", "predicted MiB", "limit MiB", "peak / predicted",
                        "build resident MiB", "step resident MiB", "resident / predicted"], rows)
            + "\n\nPeak: tracked tensor bytes (`autopar.runtime.memory`). Resident: the process's peak resident set "
              "above what it held when the rank started (build: from the start; step: over the steps, after a reset). "
              "Resident exceeds tracked by the freed blocks the emulated heap keeps (`autopar.cluster.heap`) and by "
              "buffers made outside the operators (gloo's)."
            + f"\n\nLargest relative difference from one device on the whole batch (AdamW, eps 1e-6): "
              f"{errors[worst]:.3g} ({worst}); api.md's bound 1e-3.\n")
    write_results("zero3-big", out, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
