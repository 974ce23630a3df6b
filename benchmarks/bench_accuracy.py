"""Prediction accuracy: measured against predicted step time for every strategy, on zoo models and on
two third-party-style models that are not in the zoo, before and after calibration.

Emulated: the devices are CPU processes of this machine slowed to their speed (the built-in ``demo``
cluster: 1.0 / 0.5 / 0.25); predicted figures are the cost model's. Every strategy of a model runs in
one job, one strategy after the other (``autopar.cli.trainer``, ``--consecutive 0``: interleaving steps
one by one starts each with the others' caches, which no training job does), warm-up steps excluded; each figure is the
median over the measured steps of (step time / predicted step time), with its IQR.

1. before: every model, predictions without calibration (``AUTOPAR_CALIBRATION=off``);
2. calibration: this machine's factors per (device type, cost term) fitted from the profiles of the
   calibration model's run only (``autopar.cost.calibrate.fit_machine_factors``: the share of its
   error that carries to other models), saved in this benchmark's own profile cache;
3. after: every other model planned and run again with the factors (new plans, new predictions).

``--aa`` runs step 1 twice (same cache, tables and plans) and reports how far the second run's median
step moved from the first's: the noise floor of every other figure here (``bench_host_noise.py``
measures the same floor on one fixed piece of work).

Memory tracking (``RunConfig.track_memory``) is off by default here: its per-operator Python call is
CPU time that the emulated clock stretches (by 1 / speed x time scale) and that no cost model of the
device prices; ``--track-memory`` runs with it, to show its effect.

    python benchmarks/bench_accuracy.py [--models gpt-tiny,resmlp,...] [--steps 6] [--calibrate-on gpt-tiny]

Per phase: each row also records measured against predicted seconds of every phase (forward, backward,
optimizer, each collective, p2p, wait), summed over ranks and per device type (``phase_breakdown``,
from ``compiled.profile()``), in the .json and as tables in the .md, so a gap can be traced to a phase.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _blocks import GluBlock  # noqa: E402
from _common import RESULTS, md_table, write_results  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

# name -> (MODEL spec for autopar, global batch)
MODELS = {
    "gpt-tiny": ("gpt-tiny", 48),
    "bert-tiny": ("bert-tiny", 48),
    "llama-tiny": ("llama-tiny", 48),
    "resmlp": ("benchmarks.bench_accuracy:resmlp", 112),
    "glumlp": ("benchmarks.bench_accuracy:glumlp", 48),
}
THIRD_PARTY = ("resmlp", "glumlp")


# -- two third-party-style models (not in the zoo) ---------------------------------------------------
class _PreNormBlock(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


class ResMLP(nn.Module):
    """The held-out model of issue 12: a pre-norm residual MLP, width 384, depth 8 (9.4M parameters)."""

    def __init__(self, width: int = 384, depth: int = 8, classes: int = 10):
        super().__init__()
        self.layers = nn.ModuleList(_PreNormBlock(width, 4 * width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class GluMLP(nn.Module):
    """Token embeddings, a stack of gated (SwiGLU-style) feed-forward blocks without attention, mean
    pooling and a classifier: width 256, depth 6, 16 tokens."""

    def __init__(self, vocab: int = 1000, width: int = 256, depth: int = 6, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(GluBlock(width, 4 * width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(dim=1))


def _case(name, model, make_inputs):
    from autopar.models import ModelCase

    def make_batch(n, seed, device):
        g = torch.Generator().manual_seed(seed)
        return (make_inputs(n, g),), torch.randint(0, 10, (n,), generator=g)

    return ModelCase(name=name, model=model, example_inputs=(make_inputs(4, torch.Generator().manual_seed(0)),),
                     loss_fn=nn.functional.cross_entropy, make_batch=make_batch)


def resmlp():
    torch.manual_seed(0)
    return _case("resmlp", ResMLP(), lambda n, g: torch.randn(n, 384, generator=g))


def glumlp():
    torch.manual_seed(0)
    return _case("glumlp", GluMLP(), lambda n, g: torch.randint(0, 1000, (n, 16), generator=g))


# -- the runs -----------------------------------------------------------------------------------------
def _strategies(spec: str, cluster, gb: int) -> list[str]:
    """The strategies that plan for this model (others, e.g. tp on a model without heads, are skipped)."""
    import autopar
    from autopar.api import prepare
    from autopar.config import STRATEGIES
    from autopar.models import load

    case = load(spec, device="cpu")
    prep = prepare(case.model, cluster, case.example_inputs)
    ok = []
    for s in STRATEGIES:
        try:
            autopar.plan(case.model, cluster, case.example_inputs, gb, case.loss_fn, strategy=s, prepared=prep)
            ok.append(s)
        except ValueError as exc:
            print(f"  {spec}: {s} skipped ({str(exc)[:100]})", flush=True)
    return ok


def run_model(name: str, cluster, steps: int, warmup: int, track_memory: bool | None,
              consecutive: int = 0) -> list[dict]:
    from autopar.cli.trainer import RunSpec, run_comparison, spread

    spec_name, gb = MODELS[name]
    strategies = _strategies(spec_name, cluster, gb)
    spec = RunSpec(model=spec_name, cluster_dict=cluster.to_dict(), global_batch=gb, steps=steps,
                   strategies=tuple(strategies), warmup_steps=warmup, track_memory=track_memory,
                   consecutive=consecutive)
    out = []
    for r in run_comparison(spec, cluster):
        ratio = spread(t / r.predicted_step_s for t in r.step_times_s)
        prof = r.profile
        out.append(dict(model=name, strategy=r.strategy, global_batch=gb, predicted_step_s=r.predicted_step_s,
                        step_time_s=r.step_spread.as_dict(), ratio=ratio.as_dict(), plan_json=r.plan_json,
                        profile_json=r.profile_json,
                        gaps=[dict(key=g.key, measured_s=g.measured_s, predicted_s=g.predicted_s)
                              for g in (prof.gaps("phase") if prof else [])][:6],
                        phases=phase_breakdown(prof)))
        print(f"  {name:10s} {r.strategy:16s} measured {r.step_spread.median * 1e3:8.1f} ms  predicted "
              f"{r.predicted_step_s * 1e3:8.1f} ms  ratio {ratio.median:.3f} (IQR {ratio.q1:.3f}-{ratio.q3:.3f})",
              flush=True)
    return out


def phase_breakdown(prof) -> dict:
    """Measured (sleep folded, median over steps) against predicted seconds of each phase, summed over
    the ranks (``by_phase``) and per device type (``by_type``: {type: {phase: [measured, predicted]}});
    ``wait`` and ``other`` are idle time and stay out of ``by_type``."""
    by_phase: dict[str, list[float]] = {}
    by_type: dict[str, dict[str, list[float]]] = {}
    if prof is None:
        return dict(by_phase=by_phase, by_type=by_type)
    for info in prof.ranks:
        for g in prof.compare(info.rank):
            a = by_phase.setdefault(g.key, [0.0, 0.0])
            a[0] += g.measured_s
            a[1] += g.predicted_s
            if g.key not in ("wait", "other"):
                t = by_type.setdefault(info.device_type, {}).setdefault(g.key, [0.0, 0.0])
                t[0] += g.measured_s
                t[1] += g.predicted_s
    return dict(by_phase=by_phase, by_type=by_type)


def fit(rows: list[dict], cluster) -> dict:
    from autopar.cluster.emulation import emulation_time_scale
    from autopar.cost.calibrate import device_key, fit_machine_factors, samples
    from autopar.ir.plan import Plan
    from autopar.ir.profile import StepProfile

    scale = emulation_time_scale(len(cluster))
    keys = {r: device_key(d.spec, scale) for r, d in enumerate(cluster.devices)}
    data = [x for row in rows for x in samples(StepProfile.from_json(row["profile_json"]), keys,
                                                 Plan.from_json(row["plan_json"]), pooled=True)]
    return fit_machine_factors(data)


def _scatter(before: list[dict], after: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    allv = [r["predicted_step_s"] for r in before + after] + [r["step_time_s"]["median"] for r in before + after]
    lo, hi = min(allv) * 0.7, max(allv) * 1.4
    xs = [lo, hi]
    ax.plot(xs, xs, "k-", lw=0.8)
    for f, style in ((1.1, "k--"), (1.25, "k:")):
        ax.plot(xs, [x * f for x in xs], style, lw=0.6)
        ax.plot(xs, [x / f for x in xs], style, lw=0.6)
    for rows, marker, label in ((before, "o", "before calibration"), (after, "s", "after calibration")):
        for held in (False, True):
            pts = [r for r in rows if (r["model"] in THIRD_PARTY) == held]
            if pts:
                ax.scatter([r["predicted_step_s"] for r in pts], [r["step_time_s"]["median"] for r in pts],
                           marker=marker, facecolors="none" if rows is before else None,
                           edgecolors="C1" if held else "C0", c=None if rows is before else ("C1" if held else "C0"),
                           label=f"{label}, {'third-party' if held else 'zoo'} models", s=28)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted step time (s, cost model)")
    ax.set_ylabel("measured step time (s, emulated, median over steps)")
    ax.set_title("Prediction accuracy on the emulated demo cluster\n(dashed: +-10%, dotted: +-25%)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from autopar.cli.trainer import WARMUP_STEPS, order_text

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--calibrate-on", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=WARMUP_STEPS,
                    help="warm-up steps per strategy (autopar.cli.trainer.WARMUP_STEPS: the steady clock settles)")
    ap.add_argument("--track-memory", action="store_true", help="run with the emulated memory tracking on")
    ap.add_argument("--cache-dir", help="profile cache of this benchmark (default: a new temporary folder)")
    ap.add_argument("--name", default="accuracy")
    ap.add_argument("--consecutive", type=int, default=0,
                    help="steps a strategy runs before the next takes its turn (autopar.cli.trainer: 0, the default, "
                         "one strategy after the other as a job runs one plan; 1: interleaved step by step, which "
                         "starts every step with the other strategies' caches)")
    ap.add_argument("--aa", action="store_true",
                    help="run every model a second time before calibration, same cache and plans (an A/A run): "
                         "how far this machine's measured steps move between two runs of the same plan")
    ap.add_argument("--slowdown", type=float, default=1.0,
                    help="AUTOPAR_EMULATION_SLOWDOWN: every emulated device (and the cost model) this much slower, "
                         "so the ranks keep room on a machine shared with other jobs")
    args = ap.parse_args(argv)
    os.environ["AUTOPAR_EMULATION_SLOWDOWN"] = f"{args.slowdown:g}"      # the ranks inherit it
    from autopar.cluster.model import builtin
    from autopar.measure.cache import CALIBRATION_ENV, save_calibration

    os.environ["AUTOPAR_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="autopar-accuracy-")
    torch.set_num_threads(1)     # plan here with the one-thread block times the emulated ranks measure
    cluster = builtin("demo")
    load0 = os.getloadavg()[0]
    models = [m for m in args.models.split(",") if m]
    track = True if args.track_memory else False
    print(f"before calibration (cache {os.environ['AUTOPAR_CACHE_DIR']}):", flush=True)
    os.environ[CALIBRATION_ENV] = "off"
    before = [row for m in models for row in run_model(m, cluster, args.steps, args.warmup, track, args.consecutive)]
    repeat = ([row for m in models for row in run_model(m, cluster, args.steps, args.warmup, track, args.consecutive)]
              if args.aa else [])
    factors = fit([r for r in before if r["model"] == args.calibrate_on], cluster)
    save_calibration(factors)
    print("factors:", factors, flush=True)
    os.environ.pop(CALIBRATION_ENV)
    print("after calibration:", flush=True)
    after = [row for m in models if m != args.calibrate_on
             for row in run_model(m, cluster, args.steps, args.warmup, track, args.consecutive)]

    def table(rows):
        return md_table(["model", "strategy", "measured ms (median, IQR)", "predicted ms", "measured/predicted (IQR)"],
                        [[r["model"] + (" (third-party)" if r["model"] in THIRD_PARTY else ""), r["strategy"],
                          f"{r['step_time_s']['median'] * 1e3:.1f} ({r['step_time_s']['q1'] * 1e3:.1f}-"
                          f"{r['step_time_s']['q3'] * 1e3:.1f})", f"{r['predicted_step_s'] * 1e3:.1f}",
                          f"{r['ratio']['median']:.3f} ({r['ratio']['q1']:.3f}-{r['ratio']['q3']:.3f})"]
                         for r in rows])

    def phases(rows):
        coll = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier")

        def cell(d, keys):
            m = sum(d.get(k, [0.0, 0.0])[0] for k in keys)
            q = sum(d.get(k, [0.0, 0.0])[1] for k in keys)
            return "-" if m == 0 and q == 0 else f"{m * 1e3:.1f} / {q * 1e3:.1f}"

        def by_type(d):
            out = []
            for t, ph in d.items():
                m = sum(ph.get(k, [0.0, 0.0])[0] for k in ("forward", "backward", "compute"))
                q = sum(ph.get(k, [0.0, 0.0])[1] for k in ("forward", "backward", "compute"))
                out.append(f"{t} {m / q:.2f}" if q > 0 else f"{t} -")
            return ", ".join(out)

        return md_table(["model", "strategy", "forward ms", "backward ms", "optimizer ms", "collectives ms", "p2p ms",
                         "wait ms", "fwd+bwd measured/predicted by device type"],
                        [[r["model"], r["strategy"], cell(r["phases"]["by_phase"], ("forward", "compute")),
                          cell(r["phases"]["by_phase"], ("backward",)), cell(r["phases"]["by_phase"], ("optimizer",)),
                          cell(r["phases"]["by_phase"], coll), cell(r["phases"]["by_phase"], ("p2p",)),
                          cell(r["phases"]["by_phase"], ("wait",)), by_type(r["phases"]["by_type"])]
                         for r in rows])

    def aa_table(first, second):
        pairs = [(a, b) for a, b in zip(first, second) if a["plan_json"] == b["plan_json"]]
        return pairs, md_table(
            ["model", "strategy", "first run ms (median, IQR)", "second run ms (median, IQR)", "second / first",
             "measured/predicted first, second"],
            [[a["model"], a["strategy"],
              f"{a['step_time_s']['median'] * 1e3:.1f} ({a['step_time_s']['q1'] * 1e3:.1f}-{a['step_time_s']['q3'] * 1e3:.1f})",
              f"{b['step_time_s']['median'] * 1e3:.1f} ({b['step_time_s']['q1'] * 1e3:.1f}-{b['step_time_s']['q3'] * 1e3:.1f})",
              f"{b['step_time_s']['median'] / a['step_time_s']['median']:.3f}",
              f"{a['ratio']['median']:.3f}, {b['ratio']['median']:.3f}"] for a, b in pairs])

    def worst(rows):
        return max((abs(r["ratio"]["median"] - 1) for r in rows), default=float("nan"))

    def aa_section(second):
        pairs, text = aa_table(before, second)
        moved = [abs(b["step_time_s"]["median"] / a["step_time_s"]["median"] - 1) for a, b in pairs]
        return (f"## A/A: the same plans run again, before calibration\n\nEvery model's strategies run a second "
                f"time right after the first (same cache, tables and plans; {len(pairs)} pairs with the same plan). "
                f"A second run's median step within 10% of the first's: {sum(x <= 0.10 for x in moved)} of "
                f"{len(moved)}; within 5%: {sum(x <= 0.05 for x in moved)}; largest move "
                f"{max(moved, default=float('nan')):.1%}. No cost model can be shown closer to a run than "
                f"two runs are to each other.\n\n{text}\n\n")

    held = [r for r in before if r["model"] != args.calibrate_on]
    load1 = os.getloadavg()[0]

    def within(rows, tol):
        return f"{sum(abs(r['ratio']['median'] - 1) <= tol for r in rows)} of {len(rows)}"
    md = (f"# Prediction accuracy (emulated demo cluster: speeds 1 / 0.5 / 0.25)\n\n"
          f"Measured: emulated devices on this machine, {args.warmup} warm-up + {args.steps} measured steps per "
          f"strategy, {order_text(args.consecutive)}; memory tracking {'on' if track else 'off'}. Predicted: the cost "
          f"model. Ratio: median over steps of step time / predicted step time.\n\n"
          f"Worst |ratio - 1| before calibration: {worst(before):.1%} (all models), {worst(held):.1%} (models not "
          f"used to calibrate); after calibration on {args.calibrate_on}: {worst(after):.1%}. Within 25% before "
          f"calibration: {within(before, 0.25)}; within 10% after: {within(after, 0.10)} (15%: "
          f"{within(after, 0.15)}). Load average {load0:.1f} at the start, {load1:.1f} at the end (2 cores "
          f"shared with other jobs); emulation slowdown {args.slowdown:g}. Emulated links: measured on this machine "
          f"(docs/emulation.md).\n\n"
          f"## Before calibration\n\n{table(before)}\n\n"
          + (aa_section(repeat) if repeat else "")
          + f"## Calibration factors (fitted on {args.calibrate_on})\n\n"
          + md_table(["device type", "factors"], [[k, ", ".join(f"{t} {v:.3f}" if t != "call" else
                                                                 f"call +{v * 1e3:.2f} ms" for t, v in f.items())]
                                                  for k, f in factors.items()])
          + f"\n\n## After calibration (models not used to calibrate)\n\n{table(after)}\n\n"
          f"## Per phase (measured / predicted, per step, summed over ranks)\n\n"
          f"Measured: the phase's seconds with the emulation sleep folded into the compute phases in proportion "
          f"to their wall time (``autopar.ir.profile``), median over steps; the split between forward and "
          f"backward follows wall time, their sum is what the steady clock charges. Forward holds the loss. "
          f"Predicted: ``autopar.cost.step.predicted_phases``.\n\n### Before calibration\n\n{phases(before)}\n\n"
          f"### After calibration\n\n{phases(after)}\n\n"
          f"Command: `python benchmarks/bench_accuracy.py --models {','.join(models)} --steps {args.steps} "
          f"--calibrate-on {args.calibrate_on}{' --track-memory' if track else ''}{' --aa' if args.aa else ''} "
          f"--slowdown {args.slowdown:g} "
          f"--consecutive {args.consecutive} --name {args.name}`\n")
    strip = [{k: v for k, v in r.items() if k not in ("plan_json", "profile_json")} for r in before + after + repeat]
    write_results(args.name, dict(before=strip[:len(before)], after=strip[len(before):len(before) + len(after)],
                                  aa=strip[len(before) + len(after):], factors=factors,
                                  calibrate_on=args.calibrate_on, steps=args.steps, warmup=args.warmup,
                                  consecutive=args.consecutive,
                                  track_memory=track, load=[load0, load1]), md)
    _scatter(before, after, RESULTS / f"{args.name}.png")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
