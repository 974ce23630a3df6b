"""Published GPU training runs, each pinned exactly as its source states it, with autopar's prediction
beside the published figure.

Every run names its source (paper and table, or file) in ``source``. ``pin`` holds what the source
states of the layout (TP, PP, DP, ZeRO, schedule, recomputation, sequence parallelism); what it does not
state is left to the planner and said in ``notes``. The model is the zoo's family at the published
shape, built on ``meta`` (no weights). ``published`` holds the source's figures as it gives them:

- ``step_s``: seconds per iteration;
- ``tokens_per_s_per_gpu``: tokens per second per GPU (step = global batch x sequence / (this x GPUs));
- ``tflops_per_gpu`` with ``flops_formula="megatron"``: Megatron's count with full recomputation,
  96 B s l h^2 (1 + s / 6h + V / 16 l h) per iteration (Narayanan et al. 2021, Section 5.1), so the step
  is that count over (this x GPUs);
- ``mfu``: model FLOPs utilization as the source reports it.

    python benchmarks/published.py [--runs NAME,NAME] [--unpinned] [--name published]
    autopar bench published [...]                       # the same

Prints one table: each run's pinned layout, predicted step, TFLOP/s per GPU and MFU beside the
published ones (predicted / published step where the source gives one). ``--unpinned`` also plans each
run without the pin (slow at 8,192 devices and more). Writes ``benchmarks/results/<name>.json`` and
``.md``. Every figure of autopar's is a prediction (``meta`` models, roofline time tables for the GPU
types); nothing runs on a GPU here.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

SC21 = "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, SC'21 (arXiv:2104.04473), Table 1"
KORTHIKANTI = ("Korthikanti et al., Reducing Activation Recomputation in Large Transformer Models, MLSys 2023 "
               "(arXiv:2205.05198), Tables 3 and 5")
LLAMA3 = "Llama Team, The Llama 3 Herd of Models (arXiv:2407.21783), Table 4"
NEMOTRON = "NVIDIA, Nemotron-4 340B Technical Report (arXiv:2406.11704), Table 2"
TITAN = "pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md"


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    family: str                   # zoo family: "gpt" or "llama"
    shape: dict                   # the family's config fields at the published size
    device: str                   # cluster preset
    gpus: int
    global_batch: int             # sequences per iteration
    pin: dict                     # autopar.Pin fields as published
    published: dict               # the source's figures (see the module docstring)
    precision: str = "bf16"
    notes: tuple[str, ...] = field(default=())
    device_changes: tuple = ()    # (DeviceSpec field, value) pairs: the source's GPU where it is not the preset

    @property
    def seq_len(self) -> int:
        return int(self.shape["seq_len"])

    def cluster(self, count: int | None = None):
        """The run's cluster (``count`` devices of its GPU instead: a node to prepare on), 8 to a node."""
        import autopar
        from autopar.cluster.devices import preset

        spec = dataclasses.replace(preset(self.device), **dict(self.device_changes))
        return autopar.Cluster.homogeneous(spec, count=count or self.gpus, per_node=8)


def _gpt(layers: int, hidden: int, heads: int) -> dict:
    """Megatron's GPT of SC'21 and Korthikanti et al.: vocabulary 51,200, sequence 2,048, tied embedding."""
    return dict(num_layers=layers, hidden_size=hidden, num_heads=heads, vocab_size=51200, seq_len=2048,
                tie_embeddings=True)


_SC21_TABLE = [   # params (B), heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU
    ("1.7b", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6b", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5b", 32, 4096, 36, 4, 1, 128, 512, 142), ("18b", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39b", 64, 8192, 48, 8, 2, 512, 1536, 138), ("76b", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("146b", 96, 12288, 80, 8, 8, 1536, 2304, 148), ("310b", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("530b", 128, 20480, 105, 8, 35, 2520, 2520, 163), ("1t", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
_SC21 = [PublishedRun(
    name=f"megatron-sc21-gpt-{size}", source=SC21, family="gpt", shape=_gpt(layers, hidden, heads),
    device="A100-80GB", gpus=gpus, global_batch=batch, pin=dict(tp=tp, pp=pp, dp=gpus // (tp * pp)),
    published=dict(tflops_per_gpu=tf, flops_formula="megatron"),
    notes=("the table does not state the schedule, micro-batch or recomputation: the planner picks them",
           "fp16 mixed precision, priced as bf16 (the same A100 peak)"))
    for size, heads, hidden, layers, tp, pp, gpus, batch, tf in _SC21_TABLE]

_KORTHIKANTI_TABLE = [   # name, heads, hidden, layers, TP, PP, GPUs, batch, step s full recompute, step s SP + selective
    ("22b", 64, 6144, 48, 8, 1, 8, 4, 1.42, 1.10), ("175b", 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75),
    ("530b", 128, 20480, 105, 8, 35, 280, 280, 49.05, 37.83), ("1t", 160, 25600, 128, 8, 64, 512, 512, 94.42, 71.49),
]
_KORTHIKANTI = [r for name, heads, hidden, layers, tp, pp, gpus, batch, full_s, sel_s in _KORTHIKANTI_TABLE for r in (
    PublishedRun(name=f"korthikanti-{name}-full-recompute", source=KORTHIKANTI, family="gpt",
                 shape=_gpt(layers, hidden, heads), device="A100-80GB", gpus=gpus, global_batch=batch,
                 pin=dict(tp=tp, pp=pp, dp=1, recompute=True, sequence_parallel=False),
                 published=dict(step_s=full_s), notes=("Megatron's baseline: every layer recomputed",)),
    PublishedRun(name=f"korthikanti-{name}-sp-selective", source=KORTHIKANTI, family="gpt",
                 shape=_gpt(layers, hidden, heads), device="A100-80GB", gpus=gpus, global_batch=batch,
                 pin=dict(tp=tp, pp=pp, dp=1, recompute="selective", sequence_parallel=True),
                 published=dict(step_s=sel_s),
                 notes=("sequence parallelism and selective recomputation (attention cores), the paper's method",)),
)]

_LLAMA3_405B = dict(num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8, ffn_hidden_size=53248,
                    vocab_size=128256, seq_len=8192)
_LLAMA3 = [
    PublishedRun(name="llama3-405b-8192-h100", source=LLAMA3, family="llama", shape=_LLAMA3_405B,
                 device="H100-80GB", gpus=8192, global_batch=2048,
                 pin=dict(tp=8, pp=16, dp=64, schedule="interleaved-1f1b"), published=dict(mfu=0.43, tflops_per_gpu=430),
                 notes=("context parallelism 1; batch 32 sequences per data-parallel rank",
                        "interleaved with a tuned number of stages the table does not give: the planner picks it")),
    PublishedRun(name="llama3-405b-16384-h100", source=LLAMA3, family="llama", shape=_LLAMA3_405B,
                 device="H100-80GB", gpus=16384, global_batch=2048,
                 pin=dict(tp=8, pp=16, dp=128, schedule="interleaved-1f1b"), published=dict(mfu=0.41, tflops_per_gpu=400),
                 notes=("context parallelism 1; batch 16 sequences per data-parallel rank",)),
]

# Nemotron-4 340B: squared-ReLU MLP of 4 x 18,432 (two matrices); the zoo's SwiGLU (three) at 49,152 has
# the same parameters and FLOPs.
_NEMOTRON_340B = dict(num_layers=96, hidden_size=18432, num_heads=96, num_kv_heads=8, ffn_hidden_size=49152,
                      vocab_size=256000, seq_len=4096)
_NEMOTRON = [PublishedRun(
    name=f"nemotron4-340b-{gpus}-h100", source=NEMOTRON, family="llama", shape=_NEMOTRON_340B, device="H100-80GB",
    gpus=gpus, global_batch=batch, pin=dict(tp=8, pp=12, dp=dp, schedule="interleaved-1f1b"),
    published=dict(step_s=step, mfu=mfu),
    notes=("interleaved pipeline (virtual stages not given: the planner picks them)",
           "squared-ReLU MLP priced as the SwiGLU of equal size"))
    for gpus, dp, batch, step, mfu in ((1536, 16, 768, 10.3, 0.424), (3072, 32, 1536, 10.3, 0.423),
                                       (6144, 64, 2304, 8.0, 0.410))]

_LLAMA31_8B = dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
                   vocab_size=128256, seq_len=8192)
_LLAMA31_70B = dict(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672,
                    vocab_size=128256, seq_len=8192)
_LLAMA31_405B = dict(_LLAMA3_405B)
_TITAN_H100 = ("H100 of 96 GB HBM2e (2.4 TB/s) at 500 W (Grand Teton): the H100-80GB preset with that memory; "
               "its peak, between SXM's and NVL's, is priced at SXM's",)
_GRAND_TETON = (("name", "H100-96GB"), ("memory_bytes", 96 * 2**30), ("mem_bandwidth_Bps", 2.4e12))
_TITAN_PP_FSDP = ("FSDP under pipelining keeps each stage gathered for the step (torchtitan's default "
                  "reshard_after_forward=False with PP), as a pipeline stage's ZeRO-3 runs")
_TITAN_SAC = "torchtitan's per-op selective activation checkpointing is not a mode autopar plans: recompute left to the planner"
_TITAN = [
    PublishedRun(name="torchtitan-llama3-8b-fsdp-8", source=f"{TITAN}, Table 1", family="llama", shape=_LLAMA31_8B,
                 device="H100-80GB", gpus=8, global_batch=16, pin=dict(dp=8, zero_stage=3),
                 published=dict(tokens_per_s_per_gpu=5762), device_changes=_GRAND_TETON,
                 notes=("FSDP without torch.compile or Float8", _TITAN_SAC, *_TITAN_H100)),
    PublishedRun(name="torchtitan-llama3-8b-fsdp-128", source=f"{TITAN}, Table 3", family="llama", shape=_LLAMA31_8B,
                 device="H100-80GB", gpus=128, global_batch=256, pin=dict(dp=128, zero_stage=3),
                 published=dict(tokens_per_s_per_gpu=5605), device_changes=_GRAND_TETON,
                 notes=("FSDP without torch.compile or Float8", _TITAN_SAC, *_TITAN_H100)),
    PublishedRun(name="torchtitan-llama3-70b-fsdp32-tp8", source=f"{TITAN}, Table 4", family="llama",
                 shape=_LLAMA31_70B, device="H100-80GB", gpus=256, global_batch=512,
                 pin=dict(tp=8, dp=32, zero_stage=3, recompute=True), published=dict(tokens_per_s_per_gpu=829),
                 device_changes=_GRAND_TETON,
                 notes=("torch.compile and Float8 linears: priced in bf16",
                        "FSDP block by block inside the TP mesh with full activation checkpointing: ZeRO-3 by "
                        "block in one recomputing TP stage", *_TITAN_H100)),
    PublishedRun(name="torchtitan-llama3-405b-3d-1f1b", source=f"{TITAN}, Table 5", family="llama",
                 shape=_LLAMA31_405B, device="H100-80GB", gpus=512, global_batch=256,
                 pin=dict(tp=8, pp=8, dp=8, zero_stage=3, recompute=True, schedule="1f1b"),
                 published=dict(tokens_per_s_per_gpu=100), device_changes=_GRAND_TETON,
                 notes=("torch.compile, Float8 linears and async TP: priced in bf16", _TITAN_PP_FSDP, *_TITAN_H100)),
    PublishedRun(name="torchtitan-llama3-405b-3d-interleaved", source=f"{TITAN}, Table 5", family="llama",
                 shape=_LLAMA31_405B, device="H100-80GB", gpus=512, global_batch=256,
                 pin=dict(tp=8, pp=8, dp=8, zero_stage=3, recompute=True, schedule="interleaved-1f1b"),
                 published=dict(tokens_per_s_per_gpu=128), device_changes=_GRAND_TETON,
                 notes=("torch.compile, Float8 linears and async TP: priced in bf16",
                        "chunks per rank not given: the planner picks them", _TITAN_PP_FSDP, *_TITAN_H100)),
]

RUNS: tuple[PublishedRun, ...] = tuple(_SC21 + _KORTHIKANTI + _LLAMA3 + _NEMOTRON + _TITAN)

# Runs autopar cannot state yet, and why (the bench prints the planner's own refusal for each): none now.
KNOWN_GAPS: dict[str, str] = {}


# -- figures ------------------------------------------------------------------------------------------
def megatron_flops(run: PublishedRun) -> float:
    """Megatron's FLOPs per iteration with full recomputation (SC'21 Section 5.1)."""
    s, l, h, V = run.seq_len, run.shape["num_layers"], run.shape["hidden_size"], run.shape["vocab_size"]
    return 96.0 * run.global_batch * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def published_step_s(run: PublishedRun) -> float | None:
    """The iteration seconds the source gives or implies (see the module docstring); None: it gives none."""
    p = run.published
    if "step_s" in p:
        return float(p["step_s"])
    if "tokens_per_s_per_gpu" in p:
        return run.global_batch * run.seq_len / (p["tokens_per_s_per_gpu"] * run.gpus)
    if p.get("flops_formula") == "megatron":
        return megatron_flops(run) / (p["tflops_per_gpu"] * 1e12 * run.gpus)
    return None


# -- planning -----------------------------------------------------------------------------------------
def _case(run: PublishedRun):
    from autopar.models import build

    preset = "gpt-tiny" if run.family == "gpt" else "llama-tiny"
    return build(preset, device="meta", **run.shape)


def plan_run(run: PublishedRun, *, pinned: bool = True, prepared: dict | None = None):
    """(plan, seconds to plan) of ``run`` on its cluster, pinned as published (``pinned=False``: the
    planner's own layout). ``prepared``: a memo of analysed models and their cost tables by shape,
    device type and precision, shared between runs (``autopar.api.prepare``, once per model)."""
    import autopar
    from autopar.api import prepare

    memo = prepared if prepared is not None else {}
    key = (run.family, tuple(sorted(run.shape.items())), run.device, run.device_changes, run.precision)
    if key not in memo:
        case = _case(run)
        memo[key] = (case, prepare(case.model, run.cluster(8), case.example_inputs, precision=run.precision))
    case, ready = memo[key]
    cluster = run.cluster()
    t0 = time.perf_counter()
    plan = autopar.plan(case.model, cluster, case.example_inputs, run.global_batch, case.loss_fn, prepared=ready,
                        precision=run.precision, pin=autopar.Pin(**run.pin) if pinned else None)
    return plan, time.perf_counter() - t0


def _row(run: PublishedRun, plan, seconds: float, unpinned=None) -> dict:
    pub_s = published_step_s(run)
    step = plan.predicted.step_time_s
    row: dict[str, Any] = dict(
        run=run.name, gpus=run.gpus, device=run.device, pin=dict(run.pin), source=run.source,
        predicted_step_s=step, published_step_s=pub_s,
        predicted_over_published=(step / pub_s) if pub_s else None,
        predicted_mfu=plan.predicted.mfu, published_mfu=run.published.get("mfu"),
        published_tflops_per_gpu=run.published.get("tflops_per_gpu"),
        predicted_tokens_per_s_per_gpu=run.global_batch * run.seq_len / step / run.gpus,
        schedule=plan.schedule, virtual_stages=plan.virtual_stages, zero_stage=plan.zero_stage,
        num_micro_batches=plan.num_micro_batches, plan_s=seconds, notes=list(run.notes))
    if unpinned is not None:
        row.update(unpinned_step_s=unpinned.predicted.step_time_s, unpinned_strategy=unpinned.strategy)
    return row


def _fmt(x, spec=".3g", none="-") -> str:
    return none if x is None else format(x, spec)


def markdown(rows: list[dict], command: str, refused: list[tuple[str, str]] = ()) -> str:
    from _common import md_table

    head = ("# Published runs pinned as published: autopar's prediction beside the published figure\n\n"
            f"`{command}`. Predicted: `meta` models, roofline time tables for the GPU types (nothing ran on "
            "a GPU). Published step: as the source gives it, or derived from its tokens per second or its "
            "Megatron TFLOP/s (see `benchmarks/published.py`).\n\n")
    unpinned = any("unpinned_step_s" in r for r in rows)
    extra = ["unpinned s", "unpinned / pinned"] if unpinned else []
    table = md_table(
        ["run", "GPUs", "pin", "schedule (V)", "predicted s", "published s", "pred / pub", "pred MFU", "pub MFU",
         *extra],
        [[r["run"], r["gpus"], ", ".join(f"{k}={v}" for k, v in r["pin"].items()),
          f"{r['schedule']} ({r['virtual_stages']})", _fmt(r["predicted_step_s"], ".4g"),
          _fmt(r["published_step_s"], ".4g"), _fmt(r["predicted_over_published"], ".2f"),
          _fmt(r["predicted_mfu"], ".1%"), _fmt(r["published_mfu"], ".1%"),
          *([_fmt(r.get("unpinned_step_s"), ".4g"),
             _fmt(r["unpinned_step_s"] / r["predicted_step_s"] if "unpinned_step_s" in r else None, ".2f")]
            if unpinned else [])] for r in rows])
    gaps = "".join(f"- `{name}`: {KNOWN_GAPS.get(name, 'not a known gap')}. The planner: {why}\n"
                   for name, why in refused)
    return head + table + (f"\n\nRefused ({len(refused)}):\n\n{gaps}" if refused else "") + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="autopar bench published",
                                 description="published GPU training runs pinned as published, predicted beside "
                                             "the published figures")
    ap.add_argument("--runs", default=None, help="comma-separated run names (default: all); --list shows them")
    ap.add_argument("--list", action="store_true", help="list the runs and their sources, then exit")
    ap.add_argument("--unpinned", action="store_true", help="also plan each run without its pin (slow at scale)")
    ap.add_argument("--name", default="published", help="result file name under benchmarks/results/")
    args = ap.parse_args(argv)
    if args.list:
        for r in RUNS:
            print(f"{r.name:42s} {r.gpus:6d} x {r.device:10s} {r.source}")
        return 0
    runs = RUNS if args.runs is None else tuple(r for r in RUNS if r.name in set(args.runs.split(",")))
    if args.runs is not None and len(runs) != len(set(args.runs.split(","))):
        known = {r.name for r in RUNS}
        print(f"--runs: unknown {sorted(set(args.runs.split(',')) - known)}; --list shows the runs", file=sys.stderr)
        return 2
    from autopar.errors import AutoparError

    rows, memo, failed = [], {}, []
    for i, run in enumerate(runs, 1):
        try:
            plan, secs = plan_run(run, prepared=memo)
            unpinned = plan_run(run, pinned=False, prepared=memo)[0] if args.unpinned else None
        except AutoparError as e:
            failed.append((run.name, str(e)))
            print(f"[{i}/{len(runs)}] {run.name}: REFUSED: {e}", flush=True)
            continue
        row = _row(run, plan, secs, unpinned)
        rows.append(row)
        print(f"[{i}/{len(runs)}] {run.name}: predicted {row['predicted_step_s']:.4g} s, published "
              f"{_fmt(row['published_step_s'], '.4g')} s, ratio {_fmt(row['predicted_over_published'], '.2f')} "
              f"({secs:.1f} s to plan)", flush=True)
    from _common import write_results

    command = "python benchmarks/published.py" + (f" --runs {args.runs}" if args.runs else "") + \
        (" --unpinned" if args.unpinned else "")
    write_results(args.name, {"rows": rows, "refused": failed}, markdown(rows, command, failed))
    unexpected = [name for name, _ in failed if name not in KNOWN_GAPS]
    if unexpected:
        print(f"refused, not a known gap: {', '.join(unexpected)}", file=sys.stderr)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
