"""Structural facts behind the no-overhead runtime (speed itself is measured in
benchmarks/bench_overhead.py, never asserted here): a one-device plan on a native CPU device issues no
collective and keeps no flat buffer; on several ranks the flat gradient buffers are allocated once and
every parameter's gradient is a view of them, step after step."""

from __future__ import annotations

from importlib import import_module

import pytest
import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests

import autopar
from autopar.runtime.emulate import NullClock
from oracle import RTOL, assert_state_close, batches, optimizer_factory, single_device_state, threaded_ranks
from test_dp_engine import make_engine, train

NATIVE = {"nodes": [{"device": "cpu", "count": 1}]}
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter_tensor", "reduce_scatter_single", "barrier", "broadcast_object_list")


@pytest.fixture
def _fresh_group(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    yield
    import_module("autopar.runtime.launcher").shutdown()


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_one_native_device_runs_the_plain_loop(_fresh_group, monkeypatch, zero_stage):
    case = autopar.models.build("gpt-tiny", seed=0)
    compiled = autopar.compile(case.model, autopar.Cluster.from_dict(NATIVE), case.example_inputs, 8,
                               case.loss_fn, optimizer=optimizer_factory("sgd"), strategy="dp",
                               zero_stage=zero_stage, measure=False)   # one device: the tables cannot matter
    engine = compiled.engine
    assert isinstance(engine.clock, NullClock), "device: cpu is native: no emulation clock"
    calls = []
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: calls.append(_n))
    for inputs, targets in batches("gpt-tiny", 8, 2, seed=0):
        compiled.step(inputs, targets)
    assert calls == [], f"a one-rank plan issued collectives: {calls}"
    assert engine.sync is None            # alone: no flat buffer, no sharded optimizer
    assert engine.optimizer.param_groups[0]["params"][0] is next(engine.model.parameters())
    assert_state_close(compiled.state_dict(), single_device_state("gpt-tiny", 8, steps=2, optimizer="sgd", seed=0),
                       RTOL["sgd"])


class TwoRanks(threaded_ranks(2)):
    def _check_kept(self, zero_stage):
        engine = make_engine("gpt-tiny", ((5, 4), (3,)), zero_stage, "sgd", self.rank, self.world_size)
        sync = engine.sync
        flats = list(sync.grad_flats)
        params = list(sync.param_flats)
        train(engine, "gpt-tiny", steps=1)
        ptrs = [f.data_ptr() for f in flats]
        train(engine, "gpt-tiny", steps=2)
        assert [f.data_ptr() for f in sync.grad_flats] == ptrs
        assert all(a is b for a, b in zip(sync.grad_flats, flats)), "flat buffers re-allocated"
        assert all(a is b for a, b in zip(sync.param_flats, params)), "parameter buffers re-allocated"
        return engine, flats

    def test_zero0_grads_are_views_of_one_flat_buffer(self):
        engine, flats = self._check_kept(0)
        lo, hi = flats[0].data_ptr(), flats[0].data_ptr() + flats[0].numel() * flats[0].element_size()
        for p in engine.sync.params:
            assert p.grad is not None and lo <= p.grad.data_ptr() < hi

    def test_zero1_steps_shards_of_the_kept_buffer(self):
        engine, flats = self._check_kept(1)
        shard_params = engine.sync.shard_params
        assert shard_params and all(sp.grad is None for sp, _, _ in shard_params)
        # the shard Parameters are views of the parameter buffer: the step updates the weights in place
        lo = engine.sync.param_flats[0].data_ptr()
        assert all(lo <= sp.data_ptr() < lo + engine.sync.param_flats[0].nbytes for sp, _, _ in shard_params)


if __name__ == "__main__":
    run_tests()
