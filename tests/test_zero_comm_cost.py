"""The ZeRO collectives priced as the data-parallel engine runs them (autopar.cost.comm.zero_*): uneven
shards gathered by one broadcast per owner, even ones by one all-gather, reduce-scatters in rounds of
one staging buffer; the planner's zero_comm and cost.step.predicted_phases read the same functions."""

import itertools
import math

import pytest

from autopar.cluster.emulation import with_emulated_link
from autopar.cluster.links import LINK_OPS, EmulatedLink
from autopar.cluster.model import Cluster
from autopar.cost import comm
from autopar.cost.step import predicted_phases
from autopar.ir.costs import ModelCosts, zero_staging_numel
from autopar.planner.dp import plan_dp, zero_comm
from autopar.runtime.dp_flat import shard_bounds

LINK = EmulatedLink(1e-3, tuple((op, 50e6 * (i + 1)) for i, op in enumerate(LINK_OPS)))


def _cluster(n=3):
    devices = [{"device": {"name": f"e{i}", "emulate": "cpu", "speed": 1.0 / 2 ** i, "memory_GB": 1}, "count": 1}
               for i in range(n)]
    return with_emulated_link(Cluster.from_dict({"nodes": [{"devices": devices}]}), LINK)


def _costs(n=3, *, params=(300_000, 500_000, 200_000), fwd=1e-3):
    names = [f"e{i}" for i in range(n)]
    return ModelCosts.synthetic({t: [fwd * 2 ** i] * len(params) for i, t in enumerate(names)},
                                param_bytes=[4.0 * p for p in params], act_bytes=[1e5] * len(params),
                                overhead_s=1e-4)


def _engine_rounds(numel, shares, element_size=4):
    """The engine's reduce-scatter loop (runtime.dp_flat._reduce_scatter_grads), counted."""
    b = shard_bounds(numel, shares)
    sizes = [b[p + 1] - b[p] for p in range(len(shares))]
    c = zero_staging_numel(numel, len(shares), element_size)
    return len(range(0, max(sizes), c)), c


def test_shard_sizes_are_the_engines():
    for numel, shares in itertools.product((0, 1, 7, 10, 4096, 1_000_003),
                                           ((1, 1, 1), (4, 2, 1), (0.6, 0.3, 0.1), (1, 0, 1), (1, 1))):
        b = shard_bounds(numel, shares)
        assert comm.zero_shard_sizes(numel, len(shares), shares) == tuple(b[i + 1] - b[i] for i in range(len(shares)))
    assert comm.zero_shard_sizes(10, 3) == (4, 3, 3) and not comm.zero_shards_even(10, 3)
    assert comm.zero_shards_even(9, 3) and comm.zero_shards_even(12, 3, (1, 1, 1))
    with pytest.raises(ValueError, match="zero_shares"):
        comm.zero_shard_sizes(10, 3, (1, 1))


def test_gather_even_is_one_all_gather_uneven_one_broadcast_per_owner():
    c = _cluster()
    ranks = (0, 1, 2)
    bw = dict(LINK.bandwidth_Bps)
    even = comm.zero_gather_s(c, ranks, 9000, 4)
    assert even == pytest.approx(comm.allgather_time_s(c, ranks, 36000))
    assert even == pytest.approx(2 * (LINK.latency_s + 12000 / bw["all_gather"]))
    # uneven: each owner broadcasts its shard: (n - 1) latencies + shard / bw, once per non-empty shard
    sizes = comm.zero_shard_sizes(9000, 3, (4, 2, 1))
    expect = sum(2 * LINK.latency_s + 4 * s / bw["broadcast"] for s in sizes)
    assert comm.zero_gather_s(c, ranks, 9000, 4, (4, 2, 1)) == pytest.approx(expect)
    # an empty shard sends nothing; one rank gathers nothing
    expect = sum(2 * LINK.latency_s + 4 * s / bw["broadcast"] for s in comm.zero_shard_sizes(9000, 3, (1, 0, 1))
                 if s)
    assert comm.zero_gather_s(c, ranks, 9000, 4, (1, 0, 1)) == pytest.approx(expect)
    assert comm.zero_gather_s(c, (1,), 9000, 4) == 0.0


def test_reduce_scatter_runs_in_rounds_of_one_staging_buffer():
    c = _cluster()
    ranks = (0, 1, 2)
    bw = dict(LINK.bandwidth_Bps)["reduce_scatter"]
    for numel, shares in ((10_000, (1, 1, 1)), (1_000_000, (4, 2, 1)), (3_000_000, (0.6, 0.3, 0.1)),
                          (5000, (1, 1, 1)), (20_000_000, (1, 1, 1))):
        rounds, chunk = _engine_rounds(numel, shares)
        assert comm.zero_reduce_scatter_rounds(numel, 3, 4, shares) == (rounds, chunk)
        per_round = 2 * (LINK.latency_s + 3 * chunk * 4 / 3 / bw)    # ring RS of the whole staging buffer
        assert comm.zero_reduce_scatter_s(c, ranks, numel, 4, shares) == pytest.approx(rounds * per_round)
    # the staging buffer is one gradient bucket over the positions at most: a unit of a bucket or less
    # is one round on even shares (uneven ones take more rounds of the same buffer); a larger one pays
    # every round's latency
    from autopar.config import GRAD_BUCKET_BYTES

    assert comm.zero_reduce_scatter_rounds(200_000, 3, 4) == (1, 66_667)
    assert comm.zero_reduce_scatter_rounds(200_000, 3, 4, (4, 2, 1)) == (2, 66_667)
    rounds, chunk = comm.zero_reduce_scatter_rounds(10_000_000, 3, 4, (4, 2, 1))
    assert chunk == GRAD_BUCKET_BYTES // 4 // 3
    assert rounds == -(-max(comm.zero_shard_sizes(10_000_000, 3, (4, 2, 1))) // chunk) > 1
    assert comm.zero_reduce_scatter_s(c, ranks, 10_000_000, 4, (4, 2, 1)) > rounds * 2 * LINK.latency_s
    assert comm.zero_reduce_scatter_s(c, (2,), 1_000_000, 4) == 0.0


def test_units_and_collectives_per_zero_stage():
    costs = _costs()
    assert comm.zero_units(costs, 3) == ((300_000, 2), (500_000, 2), (200_000, 2))
    assert comm.zero_units(costs, 2) == ((1_000_000, 1),)
    c, ranks, shares = _cluster(), (0, 1, 2), (4, 2, 1)
    assert comm.zero_collectives(costs, c, ranks, 0) == comm.ZeroCollectives()
    z1 = comm.zero_collectives(costs, c, ranks, 1, shares)
    assert z1.step_gather_s == pytest.approx(comm.zero_gather_s(c, ranks, 1_000_000, 4, shares))
    assert z1.gather_op == "broadcast" and z1.round_reduce_scatter_s == 0
    z2 = comm.zero_collectives(costs, c, ranks, 2)        # 1e6 / 3 is uneven too: broadcasts
    assert z2.step_gather_s == pytest.approx(comm.zero_gather_s(c, ranks, 1_000_000, 4))
    assert z2.round_reduce_scatter_s == pytest.approx(comm.zero_reduce_scatter_s(c, ranks, 1_000_000, 4))
    z3 = comm.zero_collectives(costs, c, ranks, 3, shares)
    assert z3.step_gather_s == 0
    assert z3.round_gather_s == pytest.approx(sum(2 * comm.zero_gather_s(c, ranks, p, 4, shares)
                                                  for p in (300_000, 500_000, 200_000)))
    assert z3.round_reduce_scatter_s == pytest.approx(sum(comm.zero_reduce_scatter_s(c, ranks, p, 4, shares)
                                                          for p in (300_000, 500_000, 200_000)))
    even = comm.zero_collectives(_costs(params=(300_000,) * 3), c, ranks, 1)
    assert even.gather_op == "all_gather"
    assert even.step_gather_s == pytest.approx(comm.allgather_time_s(c, ranks, 3.6e6))
    # the planner's zero_comm is the same figures
    for zero in (1, 2, 3):
        zc = zero_comm(costs, c, ranks, zero, fractions=(4 / 7, 2 / 7, 1 / 7))
        got = comm.zero_collectives(costs, c, ranks, zero, (4 / 7, 2 / 7, 1 / 7))
        loss = comm.loss_allreduce_s(c, ranks)     # the loss sum, once per step
        if zero == 1:
            assert zc.per_step_s == pytest.approx(zc.allreduce_s + got.step_gather_s + loss)
        else:
            assert zc.per_step_s == pytest.approx(got.step_gather_s + loss)
            assert zc.per_micro_step_s == pytest.approx(got.round_gather_s + got.round_reduce_scatter_s)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_predicted_phases_price_the_engines_collectives(zero):
    costs, c = _costs(), _cluster()
    plan = plan_dp(costs, c, 21, strategy="dp", zero_stage=zero)
    (st,) = plan.stages
    z = comm.zero_collectives(costs, c, (0, 1, 2), zero, st.zero_shares or None)
    rounds = max(len(mb) for mb in st.micro_batches)
    phases = predicted_phases(plan, costs, c)
    for r in (0, 1, 2):
        d = phases[r]
        gathered = z.step_gather_s + rounds * z.round_gather_s
        assert d.get(z.gather_op, 0.0) == pytest.approx(gathered)
        other = "all_gather" if z.gather_op == "broadcast" else "broadcast"
        assert other not in d
        assert d.get("reduce_scatter", 0.0) == pytest.approx(rounds * z.round_reduce_scatter_s)
        assert math.isfinite(sum(d.values()))


@pytest.mark.parametrize("shares", [(5, 3, 2, 1, 1, 0, 4, 2), (1, 2), (3, 0, 0, 1), (7, 1, 1, 1, 1, 1, 1)])
def test_uneven_gather_is_one_broadcast_per_owner_over_its_rotated_ring(shares):
    """zero_gather_s prices each owner's broadcast from the ring's links at once; the same figure, to the
    bit, as broadcast_time_s over the ring rotated to each owner (two nodes of two types: intra-node and
    network links), and over a measured emulated link."""
    cluster = Cluster.from_dict({"nodes": [{"device": "A100-80GB", "count": 4}, {"device": "V100-16GB", "count": 4}]})
    ranks = (0, 5, 1, 6, 2, 7, 3, 4)[:len(shares)]
    sizes = comm.zero_shard_sizes(1_000_003, len(ranks), shares)
    assert len(set(sizes)) > 1                                # uneven: one broadcast per owner
    rotated = sum(comm.broadcast_time_s(cluster, ranks[p:] + ranks[:p], float(s) * 2)
                  for p, s in enumerate(sizes) if s > 0)
    assert comm.zero_gather_s(cluster, ranks, 1_000_003, 2, shares) == rotated
    one_node = _cluster(3)
    sizes = comm.zero_shard_sizes(999, 3, (3, 2, 1))
    assert comm.zero_gather_s(one_node, (0, 1, 2), 999, 4, (3, 2, 1)) == sum(
        comm.broadcast_time_s(one_node, (0, 1, 2)[p:] + (0, 1, 2)[:p], float(s) * 4) for p, s in enumerate(sizes))
