"""``benchmarks/published.py``: the published GPU runs, each pinned exactly as its source states it.
Structure (pure): at least 16 runs, every one citing its source, Megatron TP+PP with and without
interleaving, with sequence parallelism and selective recomputation, FSDP runs and runs on 8,192 or
more H100. Planning: a run of each kind plans and meets its pin (every run: ``autopar bench published``,
which exits non-zero when a run outside ``KNOWN_GAPS`` is refused)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import published  # noqa: E402

from autopar.config import Pin  # noqa: E402
from autopar.planner.pins import pin_violation  # noqa: E402


def test_the_runs_cover_the_published_layouts_and_cite_their_sources():
    runs = published.RUNS
    assert len(runs) >= 16 and len({r.name for r in runs}) == len(runs)
    assert all(r.source and "Table" in r.source or r.source.endswith(".md") or ".md," in r.source for r in runs)
    pins = [r.pin for r in runs]
    assert any(p.get("tp", 1) > 1 and p.get("pp", 1) > 1 and "schedule" not in p for p in pins)     # TP + PP
    assert any(p.get("tp", 1) > 1 and p.get("schedule") == "interleaved-1f1b" for p in pins)     # interleaved
    assert any(p.get("sequence_parallel") and p.get("recompute") == "selective" for p in pins)
    assert any(p.get("zero_stage") == 3 and "tp" not in p for p in pins)                          # FSDP
    assert any(r.gpus >= 8192 and r.device.startswith("H100") for r in runs)
    assert set(published.KNOWN_GAPS) <= {r.name for r in runs}
    for r in runs:
        Pin(**r.pin)                                  # every pin is a valid Pin
        assert published.published_step_s(r) is not None or "mfu" in r.published, r.name


def test_megatron_flops_and_the_published_step():
    sc21 = next(r for r in published.RUNS if r.name == "megatron-sc21-gpt-1t")
    # 96 B s l h^2 (1 + s/6h + V/16lh) at B=3072, s=2048, l=128, h=25600, V=51200; at 163 TFLOP/s on 3,072 GPUs
    assert published.megatron_flops(sc21) == pytest.approx(5.136e19, rel=1e-3)
    assert published.published_step_s(sc21) == pytest.approx(102.6, rel=1e-3)
    titan = next(r for r in published.RUNS if r.name == "torchtitan-llama3-8b-fsdp-8")
    assert published.published_step_s(titan) == pytest.approx(16 * 8192 / (5762 * 8))


FAST = ("megatron-sc21-gpt-1.7b", "korthikanti-22b-sp-selective", "korthikanti-22b-full-recompute",
        "torchtitan-llama3-8b-fsdp-8")


def _check(names):
    memo: dict = {}
    for run in (r for r in published.RUNS if r.name in names):
        plan, _ = published.plan_run(run, prepared=memo)
        assert pin_violation(plan, Pin(**run.pin), run.cluster()) is None, run.name
        assert plan.predicted.step_time_s > 0 and plan.notes[0].startswith("pinned:"), run.name
        if run.pin.get("recompute") == "selective":
            assert all(st.recompute_attention for st in plan.stages)


def test_a_few_runs_of_each_kind_pin_as_published():
    _check(FAST)


def test_bench_command_runs_the_script(capsys):
    from autopar.cli.main import main

    assert main(["bench", "published", "--list"]) == 0
    assert "megatron-sc21-gpt-1t" in capsys.readouterr().out
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_fsdp_inside_a_tp_mesh_pins_block_by_block():
    """torchtitan's Llama 3 70B (FSDP 32 x TP 8, full recomputation) pins: one recomputing TP stage at
    ZeRO-3 gathering block by block, which fits where gathering the whole stage (ZeRO-1's peak) does not."""
    from autopar.cost.memory import fits_memory, stage_memory_bytes
    from autopar.cost.pipeline import zero3_block_round_s
    from autopar.ir.plan import zero3_by_block

    run = next(r for r in published.RUNS if r.name == "torchtitan-llama3-70b-fsdp32-tp8")
    memo: dict = {}
    plan, _ = published.plan_run(run, prepared=memo)
    costs = next(iter(memo.values()))[1].costs
    cluster = run.cluster()
    assert pin_violation(plan, Pin(**run.pin), cluster) is None
    assert zero3_by_block(plan.stages, plan.zero_stage) and plan.stages[0].recompute
    assert fits_memory(cluster, plan.predicted.memory_bytes)
    rho = plan.predicted.breakdown["tp_replicated_fraction"]
    whole = stage_memory_bytes(costs, plan.stages, plan.schedule, 1, rho)
    assert not fits_memory(cluster, whole)
    # every micro-batch a round of per-block gathers and reduce-scatters, after the compute
    rounds = plan.num_micro_batches * zero3_block_round_s(costs, cluster, plan.stages[0], rho)
    assert plan.predicted.breakdown["allreduce_s"] >= rounds > 0
