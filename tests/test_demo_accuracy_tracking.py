"""What the memory meter costs an emulated rank beyond its own estimate (autopar.measure.engine_call.
measure_tracking), and how model_costs prices it: emulated types' tables only, spread over the blocks
by their operator counts, scaled like the tables. Pure / in-process: no launch; the meter is a stand-in
whose clock charges a known amount per phase, so the figures are exact up to the real work's noise."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import torch
from torch import nn

from autopar.cluster.emulation import emulation_time_scale
from autopar.cluster.model import Cluster
from autopar.measure import engine_call
from autopar.measure.engine_call import measure_tracking, tracking_batches
from autopar.measure.cache import load_json, measure_cache_path
from autopar.measure.tables import _add_tracking, model_costs
from autopar.passes.analyze import analyze

_EXTRA_S = 0.5        # what the stand-in meter's clock charges per phase beyond the thread's CPU time (the
# real work of a phase is milliseconds; a loaded host moves it by ~10 ms, 2% of this)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    inputs = (torch.randn(4, 16),)
    return model, inputs, analyze(model, inputs), torch.randn(4, 4)


def _probe(extra_s: float = _EXTRA_S, entered: list | None = None):
    """A stand-in for compile's probe: a meter that records being entered, and a clock that runs
    ``extra_s`` ahead per reading while it is entered (each phase is two readings: +extra_s)."""
    def tracking():
        state = {"on": False, "reads": 0}

        @contextlib.contextmanager
        def meter():
            state["on"] = True
            if entered is not None:
                entered.append(1)
            try:
                yield
            finally:
                state["on"] = False

        def cpu() -> float:
            assert state["on"], "the clock is read only under the meter"
            state["reads"] += 1
            return time.thread_time() + extra_s * state["reads"]

        return meter(), cpu
    return tracking


def test_the_batches_timed_are_the_ends_and_the_middle():
    assert tracking_batches([1, 2, 4, 8, 16, 32, 64]) == [1, 8, 64]
    assert tracking_batches([64, 1, 2, 1]) == [1, 2, 64]
    assert tracking_batches([5]) == [5]
    assert tracking_batches([]) == []


def test_the_residual_is_what_the_meters_clock_charges_beyond_plain(cache, tiny):
    model, inputs, an, targets = tiny
    entered: list = []
    got = measure_tracking(an, inputs, [1, 2, 4, 8], tracking=_probe(entered=entered),
                           loss_fn=nn.functional.mse_loss, example_targets=targets, repeats=3, gap_s=0.002)
    assert sorted(got) == [1, 2, 4, 8]
    for f, b in got.values():            # each phase: +extra_s on the stand-in clock, the real work ~equal
        assert f == pytest.approx(_EXTRA_S, abs=0.05) and b == pytest.approx(_EXTRA_S, abs=0.05)
    assert len(entered) == 3 * (1 + 3)   # three batches timed, a warm-up and three repeats each
    assert all(p.grad is None for p in model.parameters())
    keys = [k for k in load_json(measure_cache_path()) if k.startswith("tracking|")]
    assert len(keys) == 3 and any("|b8|" in k for k in keys) and all("|g0.002|loss1|" in k for k in keys)
    # cached: a second call times nothing
    again = measure_tracking(an, inputs, [1, 2, 4, 8], tracking=_probe(entered=entered),
                             loss_fn=nn.functional.mse_loss, example_targets=targets, repeats=3, gap_s=0.002)
    assert again == got and len(entered) == 12


def test_the_residual_is_linear_in_the_rows_between_the_timed_batches(cache, tiny):
    from autopar.measure.cache import save_json

    _, inputs, an, _ = tiny
    path = measure_cache_path()
    measure_tracking(an, inputs, [2, 4, 8], tracking=_probe(0.0), repeats=1, gap_s=0.0)
    data = load_json(path)
    keys = {int(k.split("|b")[1].split("|")[0]): k for k in data if k.startswith("tracking|")}
    assert sorted(keys) == [2, 4, 8]
    for b, k in keys.items():           # known figures at the timed batches
        data[k] = [0.001 * b, 0.002 * b] if b != 4 else [0.010, 0.0]
    save_json(path, data)
    got = measure_tracking(an, inputs, [2, 3, 4, 8], tracking=_probe(0.0), repeats=1, gap_s=0.0)   # cached
    assert got[2] == pytest.approx((0.002, 0.004))
    assert got[3] == pytest.approx((0.006, 0.002))      # half-way between 2 and 4
    assert got[8] == pytest.approx((0.008, 0.016))
    with pytest.raises(ValueError, match="repeats"):
        measure_tracking(an, inputs, [2], tracking=_probe(), repeats=0)
    with pytest.raises(ValueError, match="gap_s"):
        measure_tracking(an, inputs, [2], tracking=_probe(), gap_s=-1.0)


def test_tables_get_it_by_operator_counts_scaled_like_them():
    class S:
        def __init__(self, n):
            self.num_ops = n
    stats = [S(1), S(3), S(0)]
    batches = np.array([1.0, 4.0])
    fwd = {"a": np.zeros((2, 3)), "b": np.ones((2, 3))}
    bwd = {"a": np.zeros((2, 3)), "b": np.ones((2, 3))}
    _add_tracking(fwd, bwd, batches, stats, {"a": 0.5}, {1: (0.004, 0.008), 4: (0.008, 0.016)})
    assert fwd["a"] == pytest.approx(np.array([[0.002, 0.006, 0.0], [0.004, 0.012, 0.0]]))
    assert bwd["a"] == pytest.approx(2 * fwd["a"])
    assert (fwd["b"] == 1).all() and (bwd["b"] == 1).all()        # a type not named is left alone


def _mixed_cluster():
    emu = {"name": "emu", "emulate": "cpu", "speed": 0.5, "memory_GB": 4}
    return Cluster.from_dict({"nodes": [{"devices": [{"device": emu, "count": 1}]},
                                        {"device": "cpu", "count": 1}]})      # this CPU, native: no meter


def test_model_costs_prices_it_on_emulated_types_only(cache, tiny, monkeypatch):
    model, inputs, an, targets = tiny
    cluster = _mixed_cluster()
    residual = {b: (0.001 * b, 0.003 * b) for b in (1, 2, 4)}
    seen = {}

    def fake(analysis, example_inputs, batches, *, tracking, loss_fn=None, example_targets=None):
        seen.update(batches=list(batches), tracking=tracking, loss=loss_fn)
        return {b: residual[b] for b in batches}
    monkeypatch.setattr(engine_call, "measure_tracking", fake)
    kw = dict(model=model, example_inputs=inputs, sample_batches=(1, 2, 4), calibration=None,
              loss_fn=nn.functional.mse_loss, example_targets=targets)
    plain = model_costs(an, cluster, **kw)
    assert not seen                                          # not priced unless a probe is given
    native = next(t for t in plain.sources if t != "emu")
    probe = object()
    priced = model_costs(an, cluster, tracking=probe, **kw)
    assert seen["tracking"] is probe and seen["batches"] == [1, 2, 4] and seen["loss"] is nn.functional.mse_loss
    scale = emulation_time_scale(len(cluster)) / 0.5      # the tables' divisor: speed / time scale
    share = np.array([st.num_ops for st in an.stats], float)
    share /= share.sum()
    for col, (got, base) in enumerate(((priced.fwd_table, plain.fwd_table), (priced.bwd_table, plain.bwd_table))):
        # the second call reads the first's measured tables from the cache: the difference is the residual
        want = np.array([residual[b][col] for b in (1, 2, 4)])[:, None] * share[None, :] * scale
        assert got["emu"] - base["emu"] == pytest.approx(want)
        assert (got[native] == base[native]).all()     # native CPU ranks step without a meter
    assert priced.sources == {"emu": "emulated", native: "measured"}
