"""The tensor-parallel cost functions of ``autopar.cost.tp`` added with ZeRO-1 in TP stages and the
per-block Linear pair counts: which stages run ZeRO-1, what it saves, and how pair counts price the
all-reduces (pure; tiny graphs)."""

from __future__ import annotations

import numpy as np

from autopar.cluster.model import builtin
from autopar.cost import tp as tp_cost
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Stage
from oracle import prepared_case



def test_zero_stage_and_saving_of_a_tp_stage():
    st = Stage(0, 2, groups=((0, 1), (2, 3)), micro_batches=((1,), (1,)), tp_shares=((3, 1), (3, 1)))
    assert tp_cost.tp_zero_stage(st, 1) == 1 and tp_cost.tp_zero_stage(st, 0) == 0
    uneven = Stage(0, 2, groups=((0, 1), (2, 3)), micro_batches=((1,), (1,)), tp_shares=((3, 1), (2, 2)))
    assert tp_cost.tp_zero_stage(uneven, 1) == 0
    one = Stage(0, 2, groups=((0, 1),), micro_batches=((1,),), tp_shares=((1, 1),))
    assert tp_cost.tp_zero_stage(one, 1) == 0
    params = [1000.0, 3000.0, 5000.0]
    costs = ModelCosts(block_names=("a", "b", "c"), params=params, param_bytes=[4 * p for p in params],
                       act_bytes=[0, 0, 0], out_bytes=[0, 0, 0], fwd_flops=[0, 0, 0], sample_batches=[1],
                       fwd_table={}, bwd_table={}, optimizer_bytes_per_param=8)
    saving = tp_cost.tp_zero_saving_bytes(costs, st, 1, 0.1)
    k = tp_cost.work_factors([0.75, 0.25], 0.1)
    assert np.isclose(saving[0], 4000 * 8 * k[0] / 2) and np.isclose(saving[3], 4000 * 8 * k[1] / 2)
    assert tp_cost.tp_zero_saving_bytes(costs, uneven, 1, 0.1) == {r: 0.0 for r in range(4)}
    steps = tp_cost.tp_optimizer_params(st, 4000.0, 0.1, zero_stage=1)
    assert np.isclose(steps[1], 4000 * k[1] / 2)


def test_pair_counts_price_two_all_reduces_per_pair():
    _, gm, _, n = prepared_case("gpt-tiny")
    pairs = tp_cost.tp_pairs_per_block(gm, n)
    assert pairs.tolist() == [0, 2, 2, 2, 2, 0]          # attention + MLP per layer; embedding, head none
    cluster = builtin("demo")
    kind = tp_cost.group_kind(cluster, (0, 1), (1, 1))
    t = np.full((1, n), 1e-3)
    costs = ModelCosts(block_names=tuple(map(str, range(n))), params=[1.0] * n, param_bytes=[4.0] * n,
                       act_bytes=[0.0] * n, out_bytes=[1e6] * n, fwd_flops=[0.0] * n, sample_batches=[1],
                       fwd_table={d.spec.name: t for d in cluster.devices},
                       bwd_table={d.spec.name: t for d in cluster.devices})
    f0, _ = tp_cost.kind_block_times(costs, kind, 1.0, 0.1)
    costs.tp_pairs = pairs
    f1, _ = tp_cost.kind_block_times(costs, kind, 1.0, 0.1)
    assert np.allclose(f1[1:5], f0[1:5])                  # a transformer layer: as before
    assert f1[0] < f0[0] and np.isclose(f1[0], 1e-3)      # no pair: whole on each rank, no all-reduce
