"""Tensor-parallel pricing as the engine runs it (issue 12, prediction accuracy).

- a group's block times: the slowest rank's compute (blocks without a pair whole) plus one all-reduce
  per pair in each direction; a rank's parameters from the rewrite's layout (``tp_rank_params``);
- the measured replicated fraction (``measure.tp``): a figure in range for a model with Linear
  pairs, the shard's fraction that the rewrite really cuts, the user's model left as it was (gradients,
  buffers, RNG), memoised; None where it cannot or should not be measured (no pairs, meta weights,
  GPU or roofline tables). No figure is asserted on: timings belong to benchmarks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from autopar.cluster.model import Cluster
from autopar.cost import tp as tp_cost
from autopar.measure.tp import cpu_replicated_fraction, measure_replicated_fraction
from autopar.ir.costs import ModelCosts
from autopar.passes.analyze import analyze


class _Block(nn.Module):
    def __init__(self, width=32, hidden=64):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.bn = nn.BatchNorm1d(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.relu(self.up(self.norm(self.bn(x))))))


class _Mlp(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(depth))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _costs(n_blocks: int, pairs=None) -> ModelCosts:
    c = ModelCosts.synthetic({"cpu": [1e-3] * n_blocks})
    if pairs is not None:
        c.tp_pairs = np.asarray(pairs, dtype=np.float64)
    return c


@pytest.fixture
def mlp_graph():
    torch.manual_seed(0)
    model = _Mlp()
    inputs = (torch.randn(4, 32),)
    return model, analyze(model, inputs).captured.gm, inputs


def test_measured_fraction_in_range_and_model_untouched(mlp_graph, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    model, gm, inputs = mlp_graph
    model.train()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    m = measure_replicated_fraction(gm, inputs, _costs(3, pairs=[1, 1, 0]), batch=8, repeats=1)
    assert m is not None
    assert 0.0 <= m.forward <= 0.9 and 0.0 <= m.backward <= 0.9
    assert min(m.forward, m.backward) <= m.step <= max(m.forward, m.backward)
    assert m.fraction == pytest.approx(0.25)      # shares (1, 3): a quarter of the hidden features
    assert m.batch == 8 and all(r > 0 for r in m.ratios)
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())
    assert all(torch.equal(v, buffers[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.random.get_rng_state(), rng)
    # memoised (and on disk): the same figure without timing again
    assert measure_replicated_fraction(gm, inputs, _costs(3, pairs=[1, 1, 0]), batch=8, repeats=1) is m
    assert (tmp_path / "tp_fraction.json").exists()


def test_not_measured_without_pairs_or_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    lone = nn.Sequential(nn.Linear(8, 4))
    x = (torch.randn(2, 8),)
    assert measure_replicated_fraction(analyze(lone, x).captured.gm, x, _costs(1), batch=4, repeats=1) is None
    with torch.device("meta"):
        meta = _Mlp()
    gm = analyze(meta, (torch.randn(4, 32, device="meta"),)).captured.gm
    assert measure_replicated_fraction(gm, (torch.randn(4, 32),), _costs(3), batch=4, repeats=1) is None


def test_only_cpus_timed_here_are_measured(mlp_graph, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    _, gm, inputs = mlp_graph
    gpus = Cluster.homogeneous("A100-80GB", count=2, per_node=2)
    cpus = Cluster.from_dict({"nodes": [{"device": {"name": "cpu", "emulate": "cpu", "speed": 1.0, "memory_GB": 2},
                                         "count": 2}]})
    costs = _costs(3, pairs=[1, 1, 0])
    costs.sources = {"cpu": "roofline (nominal CPU)"}
    assert cpu_replicated_fraction(gm, inputs, costs, cpus) is None      # tables not timed here
    assert cpu_replicated_fraction(gm, inputs, costs, gpus) is None      # GPUs keep the graph's estimate
    costs.sources = {"cpu": "emulated"}
    rho = cpu_replicated_fraction(gm, inputs, costs, cpus)
    assert rho is not None and 0.0 <= rho <= 0.9
    costs.sources = {"cpu": "emulated + calibrated"}      # calibrated tables were still timed here
    assert cpu_replicated_fraction(gm, inputs, costs, cpus) == rho
    costs.sources = {"cpu": "roofline (nominal CPU) + calibrated"}
    assert cpu_replicated_fraction(gm, inputs, costs, cpus) is None


def test_tp_rank_params_follow_the_layout():
    costs = _costs(3)
    costs.params = np.array([100.0, 1000.0, 1000.0])
    costs.tp_param_replicated = np.array([1.0, 0.01, 0.01])
    held = tp_cost.tp_rank_params(costs, slice(0, 3), [0.75, 0.25], 0.3)
    whole = 100 + 0.01 * 2000              # the first block and 1% of the others
    np.testing.assert_allclose(held, [whole + 0.75 * (2100 - whole), whole + 0.25 * (2100 - whole)])
    assert held.sum() == pytest.approx(2100 + whole)          # what is whole is held twice
    np.testing.assert_allclose(tp_cost.tp_rank_params(costs, slice(1, 3), [1.0], 0.3), [2000.0])
    costs.tp_param_replicated = None                          # without the layout: the work factors
    np.testing.assert_allclose(tp_cost.tp_rank_params(costs, slice(0, 3), [0.75, 0.25], 0.3),
                               2100 * tp_cost.work_factors([0.75, 0.25], 0.3))


def test_kind_block_times_is_the_slowest_rank_plus_its_allreduces():
    costs = ModelCosts.synthetic({"a": [1e-3, 2e-3, 3e-3], "b": [2e-3, 4e-3, 6e-3]})
    costs.tp_pairs = np.array([0.0, 1.0, 2.0])
    kind = tp_cost.GroupKind(("a", "b"), (5, 3), 1e-4, 1e-9)
    f, b = tp_cost.rank_block_times(costs, kind.types, kind.shares, 8.0, 0.2)
    assert f.shape == b.shape == (2, 3)
    np.testing.assert_allclose(f[:, 0], [costs.fwd_time("a", 8.0)[0], costs.fwd_time("b", 8.0)[0]])  # no pair: whole
    ar = tp_cost.tp_allreduce_block_s(costs, 1e-4, 1e-9, 8.0)
    np.testing.assert_allclose(ar, [0.0, 1e-4 + 1e-9 * 1e5 * 8, 2 * (1e-4 + 1e-9 * 1e5 * 8)])
    kf, kb = tp_cost.kind_block_times(costs, kind, 8.0, 0.2)
    np.testing.assert_allclose(kf, f.max(axis=0) + ar)
    np.testing.assert_allclose(kb, b.max(axis=0) + ar)
