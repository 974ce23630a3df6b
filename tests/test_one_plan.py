"""One plan: ``autopar plan``, ``autopar.plan`` and ``compile`` under ``autopar.launch`` give the same plan
and the same prediction for the demo's model, cluster and batch, on the same measured tables (one
process and one cache folder: rank 0 plans for ``compile`` and measures the tables, then the other
two plan from them).

``prepare`` is where all three decide what to measure: the loss with the model's targets and the
memory meter's price on emulated ranks, which ``compile`` always priced and ``plan`` did not."""

from __future__ import annotations

import json

import pytest

import autopar

GLOBAL_BATCH = 96


def _demo_rank(rank: int, json_path: str):
    from autopar.cli.main import main as cli
    from autopar.cluster.model import builtin
    from autopar.models import load

    cluster = builtin("demo")
    case = load("gpt-tiny", device="cpu", seed=0)
    targets = case.batch(int(case.example_inputs[0].shape[0]))[1]
    compiled = autopar.compile(case.model, cluster, case.example_inputs, GLOBAL_BATCH, case.loss_fn,
                               example_targets=targets)
    if rank != 0:
        return None
    case = load("gpt-tiny", device="cpu", seed=0)     # a model compile has not trained
    planned = autopar.plan(case.model, cluster, case.example_inputs, GLOBAL_BATCH, case.loss_fn,
                           example_targets=targets)
    assert cli(["plan", "--model", "gpt-tiny", "--cluster", "demo", "--global-batch", str(GLOBAL_BATCH),
                "--json", json_path]) == 0
    return compiled.plan.to_json(), planned.to_json()


@pytest.mark.launch
def test_plan_cli_and_compile_give_one_plan_on_the_demo(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AUTOPAR_EMULATED_LINK", "nominal")   # the link sweep is another test's
    from autopar.cluster.model import builtin

    path = tmp_path / "plan.json"
    results = autopar.launch(_demo_rank, builtin("demo"), str(path), timeout_s=400)
    compiled, planned = (json.loads(x) for x in results[0])
    from_cli = json.loads(path.read_text())
    timings = {k: from_cli.pop(k) for k in ("planning_s", "bounds_s")}
    assert all(v >= 0 for v in timings.values())
    assert planned == compiled
    assert from_cli == compiled
    assert compiled["predicted"]["step_time_s"] > 0
