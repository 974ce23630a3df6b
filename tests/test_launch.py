"""The runtime base: launch/init/context, failure handling, and emulated-device clocks.

Real multi-process gloo launches are few (they cost seconds each here): a happy path (two launches at
once), a rank raising mid-loop, and a hung rank. Parent-side failure detection (signals, the overall
timeout) is tested on plain sleeping processes, without torch.distributed.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autopar.cluster.model import Cluster
from autopar.errors import LaunchError
from autopar.runtime import emulate
from autopar.runtime.emulate import ClockStats, CpuShare, EmulatedClock, NullClock, clock_for, cpu_shares
from autopar.runtime.launcher import (context, default_backend, init, is_initialized, launch, shutdown,
                                    subgroup_backend)

# The package re-exports the function ``launch``, which shadows the module of the same name.
launch_mod = importlib.import_module("autopar.runtime.launcher")


def _slow_cluster(count: int = 3, speed: float = 0.5) -> Cluster:
    return Cluster.from_dict({"nodes": [{"device": {"name": "slow", "emulate": "cpu", "speed": speed,
                                                    "memory_GB": 2}, "count": count}]})


def _children() -> dict[int, str]:
    """pid -> "state cmdline" of this process's live children (from /proc, no psutil)."""
    out = {}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            out[int(pid)] = f"{state} {cmd}"
    return out


def _new_children(before: dict[int, str]) -> dict[int, str]:
    return {pid: what for pid, what in _children().items()
            if pid not in before and "resource_tracker" not in what}


def _listening(pid: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp and tcp6 write them) of every listening TCP socket
    that process ``pid`` holds: its socket inodes from /proc/PID/fd matched to the LISTEN rows."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:   # state 0A: LISTEN
                out.append(f[1])
    return out


_LOOPBACK_HEX = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


# --- functions run by the ranks (module level: spawn pickles them by reference) ---------------------

def _happy(rank: int, scale: float):
    ctx = context()
    t = torch.full((4,), float(rank + 1) * scale)
    dist.all_reduce(t)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    big = torch.arange(1000.0, requires_grad=True)
    with clock_for(ctx.cluster.devices[rank]).compute():
        sum(i * i for i in range(2000))
    listening = _listening(os.getpid()) + (_listening(os.getppid()) if rank == 0 else [])   # the launcher's too
    dist.barrier()      # every rank's sockets are open while each looks
    return {"listening": listening,"rank": ctx.rank, "world_size": ctx.world_size, "sum": t, "state": model.state_dict(),
            "view": big[:2] * 1, "speed": ctx.speed, "device": str(ctx.device),
            "backend": ctx.backend, "threads": torch.get_num_threads(), "env_rank": os.environ["RANK"],
            "interop_threads": torch.get_num_interop_threads(), "affinity": sorted(os.sched_getaffinity(0)),
            "oversubscription": emulate.oversubscription(ctx.world_size),
            "pair": (rank, [t.clone()]),
            "ifnames": (os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME"))}


def _raise_at_step_2(rank: int):
    t = torch.ones(8)
    for step in range(5):
        if rank == 1 and step == 2:
            raise ValueError(f"boom at step {step}")
        dist.all_reduce(t)          # the other ranks block here at step 2
    return float(t[0])


def _hang_rank_0(rank: int):
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 0:
        time.sleep(600)
    dist.all_reduce(t)
    return float(t[0])


def _hang_rank_0_in_a_sub_group(rank: int):
    """As a TP or pipeline group does: ranks 0 and 1 in a sub-group, rank 0 never reaching its collective."""
    from autopar.runtime.communicator import pg_new_group

    group = pg_new_group([0, 1])
    t = torch.ones(2)
    if rank == 0:
        time.sleep(600)
    if rank in (0, 1):
        dist.all_reduce(t, group=group)
    return float(t[0])


# --- real launches ---------------------------------------------------------------------------------

@pytest.mark.launch
@pytest.mark.timeout(120)
def test_launch_returns_values_by_rank_and_all_reduce_works_two_launches_at_once():
    clusters = [_slow_cluster(3), _slow_cluster(2, speed=0.25)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(launch, _happy, c, scale, timeout_s=100)
                   for c, scale in zip(clusters, (1.0, 10.0))]
        results = [f.result() for f in futures]

    torch.manual_seed(0)
    expected_state = torch.nn.Linear(3, 2).state_dict()
    for (cluster, scale, speed), res in zip([(clusters[0], 1.0, 0.5), (clusters[1], 10.0, 0.25)],
                                            results):
        n = len(cluster)
        assert [r["rank"] for r in res] == list(range(n))
        for rank, r in enumerate(res):
            assert r["world_size"] == n and r["env_rank"] == str(rank)
            assert torch.equal(r["sum"], torch.full((4,), scale * n * (n + 1) / 2))
            assert type(r["state"]) is OrderedDict and list(r["state"]) == ["weight", "bias"]
            for k, v in expected_state.items():
                assert torch.equal(r["state"][k], v)
            assert r["view"].shape == (2,) and not r["view"].requires_grad
            assert r["view"].untyped_storage().nbytes() == 2 * 4      # a clone, not the 1000-float base
            assert r["speed"] == speed and r["device"] == "cpu" and r["backend"] == "gloo"
            share = cpu_shares(cluster)[rank]
            assert r["threads"] == share.num_threads == 1          # emulated: one thread, its clock's
            assert r["interop_threads"] == 1
            assert r["affinity"] == list(share.cores)
            # the time scale counts the cores the launch shared out, not the one this rank is pinned to
            assert r["oversubscription"] == emulate.oversubscription(n, len(os.sched_getaffinity(0)))
            assert r["pair"][0] == rank and torch.equal(r["pair"][1][0], r["sum"])
            if sys.platform.startswith("linux"):     # one machine: gloo's and NCCL's sockets on loopback
                assert r["ifnames"] == ("lo", "lo")
                # every socket the job listens on (the rendezvous store, gloo's) is on loopback
                assert r["listening"] and all(a.split(":")[0] in _LOOPBACK_HEX for a in r["listening"]), r["listening"]
        if sys.platform.startswith("linux"):
            assert len(res[0]["listening"]) > len(res[1]["listening"])   # the launcher's store was seen


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_a_rank_raising_mid_loop_stops_every_rank_and_names_it():
    before = _children()
    with pytest.raises(LaunchError) as info:
        launch(_raise_at_step_2, _slow_cluster(3))
    err = info.value
    assert err.rank == 1
    message = str(err)
    assert "rank 1 (slow) failed: ValueError: boom at step 2" in message
    assert "Traceback" in message and "_raise_at_step_2" in message
    assert _new_children(before) == {}


@pytest.mark.launch
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", [_hang_rank_0, _hang_rank_0_in_a_sub_group])
def test_a_hung_rank_makes_peers_time_out_and_is_named(fn):
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(fn, _slow_cluster(3), step_timeout_s=2.0)
    assert time.monotonic() - t0 < 2.0 + 30     # the step timeout and a margin, in any group
    assert info.value.rank == 0
    assert "rank 0 (slow) hung" in str(info.value)
    assert "step_timeout_s=2.0" in str(info.value)
    assert _new_children(before) == {}


def _on_device(rank: int):
    ctx = context()
    t = torch.full((3,), float(rank), device=ctx.device)
    dist.all_reduce(t.cpu() if ctx.backend == "gloo" else t)
    return {"device": str(ctx.device), "t": t, "backend": ctx.backend}


@pytest.mark.launch
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(180)
def test_gpu_ranks_get_cuda_devices_and_results_come_back_on_cpu():
    n = torch.cuda.device_count()
    res = launch(_on_device, Cluster.homogeneous("A100-80GB", count=n), timeout_s=150)
    assert [r["device"] for r in res] == [f"cuda:{i}" for i in range(n)]
    assert all(r["backend"] == "nccl" and r["t"].device.type == "cpu" for r in res)
    mixed = Cluster.from_dict({"nodes": [
        {"device": "A100-80GB", "count": 1},
        {"device": {"name": "slow", "emulate": "cpu", "speed": 0.5, "memory_GB": 2}, "count": 1}]})
    res = launch(_on_device, mixed, timeout_s=150)
    assert [r["device"] for r in res] == ["cuda:0", "cpu"]
    assert all(r["backend"] == "gloo" for r in res)


# --- parent-side failure detection on plain processes ----------------------------------------------

def _start(targets):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=t, args=a) for t, a in targets]
    for p in procs:
        p.start()
    return procs


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_monitor_names_a_rank_killed_by_a_signal_and_kills_the_rest():
    procs = _start([(time.sleep, (60,)), (time.sleep, (0,)), (time.sleep, (60,))])
    os.kill(procs[2].pid, signal.SIGKILL)
    procs[1].join()
    procs[2].join()
    with tempfile.TemporaryDirectory() as d, pytest.raises(LaunchError) as info:
        torch.save(1, launch_mod._result_path(Path(d), 1))      # rank 1 finished normally
        launch_mod._monitor(procs, Path(d), None, None, 60.0, _slow_cluster(3))
    assert info.value.rank == 2
    message = str(info.value)
    assert "rank 2 (slow) failed: process killed by signal SIGKILL without reporting" in message
    assert "rank 0: still running, killed" in message
    assert "rank 1" not in message
    assert not any(p.is_alive() for p in procs)


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_monitor_enforces_the_overall_timeout():
    procs = _start([(time.sleep, (60,)), (time.sleep, (0,)), (time.sleep, (60,))])
    with tempfile.TemporaryDirectory() as d:
        for r in (1,):   # rank 1 finishes with a result
            torch.save(r, launch_mod._result_path(Path(d), r))
        with pytest.raises(LaunchError) as info:
            launch_mod._monitor(procs, Path(d), time.monotonic() + 1.0, 1.0, 60.0, _slow_cluster(3))
    assert "timed out after timeout_s=1.0 s with rank(s) 0 (slow), 2 (slow) still running" in \
        str(info.value)
    assert info.value.rank == 0
    assert not any(p.is_alive() for p in procs)


# --- launch/init argument checks (no processes) ----------------------------------------------------

def test_launch_rejects_an_unpicklable_fn_before_starting_anything():
    with pytest.raises(LaunchError, match="module-level function"):
        launch(lambda rank: rank, _slow_cluster(2))
    with pytest.raises(LaunchError, match="timeout_s"):
        launch(_happy, _slow_cluster(2), timeout_s=0)


def test_init_reads_torchrun_env_and_checks_world_size(monkeypatch):
    cluster = _slow_cluster(3)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match="RANK is not set"):
        init(cluster)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(LaunchError, match="WORLD_SIZE=4 but the cluster has 3 devices"):
        init(cluster)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(LaunchError, match="MASTER_ADDR is not set"):
        init(cluster)
    assert not is_initialized() and not dist.is_initialized()


def test_init_under_torchrun_env_joins_through_master_addr_and_port(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    ctx = init(_slow_cluster(1))
    try:
        assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.speed) == (0, 1, 0, 0.5)
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    finally:
        shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_init_of_a_gpu_rank_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(LaunchError, match=r"rank 0 is a GPU \(A100-80GB\).*0 CUDA device"):
        init(Cluster.homogeneous("A100-80GB", count=1), rank=0, world_size=1, store=dist.HashStore())
    assert not is_initialized() and not dist.is_initialized()


def test_init_context_double_init_and_shutdown_in_process():
    cluster = _slow_cluster(1, speed=0.25)
    with pytest.raises(LaunchError, match="not initialised"):
        context()
    ctx = init(cluster, rank=0, world_size=1, store=dist.HashStore(), step_timeout_s=5.0)
    try:
        assert context() is ctx
        assert (ctx.rank, ctx.world_size, ctx.device, ctx.speed, ctx.backend) == \
            (0, 1, torch.device("cpu"), 0.25, "gloo")
        assert ctx.spec.name == "slow" and ctx.is_emulated
        with pytest.raises(LaunchError, match="already initialised as rank 0"):
            init(cluster, rank=0, world_size=1, store=dist.HashStore())
        t = torch.ones(2)
        dist.all_reduce(t)
        assert torch.equal(t, torch.ones(2))
    finally:
        shutdown()
    assert not is_initialized() and not dist.is_initialized()
    with pytest.raises(LaunchError):
        context()


def test_sub_groups_wait_the_step_timeout_not_torchs_thirty_minutes():
    from datetime import timedelta

    from autopar.runtime.communicator import pg_new_group

    def waits(pg):
        return pg._get_backend(torch.device("cpu")).options._timeout

    init(_slow_cluster(1, speed=0.25), rank=0, world_size=1, store=dist.HashStore(), step_timeout_s=5.0)
    try:
        assert waits(pg_new_group([0])) == timedelta(seconds=5)    # Communicator.new_group passes the same
    finally:
        shutdown()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=5))
    try:                                 # after shutdown, a group autopar did not start keeps torch's default
        assert waits(pg_new_group([0])) == timedelta(minutes=30)
    finally:
        dist.destroy_process_group()


def test_backends_for_gpu_cpu_and_mixed_clusters():
    gpus = Cluster.homogeneous("A100-80GB", count=2)
    mixed = Cluster.from_dict({"nodes": [
        {"device": "A100-80GB", "count": 2},
        {"device": {"name": "slow", "emulate": "cpu", "speed": 0.5, "memory_GB": 2}, "count": 1}]})
    assert default_backend(gpus) == "nccl"
    assert default_backend(_slow_cluster(2)) == "gloo"
    assert default_backend(mixed) == "gloo"
    assert subgroup_backend(mixed, [0, 1]) == "nccl"
    assert subgroup_backend(mixed, [1, 2]) == "gloo"


def test_results_are_detached_cpu_clones_with_containers_kept():
    from collections import namedtuple
    Pair = namedtuple("Pair", "a b")
    model = torch.nn.Linear(2, 2)
    base = torch.zeros(100, requires_grad=True)
    out = launch_mod._to_cpu({"state": model.state_dict(), "p": Pair(base[:3] + 1, [base[5:6]]), "n": 7})
    assert type(out["state"]) is OrderedDict and out["state"]._metadata == model.state_dict()._metadata
    assert type(out["p"]) is Pair and out["p"].a.shape == (3,) and not out["p"].a.requires_grad
    assert out["p"].b[0].untyped_storage().nbytes() == 4 and out["n"] == 7


# --- emulated clocks -------------------------------------------------------------------------------

class _FakeTime:
    def __init__(self):
        self.cpu = self.wall = 0.0
        self.sleeps = []

    def sleep(self, s):
        self.sleeps.append(s)
        self.wall += s


def test_emulated_clock_sleeps_to_cpu_time_over_speed_with_fake_timers():
    ft = _FakeTime()
    clock = EmulatedClock(0.25, cpu_time=lambda: ft.cpu, wall_time=lambda: ft.wall, sleep=ft.sleep)
    with clock.compute():
        ft.cpu += 1.0
        ft.wall += 1.5          # contention: 1 s of CPU took 1.5 s of wall time
    assert ft.sleeps == [2.5]   # 1.0 / 0.25 - 1.5
    with clock.compute():
        with clock.compute():   # nested blocks are measured once, by the outermost
            ft.cpu += 0.5
            ft.wall += 3.0      # slower than 0.5 / 0.25 already: no sleep
    assert ft.sleeps == [2.5]
    assert clock.stats() == ClockStats(speed=0.25, compute_s=1.5, slept_s=2.5, num_blocks=2, overrun_s=1.0,
                                       num_overruns=1)
    with clock.compute():       # the 1 s it ran behind is repaid: sleeps 4.0 - 1.0 - 1.0
        ft.cpu += 1.0
        ft.wall += 1.0
    assert ft.sleeps == [2.5, 2.0]
    assert clock.stats().num_overruns == 1 and clock.stats().slept_s == 4.5


def test_emulated_clock_repays_oversleep_and_bounds_the_debt_a_block_leaves():
    ft = _FakeTime()

    def late_sleep(s):          # the scheduler wakes the rank 0.1 s late
        ft.sleep(s + 0.1)

    clock = EmulatedClock(0.5, cpu_time=lambda: ft.cpu, wall_time=lambda: ft.wall, sleep=late_sleep)
    walls = []
    for _ in range(3):
        start = ft.wall
        with clock.compute():
            ft.cpu += 1.0
            ft.wall += 1.0
        walls.append(ft.wall - start)
    assert ft.sleeps == pytest.approx([1.1, 1.0, 1.0])      # each sleep is shortened by the last one's lateness
    assert sum(walls) == pytest.approx(3 * 2.0 + 0.1)       # only the last 0.1 s is still owed
    assert clock.stats().slept_s == pytest.approx(3.1) and clock.stats().num_overruns == 0
    stall = EmulatedClock(0.5, cpu_time=lambda: ft.cpu, wall_time=lambda: ft.wall, sleep=ft.sleep)
    with stall.compute():       # 10 s stalled in a 2 s block: at most 2 s is carried as debt
        ft.cpu += 1.0
        ft.wall += 10.0
    n = len(ft.sleeps)
    for _ in range(3):
        with stall.compute():
            ft.cpu += 1.0
            ft.wall += 1.0
    assert ft.sleeps[n:] == pytest.approx([1.0])            # two blocks repay 1 s each, the third sleeps in full
    assert stall.stats().overrun_s == pytest.approx(8.0) and stall.stats().num_overruns == 1


def test_emulated_clock_busy_loop_at_quarter_speed_takes_four_times_its_cpu_time():
    clock = EmulatedClock(0.25)
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    with clock.compute():
        x = 0
        while time.thread_time() - cpu0 < 0.05:
            x += 1
    cpu_s, wall_s = time.thread_time() - cpu0, time.perf_counter() - wall0
    assert clock.compute_s == pytest.approx(cpu_s, abs=5e-3)
    assert wall_s >= clock.compute_s / 0.25
    if clock.slept_s > 0:       # not slowed by contention beyond 4x: the sleep made up the rest
        assert wall_s == pytest.approx(4 * cpu_s, abs=0.1)
    assert clock.num_blocks == 1


def test_clock_for_devices():
    slow = _slow_cluster(1, speed=0.5).devices[0]
    assert isinstance(clock_for(slow), EmulatedClock) and clock_for(slow).speed == 0.5
    assert isinstance(clock_for(slow.spec), EmulatedClock)
    gpu = Cluster.homogeneous("A100-80GB", count=1).devices[0]
    null = clock_for(gpu)
    assert isinstance(null, NullClock)
    with null.compute():
        pass
    assert null.stats() == ClockStats(None, 0.0, 0.0, 0)
    assert isinstance(clock_for(_slow_cluster(1, speed=1.0).devices[0]), NullClock)
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="speed"):
            EmulatedClock(bad)
    assert emulate.__all__ == ["ClockStats", "EmulatedClock", "NullClock", "clock_for", "emulation_time_scale",
                               "oversubscription", "CpuShare", "cpu_shares", "apply_cpu_share"]


def test_time_scale_keeps_speed_ratios_when_ranks_outnumber_cores():
    assert emulate.oversubscription(3, num_cores=2) == 1.5
    assert emulate.oversubscription(2, num_cores=8) == 1.0
    ft = _FakeTime()
    clocks = {speed: EmulatedClock(speed, time_scale=1.5, cpu_time=lambda: ft.cpu,
                                   wall_time=lambda: ft.wall, sleep=ft.sleep) for speed in (1.0, 0.5)}
    walls = {}
    for speed, clock in clocks.items():
        start = ft.wall
        with clock.compute():
            ft.cpu += 1.0
            ft.wall += 1.5          # three ranks on two cores: 1 s of CPU takes 1.5 s
        walls[speed] = ft.wall - start
    assert walls == {1.0: 1.5, 0.5: 3.0}    # the 1:2 ratio survives the contention
    scaled = clock_for(_slow_cluster(1, speed=1.0).devices[0], time_scale=1.5)
    assert isinstance(scaled, EmulatedClock) and scaled.time_scale == 1.5
    with pytest.raises(ValueError, match="time_scale"):
        EmulatedClock(0.5, time_scale=0)


def test_cpu_shares_pin_emulated_ranks_to_one_thread_and_balance_their_speeds_over_the_cores():
    demo = Cluster.from_dict({"nodes": [
        {"device": {"name": n, "emulate": "cpu", "speed": sp, "memory_GB": 2}, "count": 1}
        for n, sp in (("quarter", 0.25), ("full", 1.0), ("half", 0.5))]})
    # more ranks than cores: the 1.0 rank alone, the 0.5 and 0.25 ranks together
    assert cpu_shares(demo, [4, 7]) == (CpuShare((7,), 1), CpuShare((4,), 1), CpuShare((7,), 1))
    # enough cores: disjoint blocks, still one thread (the clock measures the calling thread)
    assert cpu_shares(demo, range(7)) == (CpuShare((0, 1), 1), CpuShare((2, 3), 1), CpuShare((4, 5), 1))
    from autopar.cluster.devices import cpu_spec_detect

    native = Cluster.homogeneous(cpu_spec_detect(), count=2)
    assert [s.num_threads for s in cpu_shares(native, range(4))] == [2, 2]   # native: a thread per core
    gpus = Cluster.homogeneous("A100-80GB", count=2)
    assert cpu_shares(gpus, [0, 1]) == (None, None)
    assert all(s.num_interop_threads == 1 for s in cpu_shares(demo, [0, 1]))
    with pytest.raises(ValueError, match="cores"):
        cpu_shares(demo, [])


def test_emulation_time_scale_leaves_headroom():
    from autopar.runtime.emulate import emulation_time_scale

    assert emulation_time_scale(3, num_cores=2) == 3.0
    assert emulation_time_scale(1, num_cores=8) == 2.0
