"""Tensor-parallel memory priced from the TP layout (``cost.tp.tp_memory_replicated_per_block``,
``cost.memory.tp_memory_fractions``), not from the time-based replicated fraction: which parameters
the rewrite shards (a pair's column weights and biases, its row weight) and which it leaves whole
(norms, row biases, blocks without a pair). Pure: no ranks run here (``benchmarks/bench_memory.py``
measures the engines against it)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopar.cost.memory import stage_memory_bytes, tp_memory_fractions
from autopar.cost.tp import tp_memory_replicated_per_block
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Stage


@pytest.fixture(scope="module")
def gpt_tiny():
    from autopar.models import build
    from autopar.passes.analyze import analyze

    case = build("gpt-tiny", seed=0)
    analysis = analyze(case.model, case.example_inputs)
    return case.model, analysis


def test_replicated_parameters_are_the_norms_and_row_biases(gpt_tiny):
    model, analysis = gpt_tiny
    rep_p, rep_a = tp_memory_replicated_per_block(analysis.captured.gm, len(analysis.stats))
    assert rep_p[0] == 1.0 and rep_p[-1] == 1.0            # embedding and head: no pair, whole
    layer = model.layers[0]
    whole = sum(p.numel() for n, p in layer.named_parameters() if "ln" in n or n.endswith("c_proj.bias"))
    assert rep_p[1] == pytest.approx(whole / sum(p.numel() for p in layer.parameters()))
    assert 0.0 < rep_a[1] < 0.5 and rep_a[0] == 1.0          # inside a layer most activations are sharded


def _costs(n=3, **kw) -> ModelCosts:
    return ModelCosts.synthetic({"cpu": [0.01] * n}, param_bytes=[4e6] * n, act_bytes=[1e6] * n, **kw)


def test_fractions_fall_back_to_rho_and_weight_by_size():
    costs = _costs()
    stage = Stage(0, 3, groups=((0, 1),), micro_batches=((2,),), tp_shares=((1, 1),))
    assert tp_memory_fractions(costs, stage, 0.3) == (0.3, 0.3)
    costs = dataclasses.replace(costs, tp_param_replicated=np.array([1.0, 0.0, 0.0]),
                                tp_act_replicated=np.array([0.5, 0.5, 0.5]))
    p, a = tp_memory_fractions(costs, stage, 0.3)
    assert p == pytest.approx(1 / 3) and a == pytest.approx(0.5)


def test_fully_sharded_layout_halves_each_rank():
    base = _costs()
    stage = Stage(0, 3, groups=((0, 1),), micro_batches=((2,),), tp_shares=((1, 1),))
    sharded = dataclasses.replace(base, tp_param_replicated=np.zeros(3), tp_act_replicated=np.zeros(3))
    whole = dataclasses.replace(base, tp_param_replicated=np.full(3, 0.999), tp_act_replicated=np.full(3, 0.999))
    half, full = stage_memory_bytes(sharded, [stage], "none", 0), stage_memory_bytes(whole, [stage], "none", 0)
    for r in (0, 1):     # work factors 0.5 against 0.999 + 0.001 * 0.5 (synthetic costs: no loss term)
        assert half[r] == pytest.approx(full[r] * 0.5 / 0.9995, rel=1e-6)
