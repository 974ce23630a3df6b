"""Tensor-parallel memory with separate factors for state and activations (``cost.memory``
``tp_replicated_per_block``, ``tp_span_factors``): a TP layer's parameters are all but wholly sharded
(its norms stay whole), a good part of its activations is whole on every TP rank (norms, residuals,
the row Linears' outputs), and a block without a Linear pair (embedding, head) is whole. The joint
search's memory caps (``cost.joint`` -> ``cost.stage.stage_row_parts``) must price every rank exactly
as ``stage_memory_bytes`` prices the built plan: a row entry is finite exactly where the built stage
fits. Pure: no ranks run here."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from autopar.cluster.model import Cluster
from autopar.cost import tp as tp_cost
from autopar.cost.joint import JointContext, joint_cost_tensor, prepare_stages
from autopar.cost.memory import (
    loss_bytes_per_sample, stage_memory_bytes, stage_state_bytes, tp_memory_fractions, tp_replicated_per_block,
    tp_span_factors, usable_bytes,
)
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Stage

RHO = 0.1   # the time fraction: what the memory must NOT take where the layout is known


def _costs(n=6) -> ModelCosts:
    params = np.full(n, 1e6)
    base = ModelCosts.synthetic({"a": [0.01] * n}, param_bytes=2 * params, act_bytes=[1e6] * n)
    return dataclasses.replace(
        base, params=params, grad_bytes_per_param=2, optimizer_bytes_per_param=12, output_bytes=2e5,
        tp_pairs=np.array([0.0] + [2.0] * (n - 2) + [0.0]),
        tp_param_replicated=np.array([1.0] + [0.01] * (n - 2) + [1.0]),
        tp_act_replicated=np.array([1.0] + [0.25] * (n - 2) + [1.0]))


def test_state_and_activations_take_their_own_factor():
    costs = _costs()
    rep_p, rep_a = tp_replicated_per_block(costs, RHO)
    assert rep_p[0] == rep_p[-1] == rep_a[0] == rep_a[-1] == 1.0     # no pair: whole on every rank
    assert rep_p[2] == pytest.approx(0.01) and rep_a[2] == pytest.approx(0.25)
    kp, ka = tp_span_factors(costs, RHO, 0.25)
    assert kp[1, 5] == pytest.approx(0.01 + 0.99 * 0.25) and ka[1, 5] == pytest.approx(0.25 + 0.75 * 0.25)
    assert kp[0, 1] == ka[0, 1] == pytest.approx(1.0)                  # the embedding alone
    assert kp[0, 3] == pytest.approx((1.0 + 2 * (0.01 + 0.99 * 0.25)) / 3)
    one_p, one_a = tp_span_factors(costs, RHO, 1.0)                   # a one-rank member holds everything
    assert np.all(one_p == 1.0) and np.all(one_a == 1.0)
    # the same factors as a built stage's (stage_memory_bytes goes through tp_memory_fractions)
    stage = Stage(0, 3, groups=((0, 1, 2, 3),), micro_batches=((1,),), tp_shares=((1, 1, 1, 1),))
    p, a = tp_memory_fractions(costs, stage, RHO)
    assert p + (1 - p) * 0.25 == pytest.approx(kp[0, 3]) and a + (1 - a) * 0.25 == pytest.approx(ka[0, 3])
    # without a layout both fall back to the time fraction (and blocks without a pair stay whole)
    bare = dataclasses.replace(costs, tp_param_replicated=None, tp_act_replicated=None)
    assert tp_replicated_per_block(bare, RHO)[0][2] == RHO and tp_replicated_per_block(bare, RHO)[1][0] == 1.0


def test_built_tp_stage_prices_state_by_parameters_and_activations_by_activations():
    costs = _costs()
    st = Stage(1, 5, groups=((0, 1), (2, 3)), micro_batches=((2, 2), (2, 2)), tp_shares=((1, 1), (1, 1)))
    mem = stage_memory_bytes(costs, [st], "1f1b", 1, RHO)
    state = stage_state_bytes(costs, st, 1)        # ZeRO-1 over the two TP members
    kp, ka = 0.01 + 0.99 / 2, 0.25 + 0.75 / 2
    act = 4 * 1e6 * 2 * 1                          # 4 blocks x 2 samples x 1 in flight (one stage)
    want = state * kp + act * ka + loss_bytes_per_sample(costs) * 2
    assert mem[0] == pytest.approx(want, abs=1.0)
    assert state * kp < 0.6 * state                # not the 0.25 + 0.75 / 2 = 0.625 of the activations


def _member(cluster, ranks, shares):
    return tp_cost.Member(tuple(ranks), tuple(shares), tp_cost.group_kind(cluster, ranks, shares),
                          cluster.devices[ranks[0]].node)


@pytest.mark.parametrize("recompute", [False, True])
def test_search_rows_are_finite_exactly_where_the_built_stage_fits(recompute):
    """Stages of two even TP members (ZeRO-1 over them), of one uneven TP member (3:1 shares) and of
    two one-rank members, over every split of 6 blocks, several micro-batch counts, ZeRO stages and
    device memories: the joint cost tensor's entry is finite iff every rank of the built stage fits
    (keeping, or recomputing where the entry says so)."""
    costs = _costs()
    n = costs.num_blocks
    checked = fitting = 0
    for mem_gb in np.linspace(0.01, 0.12, 12):
        dev = {"name": "a", "emulate": "cpu", "speed": 1.0, "memory_GB": float(mem_gb)}
        cluster = Cluster.from_dict({"nodes": [{"devices": [{"device": dev, "count": 4}]}] * 2})
        groups = [[_member(cluster, (0, 1), (1, 1)), _member(cluster, (2, 3), (1, 1))],
                  [_member(cluster, (4, 5), (3, 1))],
                  [_member(cluster, (6,), (4,)), _member(cluster, (7,), (4,))]]
        for M, zero in itertools.product((1, 2, 4), (0, 1)):
            B = 4 * M
            ctx = JointContext(costs, cluster, B, zero, 0.9, RHO, {}, {}, recompute)
            prep = prepare_stages(ctx, groups)
            cost, rc = joint_cost_tensor(ctx, prep, M, "1f1b", recompute)
            z = ctx.zero_for(M)
            for cuts in itertools.combinations(range(1, n), 2):
                b = (0, *cuts, n)

                def built(rc_flag):
                    return [Stage(b[s], b[s + 1], groups=tuple(m.ranks for m in members),
                                  micro_batches=tuple((4 // len(members),) * M for _ in members),
                                  tp_shares=tuple(m.shares for m in members), recompute=rc_flag)
                            for s, members in enumerate(groups)]

                fit = {}
                for rc_flag in (False, True):
                    stages = built(rc_flag)
                    mem = stage_memory_bytes(costs, stages, "1f1b", z, RHO)
                    fit[rc_flag] = [all(mem[r] <= usable_bytes(cluster.devices[r].spec, 0.9) for r in st.ranks)
                                    for st in stages]
                for s in range(len(groups)):
                    finite = bool(np.isfinite(cost[s, b[s], b[s + 1]]))
                    assert finite == (fit[False][s] or (recompute and fit[True][s])), (mem_gb, M, zero, b, s)
                    # an entry recomputes only where keeping does not fit (keeping is never slower)
                    assert bool(rc[s, b[s], b[s + 1]]) == (finite and not fit[False][s]), (mem_gb, M, zero, b, s)
                    checked += 1
                    fitting += finite
    assert 0.2 * checked < fitting < 0.9 * checked    # the sweep crosses the memory limit
