"""Step profiles (autopar.ir.profile, autopar.runtime.emulate's PhaseRecorder, compiled.profile()):
phases are labelled and disjoint, waits are split off collectives, the JSON round trip holds, and a
recorded run trains exactly as an unrecorded one."""

import threading
import time
from importlib import import_module

import pytest
import torch

import autopar
from autopar.cluster.model import Cluster
from autopar.ir.profile import Event, RankInfo, RankStep, StepProfile, from_records
from autopar.runtime.emulate import NullClock
from autopar.runtime.recorder import PhaseRecorder, RankSteps, recorded_step

from oracle import assert_state_close, batches, optimizer_factory, single_device_state, threaded_ranks

_LOCK = threading.Lock()
ONE = Cluster.from_dict({"nodes": [{"device": {"name": "cpu", "emulate": "cpu", "speed": 1.0, "memory_GB": 2},
                                    "count": 1}]})


def _busy(s: float) -> None:
    t = time.perf_counter() + s
    while time.perf_counter() < t:
        pass


def test_blocks_are_cut_at_the_marks_and_around_communication():
    # 10 ms between the marks and inside the collective, 2 ms of tolerance: a loaded machine may
    # preempt the thread between a perf_counter read and the mark's (0.13 ms seen in CI)
    clock = NullClock()
    rec = PhaseRecorder(0)
    clock.recorder = rec
    with recorded_step(clock):
        with clock.compute():           # forward, then backward, as a data-parallel micro-step
            _busy(0.002)
            t_fwd = time.perf_counter()
            rec.mark("fwd_end")
            _busy(0.01)
            t_bwd = time.perf_counter()
            rec.mark("bwd_start")
            _busy(0.002)
            t0 = time.perf_counter()
            _busy(0.01)
            rec.comm("all_reduce", t0, 64, (0, 1))    # inside the block (tensor parallelism): cut out
            t1 = time.perf_counter()
            _busy(0.001)
        with clock.compute("optimizer"):
            _busy(0.001)
    (index, s0, s1, events), = rec.snapshot().steps
    phases = [e[0] for e in events]
    assert phases == ["all_reduce", "forward", "backward", "backward", "optimizer"]
    fwd = [e for e in events if e[0] == "forward"][0]
    assert fwd[2] == pytest.approx(t_bwd, abs=2e-3)       # the loss between the marks counts as forward
    bwd = [e for e in events if e[0] == "backward"]
    assert bwd[0][1] == pytest.approx(t_bwd, abs=2e-3) and bwd[0][2] <= t0 + 2e-3 and bwd[1][1] >= t1 - 2e-3
    assert t_fwd < t_bwd
    ordered = sorted((e[1], e[2]) for e in events)
    assert all(a1 <= b0 + 1e-9 for (_, a1), (b0, _) in zip(ordered, ordered[1:])), "phases overlap"


def test_waits_are_split_off_collectives_and_receives():
    # rank 1 enters the all-reduce 30 ms after rank 0: rank 0 waited 30 ms of its 35
    r0 = RankSteps(0, "h", ((0, 10.0, 10.1, (("forward", 10.0, 10.02, 0, None),
                                             ("all_reduce", 10.02, 10.055, 8, ("all_reduce", (0, 1), 0)),
                                             ("send", 10.06, 10.061, 4, (0, 1, 7, 0)))),))
    r1 = RankSteps(1, "h", ((0, 10.0, 10.1, (("forward", 10.0, 10.05, 0, None),
                                             ("all_reduce", 10.05, 10.055, 8, ("all_reduce", (0, 1), 0)),
                                             ("recv", 10.055, 10.07, 4, (0, 1, 7, 0)))),))
    infos = (RankInfo(0, "a", predicted={"forward": 0.02}), RankInfo(1, "b", predicted={"forward": 0.05}))
    prof = from_records([r0, r1], infos, "dp", 0.1)
    m0, m1 = prof.measured(0), prof.measured(1)
    assert m0["wait"] == pytest.approx(0.03) and m0["all_reduce"] == pytest.approx(0.005)
    assert m1["all_reduce"] == pytest.approx(0.005)
    assert m1["wait"] == pytest.approx(0.005)          # the receive waited until the send was posted
    assert m1["p2p"] == pytest.approx(0.010)
    assert prof.step_times_s() == pytest.approx((0.1,))
    back = StepProfile.from_json(prof.to_json())
    assert back == prof
    worst = prof.gaps("phase")[0]
    assert worst.key == "other" or abs(worst.gap_s) >= abs(prof.gaps("phase")[-1].gap_s)


def test_sleep_is_folded_into_the_compute_it_stretches():
    step = RankStep(0, 0, 0.0, 0.1, (Event("forward", 0.0, 0.01), Event("backward", 0.01, 0.03),
                                     Event("sleep", 0.03, 0.09)))
    folded = step.phase_s(fold_sleep=True)
    assert folded["forward"] == pytest.approx(0.03) and folded["backward"] == pytest.approx(0.06)
    assert step.phase_s()["sleep"] == pytest.approx(0.06) and folded["other"] == pytest.approx(0.01)


@pytest.fixture
def _fresh_group(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    yield
    import_module("autopar.runtime.launcher").shutdown()


def test_compiled_profile_of_a_recorded_run_that_trains_exactly(_fresh_group):
    case = autopar.models.build("mlp-tiny", seed=0)
    compiled = autopar.compile(case.model, ONE, case.example_inputs, 8, case.loss_fn,   # roofline tables: quick
                               optimizer=optimizer_factory("sgd"), strategy="dp", measure=False)
    for inputs, targets in batches("mlp-tiny", 8, 3, seed=0):
        compiled.step(inputs, targets)
    assert_state_close(compiled.state_dict(), single_device_state("mlp-tiny", 8, steps=3, optimizer="sgd", seed=0),
                       1e-4)
    prof = compiled.profile(last=2)
    assert prof.step_indices() == (1, 2) and prof.emulated
    meas = prof.measured(0)
    assert meas["forward"] > 0 and meas["backward"] > 0 and meas["optimizer"] > 0
    pred = prof.rank_info(0).predicted
    assert pred["forward"] > 0 and pred["backward"] > 0 and pred["optimizer"] > 0
    assert {g.key for g in prof.gaps("device_type")} == {"cpu"}
    # the emulated clock's sleep (none when a loaded machine made the blocks overrun) is its own phase;
    # folded into the compute it stretches, the step's phases still sum to its wall time
    step = prof.steps[-1]
    folded = step.phase_s(fold_sleep=True)
    assert sum(v for k, v in folded.items() if k != "p2p") == pytest.approx(step.wall_s, rel=1e-6)


class TwoRanks(threaded_ranks(2)):
    def test_data_parallel_collectives_are_recorded_with_their_waits(self):
        from autopar.ir.plan import Plan, Predicted, Stage
        from autopar.lowering import lower
        from autopar.passes.analyze import analyze
        from autopar.runtime.communicator import pg_all_gather_objects
        from autopar.runtime.dp import DataParallelEngine
        from autopar.runtime.recorder import record_engine
        from autopar.runtime.engine import EngineInputs

        with _LOCK:     # capture and analysis run autograd: one thread at a time (as test_dp_engine does)
            case = autopar.models.build("mlp-tiny", seed=0)
            gm = analyze(case.model, case.example_inputs).captured.gm
        plan = Plan(strategy="dp", global_batch_size=8, zero_stage=1, schedule="none",
                    stages=(Stage(0, 1, groups=((0,), (1,)), micro_batches=((2, 2), (4,))),),
                    predicted=Predicted(step_time_s=0.0, samples_per_s=0.0, memory_bytes={}))
        engine = DataParallelEngine(EngineInputs(
            gm=gm, model=case.model, plan=plan, loss_fn=case.loss_fn, optimizer_factory=optimizer_factory("sgd"),
            rank=self.rank, world_size=2, device=torch.device("cpu"), clock=NullClock()),
            lower(plan, gm, self.rank, params=[p for p in case.model.parameters() if p.requires_grad]), overlap=False)
        rec = record_engine(engine, self.rank)
        x, y = case.batch(8, seed=1)
        for _ in range(2):
            with recorded_step(engine.clock):
                if self.rank == 1:
                    time.sleep(0.3)       # a straggler: rank 0 waits for it in the first collective (long
                    #                       beside rank 0's own step, which a loaded host stretched to 15 ms)
                engine.step(x, y)
        records = pg_all_gather_objects(rec.snapshot())
        prof = from_records(records, (RankInfo(0, "cpu"), RankInfo(1, "cpu")), "dp", 0.0)
        m0 = prof.measured(0)
        assert m0["wait"] >= 0.2, m0
        assert m0.get("all_reduce", 0) + m0.get("all_gather", 0) + m0.get("reduce_scatter", 0) > 0
        assert prof.measured(1).get("wait", 0.0) < m0["wait"]
        assert m0["forward"] > 0 and m0["backward"] > 0 and m0["optimizer"] > 0


class TwoRanksAsync(threaded_ranks(2)):
    def test_an_asynchronous_collective_is_recorded_at_its_wait_with_the_peer_wait_split_off(self):
        from autopar.runtime.communicator import pg_all_gather_objects, pg_all_reduce_async

        clock = NullClock()
        rec = PhaseRecorder(self.rank)
        clock.recorder = rec
        with recorded_step(clock):
            if self.rank == 1:
                time.sleep(0.03)                   # issues 30 ms after rank 0
            pending = pg_all_reduce_async(torch.ones(4))
            pending.wait()
        records = pg_all_gather_objects(rec.snapshot())
        prof = from_records(records, (RankInfo(0, "cpu"), RankInfo(1, "cpu")), "dp", 0.0)
        assert prof.measured(0)["wait"] >= 0.02
        assert prof.measured(0)["all_reduce"] >= 0 and prof.measured(1).get("wait", 0.0) < 0.01


class _FakeTime:
    """CPU and wall time a test advances by hand; sleeping advances the wall only."""
    cpu = wall = 0.0

    def sleep(self, s):
        self.wall += s


def _fake_timed_clock(**options):
    """An emulated clock at speed 0.5 on a ``_FakeTime``."""
    from autopar.runtime.emulate import EmulatedClock

    ft = _FakeTime()
    return ft, EmulatedClock(0.5, cpu_time=lambda: ft.cpu, wall_time=lambda: ft.wall, sleep=ft.sleep, **options)


def _step_walls(ft, clock, steps) -> list[float]:
    """Run ``steps`` (per step, each block's CPU seconds) on ``clock``; each step's wall time."""
    walls = []
    for work in steps:
        clock.begin_step()
        w0 = ft.wall
        for cpu in work:
            with clock.compute():
                ft.cpu += cpu
                ft.wall += cpu
        walls.append(ft.wall - w0)
    return walls


def test_a_steady_clock_charges_each_block_position_its_least_cpu_time():
    ft, clock = _fake_timed_clock(steady=True)
    walls = _step_walls(ft, clock, ((0.010, 0.005), (0.020, 0.004), (0.012, 0.006)))   # step 2's first block was inflated
    # targets: 2 x the CPU time; from step 3 (two steps of one layout seen) the least at each position
    assert walls[0] == pytest.approx(2 * 0.015)
    assert walls[1] == pytest.approx(2 * 0.024)
    assert walls[2] == pytest.approx(2 * (0.010 + 0.004))


def test_a_steady_clock_compares_positions_only_between_steps_of_one_layout():
    # the first step cuts an extra small block early (a collective run once): its positions do not
    # line up with later steps', so its small blocks must not become their minima
    ft, clock = _fake_timed_clock(steady=True)
    walls = _step_walls(ft, clock, ((0.010, 0.001, 0.020), (0.010, 0.020), (0.011, 0.021), (0.012, 0.022)))
    assert walls[1] == pytest.approx(2 * 0.030)     # its own: the previous step's layout differs
    assert walls[2] == pytest.approx(2 * 0.032)     # its own: one step of this layout seen so far
    assert walls[3] == pytest.approx(2 * 0.030)     # the least of steps 2 to 4, position by position


def test_communication_inside_a_block_is_not_counted_towards_its_target():
    ft, clock = _fake_timed_clock()
    with clock.compute():
        ft.cpu += 0.01
        ft.wall += 0.01
        with clock.paused():          # a tensor-parallel all-reduce: 20 ms blocked, no CPU
            ft.wall += 0.02
        ft.cpu += 0.01
        ft.wall += 0.01
    assert ft.wall == pytest.approx(0.02 + 0.02 + 0.02)   # both halves at half speed, plus the wait
    assert clock.num_blocks == 1 and clock.num_overruns == 0
