"""Calibration (autopar.cost.calibrate, measure_cache's per-machine store): factors fitted from
synthetic profiles recover the distortion that made them, apply to the cost tables, and stay on the
machine that measured them."""

import numpy as np
import pytest

from autopar.measure import cache as measure_cache
from autopar.cost.calibrate import Sample, calibrated, calls_per_step, device_key, fit_factors, samples
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.ir.profile import Event, RankInfo, RankStep, StepProfile


def _profile(truth: dict[str, dict[str, float]], predicted: dict[int, dict[str, float]], types, other_s=0.0):
    """Steps whose measured phases are the predicted ones times ``truth`` (with a little noise)."""
    rng = np.random.default_rng(0)
    steps = []
    for step in range(5):
        for r, pred in predicted.items():
            t, evs = 0.0, []
            for phase in ("forward", "backward", "optimizer"):
                d = pred[phase] * truth[types[r]][phase] * (1 + rng.uniform(-0.01, 0.01))
                evs.append(Event(phase, t, t + d))
                t += d
            steps.append(RankStep(r, step, 0.0, t + other_s, tuple(evs)))
    infos = tuple(RankInfo(r, types[r], predicted=pred) for r, pred in predicted.items())
    return StepProfile("dp", 1.0, infos, tuple(steps))


def test_factors_recover_the_distortion_per_device_type_and_term():
    truth = {"a": {"forward": 1.3, "backward": 0.8, "optimizer": 2.0}, "b": {"forward": 1.1, "backward": 1.6,
                                                                         "optimizer": 1.0}}
    pred = {0: {"forward": 0.01, "backward": 0.02, "optimizer": 0.005},
            1: {"forward": 0.03, "backward": 0.05, "optimizer": 0.004},
            2: {"forward": 0.02, "backward": 0.04, "optimizer": 0.002}}
    plan = Plan("dp", 6, 0, "none", (Stage(0, 1, ((0,), (1,), (2,)), ((1, 1), (2,), (2,))),),
                Predicted(1.0, 6.0, {}))
    # several profiles (runs), so that every term's evidence leaves its factor all but unshrunk
    data = [x for _ in range(8) for x in samples(_profile(truth, pred, {0: "a", 1: "a", 2: "b"}, other_s=0.006),
                                                   {0: "a", 1: "a", 2: "b"}, plan)]
    factors = fit_factors(data)
    for k in ("a", "b"):
        for term, want in truth[k].items():
            assert factors[k][term] == pytest.approx(want, rel=0.02)
    assert calls_per_step(plan, 0) == 3 and calls_per_step(plan, 2) == 2
    assert factors["a"]["call"] == pytest.approx(0.006 / 2.5, rel=0.3)    # median over ranks of other / calls
    assert factors["b"]["call"] == pytest.approx(0.006 / 2)


def test_a_term_with_little_evidence_is_shrunk_toward_one_and_every_factor_bounded():
    from autopar.cost.calibrate import FACTOR_BOUNDS, PRIOR_SHARE

    def run(comm_measured, comm_predicted, n=1):
        return [Sample("a", "forward", 0.1, 0.05), Sample("a", "backward", 0.2, 0.1),
                Sample("a", "comm", comm_measured, comm_predicted)] * n

    # communication 0.1% of the predicted time measured at 1/3 of it: little correction
    tiny = fit_factors(run(0.0001, 0.0003))["a"]
    assert 0.6 < tiny["comm"] < 1.0
    assert tiny["forward"] == pytest.approx(2.0, rel=0.05) and tiny["backward"] == pytest.approx(2.0, rel=0.05)
    # the same ratio on a term that is a third of the step: kept (almost all of its log-ratio)
    big = fit_factors(run(0.025, 0.075))["a"]["comm"]
    assert big == pytest.approx(1 / 3, rel=0.1)
    # more samples of a small term: more of its ratio
    few = fit_factors(run(0.001 / 3, 0.001, n=1))["a"]["comm"]
    many = fit_factors(run(0.001 / 3, 0.001, n=20))["a"]["comm"]
    assert many < few < 1.0 and many == pytest.approx(1 / 3, rel=0.2)
    # bounds: a term measured at 100x its prediction stops at the upper bound; no shrinkage with prior 0
    wild = fit_factors(run(0.5, 0.005, n=10), prior_share=0.0)["a"]["comm"]
    assert wild == FACTOR_BOUNDS[1]
    assert fit_factors(run(0.025, 0.075), prior_share=0.0)["a"]["comm"] == pytest.approx(1 / 3)
    assert PRIOR_SHARE > 0
    with pytest.raises(ValueError, match="bounds"):
        fit_factors(run(1, 1), bounds=(2.0, 4.0))


def test_unsplit_compute_samples_both_terms_and_unknown_terms_are_refused():
    info = RankInfo(0, "a", predicted={"forward": 0.01, "backward": 0.03, "optimizer": 0.01})
    prof = StepProfile("dp", 1.0, (info,), (RankStep(0, 0, 0.0, 0.1, (Event("compute", 0.0, 0.08),)),))
    from autopar.cost.calibrate import FACTOR_BOUNDS

    f = fit_factors(samples(prof, {0: "a"}), prior_share=0.0)
    assert f["a"]["forward"] == f["a"]["backward"] == pytest.approx(2.0)
    assert fit_factors(samples(prof, {0: "a"}))["a"]["forward"] == pytest.approx(2.0, rel=0.03)   # shrunk a little
    assert f["a"]["optimizer"] == FACTOR_BOUNDS[0]          # never measured: the lower bound, not 0
    with pytest.raises(ValueError, match="unknown term"):
        fit_factors([Sample("a", "bogus", 1.0, 1.0)])


def test_machine_factors_take_a_weighted_median_share_of_the_log_ratio_for_other_models():
    from autopar.cost.calibrate import TRANSFER_WEIGHT, fit_machine_factors

    # seven strategies of one model on one device type: five at 1.2x, one priced badly (0.5x), one 1.3x
    ratios = [1.2, 1.2, 1.2, 1.2, 1.2, 0.5, 1.3]
    data = [Sample("a", "compute", r * 0.1, 0.1) for r in ratios] + [
        Sample("a", "optimizer", 0.02, 0.01), Sample("a", "call", 0.006, 3.0), Sample("a", "call", 0.003, 2.0),
        Sample("b", "comm", 0.0, 0.01)]                     # nothing measured: no factor rather than a bound
    f = fit_machine_factors(data)
    assert f["a"]["forward"] == f["a"]["backward"] == pytest.approx(1.2 ** TRANSFER_WEIGHT)   # the outlier ignored
    assert f["a"]["optimizer"] == pytest.approx(2.0 ** TRANSFER_WEIGHT)
    assert f["a"]["call"] == pytest.approx(TRANSFER_WEIGHT * 0.0015)                  # the least per call
    assert "b" not in f
    assert fit_machine_factors(data, weight=1.0)["a"]["forward"] == pytest.approx(1.2)
    assert fit_machine_factors(data, weight=0.0)["a"]["forward"] == 1.0
    # the median is weighted by predicted seconds: a long strategy outweighs several short ones
    heavy = [Sample("a", "compute", 0.9 * 1.0, 1.0)] + [Sample("a", "compute", 1.5 * 0.1, 0.1)] * 3
    assert fit_machine_factors(heavy, weight=1.0)["a"]["forward"] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="unknown term"):
        fit_machine_factors([Sample("a", "forward", 1.0, 1.0)])
    with pytest.raises(ValueError, match="weight"):
        fit_machine_factors(data, weight=1.5)


def test_pooled_samples_give_one_compute_sample_per_rank():
    info = RankInfo(0, "a", predicted={"forward": 0.01, "backward": 0.03, "optimizer": 0.01})
    steps = (RankStep(0, 0, 0.0, 0.1, (Event("forward", 0.0, 0.02), Event("backward", 0.02, 0.08))),)
    got = samples(StepProfile("pp", 1.0, (info,), steps), {0: "a"}, pooled=True)
    compute = [s for s in got if s.term == "compute"]
    assert len(compute) == 1 and compute[0].measured_s == pytest.approx(0.08) and compute[0].predicted_s == 0.04
    assert not any(s.term in ("forward", "backward") for s in got)


def test_calibrated_costs_scale_the_tables_of_the_named_types_only():
    costs = ModelCosts.synthetic({"a": [1e-3, 2e-3], "b": [1e-3, 1e-3]})
    costs.optimizer_s_per_param.update(a=1e-9, b=1e-9)
    out = calibrated(costs, {"key-a": {"forward": 2.0, "backward": 3.0, "optimizer": 4.0, "call": 1e-3}},
                     {"a": "key-a", "b": "key-b"})
    np.testing.assert_allclose(out.fwd_time("a", 4), 2 * costs.fwd_time("a", 4))
    np.testing.assert_allclose(out.bwd_time("a", 4), 3 * costs.bwd_time("a", 4))
    np.testing.assert_allclose(out.fwd_time("b", 4), costs.fwd_time("b", 4))
    assert out.optimizer_time("a", 100) == pytest.approx(4 * costs.optimizer_time("a", 100))
    assert out.call_overhead("a") == pytest.approx(1e-3) and out.call_overhead("b") == 0.0
    assert "calibrated" in out.sources["a"] and "calibrated" not in out.sources["b"]


def test_factors_stay_on_the_machine_that_measured_them(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    measure_cache.save_calibration({"cpu": {"forward": 1.2}})
    measure_cache.save_calibration({"cpu": {"forward": 9.0}}, machine="another machine")
    assert measure_cache.load_calibration() == {"cpu": {"forward": 1.2}}
    monkeypatch.setenv(measure_cache.CALIBRATION_ENV, "off")
    assert measure_cache.load_calibration() == {}


def test_device_keys_name_an_emulated_device_by_speed_and_time_scale():
    from autopar.cluster.model import builtin

    spec = builtin("demo").devices[1].spec
    assert device_key(spec, 3.0) == "cpu-half|emulated x0.5|scale 3"


def test_a_comm_factor_slows_the_device_types_links_for_planning():
    from autopar.cluster.model import builtin
    from autopar.cost import comm
    from autopar.cost.calibrate import calibrated_cluster

    from autopar.cluster.emulation import emulation_time_scale

    demo = builtin("demo")
    keys = [device_key(d.spec, emulation_time_scale(len(demo))) for d in demo.devices]
    slow = calibrated_cluster(demo, {k: {"comm": 4.0} for k in keys}, time_scale=emulation_time_scale(len(demo)))
    nbytes = 64e6
    assert comm.allreduce_time_s(slow, [0, 1, 2], nbytes) > 3 * comm.allreduce_time_s(demo, [0, 1, 2], nbytes)
    assert calibrated_cluster(demo, {}) is demo
    assert [d.spec.name for d in slow.devices] == [d.spec.name for d in demo.devices]
