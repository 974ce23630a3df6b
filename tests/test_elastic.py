"""Elastic runs (api.md, "Elastic runs"; autopar.runtime.elastic and launch's restarts).

In one process: the present-devices rule (which devices a smaller world runs on), ``init`` under a
torchrun environment with a smaller world, ``current_cluster`` / ``restart_count`` / the cluster compile
plans for, the checkpoint options' validation, and the save cadence and resume of a compiled model on
one device against the one-device oracle. The one real multi-process run (``launch``) kills one of three
emulated ranks at step 5 of 12 and checks the restarted job against the oracle of 12 steps.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch

import autopar
from autopar.checkpoint.store import latest
from autopar.cluster.model import Cluster
from autopar.errors import LaunchError, PlanError
from autopar.runtime import elastic
from oracle import RTOL, assert_state_close, batches, single_device_run

launch_mod = importlib.import_module("autopar.runtime.launcher")
ENV = (launch_mod.FAILED_ENV, launch_mod.RESTART_ENV, launch_mod.STOPPED_AT_ENV, "TORCHELASTIC_RESTART_COUNT")


def _three(speeds=(1.0, 0.5, 0.75)) -> Cluster:
    """Three emulated devices of different types (each its own spec name) in one node."""
    return Cluster.from_dict({"nodes": [{"devices": [
        {"device": {"name": f"d{i}", "emulate": "cpu", "speed": s, "memory_GB": 2}, "count": 1}
        for i, s in enumerate(speeds)]}]})


def _names(cluster) -> list[str]:
    return [d.spec.name for d in cluster.devices]


@pytest.fixture(autouse=True)
def _clean(monkeypatch, tmp_path):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    yield
    launch_mod.shutdown()


# -- which devices a smaller world runs on ---------------------------------------------------------

def test_present_cluster_rule(monkeypatch):
    three = _three()
    assert launch_mod.present_cluster(three, 3) is three
    assert _names(launch_mod.present_cluster(three, 2)) == ["d0", "d1"]      # unset: the first WORLD_SIZE
    monkeypatch.setenv(launch_mod.FAILED_ENV, "1")
    two = launch_mod.present_cluster(three, 2)
    assert _names(two) == ["d0", "d2"] and [d.rank for d in two.devices] == [0, 1]
    assert two.devices[1].spec == three.devices[2].spec                      # speed and memory kept
    with pytest.raises(LaunchError, match="WORLD_SIZE=3 but the cluster less AUTOPAR_FAILED_DEVICES=.1. has 2"):
        launch_mod.present_cluster(three, 3)
    monkeypatch.setenv(launch_mod.FAILED_ENV, "2, 0")
    assert _names(launch_mod.present_cluster(three, 1)) == ["d1"]
    monkeypatch.setenv(launch_mod.FAILED_ENV, "one")
    with pytest.raises(LaunchError, match="AUTOPAR_FAILED_DEVICES='one' is not a comma-separated list"):
        launch_mod.present_cluster(three, 2)
    monkeypatch.setenv(launch_mod.FAILED_ENV, "5")
    with pytest.raises(LaunchError, match=r"names rank\(s\) \[5\] but the cluster has 3 devices"):
        launch_mod.present_cluster(three, 2)


def test_init_under_torchrun_with_a_smaller_world(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), launch_mod.FAILED_ENV: "0,2",
                        "TORCHELASTIC_RESTART_COUNT": "2"}.items():
        monkeypatch.setenv(name, value)
    three = _three()
    with pytest.raises(LaunchError, match="no job is running"):
        autopar.current_cluster()
    ctx = autopar.init(three)
    assert (ctx.rank, ctx.world_size, ctx.speed, ctx.spec.name) == (0, 1, 0.5, "d1")
    assert autopar.current_cluster() is ctx.cluster and _names(ctx.cluster) == ["d1"]
    assert ctx.full_cluster == three
    assert elastic.cluster_in_force(three) is ctx.cluster           # what compile plans for
    other = _three((1.0, 1.0, 1.0))
    assert elastic.cluster_in_force(other) is other                 # another cluster: compile's own error
    assert autopar.restart_count() == 2
    monkeypatch.setenv(launch_mod.RESTART_ENV, "3")                 # launch's own count wins
    assert autopar.restart_count() == 3 and elastic.stopped_at() is None


def test_launch_and_checkpoint_options_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(LaunchError, match="max_restarts must be an integer >= 0"):
        autopar.launch(_train, _three(), max_restarts=-1)
    with pytest.raises(LaunchError, match="max_restarts"):
        autopar.launch(_train, _three(), max_restarts=True)
    assert elastic.checkpoint_policy(None, None) is None
    with pytest.raises(PlanError, match="checkpoint_every: 2 given without checkpoint_dir"):
        elastic.checkpoint_policy(None, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(PlanError, match="checkpoint_every: .* must be a positive integer"):
            elastic.checkpoint_policy(tmp_path, bad)
    (tmp_path / "file").write_text("x")
    with pytest.raises(PlanError, match="checkpoint_dir: .*file exists and is not a directory"):
        elastic.checkpoint_policy(tmp_path / "file", 2)
    with pytest.raises(PlanError, match="checkpoint_dir: 3 is not a path"):
        elastic.checkpoint_policy(3, 2)
    policy = elastic.checkpoint_policy(str(tmp_path / "ck"), 3)
    assert policy == elastic.CheckpointPolicy(tmp_path / "ck", 3)
    assert elastic.checkpoint_policy(tmp_path, 3, 2) == elastic.CheckpointPolicy(tmp_path, 3, 2)
    with pytest.raises(PlanError, match="checkpoint_keep: 2 given without checkpoint_dir"):
        elastic.checkpoint_policy(None, None, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(PlanError, match="checkpoint_keep: .* must be a positive integer"):
            elastic.checkpoint_policy(tmp_path, 2, bad)
    assert elastic.step_path(policy.directory, 6) == tmp_path / "ck" / "step-6"


# -- the rank function of the launch test (module level: the ranks import it) -----------------------

STEPS, KILL_AT, EVERY, BATCH = 12, 5, 2, 12
MODEL, SIZE = "mlp", {"hidden_size": 256}   # the planner cuts it into stages on three devices and on two


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _train(rank, directory):
    directory = Path(directory)
    case = autopar.models.build(MODEL, device="cpu", seed=0, **SIZE)
    attempt = autopar.restart_count()
    compiled = autopar.compile(case.model, _three(), case.example_inputs, BATCH, case.loss_fn, optimizer=_sgd,
                               strategy="pp", measure=False, checkpoint_dir=directory / "ck",
                               checkpoint_every=EVERY)
    resumed = compiled.elastic.resumed
    if rank == 0:
        (directory / f"attempt{attempt}.json").write_text(json.dumps(
            {"plan": compiled.plan.to_json(), "cluster": _names(autopar.current_cluster()),
             "resumed_step": None if resumed is None else resumed.step}))
    data = batches(MODEL, BATCH, STEPS, seed=0, **SIZE)
    losses = {}
    for s in range(compiled.step_count, STEPS):
        if attempt == 0 and rank == 1 and s == KILL_AT - 1:       # the device of rank 1 fails in step 5
            os._exit(17)
        losses[s] = compiled.step(*data[s])
    return {"state": compiled.state_dict(), "losses": losses, "steps": compiled.step_count}


# -- the save cadence and the resume, on one device (the real save and load) ------------------------

def _one_device() -> Cluster:
    return Cluster.from_dict({"nodes": [{"device": {"name": "cpu", "emulate": "cpu", "speed": 1.0, "memory_GB": 2},
                                         "count": 1}]})


def _compile_mlp(cluster, directory, every=2, keep=None):
    case = autopar.models.build("mlp-tiny", device="cpu", seed=0)
    return autopar.compile(case.model, cluster, case.example_inputs, 12, case.loss_fn, optimizer=_sgd,
                           strategy="dp", measure=False, checkpoint_dir=directory, checkpoint_every=every,
                           checkpoint_keep=keep)


def test_checkpoint_keep_holds_the_newest_and_clears_interrupted_saves(tmp_path):
    ck = tmp_path / "ck"
    data = batches("mlp-tiny", 12, 5, seed=0)
    compiled = _compile_mlp(_one_device(), ck, every=1, keep=2)
    (ck / "step-1.partial-1-x").mkdir(parents=True)      # what a crashed save left
    for s in range(5):
        compiled.step(*data[s])
        assert len([p for p in ck.iterdir() if p.name.startswith("step-")]) == min(s + 1, 2)
    assert sorted(p.name for p in ck.iterdir()) == ["step-4", "step-5"] and latest(ck) == ck / "step-5"


@pytest.mark.slow
def test_checkpoint_every_saves_and_compile_resumes_from_the_newest(tmp_path):
    ck = tmp_path / "ck"
    data = batches("mlp-tiny", 12, 6, seed=0)
    oracle = single_device_run("mlp-tiny", 12, 6, optimizer="sgd", seed=0)
    first = _compile_mlp(_one_device(), ck)
    assert first.elastic.resumed is None and first.step_count == 0
    losses = [first.step(*data[s]) for s in range(5)]
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-4"] and latest(ck) == ck / "step-4"
    assert first.elastic.saved == [ck / "step-2", ck / "step-4"]

    (ck / "step-6").mkdir()                  # an interrupted save: no manifest, so it does not count
    again = _compile_mlp(_one_device(), ck)  # a restart: resumes from step 4, re-does step 5
    assert again.step_count == 4 and again.elastic.resumed.step == 4
    assert again.elastic.resumed.path == ck / "step-4"
    losses[4:] = [again.step(*data[s]) for s in range(again.step_count, 6)]
    assert again.step_count == 6 and latest(ck) == ck / "step-6"
    assert_state_close(again.state_dict(), oracle.state, RTOL["sgd"])
    assert losses == pytest.approx(oracle.losses, rel=1e-5)


# -- the job that loses a device (real processes) --------------------------------------------------

@pytest.mark.launch
def test_a_job_that_loses_one_of_three_ranks_resumes_on_two_and_equals_the_oracle(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_EMULATED_LINK", "nominal")   # the ranks plan on nominal links: no link measuring
    results = autopar.launch(_train, _three(), str(tmp_path), max_restarts=1, timeout_s=300)
    first = json.loads((tmp_path / "attempt0.json").read_text())
    second = json.loads((tmp_path / "attempt1.json").read_text())
    assert first["cluster"] == ["d0", "d1", "d2"] and first["resumed_step"] is None
    assert second["cluster"] == ["d0", "d2"]                       # rank 1's device is gone
    assert second["resumed_step"] == (KILL_AT - 1) // EVERY * EVERY     # step 4: the last checkpoint
    old, new = autopar.Plan.from_json(first["plan"]), autopar.Plan.from_json(second["plan"])
    assert sorted(old.rank_batch) == [0, 1, 2] and sorted(new.rank_batch) == [0, 1]   # re-planned for two
    assert [s.num_layers for s in old.stages] != [s.num_layers for s in new.stages]
    assert len(results) == 2
    oracle = single_device_run(MODEL, BATCH, STEPS, optimizer="sgd", seed=0, **SIZE)
    for result in results:
        assert result["steps"] == STEPS and sorted(result["losses"]) == list(range(4, STEPS))
        assert_state_close(result["state"], oracle.state, RTOL["sgd"])
        assert [result["losses"][s] for s in range(4, STEPS)] == pytest.approx(oracle.losses[4:], rel=1e-5)
