"""Does ``auto`` pick the fastest plan, and ``dp`` the fastest ZeRO stage, on models it has not seen?

Three models no table or test was made on (``benchmarks/pick_models.py``: Hugging Face GPT-2 3.3M and
Llama 11.5M from configs, a 50.7M residual GLU MLP), on the emulated demo cluster (1.0 / 0.5 / 0.25 of
this CPU). Two ``autopar train`` runs per model, every strategy measured in the same run, steps
interleaved:

- the pick: ``--strategy auto --compare dp,pp,tp``: auto's median step over the fastest of the three;
- the ZeRO stage: ``--strategy dp --compare dp:zero=0,dp:zero=1,dp:zero=2,dp:zero=3``: the chosen dp
  plan's median step over the fastest pinned stage.

Also the chosen plans' measured/predicted. Emulated devices: every figure is of this machine's CPU.

    python benchmarks/bench_pick.py [--models gpt2s,llama11,glu50] [--steps 12] [--warmup 8]
    python benchmarks/bench_pick.py --from DIR     # the table of runs already made (their --json files)

Writes ``benchmarks/results/pick.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_results  # noqa: E402

HERE = Path(__file__).resolve().parent
MODELS = {"gpt2s": 48, "llama11": 24, "glu50": 48}     # model -> global batch
RUNS = {"pick": ("auto", "dp,pp,tp"), "zero": ("dp", "dp:zero=0,dp:zero=1,dp:zero=2,dp:zero=3")}


def _run(model: str, kind: str, out: Path, steps: int, warmup: int) -> None:
    strategy, compare = RUNS[kind]
    env = dict(os.environ, PYTHONPATH=str(HERE), AUTOPAR_CACHE_DIR=str(out / f"cache_{model}"))
    cmd = [sys.executable, "-m", "autopar", "train", "--model", f"pick_models:{model}", "--cluster", "demo",
           "--global-batch", str(MODELS[model]), "--strategy", strategy, "--compare", compare,
           "--steps", str(steps), "--warmup", str(warmup), "--json", str(out / f"{kind}_{model}.json")]
    print("+", " ".join(cmd[1:]), flush=True)
    # outside the repository: its top-level ``kernels`` folder would shadow the Hugging Face package
    with open(out / f"{kind}_{model}.txt", "w") as log:
        subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), stdout=log, stderr=subprocess.STDOUT, check=True)


def _row(summary: dict, chosen: str, others: list[str]) -> dict:
    med = {k: summary[k]["step_time_s"]["median"] for k in [chosen, *others]}
    fastest = min(others, key=med.__getitem__)
    return dict(chosen_ms=1e3 * med[chosen], ms={k: 1e3 * med[k] for k in others}, fastest=fastest,
                over_fastest=med[chosen] / med[fastest], chosen_over_predicted=summary[chosen]["measured_over_predicted"],
                predicted_ms={k: 1e3 * summary[k]["predicted_step_s"] for k in [chosen, *others]})


COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "p2p")


def _collectives(summary: dict, strategy: str) -> dict[str, tuple[float, float]]:
    """Per collective phase of ``strategy``'s plan: (measured, predicted) ms per step, summed over ranks."""
    out: dict[str, list[float]] = {}
    for rank in summary[strategy]["phases"]:
        for name, ph in rank["phases"].items():
            if any(name.startswith(c) for c in COLLECTIVES):
                acc = out.setdefault(name, [0.0, 0.0])
                acc[0] += 1e3 * ph["measured_s"]
                acc[1] += 1e3 * ph["predicted_s"]
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


def _plan_of(out: Path, kind: str, model: str, strategy: str, row: dict) -> str:
    """What ``strategy`` chose: the compared plan it equals (the same predicted step), else its printed
    strategy and ZeRO stage."""
    same = [k for k, v in row["predicted_ms"].items() if k != strategy and v == row["predicted_ms"][strategy]]
    if same:
        return f"= {same[-1]}"
    for line in (out / f"{kind}_{model}.txt").read_text().splitlines():
        if line.startswith(f"== strategy {strategy}:"):
            return line.split(":", 1)[1].split(", rank batch")[0].strip()
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--from", dest="src", help="a folder of earlier runs' --json files (kind_model.json)")
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    out = Path(args.src) if args.src else Path(tempfile.mkdtemp(prefix="autopar-pick-"))
    if not args.src:
        for model in models:
            for kind in RUNS:
                _run(model, kind, out, args.steps, args.warmup)
    from pick_models import num_params

    rows = {}
    for model in models:
        pick = json.loads((out / f"pick_{model}.json").read_text())
        zero = json.loads((out / f"zero_{model}.json").read_text())
        p = _row(pick, "auto", ["dp", "pp", "tp"])
        z = _row(zero, "dp", [f"dp:zero={z}" for z in range(4)])
        rows[model] = dict(params=num_params(model), batch=MODELS[model],
                           pick=dict(p, plan=_plan_of(out, "pick", model, "auto", p)),
                           zero=dict(z, plan=_plan_of(out, "zero", model, "dp", z)),
                           collectives={s: _collectives(zero, s) for s in ("dp", *[f"dp:zero={z}" for z in range(4)])}
                           | {f"pick {s}": _collectives(pick, s) for s in ("auto", "pp", "tp")})
    lines = ["# The pick on held-out models (emulated demo cluster)", "",
             "`python benchmarks/bench_pick.py` (see its docstring): per model, one `autopar train` run with auto, dp, "
             "pp and tp, and one with dp and its four ZeRO stages pinned, steps interleaved. Emulated CPU devices "
             "(1.0 / 0.5 / 0.25 of this CPU). Median step over the measured steps, ms; predicted in brackets.", "",
             "| model | params | batch | auto chose | auto | dp | pp | tp | auto / fastest | auto measured / predicted |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model, r in rows.items():
        p = r["pick"]
        cells = [f"{p['ms'][k]:.0f} ({p['predicted_ms'][k]:.0f})" for k in ("dp", "pp", "tp")]
        lines.append(f"| {model} | {r['params'] / 1e6:.1f}M | {r['batch']} | {p['plan']} | {p['chosen_ms']:.0f} "
                     f"({p['predicted_ms']['auto']:.0f}) | " + " | ".join(cells) +
                     f" | {p['over_fastest']:.2f} | {p['chosen_over_predicted']:.2f} |")
    lines += ["", "| model | dp chose | dp | ZeRO-0 | ZeRO-1 | ZeRO-2 | ZeRO-3 | chosen / fastest | chosen measured / predicted |",
              "|---|---|---|---|---|---|---|---|---|"]
    for model, r in rows.items():
        z = r["zero"]
        cells = [f"{z['ms'][f'dp:zero={k}']:.0f} ({z['predicted_ms'][f'dp:zero={k}']:.0f})" for k in range(4)]
        lines.append(f"| {model} | {z['plan']} | {z['chosen_ms']:.0f} ({z['predicted_ms']['dp']:.0f}) | " +
                     " | ".join(cells) + f" | {z['over_fastest']:.2f} | {z['chosen_over_predicted']:.2f} |")
    lines += ["", "Collective phases of every plan measured (ms per step, all ranks summed; measured / predicted). "
              "What a phase measures is its exposed time: a collective overlapped with compute shows as the part "
              "that was not hidden.", "",
              "| model | plan | phase | measured | predicted | measured / predicted |", "|---|---|---|---|---|---|"]
    for model, r in rows.items():
        for plan, phases in r["collectives"].items():
            for name, (m, p) in phases.items():
                ratio = f"{m / p:.2f}" if p > 0 else "-"
                lines.append(f"| {model} | {plan} | {name} | {m:.1f} | {p:.1f} | {ratio} |")
    write_results("pick", dict(rows=rows), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
