"""Runtime overhead: ``autopar.compile`` on one native-speed CPU device against a plain eager loop.

One device (``device: cpu``: this machine's CPU, not emulated, a ``NullClock`` rank), the same model
(the compiled one starts from a copy of the eager one's weights), the same optimizer (AdamW, lr 1e-3),
the same global batch every step, the same thread count. Per model: warm up both, then ``--reps``
repetitions, each timing ``--steps`` steps of one then ``--steps`` of the other, the order swapped every
repetition so that drift on a shared machine hits both alike. Per repetition the ratio is the median
compiled step over the median eager step; the table gives the median step times over all steps, the
median ratio and its spread (min-max and IQR over repetitions). The target is a ratio within 1.05.
After the run both have taken the same steps from the same weights, so their states must agree
(``max |dw|`` checks that the compiled step did the same work).

    python benchmarks/bench_overhead.py [--reps 7] [--steps 5] [--threads 1] [--models mlp,gpt,...]
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

import torch  # noqa: E402

# name -> (zoo name, config overrides, global batch): zoo models scaled up to a step of tens of ms on
# one core, and two third-party (Hugging Face style) models whose output carries the loss.
MODELS = {
    "mlp": ("mlp", {}, 32),
    "gpt": ("gpt-tiny", dict(num_layers=4, hidden_size=256, num_heads=4, vocab_size=2048, seq_len=64), 8),
    "llama": ("llama-tiny", dict(num_layers=4, hidden_size=256, num_heads=4, ffn_hidden_size=688,
                                 vocab_size=2048, seq_len=64), 8),
    "hf-gpt": ("hf-gpt-tiny", dict(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=64), 8),
    "hf-llama": ("hf-llama-tiny", dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                                       intermediate_size=688, vocab_size=2048, max_position_embeddings=64), 8),
}
CLUSTER = {"name": "one-native-cpu", "nodes": [{"device": "cpu", "count": 1}]}


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def run_model(key: str, reps: int, steps: int, warmup: int) -> dict:
    import autopar
    from autopar.models import build

    zoo, overrides, gb = MODELS[key]
    case = build(zoo, seed=0, **overrides)
    cluster = autopar.Cluster.from_dict(CLUSTER)
    eager = copy.deepcopy(case.model)
    opt = _optimizer(eager.parameters())
    inputs, targets = case.batch(gb, seed=1)
    loss_fn = case.loss_fn

    def eager_step() -> float:
        opt.zero_grad(set_to_none=True)
        out = eager(*inputs)
        loss = loss_fn(out, targets) if loss_fn is not None else out["loss"]
        loss.backward()
        opt.step()
        return float(loss.detach())

    t0 = time.perf_counter()
    compiled = autopar.compile(case.model, cluster, case.example_inputs, gb, loss_fn, optimizer=_optimizer)
    compile_s = time.perf_counter() - t0

    def compiled_step() -> float:
        return compiled.step(inputs, targets)

    for _ in range(warmup):
        eager_step()
        compiled_step()
    times = {"eager": [], "compiled": []}
    ratios = []
    fns = {"eager": eager_step, "compiled": compiled_step}
    for r in range(reps):
        block = {}
        for who in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            ts = []
            for _ in range(steps):
                t = time.perf_counter()
                fns[who]()
                ts.append(time.perf_counter() - t)
            block[who] = statistics.median(ts)
            times[who] += ts
        ratios.append(block["compiled"] / block["eager"])
    state, ref = compiled.state_dict(), eager.state_dict()
    max_dw = max(float((state[k].float() - ref[k].float()).abs().max()) for k in ref if ref[k].is_floating_point())
    q1, q3 = _quartiles(ratios)
    engine = compiled.engine
    return dict(
        model=key, zoo=zoo, overrides=overrides, global_batch=gb,
        params=sum(p.numel() for p in eager.parameters()),
        plan=dict(strategy=compiled.plan.strategy, zero_stage=compiled.plan.zero_stage,
                  micro_batches=[list(m) for m in compiled.plan.stages[0].micro_batches]),
        engine=type(engine).__name__, clock=type(engine.clock).__name__, compile_s=compile_s,
        eager_ms=statistics.median(times["eager"]) * 1e3, compiled_ms=statistics.median(times["compiled"]) * 1e3,
        ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios), ratio_q1=q1, ratio_q3=q3,
        ratios=ratios, max_abs_state_diff=max_dw,
        eager_step_ms=[t * 1e3 for t in times["eager"]], compiled_step_ms=[t * 1e3 for t in times["compiled"]],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--reps", type=int, default=7, help="alternating repetitions per model")
    ap.add_argument("--steps", type=int, default=5, help="steps per repetition and side")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per side")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, the same for both (1: steadier)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows, results = [], []
    for key in args.models.split(","):
        res = run_model(key, args.reps, args.steps, args.warmup)
        results.append(res)
        rows.append([key, f"{res['params'] / 1e6:.2f}M", res["global_batch"],
                     f"{res['plan']['strategy']} z{res['plan']['zero_stage']}", res["clock"],
                     f"{res['eager_ms']:.1f}", f"{res['compiled_ms']:.1f}", f"{res['ratio']:.3f}",
                     f"{res['ratio_min']:.3f}-{res['ratio_max']:.3f}", f"{res['ratio_q1']:.3f}-{res['ratio_q3']:.3f}",
                     f"{res['max_abs_state_diff']:.1e}"])
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    header = ["model", "params", "batch", "plan", "clock", "eager ms", "compiled ms", "ratio",
              "ratio min-max", "ratio IQR", "max |dw|"]
    within = all(r["ratio"] <= 1.05 for r in results)
    md = (f"# Runtime overhead: autopar.compile vs a plain eager loop\n\n"
          f"One native-speed CPU device (`device: cpu`, not emulated), AdamW, {args.threads} torch thread(s); "
          f"{args.warmup} warm-up steps, then {args.reps} repetitions x {args.steps} steps per side, alternating "
          f"(order swapped every repetition). Step times: median over all timed steps; ratio: median over "
          f"repetitions of (median compiled step / median eager step), with its min-max and IQR. "
          f"`max |dw|`: largest difference between the two final states (same steps from the same weights).\n\n"
          + md_table(header, rows)
          + f"\n\nTarget (compiled within 5% of eager, median ratio <= 1.05 on every model): "
          f"{'met' if within else 'NOT met'}.\n\nReproduce: `python benchmarks/bench_overhead.py --reps {args.reps} "
          f"--steps {args.steps} --threads {args.threads}`\n")
    write_results("overhead", dict(scenario="one native-speed CPU device, compile vs eager", cluster=CLUSTER,
                                   optimizer="AdamW(lr=1e-3)", reps=args.reps, steps=args.steps,
                                   warmup=args.warmup, threads=args.threads, within_5_percent=within,
                                   results=results), md)


if __name__ == "__main__":
    main()
