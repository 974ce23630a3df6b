"""A model too big for any one device trains (issue 11, Must show): its fp32 training state (weights,
gradients, AdamW's two moments: 16 bytes a parameter) is 2.5 times the memory of each of three emulated
devices. Built on ``meta``, it trains under ``strategy="auto"`` and ``"pp"`` on real processes
(``autopar.launch``); each rank's tracked peak (``autopar.runtime.memory``, the emulated limit on)
stays under its device's memory and within 15% of the plan's prediction, and the final state equals
the one-device oracle (``autopar.materialize`` + AdamW on the whole global batch, in the test process,
which has no limit) to api.md's AdamW tolerance. On a cluster where it cannot fit under any plan, it
is refused up front with a ``PlanError`` saying what was needed.

``memory_fraction=0.93``: three devices of 1/2.5 of the state leave 20% over the state for activations
and the stage cut's imbalance; at the default 0.9 no pipeline fits, and at 1.0 ``auto`` picks ZeRO-3
data parallelism predicted at 99.4% of memory, which the data-parallel engine passes (see
``benchmarks/results/memory.md``): it fails with ``MemoryLimitError``, as a GPU would with an OOM.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import functools
from importlib import import_module

import pytest
import torch

import autopar
from autopar.cluster.model import Cluster
from autopar.errors import PlanError
from oracle import RTOL, assert_state_close, optimizer_factory

MODEL = "gpt-tiny"
OVERRIDES = dict(tie_embeddings=False, num_layers=9, hidden_size=128, seq_len=8)   # 1.84M parameters
GB, STEPS, RATIO, FRACTION = 4, 2, 2.5, 0.93


def state_bytes() -> int:
    model = autopar.models.build(MODEL, device="meta", **OVERRIDES).model
    return 16 * sum(p.numel() for p in model.parameters())


def cluster(memory_gb: float, n: int = 3) -> Cluster:
    speeds = (1.0, 0.5, 0.5)
    return Cluster.from_dict({"nodes": [{"device": {"name": f"cpu-{i}", "emulate": "cpu", "speed": speeds[i],
                                                    "memory_GB": memory_gb}, "count": 1} for i in range(n)]})


def data(steps: int = STEPS):
    case = autopar.models.build(MODEL, **OVERRIDES)
    return [case.batch(GB, seed=10 + s) for s in range(steps)]


def oracle_state() -> dict:
    """One device, no limit: the meta model materialised whole, AdamW (eps=1e-6) on each global batch."""
    from autopar.runtime.engine import compute_loss

    case = autopar.models.build(MODEL, device="meta", **OVERRIDES)
    model = autopar.materialize(case.model, seed=5)
    opt = optimizer_factory("adamw")(list(model.parameters()))
    for inputs, targets in data():
        opt.zero_grad(set_to_none=True)
        compute_loss(model(*inputs), targets, case.loss_fn).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def big_model_rank(rank: int, memory_gb: float, plans: dict) -> dict:
    """One rank: compile the meta model under each plan, train, report memory (rank 0: the state)."""
    out = {}
    for name, plan_json in plans.items():
        meta, cpu = (autopar.models.build(MODEL, device=d, **OVERRIDES) for d in ("meta", "cpu"))
        compiled = autopar.compile(meta.model, cluster(memory_gb), cpu.example_inputs, GB, meta.loss_fn,
                                   optimizer=optimizer_factory("adamw"), seed=5,
                                   strategy=autopar.Plan.from_json(plan_json))
        meter = compiled.memory
        build_peak = meter.peak_bytes
        meter.reset_peak()
        for inputs, targets in data():
            compiled.step(inputs, targets)
        state = compiled.state_dict()
        out[name] = dict(build_peak=build_peak, step_peak=meter.peak_bytes, limit=meter.limit_bytes,
                         predicted=compiled.plan.predicted.memory_bytes[rank], state=state if rank == 0 else None)
    return out


@functools.cache
def prepared():
    """The analysis and cost tables, once (device types and speeds are the same on every cluster here;
    only their memory differs, which the tables do not depend on)."""
    from autopar.api import prepare

    meta, cpu = (autopar.models.build(MODEL, device=d, **OVERRIDES) for d in ("meta", "cpu"))
    return meta, prepare(meta.model, cluster(1.0), cpu.example_inputs, measure=False), cpu.example_inputs


def plan_on(memory_gb: float, strategy: str):
    meta, prep, example = prepared()
    return autopar.plan(meta.model, cluster(memory_gb), example, GB, meta.loss_fn, prepared=prep,
                        config=autopar.PlanConfig(strategy=strategy, memory_fraction=FRACTION))


def test_refused_up_front_where_no_plan_fits():
    small = state_bytes() / 4 / 2**30       # three devices of a quarter of the state each
    with pytest.raises(PlanError, match=r"no plan fits.*needs") as info:
        plan_on(small, "auto")
    assert "GiB of weights+gradients+optimizer state" in str(info.value)


@pytest.mark.launch
def test_a_model_too_big_for_any_one_device_trains(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    memory_gb = (state_bytes() // RATIO - 1) / 2**30      # each device holds at most 1/2.5 of the state
    device_bytes = cluster(memory_gb).devices[0].spec.memory_bytes
    assert state_bytes() >= RATIO * device_bytes
    # Planned here, run on the ranks as given; auto's plan and pp's, once each if they differ.
    plans = {s: plan_on(memory_gb, s) for s in ("auto", "pp")}
    for p in plans.values():
        assert p.num_stages > 1 and all(v < device_bytes for v in p.predicted.memory_bytes.values())
    runs = {"auto": plans["auto"].to_json()}
    if plans["pp"].to_json() != runs["auto"]:
        runs["pp"] = plans["pp"].to_json()
    ranks = autopar.launch(big_model_rank, cluster(memory_gb), memory_gb, runs, timeout_s=300)
    ref = oracle_state()
    for name in runs:
        for r, out in enumerate(ranks):
            m = out[name]
            assert m["limit"] == device_bytes
            assert m["build_peak"] < device_bytes and m["step_peak"] < device_bytes, (name, r, m)
            assert abs(m["step_peak"] / m["predicted"] - 1) <= 0.15, (name, r, m["step_peak"], m["predicted"])
        assert_state_close(ranks[0][name]["state"], ref, RTOL["adamw"])


def teardown_module(module):
    import_module("autopar.runtime.launch").shutdown()
    torch.set_num_threads(max(1, torch.get_num_threads()))
