"""TP pricing as the engine runs it on the device it runs on (issue 12): SP's all-gathers and
reduce-scatters priced on their own operation's link, the backward overlap hidden only where the
collectives have an engine of their own (NCCL), SP's compute from what the rewrite measures. Pure."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopar.cluster.model import Cluster
from autopar.cost import tp as tp_cost
from autopar.cost.comm import ring_link
from autopar.cost.tp_tables import tp_graph_tables
from autopar.ir.costs import ModelCosts
from oracle import prepared_case


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))


def _costs():
    _, gm, _, n = prepared_case("gpt-tiny")
    pairs = tp_cost.tp_pairs_per_block(gm, n)
    t = {"cpu": np.full((1, n), 1e-3)}
    return ModelCosts(block_names=tuple(map(str, range(n))), params=[1e3] * n, param_bytes=[4e3] * n,
                      act_bytes=[1e6] * n, out_bytes=[1e5] * n, fwd_flops=[1.0] * n, sample_batches=[1],
                      fwd_table=t, bwd_table={k: 2 * v for k, v in t.items()}, tp_pairs=pairs,
                      tp_act_replicated=np.where(pairs > 0, 0.2, 1.0),
                      tp_param_replicated=np.where(pairs > 0, 0.01, 1.0), **tp_graph_tables(gm, n)), pairs


def _cpus(n=3):
    return Cluster.from_dict({"nodes": [{"device": {"name": "cpu", "emulate": "cpu", "speed": 1.0, "memory_GB": 4},
                                         "count": n}]})


def test_only_nccl_groups_hide_the_backward_collectives():
    cpus, gpus = _cpus(2), Cluster.from_dict({"nodes": [{"device": "H100-80GB", "count": 2}]})
    assert not tp_cost.comm_hides(cpus, (0, 1)) and tp_cost.comm_hides(gpus, (0, 1))
    assert not tp_cost.group_kind(cpus, (0, 1), (1, 1)).hides_comm
    assert tp_cost.group_kind(gpus, (0, 1), (1, 1)).hides_comm
    costs, pairs = _costs()
    kind = tp_cost.group_kind(_cpus(2), (0, 1), (1, 1))
    for sp in (False, True):
        _, b_on = tp_cost.kind_block_times(costs, kind, 4.0, 0.3, sp, overlap=True)
        _, b_off = tp_cost.kind_block_times(costs, kind, 4.0, 0.3, sp, overlap=False)
        assert np.allclose(b_on, b_off)                     # CPU ranks: nothing hidden
        _, b_gpu = tp_cost.kind_block_times(costs, dataclasses.replace(kind, hides_comm=True), 4.0, 0.3, sp,
                                            overlap=True)
        assert (b_gpu <= b_off + 1e-15).all() and (b_gpu[pairs > 0] < b_off[pairs > 0]).all()


def test_sp_collectives_on_their_own_links():
    cluster = _cpus(3)
    ranks = (0, 1, 2)
    bw, lat = ring_link(cluster, ranks)
    ag_a, ag_b, rs_a, rs_b = tp_cost.sp_alpha_beta(cluster, ranks)
    # one link for every operation (no measured link): an all-gather plus a reduce-scatter is one all-reduce
    alpha, beta = tp_cost.allreduce_alpha_beta(cluster, ranks)
    assert np.isclose(ag_a + rs_a, alpha) and np.isclose(ag_b + rs_b, beta)
    assert np.isclose(ag_a, 2 * lat) and np.isclose(rs_b, 2 / 3 / bw)
    costs, pairs = _costs()
    x, pad = 4.0, 1.5
    link = (1e-4, 1e-9, 3e-4, 4e-9)                         # gloo: a reduce-scatter dearer than an all-gather
    got = tp_cost.tp_allreduce_block_s(costs, alpha, beta, x, True, pad, link)
    nbytes = costs.out_bytes * x * pad
    sp = tp_cost.sp_blocks(costs)
    want = np.where(sp, pairs * (link[0] + link[2] + (link[1] + link[3]) * nbytes),
                    tp_cost.tp_allreduce_block_s(costs, alpha, beta, x))
    assert np.allclose(got, want)
    # backward: no weight-gradient time to hide under, the same price; with it, f's reduce-scatter is hidden
    w = np.zeros_like(costs.tp_wgrad_share)
    assert np.allclose(tp_cost.tp_backward_comm_s(costs, alpha, beta, x, w, True, pad, link), got)
    w[:] = 1.0
    hidden = pairs * (link[2] + link[3] * nbytes)
    assert np.allclose(tp_cost.tp_backward_comm_s(costs, alpha, beta, x, w, True, pad, link)[sp], (got - hidden)[sp])


def test_measured_sp_covered_prices_sp_blocks_with_the_measured_fraction():
    costs, pairs = _costs()
    sp = tp_cost.sp_blocks(costs)
    types, shares = ("cpu", "cpu"), (3, 1)
    plain_f, _ = tp_cost.rank_block_times(costs, types, shares, 4.0, 0.3, False)
    # the graph's count: SP removes replicated work
    graph_f, _ = tp_cost.rank_block_times(costs, types, shares, 4.0, 0.3, True)
    assert (graph_f[:, sp] < plain_f[:, sp]).all()
    # as measure.tp.cpu_sp_covered gives it on a CPU where SP measured slower: more than plain
    slower = dataclasses.replace(costs, tp_sp_covered=np.where(sp, -0.1, 0.0), _cache={})
    f, _ = tp_cost.rank_block_times(slower, types, shares, 4.0, 0.3, True)
    rho = 0.4
    assert np.allclose(f[:, sp], (rho + (1 - rho) * np.array([0.75, 0.25]))[:, None] * costs.fwd_time("cpu", 4.0)[sp])
    assert np.allclose(f[:, ~sp], plain_f[:, ~sp])
