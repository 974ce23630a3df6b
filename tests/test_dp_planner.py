"""Heterogeneous data-parallel planning on synthetic costs and small hand-written clusters."""

import math

import numpy as np
import pytest

from autopar.cost import comm
from autopar.cluster.model import Cluster
from autopar.ir.costs import ModelCosts
from autopar.planner.dp import (
    DEFAULT_WORKSPACE_BYTES, max_micro_batch, micro_step_curve, plan_dp, rank_memory, zero_comm,
)
from autopar.planner.bounds import with_all_bounds
from autopar.errors import PlanError
from autopar.ir.plan import Plan

GiB = 1 << 30


def _device(name, tflops, memory_GB):
    return {"name": name, "vendor": "nvidia", "tflops": tflops, "memory_GB": memory_GB,
            "mem_bandwidth_GBps": 1000}


def _cluster(fast=2, slow=1, fast_GB=2, slow_GB=1):
    return Cluster.from_dict({
        "name": "test",
        "nodes": [{"device": _device("fast", 300, fast_GB), "count": fast},
                  {"device": _device("slow", 100, slow_GB), "count": slow}],
        "network": {"bandwidth_GBps": 12.5, "latency_us": 10},
    })


def _costs(fast_s=1e-3, slow_s=3e-3, *, param_bytes=4e6, act_bytes=1e6, overhead_s=1e-4, blocks=4):
    return ModelCosts.synthetic({"fast": [fast_s] * blocks, "slow": [slow_s] * blocks},
                                param_bytes=[param_bytes] * blocks, act_bytes=[act_bytes] * blocks,
                                overhead_s=overhead_s)


def _micro(plan):
    (stage,) = plan.stages
    return dict(zip(stage.ranks, stage.micro_batches))


# -- the plan's shape -------------------------------------------------------------------------------
def test_dp_gives_the_faster_device_more_and_covers_an_indivisible_batch():
    plan = plan_dp(_costs(), _cluster(), 47)
    shares = plan.rank_batch
    assert sum(shares.values()) == 47
    assert shares[0] > shares[2] and shares[1] > shares[2]
    assert plan.strategy == "dp" and plan.num_stages == 1
    (stage,) = plan.stages
    assert stage.groups == ((0,), (1,), (2,)) and (stage.block_start, stage.block_stop) == (0, 4)
    for r, mb in _micro(plan).items():
        assert sum(mb) == shares[r]
        assert not mb or max(mb) - min(mb) <= 1
    assert plan.predicted.samples_per_s == pytest.approx(47 / plan.predicted.step_time_s)
    bd = plan.predicted.breakdown
    assert bd["compute_s"] + bd["comm_s"] == pytest.approx(plan.predicted.step_time_s)
    assert bd["comm_s"] > 0


def test_uniform_dp_equal_shares_one_micro_batch_size():
    cluster = _cluster(fast_GB=2, slow_GB=1)
    costs = _costs(act_bytes=45e6)   # 3 samples fit on "slow", 8 on "fast"
    plan = plan_dp(costs, cluster, 47, strategy="uniform-dp", zero_stage=0)
    assert plan.rank_batch == {0: 16, 1: 16, 2: 15}
    assert max_micro_batch(costs, cluster.devices[2].spec, 0, 3) == 3
    # DeepSpeed-style: one micro-batch size everywhere (the smallest cap), the remainder last
    assert _micro(plan) == {0: (3, 3, 3, 3, 3, 1), 1: (3, 3, 3, 3, 3, 1), 2: (3, 3, 3, 3, 3)}


def test_proportional_dp_follows_peak_flops():
    plan = plan_dp(_costs(), _cluster(), 47, strategy="proportional-dp")
    # 300 : 300 : 100 TFLOP/s -> 20.14, 20.14, 6.71 -> largest remainder 20, 20, 7
    assert plan.rank_batch == {0: 20, 1: 20, 2: 7}


def test_dp_never_slower_than_either_baseline():
    rng = np.random.default_rng(3)
    cluster = _cluster(fast=2, slow=2)
    for case in range(12):
        costs = _costs(fast_s=rng.uniform(1e-4, 3e-3), slow_s=rng.uniform(1e-4, 3e-3),
                       overhead_s=rng.uniform(0, 2e-3), act_bytes=rng.choice([1e6, 3e7, 1e8]))
        batch = int(rng.integers(1, 80))
        for zero in ("auto", 0, 3):
            dp = plan_dp(costs, cluster, batch, zero_stage=zero)
            for baseline in ("uniform-dp", "proportional-dp"):
                base = plan_dp(costs, cluster, batch, strategy=baseline, zero_stage=zero)
                assert dp.predicted.step_time_s <= base.predicted.step_time_s * (1 + 1e-12), (case, zero)


def test_dp_strictly_beats_uniform_on_heterogeneous_speed():
    costs, cluster = _costs(), _cluster()
    dp = plan_dp(costs, cluster, 48)
    uni = plan_dp(costs, cluster, 48, strategy="uniform-dp")
    assert dp.predicted.samples_per_s > 1.5 * uni.predicted.samples_per_s


# -- memory ---------------------------------------------------------------------------------------------
def test_max_micro_batch_by_hand():
    costs = _costs(param_bytes=4e6, act_bytes=1e6)   # 4 blocks: 4e6 params, 16 B/param of state
    spec = _cluster().devices[2].spec                 # 1 GiB
    usable = 0.9 * GiB - DEFAULT_WORKSPACE_BYTES
    assert max_micro_batch(costs, spec, 0, 3) == int((usable - 64e6) // 4e6)
    # every state sharded, + the gathered block and the prefetched one, + a block's reduce-scatter
    # staging (its even shard on each position) and two blocks' gradients: ZeRO-3 reduce-scatters each
    # block inside backward, beside the activations
    z3 = (16e6 + 16e6 + 32e6) / 3 + 2 * 4e6 + 3 * 333_334 * 4 + 2 * 4e6
    assert max_micro_batch(costs, spec, 3, 3) == int((usable - z3) // 4e6)
    # ZeRO-2 reduce-scatters after backward: its staging (one bucket) lives where the activations are
    # freed, beside the full gradient (16e6, less than the activations here)
    z2 = 16e6 + (16e6 + 32e6) / 3
    assert max_micro_batch(costs, spec, 2, 3) == int((usable - z2) // 4e6)
    assert max_micro_batch(costs, spec, 0, 3, memory_fraction=0.2) == 0


def test_memory_caps_respected():
    cluster = _cluster()
    costs = _costs(act_bytes=50e6)
    for strategy in ("dp", "uniform-dp", "proportional-dp"):
        plan = plan_dp(costs, cluster, 40, strategy=strategy)
        for r, mb in _micro(plan).items():
            spec = cluster.devices[r].spec
            assert plan.predicted.memory_bytes[r] <= 0.9 * spec.memory_bytes
            assert max(mb, default=0) <= max_micro_batch(costs, spec, plan.zero_stage, len(cluster))
    # the caps bind: the small device takes several micro-steps
    plan = plan_dp(costs, cluster, 40)
    cap = max_micro_batch(costs, cluster.devices[2].spec, plan.zero_stage, 3)
    assert len(_micro(plan)[2]) >= 2 and max(_micro(plan)[2]) <= cap


def test_model_that_does_not_fit_says_bytes_needed_and_available():
    costs = _costs(param_bytes=1e9)   # 16 GB of state per block at ZeRO-0
    with pytest.raises(PlanError) as e:
        plan_dp(costs, _cluster(), 8)
    msg = str(e.value)
    assert "needs" in msg and "bytes" in msg and "usable" in msg
    assert "ZeRO-0" in msg and "ZeRO-3" in msg
    # activations alone too large for one sample on every device
    with pytest.raises(PlanError, match=r"a micro-batch of 1 sample needs .* bytes .* usable"):
        plan_dp(_costs(act_bytes=1e9), _cluster(), 8, zero_stage=0)


def test_zero_auto_picks_a_stage_that_fits_when_zero0_does_not():
    # 15e6 params: 0.96 GB of ZeRO-0 state, over the 1 GiB device with its workspace; sharding fits.
    costs = _costs(param_bytes=60e6, act_bytes=1e6)
    cluster = _cluster(fast=3, slow=1, fast_GB=1, slow_GB=1)
    with pytest.raises(PlanError, match="ZeRO-0"):
        plan_dp(costs, cluster, 16, zero_stage=0)
    plan = plan_dp(costs, cluster, 16)
    assert plan.zero_stage >= 1
    assert plan.notes[0].startswith("zero-0: does not fit")
    assert any("(chosen)" in n and n.startswith(f"zero-{plan.zero_stage}") for n in plan.notes)
    mem = rank_memory(costs, cluster.devices[0].spec, plan.zero_stage, 4)
    assert mem.fixed_bytes <= mem.usable_bytes


def test_zero_auto_prefers_fewest_bytes_on_a_tie_and_zero3_pays_per_micro_step():
    costs, cluster = _costs(), _cluster()
    plan = plan_dp(costs, cluster, 47)
    assert plan.zero_stage == 0   # ZeRO-2 ties on time (RS + AG = AR) and bytes; lower stage kept
    z3 = plan_dp(costs, cluster, 47, zero_stage=3)
    zc = zero_comm(costs, cluster, (0, 1, 2), 3)
    rank_time = {}
    for r, mb in _micro(z3).items():
        curve = micro_step_curve(costs, cluster.devices[r].spec.name, 3, zc, max_batch=47)
        rank_time[r] = sum(float(curve(b)) for b in mb)
    # once per step: the loss sum's all-reduce (zc.per_step_s at ZeRO-3)
    assert z3.predicted.step_time_s == pytest.approx(max(rank_time.values()) + zc.per_step_s, rel=1e-12)
    bottleneck = max(rank_time, key=rank_time.get)
    assert z3.predicted.breakdown["comm_s"] == pytest.approx(
        zc.per_micro_step_s * len(_micro(z3)[bottleneck]) + zc.per_step_s, rel=1e-12)
    # ZeRO-3 as the engine runs it: per block, two gathers (forward, backward) and a chunked reduce-scatter
    block = int(costs.params[0])
    ag = comm.zero_gather_s(cluster, (0, 1, 2), block, 4)
    rs = comm.zero_reduce_scatter_s(cluster, (0, 1, 2), block, 4)
    assert zc.per_micro_step_s == pytest.approx(4 * (2 * ag + rs))
    assert zero_comm(costs, cluster, (0, 1, 2), 0).per_step_s == pytest.approx(
        comm.dp_allreduces(costs, cluster, (0, 1, 2), 0).grad_s + comm.loss_allreduce_s(cluster, (0, 1, 2)))
    ring = zero_comm(costs, cluster, (0, 1, 2), 2, algorithm="ring")
    # ZeRO-2 shards gradients: a reduce-scatter on every micro-step, the all-gather once per step
    total = int(costs.params.sum())
    assert ring.per_micro_step_s == pytest.approx(comm.zero_reduce_scatter_s(cluster, (0, 1, 2), total, 4,
                                                                             algorithm="ring"))
    assert ring.per_step_s == pytest.approx(comm.zero_gather_s(cluster, (0, 1, 2), total, 4, algorithm="ring")
                                            + comm.loss_allreduce_s(cluster, (0, 1, 2), algorithm="ring"))
    z2 = plan_dp(costs, cluster, 47, zero_stage=2)
    zc2 = zero_comm(costs, cluster, (0, 1, 2), 2)
    steps = max(len(mb) for mb in _micro(z2).values())
    assert z2.predicted.breakdown["comm_s"] <= zc2.per_step_s + zc2.per_micro_step_s * steps + 1e-12
    assert z2.predicted.breakdown["comm_s"] >= zc2.per_step_s + zc2.per_micro_step_s - 1e-12


# -- pins, subsets, bounds ------------------------------------------------------------------------------
def test_dp_batch_pins_shares_and_is_validated():
    costs, cluster = _costs(), _cluster()
    plan = plan_dp(costs, cluster, 47, dp_batch={2: 20})
    assert plan.rank_batch[2] == 20 and sum(plan.rank_batch.values()) == 47
    full = plan_dp(costs, cluster, 47, dp_batch={0: 15, 1: 16, 2: 16})
    assert full.rank_batch == {0: 15, 1: 16, 2: 16}
    with pytest.raises(PlanError, match="cover it exactly"):
        plan_dp(costs, cluster, 47, dp_batch={0: 15, 1: 16, 2: 15})
    with pytest.raises(PlanError, match="rank 7 is not in the plan"):
        plan_dp(costs, cluster, 47, dp_batch={7: 1})
    with pytest.raises(PlanError, match="more than the global batch"):
        plan_dp(costs, cluster, 10, dp_batch={0: 11})
    with pytest.raises(PlanError, match="strategy='dp'"):
        plan_dp(costs, cluster, 10, strategy="uniform-dp", dp_batch={0: 5})


def test_ranks_subset_upper_bound_and_efficiency():
    costs, cluster = _costs(), _cluster(fast=2, slow=2)
    sub = plan_dp(costs, cluster, 32, ranks=[2, 3])
    assert sub.ranks == (2, 3) and sum(sub.rank_batch.values()) == 32
    fast_only = plan_dp(costs, cluster, 32, ranks=[0, 1]).predicted.samples_per_s
    plan = plan_dp(costs, cluster, 32)
    assert plan.predicted.upper_bound_samples_per_s == plan.predicted.compute_bound_samples_per_s == 0.0
    bounded = with_all_bounds(plan, costs, cluster)   # the one definition of the bounds
    ub = bounded.predicted.upper_bound_samples_per_s
    # each type alone at its best (any strategy) reaches at least its data-parallel plan
    assert ub >= (fast_only + sub.predicted.samples_per_s) * (1 - 1e-9)
    assert bounded.predicted.efficiency == pytest.approx(plan.predicted.samples_per_s / ub)
    assert 0.5 < bounded.predicted.efficiency <= 1.0 + 1e-9
    assert plan.predicted.efficiency == 0.0     # the original is untouched
    assert plan.predicted.samples_per_s <= bounded.predicted.compute_bound_samples_per_s


def test_rank_may_get_no_samples_and_batch_smaller_than_ranks():
    costs = _costs(fast_s=1e-4, slow_s=1e-1)
    plan = plan_dp(costs, _cluster(), 2)
    assert plan.rank_batch == {0: 1, 1: 1, 2: 0}
    assert _micro(plan)[2] == ()
    assert Plan.from_json(plan.to_json()) == plan


def test_bad_arguments():
    costs, cluster = _costs(), _cluster()
    with pytest.raises(PlanError, match="strategy"):
        plan_dp(costs, cluster, 8, strategy="pp")
    with pytest.raises(PlanError, match="zero_stage"):
        plan_dp(costs, cluster, 8, zero_stage=4)
    with pytest.raises(PlanError, match="global_batch"):
        plan_dp(costs, cluster, 0)
    with pytest.raises(PlanError, match="ranks"):
        plan_dp(costs, cluster, 8, ranks=[0, 9])
    with pytest.raises(PlanError, match="no time table for device type 'slow'"):
        plan_dp(ModelCosts.synthetic({"fast": [1e-3] * 4}), cluster, 8)


# -- the curve --------------------------------------------------------------------------------------------
def test_micro_step_curve_matches_tables_and_adds_zero3_comm():
    costs, cluster = _costs(overhead_s=5e-4), _cluster()
    curve = micro_step_curve(costs, "slow", max_batch=100)
    for b in (1, 2, 4, 8, 16, 64, 100):
        assert float(curve(b)) == pytest.approx(costs.step_time("slow", b))
    xs = np.arange(1, 101)
    assert np.all(np.diff(curve(xs)) >= 0)
    zc = zero_comm(costs, cluster, (0, 1, 2), 3)
    z3 = micro_step_curve(costs, "slow", 3, zc, max_batch=100)
    assert float(z3(5)) == pytest.approx(float(curve(5)) + zc.per_micro_step_s)
    with pytest.raises(ValueError, match="ZeRO-3"):
        micro_step_curve(costs, "slow", 0, zc)
    assert math.isfinite(float(micro_step_curve(costs, "fast", max_batch=1)(1)))


def test_dp_keeps_a_baselines_allocation_when_its_uneven_split_wins():
    """A concave micro-step curve (t(1)=1, t(2)=1.9, t(3)=2 s) with 3 samples fitting: 7 samples as
    3+3+1 (uniform-dp) beat any even split, so "dp" must not lose to the baseline."""
    sb = np.array([1.0, 2.0, 3.0, 4.0])
    per_block = np.outer([1.0, 1.9, 2.0, 2.05], np.ones(2)) / 6   # fwd + 2x bwd over 2 blocks
    costs = ModelCosts(block_names=("b0", "b1"), params=[1e6, 1e6], param_bytes=[4e6, 4e6],
                       act_bytes=[0.0, 0.0], out_bytes=[0.0, 0.0], fwd_flops=[1e9, 1e9],
                       sample_batches=sb, fwd_table={"fast": per_block}, bwd_table={"fast": 2 * per_block})
    cluster = Cluster.from_dict({"nodes": [{"device": _device("fast", 300, 2), "count": 2}]})
    mem = rank_memory(costs, cluster.devices[0].spec, 0, 2)
    costs.act_bytes[:] = (mem.usable_bytes - mem.fixed_bytes) / 3.5 / 2    # 3 samples fit
    assert max_micro_batch(costs, cluster.devices[0].spec, 0, 2) == 3
    uni = plan_dp(costs, cluster, 14, strategy="uniform-dp", zero_stage=0)
    dp = plan_dp(costs, cluster, 14, zero_stage=0)
    assert _micro(uni) == {0: (3, 3, 1), 1: (3, 3, 1)}
    assert dp.predicted.step_time_s == pytest.approx(uni.predicted.step_time_s)
    assert "uniform-dp's allocation predicted faster" in dp.notes[0]


def test_dp_matches_brute_force_over_pinned_compositions():
    """End to end: no pinned composition of the batch (dp_batch) beats the planner's own choice."""
    costs = _costs(fast_s=1e-3, slow_s=2.5e-3, overhead_s=1.5e-3, act_bytes=60e6)
    cluster = _cluster()
    for batch in (1, 5, 9):
        for zero in (0, 3):
            best = plan_dp(costs, cluster, batch, zero_stage=zero).predicted.step_time_s
            brute = min(
                plan_dp(costs, cluster, batch, zero_stage=zero,
                        dp_batch={0: a, 1: b, 2: batch - a - b}).predicted.step_time_s
                for a in range(batch + 1) for b in range(batch + 1 - a))
            assert best == pytest.approx(brute, rel=1e-12)


def test_uniform_dp_needs_a_sample_per_rank():
    with pytest.raises(PlanError, match="at least 3 samples for 3 ranks, got 2"):
        plan_dp(_costs(), _cluster(), 2, strategy="uniform-dp")


def test_rank_that_holds_states_but_no_sample_gets_none():
    costs, cluster = _costs(act_bytes=50e6), _cluster(slow_GB=0.5)   # "slow": states fit, 1 sample not
    assert max_micro_batch(costs, cluster.devices[2].spec, 0, 3) == 0
    plan = plan_dp(costs, cluster, 12, zero_stage=0)
    assert plan.rank_batch == {0: 6, 1: 6, 2: 0}
    assert plan_dp(costs, cluster, 12, strategy="proportional-dp", zero_stage=0).rank_batch[2] == 0
    with pytest.raises(PlanError, match=r"dp_batch\[2\] = 3, but rank 2 \(slow\) cannot hold 1 sample"):
        plan_dp(costs, cluster, 12, zero_stage=0, dp_batch={2: 3})
    with pytest.raises(PlanError, match="rank 2 .* cannot hold 1 sample"):
        plan_dp(costs, cluster, 12, strategy="uniform-dp", zero_stage=0)


def test_round_split_is_the_min_max_and_zero3_rounds_are_priced_in_lockstep():
    import itertools
    import random

    from autopar.planner.allocate import lockstep_allocations, round_split

    rng = random.Random(0)
    for _ in range(200):   # one micro-batch per rank: greedy equals the brute-force min-max
        n = rng.randint(1, 3)
        rates = [rng.uniform(0.5, 3.0) for _ in range(n)]
        fixed = [rng.uniform(0.0, 1.0) for _ in range(n)]
        fns = [lambda b, a=a, c=c: c + a * b for a, c in zip(rates, fixed)]
        caps = [rng.randint(0, 6) for _ in range(n)]
        total = rng.randint(1, 10)
        got = round_split(fns, caps, total)
        splits = [x for x in itertools.product(*[range(c + 1) for c in caps]) if sum(x) == total]
        if not splits:
            assert got is None
            continue
        cost = lambda x: max((fns[r](b) for r, b in enumerate(x) if b), default=0.0)  # noqa: E731
        assert sum(got) == total and all(b <= c for b, c in zip(got, caps))
        assert cost(got) == pytest.approx(min(cost(x) for x in splits))
    fns = [lambda b: 1.0 + b, lambda b: 1.0 + 3 * b]
    for shares, micro in lockstep_allocations(fns, [4, 4], 23):
        assert sum(shares) == 23 and all(b <= 4 for m in micro for b in m)

    costs, cluster = _costs(), _cluster()
    z3 = plan_dp(costs, cluster, 47, zero_stage=3)
    zc = zero_comm(costs, cluster, (0, 1, 2), 3)
    micro = _micro(z3)
    rounds = max(len(mb) for mb in micro.values())
    curves = {r: micro_step_curve(costs, cluster.devices[r].spec.name, 3, zc, max_batch=47) for r in micro}
    lockstep = sum(max(float(curves[r](mb[i])) for r, mb in micro.items() if i < len(mb))
                   for i in range(rounds))
    assert z3.predicted.step_time_s == pytest.approx(lockstep + zc.per_step_s, rel=1e-9)   # + the loss sum


def test_recompute_lets_dp_fit_and_is_priced_one_more_forward():
    from autopar.planner.dp import activation_bytes_per_sample

    costs = ModelCosts.synthetic({"fast": [1e-3] * 4, "slow": [3e-3] * 4}, param_bytes=[4e6] * 4,
                                 act_bytes=[2e8] * 4, out_bytes=[1e6] * 4, overhead_s=1e-4)
    assert activation_bytes_per_sample(costs) == 8e8
    assert activation_bytes_per_sample(costs, recompute=True) == 3e6 + 2e8   # 3 block inputs + 1 block
    cluster = _cluster(fast_GB=1, slow_GB=1)     # 90% of 1 GB usable: 8e8 B of activations per sample do not fit
    with pytest.raises(PlanError, match="no ZeRO stage fits"):
        plan_dp(costs, cluster, 12)
    plan = plan_dp(costs, cluster, 12, recompute=True)
    (stage,) = plan.stages
    assert stage.recompute and sum(plan.rank_batch.values()) == 12
    assert all(v <= 0.9 * cluster.devices[r].spec.memory_bytes for r, v in plan.predicted.memory_bytes.items())
    assert "zero-0 recompute" in " ".join(plan.notes)
    # the recompute curve is the keeping curve plus one forward
    keep = micro_step_curve(costs, "fast", 0, max_batch=4)
    rc = micro_step_curve(costs, "fast", 0, max_batch=4, recompute=True)
    assert float(rc(2)) == pytest.approx(float(keep(2)) + float(costs.fwd_time("fast", 2).sum()))
    # where keeping fits it is faster, so recompute=True changes nothing; the baselines never recompute
    roomy = _cluster(fast_GB=40, slow_GB=40)
    assert not plan_dp(costs, roomy, 12, recompute=True).stages[0].recompute
    assert plan_dp(costs, roomy, 12, recompute=True).predicted.step_time_s == pytest.approx(
        plan_dp(costs, roomy, 12).predicted.step_time_s)
    with pytest.raises(PlanError):
        plan_dp(costs, cluster, 12, strategy="uniform-dp", recompute=True)


def test_a_refusal_names_every_term_it_adds():
    """ZeRO-2 refused for the full gradient a micro-step makes before its reduce-scatter, ZeRO-3 for
    the units' gradients it holds inside backward beside the activations: each message names every
    term, and they add up to the figure it gives."""
    import re

    def terms_add_up(text: str, count: int) -> None:
        total = float(re.search(r"needs ([0-9.e+]+) bytes", text).group(1))
        terms = [float(x) for x in re.findall(
            r"(?:states|gathered|workspace|staging|reduce-scatter|activations) ([0-9.e+]+)", text)]
        assert len(terms) == count and sum(terms) == pytest.approx(total, rel=1e-3), text

    def four(memory_gb: float) -> Cluster:
        return Cluster.from_dict({"nodes": [{"device": {"name": "a", "emulate": "cpu", "speed": 1.0,
                                                        "memory_GB": memory_gb}, "count": 4}]})

    costs = ModelCosts.synthetic({"a": [0.01] * 4}, param_bytes=[2e8] * 4, act_bytes=[1e5] * 4)
    for zero, memory_gb, named, count in (
            (2, 2.0, "full gradient a micro-step holds before its reduce-scatter", 5),
            (3, 1.35, "the gradients of the units backward holds before their reduce-scatter", 6)):
        with pytest.raises(PlanError) as info:
            plan_dp(costs, four(memory_gb), 8, zero_stage=zero)
        assert named in str(info.value)
        terms_add_up(str(info.value), count)
    small = four(1.0)
    with pytest.raises(PlanError, match=r"before any sample \(states .* \+ gathered .* \+ workspace .* \+ "
                                         r"reduce-scatter staging .*\)"):
        plan_dp(costs, small, 8, zero_stage=3)
