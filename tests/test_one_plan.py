"""One plan: ``autopar plan`` and ``autopar.plan`` from a shell, and ``compile`` under
``autopar.launch`` and under torchrun, give the same plan and the same prediction for the demo's model,
cluster and batch, on the same measured tables (one cache folder: the first call measures, the others
read what it measured).

``prepare`` is where all of them decide what to measure: the loss with the model's targets and the
memory meter's price on emulated ranks (which ``compile`` priced and ``plan`` did not), each table
timed at the thread count the cluster's ranks run with (``autopar.measure.tables.rank_threads``: a
shell's process has every core, an emulated rank one thread)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import autopar

GLOBAL_BATCH = 96


def _compile_rank(rank: int):
    from torchrun_compile import demo_plan

    plan = demo_plan(GLOBAL_BATCH, compiled=True)
    return plan.to_json() if rank == 0 else None


def _run(*args: str) -> None:
    done = subprocess.run([sys.executable, *args], timeout=400, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(args[:4])} exited {done.returncode}:\n{done.stderr[-4000:]}"


@pytest.mark.launch
def test_plan_cli_launch_and_torchrun_give_one_plan_on_the_demo(tmp_path, monkeypatch, shared_cache):
    """Each side in fresh processes, as a user runs it: the CLI and ``autopar.plan`` from a shell (the
    first measures the tables, unless another test of this worker did), then ``compile`` under
    ``autopar.launch`` and under torchrun."""
    from autopar.cluster.model import builtin

    monkeypatch.setenv("AUTOPAR_EMULATED_LINK", "nominal")   # the link sweep is another test's
    script = str(Path(__file__).with_name("torchrun_compile.py"))
    _run("-m", "autopar", "plan", "--model", "gpt-tiny", "--cluster", "demo", "--global-batch", str(GLOBAL_BATCH),
         "--json", str(tmp_path / "cli.json"))
    _run(script, "plan", str(tmp_path / "plan.json"), str(GLOBAL_BATCH))
    launched = json.loads(autopar.launch(_compile_rank, builtin("demo"), timeout_s=400)[0])
    _run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", script, "compile",
         str(tmp_path / "torchrun.json"), str(GLOBAL_BATCH))
    from_cli = json.loads((tmp_path / "cli.json").read_text())
    timings = {k: from_cli.pop(k) for k in ("planning_s", "bounds_s")}
    assert all(v >= 0 for v in timings.values())
    planned = json.loads((tmp_path / "plan.json").read_text())
    torchrun = json.loads((tmp_path / "torchrun.json").read_text())
    assert planned["predicted"]["step_time_s"] > 0
    assert from_cli == planned
    assert launched == planned
    assert torchrun == planned
