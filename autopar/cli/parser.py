"""The ``autopar`` command line: its parser, one sub-parser per command (``autopar.cli.main`` runs them)."""

from __future__ import annotations

import argparse

__all__ = ["build_parser"]

_DESCRIPTION = """\
autopar: plan and run training of a PyTorch model over a heterogeneous cluster.

  autopar demo                                   plan + train a small GPT on an emulated 3-device cluster
  autopar analyze --model gpt2-small             per-block parameters, FLOPs, memory, time per device type
  autopar plan --model llama-7b --cluster benchmarks/clusters/mixed-3.yaml --global-batch 256
  autopar train --model gpt-tiny --cluster demo --global-batch 48 --steps 5
  autopar check --model gpt-tiny --cluster demo --global-batch 48   exact? autopar vs the model's own rounding
  autopar models                                 the model zoo
  autopar tune                                   Triton kernel tuning runs (needs a GPU)

MODEL is a zoo name (autopar models) or package.module:factory. CLUSTER is a YAML file or a built-in
name (demo). On a machine without GPUs, devices marked `emulate: cpu` are CPU processes slowed to their
speed: figures from such runs are emulated, and planner figures are predictions of the cost model.
"""


def _plan_args(q, train=False) -> None:
    from autopar.config import STRATEGIES, ZERO_STAGES

    q.add_argument("--model", required=not train, help="zoo name or package.module:factory")
    q.add_argument("--cluster", required=not train, help="cluster YAML file or built-in name (demo)")
    q.add_argument("--global-batch", type=int, required=not train, help="samples per optimizer step")
    q.add_argument("--strategy", default="auto", choices=list(STRATEGIES))
    q.add_argument("--zero", default="auto", choices=["auto", *map(str, ZERO_STAGES)], help="ZeRO stage")
    q.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True,
                   help="let pipeline stages and data parallelism recompute activations in backward "
                        "where that is faster or keeping them does not fit (one more forward; on by "
                        "default, --no-recompute keeps every activation)")
    q.add_argument("--json", metavar="OUT", help="write JSON to OUT ('-' for stdout)")


def _add_plan(sub) -> None:
    from autopar.config import SCHEDULES

    q = sub.add_parser("plan", help="plan a model on a cluster and show the predicted throughput")
    _plan_args(q)
    q.add_argument("--schedule", default="auto", choices=list(SCHEDULES))
    q.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"],
                   help="price the memory of autocast at this compute precision (fp32 weights and optimizer "
                        "state; default: the device rule, bf16 bytes on an all-GPU cluster, fp32 otherwise)")
    q.add_argument("--pp-layers", help="pin blocks per pipeline stage, e.g. 8,4")
    q.add_argument("--pin", help="what-if: fix some dimensions and search the rest, e.g. tp=8,pp=8,recompute=1 "
                                 "(tp, pp, dp, num_micro_batches, recompute, zero_stage, schedule, virtual_stages, "
                                 "sequence_parallel; "
                                 "tp=TYPE:D/TYPE:D per device type)")
    q.add_argument("--seq-len", type=int, metavar="T",
                   help="tokens per sample of a language model (the zoo's LMs, hf:PATH, causal LMs; default: the "
                        "model's own example), at most its position table")
    q.add_argument("--example-batch", type=int, metavar="N",
                   help="capture and analyse the model with an example of N rows (any N >= 1; default: the "
                        "model's own example); the plan's batch sizes do not depend on it")
    q.add_argument("--explain", action="store_true",
                   help="per stage: compute, communication, bubble, optimizer and memory of the prediction")
    q.add_argument("--timeline", metavar="OUT.png", help="write the simulated per-rank Gantt chart")


def _add_warmup(q) -> None:
    from autopar.cli.trainer import WARMUP_STEPS

    q.add_argument("--warmup", type=int, default=WARMUP_STEPS,
                   help="warm-up steps per strategy, excluded from the figures (an emulated clock's steady "
                        "per-block minima settle over several steps)")


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="really train on this machine (emulated devices are CPU processes)")
    _plan_args(t)
    t.add_argument("--steps", type=int, default=5, help="measured steps per strategy, after the warm-up")
    _add_warmup(t)
    t.add_argument("--compare", help="comma-separated strategies to run after it in the same run, e.g. uniform-dp; "
                                     "STRATEGY:zero=K pins that one's ZeRO stage, e.g. dp:zero=0,dp:zero=3")
    t.add_argument("--consecutive", type=int, default=1, metavar="K",
                   help="with --compare: steps a strategy runs before the next takes its turn (default 1: "
                        "interleaved step by step; 0: each strategy's steps in one run, one after the other, as a "
                        "job running one plan does; interleaved steps start with each other's caches)")
    t.add_argument("--timeline", metavar="OUT.png",
                   help="Gantt chart of the last measured step of every strategy, by phase and rank")
    t.add_argument("--replan", choices=("off", "auto"), default="off",
                   help="auto: after a few steps, re-plan on costs calibrated from the measured steps and switch "
                        "in place when that pays (compile(replan=); a device's actual_speed shows it)")
    t.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save every --checkpoint-every steps under DIR/STRATEGY/step-N and resume from the newest "
                        "valid checkpoint there (compile(checkpoint_dir=); docs/elastic.md)")
    t.add_argument("--checkpoint-every", type=int, metavar="K", help="steps between checkpoints (with --checkpoint-dir)")
    t.add_argument("--checkpoint-keep", type=int, metavar="N",
                   help="keep the newest N checkpoints of each strategy, removing older ones after each save "
                        "(compile(checkpoint_keep=); default: keep all)")
    t.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="when a device fails, restart on the others, re-planned, at most N times, resuming from "
                        "--checkpoint-dir (launch(max_restarts=))")
    t.add_argument("--calibrate", action="store_true",
                   help="fit this machine's cost-model correction factors from the measured profiles and save "
                        "them in the profile cache (later plans use them)")


def _add_demo(sub) -> None:
    d = sub.add_parser("demo", help="plan and train a small GPT on the emulated demo cluster vs uniform-dp")
    d.add_argument("--model", default=None, help="default gpt-tiny")
    d.add_argument("--cluster", default=None, help="default the built-in demo cluster")
    d.add_argument("--global-batch", type=int, default=96)
    d.add_argument("--steps", type=int, default=24, help="measured steps per strategy, after the warm-up")
    _add_warmup(d)
    d.add_argument("--json", metavar="OUT")
    d.add_argument("--timeline", metavar="OUT.png", help="Gantt chart of the last measured step of both strategies")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar", description=_DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("models", help="list the model zoo")
    sub.add_parser("env", help="the environment variables autopar reads: value in force, default, meaning")

    a = sub.add_parser("analyze", help="per-block parameters, FLOPs, activations and time per device type")
    a.add_argument("--model", required=True, help="zoo name or package.module:factory")
    a.add_argument("--cluster", help="cluster YAML file or built-in name (default: this machine)")
    a.add_argument("--batch", type=int, help="micro-batch size for FLOPs and times (default: the example's)")
    a.add_argument("--json", metavar="OUT", help="write JSON to OUT ('-' for stdout)")

    _add_plan(sub)
    _add_train(sub)
    _add_demo(sub)
    sub.add_parser("tune", help="Triton kernel tuning runs on the local GPU (autopar tune --help)", add_help=False)
    sub.add_parser("bench", help="run a benchmark of the source tree: 'autopar bench published' pins published GPU "
                                 "runs as published and predicts them, 'autopar bench published_layouts' prices "
                                 "published measured layouts as they ran (autopar bench NAME --help)",
                   add_help=False)
    from autopar.cli.checkpoint import add_parser as add_checkpoint_parser

    add_checkpoint_parser(sub)
    from autopar.cli.check import add_parser as add_check_parser

    add_check_parser(sub)
    return p
