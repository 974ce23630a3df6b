"""Pricing of the forward TP collective-matmul (``cost.tp_fwd``, issue 14; the runtime is
``passes.tp_fwd_overlap``): the exposure formula against a brute-force chunk timeline, the price never
below zero nor above the unoverlapped one and exactly the old one where it does not apply (gloo /
emulated ranks, no SP, the switch off, no tables), the phases laid out like the plan's price, and the
graph's GEMM share tables against a hand count on a tiny llama (pure; tiny graphs, synthetic tables)."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest

from autopar.cluster.model import Cluster
from autopar.cost import tp as tp_cost
from autopar.cost import tp_fwd
from autopar.cost.tp_tables import tp_gemm_shares, tp_graph_tables
from autopar.ir.costs import ModelCosts
from oracle import prepared_case


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))


# -- the exposure formula against a chunk timeline ----------------------------------------------------

def _run(start: float, work: float, stalls: list[tuple[float, float]]) -> float:
    """When ``work`` seconds of GEMM started at ``start`` end, paused during every stall interval."""
    t = start
    for a, b in sorted(stalls):
        if b <= t:
            continue
        if a >= t + work:
            break
        if a > t:
            work -= a - t
        t = b
    return t + work


def _timeline(alpha: float, nbytes_s: float, gemm_s: float, k: int, stall_gemms: bool = True) -> float:
    """Exposed seconds of a collective cut into ``k`` chunks against a GEMM cut alike, simulated on two
    resources: the link runs chunk after chunk (each its call latency ``alpha``, then its bytes); chunk
    c's GEMM starts once its bytes are in and chunk c-1's GEMM is done. With ``stall_gemms`` a call's
    latency also stalls the GEMMs (the pricing's conservative model), else it is the link's alone."""
    link, stalls, ready = 0.0, [], []
    for _ in range(k):
        stalls.append((link, link + alpha))
        link += alpha + nbytes_s / k
        ready.append(link)
    t = 0.0
    for c in range(k):
        t = _run(max(t, ready[c]), gemm_s / k, stalls if stall_gemms else [])
    return t - gemm_s


def test_exposure_formula_is_the_chunk_timeline():
    rng = np.random.default_rng(0)
    for _ in range(300):
        k = int(rng.integers(1, 9))
        alpha, b, m = rng.uniform(0, 1e-4), rng.uniform(0, 1e-2), rng.uniform(0, 2e-2)
        raw = k * alpha + b / k + (k - 1) / k * max(0.0, b - m)
        sim = _timeline(alpha, b, m, k)
        assert sim == pytest.approx(raw, rel=1e-9, abs=1e-15)
        got = float(tp_fwd.chunked_exposed_s(alpha, b, m, k))
        assert got == pytest.approx(min(raw, alpha + b), rel=1e-12, abs=1e-15)
        assert 0.0 <= got <= alpha + b + 1e-15                           # never above the unchunked call
        assert _timeline(alpha, b, m, k, stall_gemms=False) <= sim + 1e-12  # conservative against link-only
    assert float(tp_fwd.chunked_exposed_s(1e-5, 4e-3, 0.0, 1)) == pytest.approx(1e-5 + 4e-3)  # k = 1: no overlap
    with pytest.raises(ValueError, match="chunks"):
        tp_fwd.chunked_exposed_s(0.0, 1.0, 1.0, 0)


def test_chunk_count_is_the_runtimes():
    if importlib.util.find_spec("autopar.passes.tp_fwd_overlap") is None:
        pytest.skip("passes.tp_fwd_overlap (the runtime's chunked forward) is not built")
    from autopar.passes.tp_fwd_overlap import FWD_OVERLAP_CHUNKS

    assert tp_fwd.FWD_OVERLAP_CHUNKS == FWD_OVERLAP_CHUNKS


# -- the price on a group -------------------------------------------------------------------------------

def _llama_costs(types=("a",), gemm_heavy: float = 1.0):
    _, gm, _, n = prepared_case("llama-tiny")
    tables = tp_graph_tables(gm, n)
    # the tiny model's GEMMs are a few % of its work at 150 FLOP per byte: scale them up so the
    # overlap has GEMM time to hide under (the tables are shares; any positive values do)
    for k in ("tp_fwd_col_share", "tp_fwd_row_share", "tp_bwd_row_share"):
        tables[k] = np.minimum(tables[k] * gemm_heavy, 0.45)
    pairs = tp_cost.tp_pairs_per_block(gm, n)
    t = {k: np.full((1, n), 5e-2 * (i + 1)) for i, k in enumerate(types)}
    return ModelCosts(block_names=tuple(map(str, range(n))), params=[1e3] * n, param_bytes=[4e3] * n,
                      act_bytes=[1e6] * n, out_bytes=[2e6] * n, fwd_flops=[1.0] * n, sample_batches=[1],
                      fwd_table=t, bwd_table={k: 2 * v for k, v in t.items()}, tp_pairs=pairs, **tables), pairs


def _old_prices(costs, kind, x, sp, overlap=True):
    """The unchunked prices (``tp_allreduce_block_s``, ``tp_backward_comm_s``), as before this pricing."""
    pad = tp_cost.sp_pad(kind.shares) if sp else 1.0
    fwd = tp_cost.tp_allreduce_block_s(costs, kind.alpha_s, kind.beta_s_per_byte, x, sp, pad, kind.sp_link)
    w = tp_cost.group_wgrad_s(costs, kind.types, kind.shares, x) if overlap and kind.hides_comm else None
    bwd = tp_cost.tp_backward_comm_s(costs, kind.alpha_s, kind.beta_s_per_byte, x, w, sp, pad, kind.sp_link)
    return fwd, bwd


def _nccl_kind(shares=(3, 1)):
    cluster = Cluster.homogeneous("MI210-64GB", 2)
    kind = tp_cost.group_kind(cluster, (0, 1), shares)
    assert kind.hides_comm
    # a slow link (1 GB/s per call's bytes, 10 us a call), so the collectives are worth hiding
    return dataclasses.replace(kind, types=("a", "a"), sp_link=(1e-5, 1e-9, 1e-5, 1e-9))


def _comm(costs, kind, x, sp):
    return tp_fwd.tp_block_comm_s(costs, kind.alpha_s, kind.beta_s_per_byte, x, kind.types, kind.shares, sp,
                                  kind.sp_link, kind.hides_comm, True)


def test_overlap_hides_forward_collectives_on_nccl_sp_groups_only(monkeypatch):
    costs, pairs = _llama_costs(gemm_heavy=30.0)
    kind = _nccl_kind()
    sp = tp_cost.sp_blocks(costs)
    assert sp is not None and sp.any()
    assert tp_fwd.FWD_OVERLAP_PATTERNS == frozenset(tp_fwd.OVERLAP_PATTERNS)   # the default: all three
    # (a) and (b) alone: the backward keeps its old price
    monkeypatch.setattr(tp_fwd, "FWD_OVERLAP_PATTERNS", frozenset({"ag_columns", "row_rs"}))
    for x in (1.0, 4.0):
        old_f, old_b = _old_prices(costs, kind, x, True)
        f, b = _comm(costs, kind, x, True)
        assert (f[sp] < old_f[sp]).all() and (f >= 0).all() and (f <= old_f).all()
        assert np.array_equal(f[~sp], old_f[~sp]) and np.array_equal(b, old_b)
        # the plan's price is compute plus this (cost.tp.kind_block_times, memoised by the switches)
        kf, kb = tp_cost.kind_block_times(costs, kind, x, 0.2, True)
        cf, cb = tp_cost.rank_block_times(costs, kind.types, kind.shares, x, 0.2, True)
        assert np.allclose(kf, cf.max(axis=0) + f) and np.allclose(kb, cb.max(axis=0) + b)
    # (c) too, the default (the runtime runs all three): g's backward all-gather under the row's
    # input-gradient GEMM
    monkeypatch.setattr(tp_fwd, "FWD_OVERLAP_PATTERNS", frozenset(tp_fwd.OVERLAP_PATTERNS))
    old_f, old_b = _old_prices(costs, kind, 2.0, True)
    f, b = _comm(costs, kind, 2.0, True)
    assert (b[sp] < old_b[sp]).all() and (b >= 0).all() and np.array_equal(b[~sp], old_b[~sp])
    kb = tp_cost.kind_block_times(costs, kind, 2.0, 0.2, True)[1]
    assert np.allclose(kb, tp_cost.rank_block_times(costs, kind.types, kind.shares, 2.0, 0.2, True)[1].max(0) + b)


def test_exactly_the_old_price_where_it_does_not_apply(monkeypatch):
    costs, _ = _llama_costs(gemm_heavy=30.0)
    nccl = _nccl_kind()
    gloo_cluster = Cluster.from_dict({"nodes": [{"device": {"name": "a", "emulate": "cpu", "speed": 1.0,
                                                            "memory_GB": 4}, "count": 2}]})
    gloo = tp_cost.group_kind(gloo_cluster, (0, 1), (3, 1))
    assert not gloo.hides_comm                                    # emulated CPU ranks (gloo)
    bare = dataclasses.replace(costs, tp_fwd_col_share=None, tp_fwd_row_share=None, tp_bwd_row_share=None,
                               _cache={})
    monkeypatch.setattr(tp_fwd, "FWD_OVERLAP_PATTERNS", frozenset(tp_fwd.OVERLAP_PATTERNS))
    for x in (1.0, 3.0):
        for c, kind, sp in ((costs, gloo, True), (costs, nccl, False), (bare, nccl, True)):
            got = _comm(c, kind, x, sp)
            old = _old_prices(c, kind, x, sp)
            assert np.array_equal(got[0], old[0]) and np.array_equal(got[1], old[1])
    with monkeypatch.context() as m:                              # the switch off (the ablation)
        m.setattr(tp_fwd, "TP_FORWARD_OVERLAP", False)
        got, old = _comm(costs, nccl, 2.0, True), _old_prices(costs, nccl, 2.0, True)
        assert np.array_equal(got[0], old[0]) and np.array_equal(got[1], old[1])
        off = tp_cost.kind_block_times(costs, nccl, 2.0, 0.2, True)
    on = tp_cost.kind_block_times(costs, nccl, 2.0, 0.2, True)    # not served from the memo of the switch-off
    assert on[0].sum() < off[0].sum()


def test_phases_lay_out_the_plans_price(monkeypatch):
    from autopar.cost.step import tp_collective_phases

    costs, _ = _llama_costs(gemm_heavy=30.0)
    kind = _nccl_kind()
    for patterns in (tp_fwd.FWD_OVERLAP_PATTERNS, frozenset(tp_fwd.OVERLAP_PATTERNS)):
        monkeypatch.setattr(tp_fwd, "FWD_OVERLAP_PATTERNS", patterns)
        for sp in (True, False):
            ph = tp_fwd.tp_collective_phase_s(costs, kind.alpha_s, kind.beta_s_per_byte, 2.0, kind.types,
                                              kind.shares, sp, kind.sp_link, kind.hides_comm, True)
            f, b = _comm(costs, kind, 2.0, sp)
            assert np.allclose(sum(ph.values()), f + b) and all((v >= 0).all() for v in ph.values())
    # with nothing chunked it is the per-phase layout cost.step has used (its tp_collective_phases)
    monkeypatch.setattr(tp_fwd, "TP_FORWARD_OVERLAP", False)
    for sp in (True, False):
        ph = tp_fwd.tp_collective_phase_s(costs, kind.alpha_s, kind.beta_s_per_byte, 2.0, kind.types, kind.shares,
                                          sp, kind.sp_link, kind.hides_comm, True)
        old = tp_collective_phases(costs, kind.alpha_s, kind.beta_s_per_byte, 2.0, kind.types, kind.shares, sp,
                                   sp_link=kind.sp_link, hides=kind.hides_comm)
        assert old.keys() == {k for k, v in ph.items() if v.sum() > 0}
        assert all(np.isclose(old[k], ph[k].sum()) for k in old)


# -- the tables -----------------------------------------------------------------------------------------

def test_gemm_shares_match_a_hand_count_on_a_tiny_llama():
    model, gm, _, n = prepared_case("llama-tiny")
    got = tp_gemm_shares(gm, n)
    col, row, brow = got["tp_fwd_col_share"], got["tp_fwd_row_share"], got["tp_bwd_row_share"]
    pairs = tp_cost.tp_pairs_per_block(gm, n)
    layers = pairs > 0
    assert col.shape == row.shape == brow.shape == (n, 2) and layers.sum() == len(model.layers)
    assert (col[~layers] == 0).all() and (row[~layers] == 0).all()
    assert ((col + row).sum(axis=1) <= 1.0).all() and (brow.sum(axis=1) <= 0.5).all()
    d, ffn = model.layers[0].attn.q_proj.in_features, model.layers[0].mlp.up_proj.out_features
    # per token: q, k, v, o are d x d GEMMs; gate and up d x ffn, down ffn x d (2 FLOPs a multiply-add)
    for b in np.flatnonzero(layers):
        attn, mlp = 0, 1                                     # graph order: attention, then the MLP
        assert row[b, attn] / col[b, attn] == pytest.approx(1 / 3)
        assert row[b, mlp] / col[b, mlp] == pytest.approx(1 / 2)
        assert col[b, attn] / col[b, mlp] == pytest.approx(3 * d * d / (2 * d * ffn))
        assert brow[b] == pytest.approx(row[b] / 2)          # the input gradient repeats the row's FLOPs
    # the columns' forward GEMMs cost what their weight gradients do: twice the backward share
    assert np.allclose(col, 2 * tp_graph_tables(gm, n)["tp_wgrad_share"])


def test_plan_cache_key_covers_the_tables():
    from autopar.planner.cache import cache_key

    costs, _ = _llama_costs()
    cluster = Cluster.homogeneous("MI210-64GB", 2)
    base = cache_key(costs, cluster, {})
    other = dataclasses.replace(costs, tp_fwd_row_share=costs.tp_fwd_row_share * 0.5, _cache={})
    assert cache_key(other, cluster, {}) != base
    assert cache_key(dataclasses.replace(costs, tp_bwd_row_share=None, _cache={}), cluster, {}) != base
