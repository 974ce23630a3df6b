"""Measured layouts on one cluster, each priced exactly as it ran: does the cost model rank them as they
measure?

For every cluster of ``layout_runs.CLUSTERS`` and every published layout on it, the layout is built as
plain plan data, stage by stage, as the source's engine laid it out (DeepSpeed's rank order, the
published layer boundaries, TP groups, data-parallel members, micro-batch size; 1F1B, no ZeRO) and
priced by autopar's cost model: the simulated step (``autopar.cost.pipeline.plan_timeline``, the
function the planner predicts with) and the peak memory of every rank
(``autopar.cost.memory.stage_memory_bytes``). Nothing is searched: the planner's only part is the price.

    python benchmarks/published_layouts.py [--clusters NAME,NAME] [--name published-layouts]
    autopar bench published_layouts [...]                      # the same

Prints and writes one table per cluster (predicted beside measured, and the source's own prediction),
then per cluster: Spearman's and Kendall's rank correlation between predicted and measured step over
the layouts that ran, what the layout ranked first measures over the best measured, and predicted /
measured. Writes ``benchmarks/results/<name>.json``, ``.md`` and ``.png`` (predicted against
measured). Every figure of autopar's is a prediction (``meta`` models, roofline time tables for the GPU
types); nothing runs on a GPU here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from layout_runs import CLUSTERS, LayoutCluster, LayoutRun  # noqa: E402

# DeepSpeed's 30 layers -> the zoo GPT's pipeline blocks (embed, layers.0-23, head): the transposes and
# the cast are free, the final norm belongs to the head block.
_BLOCK_OF = {0: 0, **{i: i - 1 for i in range(2, 26)}, 27: 25, 28: 25}


def prepared(lc: LayoutCluster):
    """(cluster, model costs) of one layout cluster: the zoo GPT at its shape on ``meta``, analysed."""
    import autopar
    from autopar.api import prepare
    from autopar.models import build

    case = build("gpt-tiny", device="meta", **lc.shape)
    cluster = autopar.Cluster.from_dict(lc.cluster)
    return cluster, prepare(case.model, cluster, case.example_inputs, precision=lc.precision).costs


def layout_stages(run: LayoutRun, global_batch: int, num_heads: int, cluster=None):
    """The stages of ``run`` as its engine laid them out, or a string saying why autopar cannot state it.
    Rank of (stage s, data member d, TP rank m) = (s * dp + d) * tp + m (DeepSpeed's topology), or where
    the run names its nodes, each member the TP group of its node's devices (``cluster`` needed)."""
    from autopar.ir.plan import Stage

    parts = []   # (first block, block stop, members) per stage
    if run.nodes is not None:
        start = 0
        for members, k in zip(run.nodes, run.blocks):
            parts.append((start, start + k, tuple(cluster.ranks_of_node(n) for n in members)))
            start += k
    else:
        for s, (a, b) in enumerate(zip(run.boundaries, run.boundaries[1:])):
            blocks = sorted({_BLOCK_OF[i] for i in range(a, b) if i in _BLOCK_OF})
            if not blocks or (parts and blocks[0] < parts[-1][1]):
                return f"stage {s} (DeepSpeed layers {a}-{b - 1}) holds no block of its own"
            parts.append((blocks[0], blocks[-1] + 1, tuple(tuple((s * run.dp + d) * run.tp + m for m in range(run.tp))
                                                             for d in range(run.dp))))
    micro = global_batch // (run.dp * run.micro_batch)
    return tuple(Stage(block_start=a, block_stop=b, groups=groups,
                       micro_batches=tuple((run.micro_batch,) * micro for _ in groups),
                       tp_shares=tuple((num_heads // len(g),) * len(g) for g in groups) if run.tp > 1 else ())
                 for a, b, groups in parts)


def price(run: LayoutRun, lc: LayoutCluster, cluster, costs) -> dict:
    """The layout's predicted step, whether it fits, and its largest rank's peak (GiB)."""
    from autopar.cost.memory import fits_memory, stage_memory_bytes
    from autopar.cost.pipeline import plan_timeline
    from autopar.ir.plan import Plan, Predicted

    stages = layout_stages(run, lc.global_batch, lc.shape["num_heads"], cluster)
    if isinstance(stages, str):
        return dict(predicted_s=None, fits=None, peak_gib=None, why=stages)
    memory = stage_memory_bytes(costs, stages, "1f1b", 0)
    plan = Plan(strategy="auto", global_batch_size=lc.global_batch, zero_stage=0, schedule="1f1b",
                stages=stages, predicted=Predicted(step_time_s=1.0, samples_per_s=1.0, memory_bytes=memory,
                                                   breakdown={}),
                block_names=tuple(costs.block_names))
    timeline, step = plan_timeline(plan, costs, cluster)
    return dict(predicted_s=step, fits=fits_memory(cluster, memory), pipeline_s=timeline.step_time_s,
                peak_gib=max(memory.values()) / 2**30, why=None)


def ranking(rows: list[dict], key: str) -> dict:
    """How ``key``'s figures rank the layouts that ran: Spearman and Kendall against measured, and the
    measured step of the layout ``key`` ranks first over the best measured (a layout ranked first that
    did not run counts as such: ``pick_ran`` False)."""
    from scipy.stats import kendalltau, spearmanr

    ran = [r for r in rows if r["measured_s"] is not None and r[key] is not None]
    if not ran:
        return None
    pred, meas = [r[key] for r in ran], [r["measured_s"] for r in ran]
    candidates = [r for r in rows if r[key] is not None and r.get("fits", True) is not False] \
        if key == "predicted_s" else [r for r in rows if r[key] is not None]
    pick = min(candidates, key=lambda r: r[key])
    best = min(meas)
    ratios = [p / m for p, m in zip(pred, meas)]
    return dict(layouts=len(ran), spearman=float(spearmanr(pred, meas)[0]), kendall=float(kendalltau(pred, meas)[0]),
                pick=pick["layout"], pick_ran=pick["measured_s"] is not None,
                pick_over_best=(pick["measured_s"] / best) if pick["measured_s"] is not None else None,
                ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))


def layout_name(run: LayoutRun) -> str:
    from layout_runs import layers_per_stage

    split = "/".join(map(str, layers_per_stage(run))) if run.pp > 1 else "-"
    return f"mb{run.micro_batch} tp{run.tp} dp{run.dp} pp{run.pp} [{split}]"


def run_cluster(lc: LayoutCluster) -> tuple[list[dict], dict]:
    cluster, costs = prepared(lc)
    rows = []
    for run in lc.runs:
        rows.append(dict(layout=layout_name(run), micro_batch=run.micro_batch, tp=run.tp, dp=run.dp, pp=run.pp,
                         boundaries=list(run.boundaries) if run.boundaries else None,
                         nodes=[list(m) for m in run.nodes] if run.nodes else None, measured_s=run.measured_s,
                         source_predicted_s=run.source_predicted_s,
                         measured_peak_gib=run.measured_peak_bytes / 2**30 if run.measured_peak_bytes else None,
                         **price(run, lc, cluster, costs)))
    stats = dict(autopar=ranking(rows, "predicted_s"), source=ranking(rows, "source_predicted_s"))
    ooms = [r for r in rows if r["measured_s"] is None]
    stats["did_not_run"] = len(ooms)
    stats["did_not_run_predicted_to_fit"] = sum(1 for r in ooms if r["fits"])
    stats["ran_predicted_not_to_fit"] = sum(1 for r in rows if r["measured_s"] is not None and r["fits"] is False)
    return rows, stats


def _f(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def markdown(results: dict, command: str) -> str:
    from _common import md_table

    out = ["# Published layouts priced as they ran: predicted beside measured, and the ranking\n",
           f"`{command}`. Predicted: autopar's cost model on `meta` models with roofline time tables for the "
           "GPU types (nothing ran on a GPU here); each layout built stage by stage as it ran and priced "
           "(`benchmarks/published_layouts.py`). Measured and the source's prediction: as published.\n"]
    for name, res in results.items():
        lc = next(c for c in CLUSTERS if c.name == name)
        a, s = res["stats"]["autopar"], res["stats"]["source"]
        out.append(f"## {name}\n\nSource: {lc.source}. " + " ".join(f"{n}." for n in lc.notes)
                   + "\n")
        out.append(md_table(
            ["ranking", "layouts", "Spearman", "Kendall", "ranked first", "its measured / best",
             "predicted / measured (median, range)"],
            [[who, x["layouts"], f"{x['spearman']:.2f}", f"{x['kendall']:.2f}", x["pick"],
              _f(x["pick_over_best"], ".2f") if x["pick_ran"] else "did not run",
              f"{x['ratio_median']:.2f} ({x['ratio_min']:.2f}-{x['ratio_max']:.2f})"]
             for who, x in (("autopar", a), ("the source's model", s)) if x is not None]))
        st = res["stats"]
        out.append(f"\nDid not run (out of memory): {st['did_not_run']}, of which autopar predicts "
                   f"{st['did_not_run_predicted_to_fit']} to fit; ran but predicted not to fit: "
                   f"{st['ran_predicted_not_to_fit']}.\n")
        rows = sorted(res["rows"], key=lambda r: (r["measured_s"] is None, r["measured_s"] or 0))
        out.append(md_table(
            ["layout (layers per stage)", "measured s", "predicted s", "pred / meas", "fits (peak GiB)",
             "measured peak GiB", "source's s"],
            [[r["layout"], _f(r["measured_s"]), _f(r["predicted_s"]),
              _f(r["predicted_s"] / r["measured_s"] if r["measured_s"] and r["predicted_s"] else None, ".2f"),
              r["why"] or f"{'yes' if r['fits'] else 'no'} ({r['peak_gib']:.1f})",
              _f(r["measured_peak_gib"], ".1f"), _f(r["source_predicted_s"])]
             for r in rows]) + "\n")
    return "\n".join(out)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 5), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items()):
        ran = [r for r in res["rows"] if r["measured_s"] is not None and r["predicted_s"] is not None]
        m = [r["measured_s"] for r in ran]
        ax.scatter(m, [r["predicted_s"] for r in ran], label="autopar", s=18)
        if all(r["source_predicted_s"] is not None for r in ran):
            ax.scatter(m, [r["source_predicted_s"] for r in ran], label="the source's model", s=18, marker="x")
        lo, hi = min(m + [r["predicted_s"] for r in ran]) * 0.8, max(m) * 1.6
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="measured step (s)", ylabel="predicted step (s)",
               title=f"{name}: Spearman {res['stats']['autopar']['spearman']:.2f}")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="autopar bench published_layouts",
                                 description="published measured layouts priced as they ran: predicted beside "
                                             "measured, and the rank correlation per cluster")
    ap.add_argument("--clusters", default=None, help="comma-separated cluster names (default: all): "
                                                      + ", ".join(c.name for c in CLUSTERS))
    ap.add_argument("--name", default="published-layouts", help="result file name under benchmarks/results/")
    args = ap.parse_args(argv)
    names = [c.name for c in CLUSTERS] if args.clusters is None else args.clusters.split(",")
    unknown = set(names) - {c.name for c in CLUSTERS}
    if unknown:
        print(f"--clusters: unknown {sorted(unknown)}; known: {[c.name for c in CLUSTERS]}", file=sys.stderr)
        return 2
    results = {}
    for lc in (c for c in CLUSTERS if c.name in names):
        rows, stats = run_cluster(lc)
        results[lc.name] = dict(rows=rows, stats=stats)
        a = stats["autopar"]
        src = f" (the source's model {stats['source']['spearman']:.2f})" if stats["source"] else ""
        print(f"{lc.name}: {a['layouts']} layouts ran; Spearman {a['spearman']:.2f}{src}; ranked first: {a['pick']}, measures "
              f"{_f(a['pick_over_best'], '.2f')} x the best; predicted / measured {a['ratio_median']:.2f} "
              f"({a['ratio_min']:.2f}-{a['ratio_max']:.2f})", flush=True)
    from _common import RESULTS, write_results

    command = "python benchmarks/published_layouts.py" + (f" --clusters {args.clusters}" if args.clusters else "")
    write_results(args.name, {"clusters": results}, markdown(results, command))
    plot(results, RESULTS / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
