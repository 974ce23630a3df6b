"""The emulated memory limit (``autopar.runtime.memory``): tracked tensor bytes count each storage once
until it is freed, per thread; passing an emulated device's ``memory_GB`` fails like a CUDA OOM with
the rank and the figures; GPU and native CPU ranks get meters that track nothing; a compiled one-device
run on an emulated device is tracked, under its limit, and refused at run time when a hand-written plan
does not fit."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import threading
from importlib import import_module

import pytest
import torch

import autopar
from autopar.cluster.model import Cluster
from autopar.errors import AutoparError
from autopar.ir.plan import Plan, Predicted, Stage
from autopar.runtime.memory import CudaMeter, MemoryLimitError, NullMeter, TrackedMeter, meter_for, module_tensors


def _cluster(memory_gb: float, emulate: bool = True) -> Cluster:
    dev = {"name": "cpu-small", "emulate": "cpu", "speed": 1.0, "memory_GB": memory_gb} if emulate else \
        {"name": "host", "tflops": 1, "memory_GB": memory_gb, "mem_bandwidth_GBps": 10}
    return Cluster.from_dict({"nodes": [{"device": dev, "count": 1}]})


@pytest.fixture(autouse=True)
def _fresh_group(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    yield
    import_module("autopar.runtime.launcher").shutdown()


def test_tracked_bytes_count_each_storage_once_until_freed():
    meter = TrackedMeter(rank=0)
    with meter:
        a = torch.ones(1000)                 # 4000 bytes
        v = a.view(10, 100)                  # a view: the same storage
        b = a * 2                            # a new storage
        assert meter.current_bytes == 8000
        del b
        assert meter.current_bytes == 4000
        c = torch.empty(250)
        del c
    assert meter.current_bytes == 4000 and meter.peak_bytes == 8000
    meter.reset_peak()
    assert meter.peak_bytes == 4000
    outside = torch.ones(10_000)             # made while no meter is active: not counted
    assert meter.current_bytes == 4000
    meter.track([outside, outside[:5]])      # counted once when tracked explicitly
    assert meter.current_bytes == 44_000
    del a, v, outside
    assert meter.current_bytes == 0
    model = torch.nn.Linear(10, 10)
    assert sum(t.numel() for t in module_tensors(model)) == 110


def test_autograd_state_is_tracked_and_freed():
    meter = TrackedMeter(rank=0, record=True)
    model = torch.nn.Linear(64, 64)
    meter.track(module_tensors(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with meter:
        for _ in range(2):
            model(torch.randn(8, 64)).square().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    state = 3 * (64 * 64 + 64) * 4           # weights + momentum, and the gradient at the peak
    assert meter.current_bytes == 2 * (64 * 64 + 64) * 4     # gradients freed, momentum kept
    assert state <= meter.peak_bytes < state + 16 * 1024     # + activations and temporaries
    assert meter.peak_snapshot and all(n > 0 for _, _, n in meter.peak_snapshot)


def test_passing_the_limit_fails_like_an_oom_naming_rank_and_figures():
    meter = TrackedMeter(rank=2, limit_bytes=10_000, device_name="cpu-small")
    with pytest.raises(MemoryLimitError) as info, meter:
        keep = [torch.zeros(1000)]           # 4000 bytes
        keep.append(torch.zeros(1000))       # 8000
        keep.append(torch.zeros(1000))       # 12000 > 10000
    err = info.value
    assert isinstance(err, AutoparError) and isinstance(err, RuntimeError)
    assert err.rank == 2 and err.used_bytes == 12_000 and err.limit_bytes == 10_000
    assert "rank 2 (cpu-small)" in str(err) and "12000 bytes" in str(err) and "10000 bytes" in str(err)
    with pytest.raises(AutoparError, match="limit_bytes"):
        TrackedMeter(limit_bytes=0)


def test_threads_track_only_their_own_tensors():
    meters, held, ready = [TrackedMeter(rank=r) for r in range(2)], {}, threading.Barrier(2)

    def rank(r: int) -> None:
        with meters[r]:
            held[r] = torch.zeros(1000 * (r + 1))
            ready.wait()                      # both ranks allocate while the other's meter is active
            held[(r, "sum")] = held[r].sum()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [m.current_bytes for m in meters] == [4004, 8004]


def test_meter_for_each_kind_of_rank():
    emulated = _cluster(0.001).devices[0]
    m = meter_for(emulated, 0, "cpu")
    assert isinstance(m, TrackedMeter) and m.limit_bytes == emulated.spec.memory_bytes == round(0.001 * 2**30)
    assert isinstance(meter_for(emulated, 0, "cpu", track=False), NullMeter)
    native = _cluster(4, emulate=False).devices[0]
    assert isinstance(meter_for(native, 0, "cpu"), NullMeter)
    tracked = meter_for(native, 0, "cpu", track=True)
    assert isinstance(tracked, TrackedMeter) and tracked.limit_bytes is None
    assert isinstance(meter_for(native, 0, torch.device("cuda", 0)), CudaMeter)   # nothing touches CUDA yet
    null = NullMeter()
    with null:
        torch.ones(3)
    assert null.peak_bytes is None


def test_compiled_run_is_tracked_and_a_plan_that_does_not_fit_fails_at_run_time():
    case = autopar.models.build("mlp-tiny")
    state = 16 * sum(p.numel() for p in case.model.parameters())     # fp32 weights, grads, AdamW
    compiled = autopar.compile(case.model, _cluster(64 * state / 2**30), case.example_inputs, 8, case.loss_fn,
                               strategy="dp", zero_stage=0, measure=False)
    for s in range(2):
        compiled.step(*case.batch(8, seed=s))
    meter = compiled.memory
    assert isinstance(meter, TrackedMeter) and state <= meter.peak_bytes < meter.limit_bytes
    # A hand-written plan is taken as given; on a device of half the state it fails in its first step
    # (or while the engine is built), naming the rank.
    plan = Plan(strategy="dp", global_batch_size=8, zero_stage=0, schedule="none",
                stages=(Stage(0, compiled.plan.stages[0].block_stop, groups=((0,),), micro_batches=((8,),)),),
                predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))
    import_module("autopar.runtime.launcher").shutdown()
    case = autopar.models.build("mlp-tiny")
    with pytest.raises(MemoryLimitError, match=r"rank 0 \(cpu-small\): out of memory"):
        tight = autopar.compile(case.model, _cluster(state / 2 / 2**30), case.example_inputs, 8, case.loss_fn,
                                strategy=plan)
        tight.step(*case.batch(8, seed=0))


def test_the_clock_of_an_emulated_rank_does_not_stretch_the_tracking():
    import time

    from autopar.runtime.memory import TrackedMeter, cpu_time_less_tracking, tracking_cost_per_op_s

    meter = TrackedMeter()
    clock = cpu_time_less_tracking(meter)
    x = torch.ones(8)
    with meter:
        for _ in range(100):
            x = x + 1
    assert meter.num_ops >= 100 and meter.overhead_s == meter.num_ops * tracking_cost_per_op_s() >= 0
    assert clock() <= time.thread_time()
    assert cpu_time_less_tracking(None) is time.thread_time
