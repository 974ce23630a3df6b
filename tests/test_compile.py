"""autopar.compile end to end on a one-device cluster (no processes): the public path from model to
training step, with and without the Triton kernels substituted (interpreter on CPU), and ZeRO-3 at
either gathering granularity."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from importlib import import_module

import autopar
from autopar.cluster.model import Cluster
from oracle import RTOL, assert_state_close, batches, optimizer_factory, single_device_state

ONE = Cluster.from_dict({"nodes": [{"device": {"name": "cpu", "emulate": "cpu", "speed": 1.0, "memory_GB": 2},
                                    "count": 1}]})


@pytest.fixture(autouse=True)
def _fresh_group(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    yield
    import_module("autopar.runtime.launcher").shutdown()


def _train(use_triton: bool, steps=2, gb=8, **options):
    # One device, strategy dp: the plan is the same whatever the tables say, so only the first test
    # times the blocks (the Triton interpreter would run every kernel in every timed repeat).
    options.setdefault("measure", False)
    case = autopar.models.build("gpt-tiny", seed=0)
    compiled = autopar.compile(case.model, ONE, case.example_inputs, gb, case.loss_fn,
                               optimizer=optimizer_factory("sgd"), strategy="dp", use_triton=use_triton,
                               **options)
    losses = [compiled.step(inputs, targets) for inputs, targets in batches("gpt-tiny", gb, steps, seed=0)]
    return compiled, losses


def test_compile_trains_like_one_device():
    compiled, losses = _train(False, measure=None)
    assert compiled.plan.rank_batch == {0: 8}
    assert_state_close(compiled.state_dict(), single_device_state("gpt-tiny", 8, steps=2, optimizer="sgd", seed=0),
                       RTOL["sgd"])
    assert losses[1] < losses[0] + 1.0


@pytest.mark.slow   # about 50 s: the Triton interpreter runs every kernel on CPU
def test_a_batch_1_example_of_an_exported_model_compiles_and_trains_like_one_device():
    """torch.export fixes a dimension of size 1; capture exports a batch-1 example at two rows, so the
    tables (timed at other batch sizes) and the engine's micro-batches of 8 run."""
    case = autopar.models.build("hf-gpt-tiny", seed=0)
    one = tuple(t[:1] for t in case.example_inputs)
    compiled = autopar.compile(case.model, ONE, one, 8, case.loss_fn, optimizer=optimizer_factory("sgd"),
                               strategy="dp")
    for inputs, targets in batches("hf-gpt-tiny", 8, 2, seed=0):
        compiled.step(inputs, targets)
    assert_state_close(compiled.state_dict(), single_device_state("hf-gpt-tiny", 8, steps=2, optimizer="sgd", seed=0),
                       RTOL["sgd"])


def test_use_triton_trains_to_the_same_state():
    from autopar.passes import triton_patterns

    calls = []
    orig = triton_patterns._layer_norm

    def spy(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    triton_patterns._layer_norm = spy
    try:
        compiled, losses = _train(True)
    finally:
        triton_patterns._layer_norm = orig
    assert calls, "the substituted graph did not call the kernels"
    import_module("autopar.runtime.launcher").shutdown()
    plain, plain_losses = _train(False)
    assert_state_close(compiled.state_dict(), plain.state_dict(), 1e-4)
    assert losses == pytest.approx(plain_losses, rel=1e-4)


@pytest.mark.parametrize("granularity", ["block", "micro_step"])
def test_zero3_granularity_reaches_the_engine_and_trains_like_one_device(granularity):
    compiled, losses = _train(False, zero_stage=3, zero3_granularity=granularity)
    assert compiled.plan.zero_stage == 3
    assert compiled.engine.zero3_granularity == granularity
    assert len(compiled.engine.units) == (1 if granularity == "micro_step" else 7)
    assert_state_close(compiled.state_dict(), single_device_state("gpt-tiny", 8, steps=2, optimizer="sgd", seed=0),
                       RTOL["sgd"])


@pytest.mark.parametrize("bad", ["layer", None, "Block"])
def test_bad_zero3_granularity_is_a_clear_error(bad):
    case = autopar.models.build("gpt-tiny", seed=0)
    with pytest.raises(autopar.PlanError, match=r"zero3_granularity: .*'block', 'micro_step'"):
        autopar.compile(case.model, ONE, case.example_inputs, 8, case.loss_fn, strategy="dp", zero_stage=3,
                        zero3_granularity=bad)


def test_wrong_batch_size_is_a_clear_error():
    compiled, _ = _train(False, steps=0)
    case = autopar.models.build("gpt-tiny")
    with pytest.raises(ValueError, match="global_batch_size=8"):
        compiled.step(*case.batch(5))


def test_dp_plan_that_recomputes_trains_like_one_device():
    """A device whose memory holds a micro-batch only with activations recomputed: compile(recompute=True)
    plans data parallelism that recomputes block by block, and it trains exactly."""
    from autopar.planner.dp import activation_bytes_per_sample

    case = autopar.models.build("gpt-tiny", seed=0)
    costs = import_module("autopar.api").prepare(case.model, ONE, case.example_inputs, optimizer="sgd").costs
    keep, rc = activation_bytes_per_sample(costs), activation_bytes_per_sample(costs, recompute=True)
    assert rc < keep
    usable = costs.state_bytes() + (keep + rc) / 2   # < 1 sample kept (emulated devices keep no workspace)
    tight = Cluster.from_dict({"nodes": [{"device": {"name": "cpu-tight", "emulate": "cpu", "speed": 1.0,
                                                     "memory_GB": usable / 0.9 / 2**30}, "count": 1}]})
    compiled = autopar.compile(case.model, tight, case.example_inputs, 4, case.loss_fn,
                               optimizer=optimizer_factory("sgd"), strategy="dp", recompute=True)
    assert compiled.plan.stages[0].recompute     # keeping does not fit even one sample
    for inputs, targets in batches("gpt-tiny", 4, 2, seed=0):
        compiled.step(inputs, targets)
    assert_state_close(compiled.state_dict(), single_device_state("gpt-tiny", 4, steps=2, optimizer="sgd", seed=0),
                       RTOL["sgd"])
