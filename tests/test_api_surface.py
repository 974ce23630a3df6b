"""The documented surface (shared/spec/api.md), called exactly as the page writes it, in one process.

Every name here goes through ``import autopar`` and its attributes, never through a submodule path:
that is what users write, and it is what once broke (``autopar.plan`` stopped being the function on
its second call when a submodule of that name replaced the package attribute). The models are the
zoo's smallest, so the whole file stays quick; the one real multi-process run is marked ``launch``.
"""

from __future__ import annotations

import os
from importlib import import_module
from pathlib import Path

import pytest
import torch

import autopar
from oracle import RTOL, assert_state_close, batches, single_device_state

ROOT = Path(__file__).resolve().parents[1]
TWO = ROOT / "benchmarks" / "clusters" / "two-emulated.yaml"
ONE = {"nodes": [{"device": {"name": "cpu", "emulate": "cpu", "speed": 1.0, "memory_GB": 2}, "count": 1}]}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    yield
    import_module("autopar.runtime.launcher").shutdown()   # compile on one device starts a group


# -- cluster -------------------------------------------------------------------------------------

def test_cluster_constructors():
    cluster = autopar.Cluster.from_yaml(TWO)
    assert len(cluster) == 2
    assert [cluster.devices[r].spec.name for r in range(2)] == ["fast", "slow"]
    assert [cluster.devices[r].node for r in range(2)] == [0, 0]
    assert autopar.Cluster.from_dict(cluster.to_dict()) == cluster      # same schema as the YAML

    eight = autopar.Cluster.homogeneous("A100-80GB", count=8, per_node=8)
    assert len(eight) == 8 and eight.num_nodes == 1
    assert {d.spec.name for d in eight.devices} == {"A100-80GB"}
    two_nodes = autopar.Cluster.homogeneous("H100-80GB", count=16, per_node=8)
    assert [two_nodes.devices[r].node for r in (0, 7, 8, 15)] == [0, 0, 1, 1]


def test_cluster_errors_name_the_field(tmp_path):
    with pytest.raises(autopar.ClusterError, match=r"nodes\[0\]\.device: unknown device preset 'A100-80'"):
        autopar.Cluster.from_dict({"nodes": [{"device": "A100-80", "count": 8}]})
    with pytest.raises(autopar.ClusterError, match=r"nodes\[0\]\.count: -1 is not a positive integer"):
        autopar.Cluster.from_dict({"nodes": [{"device": "A100-80GB", "count": -1}]})
    with pytest.raises(autopar.ClusterError, match=r"speed: 0 must be a number in"):
        autopar.Cluster.from_dict({"nodes": [{"device": {"name": "x", "emulate": "cpu", "speed": 0,
                                                         "memory_GB": 2}, "count": 1}]})
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [\n")
    with pytest.raises(autopar.ClusterError, match="malformed YAML"):
        autopar.Cluster.from_yaml(bad)
    with pytest.raises(ValueError):     # every autopar error is a ValueError
        autopar.Cluster.homogeneous("A100-80GB", count=0)


# -- model zoo -----------------------------------------------------------------------------------

def test_model_zoo():
    assert {"gpt-tiny", "mlp"} <= set(autopar.models.names())
    case = autopar.models.build("gpt-tiny", device="cpu")
    assert isinstance(case.model, torch.nn.Module) and isinstance(case.example_inputs, tuple)
    inputs, targets = case.batch(48, seed=0)
    assert inputs[0].shape[0] == 48 and targets.shape[0] == 48
    loss = case.loss_fn(case.model(*inputs), targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    meta = autopar.models.build("gpt-tiny", device="meta")
    assert next(meta.model.parameters()).device.type == "meta"
    with pytest.raises(autopar.AutoparError, match="model: unknown zoo name 'gpt-huge'"):
        autopar.models.build("gpt-huge")


# -- plan ----------------------------------------------------------------------------------------

def test_plan_twice_and_the_plan_data(shared_cache):
    cluster = autopar.Cluster.from_yaml(TWO)
    case = autopar.models.build("gpt-tiny", device="cpu")
    plans = []
    for _ in range(2):   # the second call once found a module where the function was
        assert callable(autopar.plan)
        plans.append(autopar.plan(case.model, cluster, case.example_inputs, global_batch_size=16,
                                  loss_fn=case.loss_fn, strategy="auto", zero_stage="auto", schedule="auto",
                                  pp_layers=None, dp_batch=None))
    plan = plans[-1]
    assert isinstance(plan, autopar.Plan)
    # each stage's members share the global batch (a pipeline's ranks each compute on all of it)
    assert all(sum(plan.rank_batch[g[0]] for g in st.groups) == 16 for st in plan.stages)
    assert plan.predicted.step_time_s > 0 and plan.predicted.samples_per_s > 0
    assert set(plan.predicted.memory_bytes) <= {0, 1}
    assert 0 < plan.predicted.efficiency <= 1 + 1e-9
    assert plan.predicted.samples_per_s <= plan.predicted.compute_bound_samples_per_s * (1 + 1e-9)
    assert all(s.ranks and s.num_layers >= 1 for s in plan.stages)
    assert autopar.Plan.from_json(plan.to_json()) == plan
    with pytest.raises(autopar.PlanError, match="plan.global_batch_size: missing"):
        autopar.Plan.from_json('{"strategy": "dp"}')
    text = plan.summary()
    assert f"summed: {plan.predicted.upper_bound_samples_per_s:.4g} samples/s" in text   # the upper bound
    assert f"MFU {plan.predicted.mfu:.1%}" in text and "efficiency vs compute bound" in text
    assert f"plan: strategy={plan.strategy}" in text

    # A Plan as the strategy is run as given; the same options as a PlanConfig give the same plan.
    assert autopar.plan(case.model, cluster, case.example_inputs, 16, strategy=plan) is plan
    config = autopar.PlanConfig(strategy="dp", zero_stage=0)
    by_config = autopar.plan(case.model, cluster, case.example_inputs, 16, case.loss_fn, config=config)
    by_keywords = autopar.plan(case.model, cluster, case.example_inputs, 16, case.loss_fn, strategy="dp",
                               zero_stage=0)
    assert by_config.rank_batch == by_keywords.rank_batch and by_config.strategy == by_keywords.strategy


def test_plan_errors_name_the_field():
    cluster = autopar.Cluster.from_dict(ONE)
    case = autopar.models.build("mlp", device="cpu")
    args = (case.model, cluster, case.example_inputs)
    cases = [
        (dict(global_batch_size=0), "global_batch_size: 0 is not a positive integer"),
        (dict(global_batch_size=8, strategy="fastest"), "strategy: 'fastest' must be one of 'auto'"),
        (dict(global_batch_size=8, zero_stage=5), "zero_stage: 5 must be one of"),
        (dict(global_batch_size=8, schedule="zigzag"), "schedule: 'zigzag' must be one of"),
        (dict(global_batch_size=8, strategy="uniform-dp", dp_batch={0: 8}), "dp_batch: pins data-parallel"),
        (dict(global_batch_size=8, strategy="dp", pp_layers=[1, 1]), r"pp_layers: \[1, 1\] asks for a pipeline"),
        (dict(global_batch_size=8, config=autopar.PlanConfig(), strategy="dp"), "config: given together with"),
    ]
    for kwargs, message in cases:
        with pytest.raises(autopar.PlanError, match=message):
            autopar.plan(*args, **kwargs)
    with pytest.raises(autopar.PlanError, match=r"memory_fraction: 1\.5"):
        autopar.PlanConfig(memory_fraction=1.5)
    with pytest.raises(autopar.PlanError, match="zero3_granularity: 'layer'"):
        autopar.RunConfig(zero3_granularity="layer")


def test_error_hierarchy():
    from autopar import kernels

    for err in (autopar.ClusterError, autopar.PlanError, autopar.RuntimeInputError, autopar.LaunchError,
                autopar.models.ModelZooError):
        assert issubclass(err, autopar.AutoparError) and issubclass(err, ValueError)
    assert issubclass(autopar.LaunchError, RuntimeError)
    # kernels imports nothing of autopar: its input error is its own ValueError
    assert issubclass(kernels.KernelInputError, ValueError)
    assert not issubclass(kernels.KernelInputError, autopar.AutoparError)


# -- compile -------------------------------------------------------------------------------------

def test_compile_on_one_device_and_step():
    cluster = autopar.Cluster.from_dict(ONE)
    case = autopar.models.build("mlp", device="cpu", seed=0)
    compiled = autopar.compile(case.model, cluster, case.example_inputs, global_batch_size=8, loss_fn=case.loss_fn,
                               optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
                               strategy="auto", measure=False)   # one device: the tables cannot matter
    assert isinstance(compiled.plan, autopar.Plan) and compiled.plan.rank_batch == {0: 8}
    for inputs, targets in batches("mlp", 8, 2, seed=0):
        loss = compiled.step(inputs, targets)
        assert isinstance(loss, float)
    oracle = single_device_state("mlp", 8, steps=2, optimizer="sgd", seed=0)
    assert_state_close(compiled.state_dict(), oracle, RTOL["sgd"])
    inputs, targets = case.batch(6, seed=0)
    with pytest.raises(autopar.RuntimeInputError, match="step: the batch has 6 samples .* global_batch_size=8"):
        compiled.step(inputs, targets)


def test_compile_errors_name_the_field():
    case = autopar.models.build("mlp", device="cpu")
    with pytest.raises(autopar.ClusterError, match="cluster: has 2 devices but no job is running"):
        autopar.compile(case.model, autopar.Cluster.from_yaml(TWO), case.example_inputs, 8, case.loss_fn)
    one = autopar.Cluster.from_dict(ONE)
    with pytest.raises(autopar.PlanError, match="zero3_granularity"):
        autopar.compile(case.model, one, case.example_inputs, 8, case.loss_fn, zero3_granularity="layer")
    with pytest.raises(autopar.PlanError, match="run: given together with"):
        autopar.compile(case.model, one, case.example_inputs, 8, case.loss_fn, run=autopar.RunConfig(),
                        use_triton=True)


# -- kernels -------------------------------------------------------------------------------------

def test_kernels_call():
    from autopar import kernels

    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3, 5, 16, device=device, requires_grad=True)
    y = kernels.softmax(x)
    torch.testing.assert_close(y, torch.softmax(x, dim=-1), rtol=1e-5, atol=1e-6)
    y.sum().backward()      # differentiable
    assert x.grad is not None and x.grad.shape == x.shape
    with pytest.raises(kernels.KernelInputError):
        kernels.softmax(torch.zeros(4, 4, dtype=torch.int64, device=device))


# -- launch --------------------------------------------------------------------------------------

def _train(rank, plan_late_s: float = 0.0, measure=None):   # runs in every process (module level: the ranks import it)
    import time

    import autopar
    from oracle import batches

    cluster = autopar.Cluster.from_yaml(TWO)
    case = autopar.models.build("mlp", device="cpu", seed=0)
    if rank == 0:
        time.sleep(plan_late_s)   # rank 0's planning, as if slow: the other ranks wait for its plan
    compiled = autopar.compile(case.model, cluster, case.example_inputs, global_batch_size=12, loss_fn=case.loss_fn,
                               optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
                               strategy="dp", measure=measure)
    for inputs, targets in batches("mlp", 12, 2, seed=0):
        compiled.step(inputs, targets)
    return compiled.state_dict()


@pytest.mark.launch
def test_ranks_wait_for_a_plan_longer_than_a_step_may_wait():
    # a cold plan (analysis, block timing, search) can take minutes on a loaded machine: the others wait
    # for it on the planning group (PLANNING_TIMEOUT_S), not under step_timeout_s (which once ended the
    # demo: rank 1's broadcast timed out after 60 s while rank 0 was still timing blocks)
    results = autopar.launch(_train, autopar.Cluster.from_yaml(TWO), 9.0, False, step_timeout_s=6.0)
    assert len(results) == 2
    oracle = single_device_state("mlp", 12, steps=2, optimizer="sgd", seed=0)
    for state in results:                # two launched ranks equal one device: the full state, on every rank
        assert_state_close(state, oracle, RTOL["sgd"])
