"""Pricing of sequence parallelism (SP) and of the backward TP overlap (``cost.tp``, ``cost.tp_tables``),
and the planner's use of them: SP from the graph (the replicated share drops, the latency terms double,
the activations left whole shrink), the overlap never negative and never above the unoverlapped price,
``Stage.sequence_parallel`` set where SP is priced no slower and supported, the pin (pure; tiny graphs
and synthetic tables)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopar.cluster.model import Cluster
from autopar.config import Pin, PlanConfig
from autopar.cost import tp as tp_cost
from autopar.cost.memory import stage_memory_bytes, tp_replicated_per_block
from autopar.cost.tp_tables import tp_graph_tables
from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Stage
from autopar.planner.pins import pin_violation, plan_pinned
from oracle import prepared_case


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))


def _gpt_tables():
    _, gm, _, n = prepared_case("gpt-tiny")
    return tp_graph_tables(gm, n), tp_cost.tp_pairs_per_block(gm, n), n


def _costs(tables, pairs, n, types=("a", "b")):
    t = {k: np.full((1, n), 1e-3 * (i + 1)) for i, k in enumerate(types)}
    return ModelCosts(block_names=tuple(map(str, range(n))), params=[1e3] * n, param_bytes=[4e3] * n,
                      act_bytes=[1e6] * n, out_bytes=[1e5] * n, fwd_flops=[1.0] * n, sample_batches=[1],
                      fwd_table=t, bwd_table={k: 2 * v for k, v in t.items()}, tp_pairs=pairs,
                      tp_act_replicated=np.where(pairs > 0, 0.2, 1.0), tp_param_replicated=np.where(pairs > 0, 0.01, 1.0),
                      **tables)


def test_sp_from_the_graph_drops_the_replicated_share_and_doubles_the_latency():
    tables, pairs, n = _gpt_tables()
    sp = tables["tp_sp_supported"] > 0
    assert sp.tolist() == (pairs > 0).tolist()               # the layers, not the embedding or the head
    assert (tables["tp_sp_covered"][sp] > 0).all() and (tables["tp_sp_covered"][~sp] == 0).all()
    costs = _costs(tables, pairs, n)
    rho = 0.4
    f0, b0 = tp_cost.rank_block_times(costs, ("a", "b"), (3, 1), 1.0, rho, sequence_parallel=False)
    f1, b1 = tp_cost.rank_block_times(costs, ("a", "b"), (3, 1), 1.0, rho, sequence_parallel=True)
    assert (f1[:, sp] < f0[:, sp]).all() and (b1[:, sp] < b0[:, sp]).all()     # less computed whole
    assert np.allclose(f1[:, ~sp], f0[:, ~sp])
    # the SP block's factor: rho less what SP shards along the sequence, the rest at the rank's share
    k = max(0.0, rho - tables["tp_sp_covered"][1])
    assert np.isclose(f1[1, 1], (k + (1 - k) * 0.25) * 2e-3)
    # a reduce-scatter and an all-gather per pair: twice the latency terms, the same ring bytes (even shares)
    lat0 = tp_cost.tp_allreduce_block_s(costs, 1e-3, 0.0, 4.0)
    lat1 = tp_cost.tp_allreduce_block_s(costs, 1e-3, 0.0, 4.0, sequence_parallel=True)
    assert np.allclose(lat1[sp], 2 * lat0[sp]) and np.allclose(lat1[~sp], lat0[~sp])
    bw0 = tp_cost.tp_allreduce_block_s(costs, 0.0, 1e-9, 4.0)
    assert np.allclose(tp_cost.tp_allreduce_block_s(costs, 0.0, 1e-9, 4.0, True, pad=1.0), bw0)
    assert tp_cost.sp_pad((1, 1)) == 1.0 and tp_cost.sp_pad((3, 1)) == 1.5     # uneven: padded chunks
    # the activations left whole under SP: the columns' gathered inputs only
    _, act0 = tp_replicated_per_block(costs, rho)
    _, act1 = tp_replicated_per_block(costs, rho, sequence_parallel=True)
    assert (act1[sp] < act0[sp]).all() and np.allclose(act1[~sp], act0[~sp])
    st = Stage(0, n, groups=((0, 1),), micro_batches=((2,),), tp_shares=((1, 1),))
    on = dataclasses.replace(st, sequence_parallel=True)
    m0, m1 = stage_memory_bytes(costs, [st], "1f1b", 0, rho), stage_memory_bytes(costs, [on], "1f1b", 0, rho)
    assert all(m1[r] < m0[r] for r in m0)


def test_overlap_is_never_negative_nor_above_the_unoverlapped_price():
    tables, pairs, n = _gpt_tables()
    costs = _costs(tables, pairs, n)
    rng = np.random.default_rng(0)
    for _ in range(50):
        alpha, beta, x = rng.uniform(0, 1e-3), rng.uniform(0, 1e-8), float(rng.integers(1, 9))
        w = rng.uniform(0, 2e-3, size=tables["tp_wgrad_share"].shape)
        for sp in (False, True):
            whole = tp_cost.tp_allreduce_block_s(costs, alpha, beta, x, sp)
            got = tp_cost.tp_backward_comm_s(costs, alpha, beta, x, w, sp)
            assert (got >= 0).all() and (got <= whole + 1e-15).all()
    # per pair: max(0, comm - weight-gradient seconds), f's all-reduce (no SP)
    c = 1e-4 + 1e-9 * 1e5 * 2
    w = np.zeros_like(tables["tp_wgrad_share"])
    w[1] = [5e-5, 5e-4]
    got = tp_cost.tp_backward_comm_s(costs, 1e-4, 1e-9, 2.0, w)
    assert np.isclose(got[1], (c - 5e-5) + 0.0) and np.isclose(got[2], 2 * c)
    assert np.allclose(tp_cost.tp_backward_comm_s(costs, 1e-4, 1e-9, 2.0, None), 2 * c * (pairs > 0))
    # kind_block_times: backward with the overlap no slower, forward unchanged
    cluster = Cluster.from_dict({"nodes": [{"device": {"name": k, "emulate": "cpu", "speed": 1.0, "memory_GB": 4},
                                            "count": 2} for k in ("a",)]})
    kind = tp_cost.group_kind(cluster, (0, 1), (1, 1))
    costs.fwd_table = costs.bwd_table = {"a": np.full((1, n), 1e-1)}
    f0, b0 = tp_cost.kind_block_times(costs, kind, 1.0, 0.3, False, overlap=False)
    assert not kind.hides_comm          # emulated CPU ranks (gloo) hide nothing: cost.tp.comm_hides
    assert np.allclose(tp_cost.kind_block_times(costs, kind, 1.0, 0.3, False, overlap=True)[1], b0)
    kind = dataclasses.replace(kind, hides_comm=True)                   # as on a group of GPUs (NCCL)
    f1, b1 = tp_cost.kind_block_times(costs, kind, 1.0, 0.3, False, overlap=True)
    assert np.allclose(f0, f1) and (b1 <= b0).all() and (b1[pairs > 0] < b0[pairs > 0]).all()


def _tp_cluster():
    d = {"name": "a", "emulate": "cpu", "speed": 1.0, "memory_GB": 4}
    return Cluster.from_dict({"nodes": [{"device": d, "count": 2}]})


def test_planner_sets_sequence_parallel_where_priced_no_slower_and_supported():
    tables, pairs, n = _gpt_tables()
    costs = _costs(tables, pairs, n, types=("a",))
    cluster = _tp_cluster()
    kind = tp_cost.group_kind(cluster, (0, 1), (1, 1))
    assert tp_cost.sp_pays(costs, kind, 1.0, 0.3)                       # less replicated work, cheap calls
    slow = dataclasses.replace(kind, alpha_s=1.0, sp_link=(1.0, 0.0, 1.0, 0.0))  # a collective call costs a second
    assert not tp_cost.sp_pays(costs, slow, 1.0, 0.3)
    f, b = tp_cost.kind_block_times(costs, slow, 1.0, 0.3)              # None: as the planner sets it
    f0, b0 = tp_cost.kind_block_times(costs, slow, 1.0, 0.3, False)
    assert np.allclose(f, f0) and np.allclose(b, b0)
    unsupported = dataclasses.replace(costs, tp_sp_supported=np.zeros(n), _cache={})
    assert not tp_cost.sp_pays(unsupported, kind, 1.0, 0.3)
    one = tp_cost.group_kind(cluster, (0,), (1,))
    assert not tp_cost.stage_sequence_parallel(costs, [one], [1], 0.3)   # no TP: no SP
    # the joint planner (a pinned TP degree) sets it on its TP stages, not where unsupported
    cfg = PlanConfig(num_heads=4, pin=Pin(tp=2), replicated_fraction=0.3)
    plan = plan_pinned(costs, cluster, 8, cfg)
    assert plan.stages and all(st.sequence_parallel for st in plan.stages)
    plan = plan_pinned(unsupported, cluster, 8, cfg)
    assert not any(st.sequence_parallel for st in plan.stages)


def test_a_stage_is_priced_as_its_flag_runs_it():
    # a pinned SP that is priced slower still runs SP, and a stage without SP runs none where SP would pay
    from autopar.cost.pipeline import stage_durations

    tables, pairs, n = _gpt_tables()
    costs = _costs(tables, pairs, n, types=("a",))
    cluster = _tp_cluster()
    kind = tp_cost.group_kind(cluster, (0, 1), (1, 1))
    assert tp_cost.sp_pays(costs, kind, 2.0, tp_cost.DEFAULT_REPLICATED_FRACTION)
    for sp in (False, True):
        st = Stage(block_start=0, block_stop=n, groups=((0, 1),), micro_batches=((2,),), tp_shares=((1, 1),),
                   sequence_parallel=sp)
        f, b, _ = stage_durations(costs, cluster, (st,))
        want_f, want_b = tp_cost.kind_block_times(costs, kind, 2.0, None, sp)
        assert f[0, 0] == pytest.approx(want_f.sum()) and b[0, 0] == pytest.approx(want_b.sum())
    assert tp_cost.kind_block_times(costs, kind, 2.0, None, False)[0].sum() > \
        tp_cost.kind_block_times(costs, kind, 2.0, None, True)[0].sum()


def test_sequence_parallel_pin_is_honoured_or_named():
    if "sequence_parallel" not in Pin.__dataclass_fields__:      # a config.py without the field
        pytest.skip("Pin.sequence_parallel is not in autopar/config.py yet")
    tables, pairs, n = _gpt_tables()
    costs = _costs(tables, pairs, n, types=("a",))
    cluster = _tp_cluster()
    for want in (True, False):
        pin = Pin(tp=2, sequence_parallel=want)
        plan = plan_pinned(costs, cluster, 8, PlanConfig(num_heads=4, pin=pin, replicated_fraction=0.3))
        assert pin_violation(plan, pin, cluster) is None
        assert all(st.sequence_parallel == want for st in plan.stages)
    bare = dataclasses.replace(costs, tp_sp_supported=None, _cache={})
    with pytest.raises(PlanError, match="pin.sequence_parallel"):
        plan_pinned(bare, cluster, 8, PlanConfig(num_heads=4, pin=Pin(sequence_parallel=True)))
    with pytest.raises(PlanError, match="pin.sequence_parallel"):
        Pin(sequence_parallel=2)
    assert Pin.parse("tp=2,sequence_parallel=1") == Pin(tp=2, sequence_parallel=True)


def test_search_memory_factors_are_the_built_sp_stage_ones():
    from autopar.cost.memory import tp_memory_fractions, tp_span_factors

    tables, pairs, n = _gpt_tables()
    costs = _costs(tables, pairs, n)
    st = Stage(1, n - 1, groups=((0, 1),), micro_batches=((2,),), tp_shares=((3, 1),), sequence_parallel=True)
    kp, ka = tp_span_factors(costs, 0.3, 0.25)                  # the search's default: SP where supported
    p, a = tp_memory_fractions(costs, st, 0.3)
    assert np.isclose(kp[1, n - 1], p + (1 - p) * 0.25) and np.isclose(ka[1, n - 1], a + (1 - a) * 0.25)
    plain = tp_span_factors(costs, 0.3, 0.25, sequence_parallel=False)
    assert plain[1][1, n - 1] > ka[1, n - 1]
    bare = dataclasses.replace(costs, tp_sp_supported=None, _cache={})   # no SP facts: as before
    assert np.allclose(tp_span_factors(bare, 0.3, 0.25)[1], plain[1])
