"""The per-device cost model: calibration recovers known efficiencies, measurement of real blocks,
emulated devices scale with their speed, roofline tables for device types not at hand."""

import numpy as np
import pytest

import autopar.models as zoo
from autopar.cluster.model import Cluster, builtin
from autopar.cost.profile import calibrate, roofline_features
from autopar.measure.blocks import measure_blocks
from autopar.measure.tables import model_costs
from autopar.passes.analyze import analyze


def test_calibrate_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    feats = rng.uniform(0, 1e-3, size=(40, 6))
    feats[:, 4] = rng.integers(10, 200, size=40)
    feats[:, 5] = rng.integers(1, 20, size=40)
    truth = np.array([1.7, 2.5, 1.3, 1.1, 3e-6, 2e-5])
    eff = calibrate(feats, feats @ truth)
    np.testing.assert_allclose(eff.as_array(), truth, rtol=1e-6)


def test_roofline_features_scale_with_the_micro_batch():
    case = zoo.build("gpt2-small", device="meta")
    a = analyze(case.model, case.example_inputs)
    layer = a.stats[1]
    f1 = roofline_features(layer, 4, a.batch_size, 1e14, 1e12)
    f2 = roofline_features(layer, 8, a.batch_size, 1e14, 1e12)
    assert f2[0] == pytest.approx(2 * f1[0], rel=1e-6)  # matmul FLOPs dominate: linear in the batch
    assert roofline_features(layer, 4, a.batch_size, 1e14, 1e12, backward=True)[0] > f1[0]


@pytest.fixture(scope="module")
def tiny(shared_cache_root):
    import os

    os.environ["AUTOPAR_CACHE_DIR"] = str(shared_cache_root)
    case = zoo.build("gpt-tiny")
    return case, analyze(case.model, case.example_inputs)


def test_measured_blocks_are_positive_and_identical_blocks_share(tiny):
    case, a = tiny
    m = measure_blocks(a, case.model, case.example_inputs, [1, 4], repeats=1)
    for b in (1, 4):
        assert (m[b] > 0).all()
        layers = m[b][:, 1:-1]
        assert (layers == layers[:, :1]).all()  # one measurement copied to the identical layers


def test_emulated_types_scale_with_speed(tiny):
    case, a = tiny
    costs = model_costs(a, builtin("demo"), model=case.model, example_inputs=case.example_inputs)
    assert set(costs.sources.values()) == {"emulated"}
    full, quarter = costs.step_time("cpu-full", 8), costs.step_time("cpu-quarter", 8)
    assert quarter == pytest.approx(4 * full, rel=1e-9)


def test_roofline_for_devices_not_at_hand_orders_by_speed():
    case = zoo.build("gpt2-xl", device="meta")
    a = analyze(case.model, case.example_inputs)
    cl = Cluster.from_yaml("benchmarks/clusters/mixed-3.yaml")
    costs = model_costs(a, cl, model=case.model)
    assert set(costs.sources.values()) == {"roofline"}
    h100, a100, v100 = (costs.step_time(t, 8) for t in ("H100-80GB", "A100-40GB", "V100-16GB"))
    assert h100 < a100 < v100
    assert costs.state_bytes() == pytest.approx(case.num_params_expected * 16, rel=1e-6)


def test_tuned_kernel_times_replace_the_roofline_of_the_nodes_they_cover(tmp_path, monkeypatch):
    from autopar.kernels.cache import invalidate, shape_bucket, write_entries

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    invalidate()
    case = zoo.build("gpt2-small", device="meta")
    a = analyze(case.model, case.example_inputs)
    cl = Cluster.homogeneous("H100-80GB", count=1)
    before = model_costs(a, cl, model=case.model)
    # A (pretend) tuning run on an H100 found LayerNorm 1 ms forward and 2 ms backward at this shape.
    shape = (a.batch_size, case.config.seq_len, case.config.hidden_size)
    import torch
    write_entries([("NVIDIA H100 80GB HBM3", k, shape_bucket(k, shape, torch.bfloat16),
                    {"time_s": t, "shape": list(shape)}) for k, t in (("layer_norm", 1e-3), ("layer_norm.bwd", 2e-3))])
    after = model_costs(a, cl, model=case.model)
    invalidate()
    assert after.sources["H100-80GB"] == "roofline + tuned Triton kernels"
    # Each layer has two LayerNorms: about +2 ms forward and +4 ms backward at the analysis batch.
    df = after.fwd_time("H100-80GB", a.batch_size)[1] - before.fwd_time("H100-80GB", a.batch_size)[1]
    db = after.bwd_time("H100-80GB", a.batch_size)[1] - before.bwd_time("H100-80GB", a.batch_size)[1]
    assert df == pytest.approx(2e-3, rel=0.1) and db == pytest.approx(4e-3, rel=0.1)
