"""Re-planning (autopar.runtime.replan, autopar.planner.replan; compile(replan="auto") in api.md):
one emulated device declared at speed 1.0 runs at actual_speed 0.5; after the first steps the job
detects it, re-plans on the calibrated costs, switches in place (save, new engine, load resharded) and
ends in the one-device oracle's state. Timing is never asserted, only the decision it leads to."""

import copy
import threading

import pytest
import torch

from oracle import RTOL, assert_state_close, optimizer_factory, threaded_ranks, train_one_device

from autopar.api import Compiled, plan_from_costs, prepare
from autopar.cluster.model import Cluster
from autopar.config import PlanConfig
from autopar.errors import ClusterError, PlanError
from autopar.ir.plan import Plan
from autopar.lowering import lower
from autopar.planner.replan import propose, slow_devices
from autopar.runtime.emulate import clock_for, emulation_time_scale
from autopar.runtime.engine import EngineInputs, build_engine
from autopar.runtime.recorder import record_engine
from autopar.runtime.replan import Proposal, ReplanPolicy, Replanner, decide, switch_cost_s

B = 24
STEPS = 6
MLP = dict(num_layers=4, hidden_size=192)
HOT = {"devices": [{"device": {"name": "hot", "emulate": "cpu", "speed": 1.0, "actual_speed": 0.5,
                               "memory_GB": 1}, "count": 1},
                   {"device": {"name": "cool", "emulate": "cpu", "speed": 1.0, "memory_GB": 1}, "count": 1}]}
# the re-planning test's cluster: the hot device at a quarter of its declared speed, so that on a host
# loaded enough to stretch the other rank's steps 2x (CI, beside tests that start processes) it still
# stands out past detect_ratio; at half its speed it once did not
SLOWER = copy.deepcopy(HOT)
SLOWER["devices"][0]["device"]["actual_speed"] = 0.25
_LOCK = threading.Lock()
_SHARED: dict = {}


def test_actual_speed_is_parsed_written_back_and_runs_the_clock():
    c = Cluster.from_dict({"nodes": [HOT]})
    hot = c.devices[0].spec
    assert hot.speed == 1.0 and hot.actual_speed == 0.5 and hot.run_speed == 0.5
    assert Cluster.from_dict(c.to_dict()) == c
    assert clock_for(c.devices[0], 2.0).speed == 0.5 and clock_for(c.devices[1], 2.0).speed == 1.0
    bad = copy.deepcopy(HOT)
    bad["devices"][0]["device"]["actual_speed"] = 1.5
    with pytest.raises(ClusterError, match=r"devices\[0\]\.device\.actual_speed"):
        Cluster.from_dict({"nodes": [bad]})


def test_the_decision_weighs_the_gain_over_the_horizon_against_the_switch():
    p = ReplanPolicy(horizon_steps=10, min_gain=0.05)
    assert decide(1.0, 0.5, 4.0, p) == (True, decide(1.0, 0.5, 4.0, p)[1])
    assert not decide(1.0, 0.5, 6.0, p)[0]            # 0.5 s x 10 steps does not pay a 6 s switch
    assert not decide(1.0, 0.97, 0.0, p)[0]           # 3% is under min_gain
    assert not decide(1.0, 1.2, 0.0, p)[0]
    assert switch_cost_s(1e9, 2.0, ReplanPolicy(copy_Bps=1e9)) == 4.0
    assert slow_devices({"a": 1.9, "b": 1.1, "c": 0.5}, 1.25) == {"a": 3.8, "b": 2.2}    # relative to c
    assert slow_devices({"a": 1.2, "b": 1.1}, 1.25) == {}
    with pytest.raises(PlanError, match="check_after"):
        ReplanPolicy(check_after=2, warmup=2)


def _shared():
    """The model, its captured graph, the cost tables (roofline: quick) and the oracle, once."""
    with _LOCK:
        if not _SHARED:
            from autopar.models import build
            from autopar.passes.analyze import analyze

            case = build("mlp-tiny", seed=0, **MLP)
            cluster = Cluster.from_dict({"nodes": [SLOWER]})
            gm = analyze(case.model, case.example_inputs).captured.gm
            prep = prepare(case.model, cluster, case.example_inputs, measure=False)
            data = [case.batch(B, seed=1 + s) for s in range(STEPS)]
            ref_model = copy.deepcopy(case.model)
            _SHARED.update(case=case, cluster=cluster, gm=gm, costs=prep.costs, data=data,
                           oracle=train_one_device(ref_model, case.loss_fn, data, "adamw"))
        return _SHARED


def _compiled(plan: Plan, rank: int, world_size: int) -> Compiled:
    s = _shared()
    with _LOCK:
        model, gm = copy.deepcopy((s["case"].model, s["gm"]))
    cluster = s["cluster"]
    # a generous time scale (16x a run's): the emulated speeds stay apart on a loaded machine, whose
    # threaded ranks also share one GIL (at 4x, with six busy loops on the two cores, the 1.0 rank
    # overran every target and never slept; at 8x, in CI beside a test that starts six processes, the
    # 2x slower device once measured within 1.25x of the other); detection is relative, so the cost
    # tables' scale does not matter
    clock = clock_for(cluster.devices[rank], time_scale=16 * emulation_time_scale(world_size))
    engine = build_engine(EngineInputs(
        gm=gm, model=model, plan=plan, loss_fn=s["case"].loss_fn, optimizer_factory=optimizer_factory("adamw"),
        rank=rank, world_size=world_size, device=torch.device("cpu"), clock=clock),
        lower(plan, gm, rank, params=[p for p in model.parameters() if p.requires_grad]))
    record_engine(engine, rank)
    return Compiled(plan=plan, engine=engine, rank=rank, cluster=cluster, costs=s["costs"] if rank == 0 else None)


def _plan_fn(costs, cluster, global_batch, config):
    return plan_from_costs(costs, cluster, global_batch, config=config)


class TwoRanks(threaded_ranks(2)):
    def test_a_device_slower_than_declared_is_detected_and_work_moves_off_it_exactly(self):
        s = _shared()
        # ZeRO-0 both sides: a ZeRO-1/2 engine loading a ZeRO-0 checkpoint does not continue AdamW exactly
        # yet (the next step's loss is off by 2e-3: runtime.state / checkpointing), which is not what
        # this test is about
        config = PlanConfig(strategy="dp", zero_stage=0)
        plan = _plan_fn(s["costs"], s["cluster"], B, config)
        assert plan.rank_batch[0] == plan.rank_batch[1]          # declared alike: planned alike
        compiled = _compiled(plan, self.rank, self.world_size)
        policy = ReplanPolicy(check_after=4, warmup=1, horizon_steps=1000)

        def proposal(profile):
            return Proposal(**propose(profile, compiled.plan, compiled.costs, compiled.cluster, B, config, _plan_fn,
                                      detect_ratio=policy.detect_ratio))

        def rebuild(plan_json):
            return _compiled(Plan.from_json(plan_json), self.rank, self.world_size)

        compiled.replanner = Replanner(policy, proposal, rebuild, build_s=0.1)
        losses = [compiled.step(*batch) for batch in s["data"]]
        (report,) = compiled.replans
        assert report.step == 4 and "hot" in report.slow and report.slow["hot"] > 1.25, report.summary()
        assert report.switched, report.summary()
        assert compiled.plan.rank_batch[0] < compiled.plan.rank_batch[1], compiled.plan.rank_batch
        assert compiled.step_count == STEPS
        for got, want in zip(losses, s["oracle"].losses):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (losses, s["oracle"].losses)
        assert_state_close(compiled.state_dict(), s["oracle"].state, RTOL["adamw"])
