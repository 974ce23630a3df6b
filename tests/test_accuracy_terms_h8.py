"""Step terms the block tables missed (issue 12): the optimizer's per-tensor cost where engines step
unflattened tensors, the loss function's time on the last block, and a sequence-parallel TP stage's
reduce-scatter / all-gather phases. Pure or in-process on tiny models; no timing is asserted."""

import dataclasses

import numpy as np
import pytest
import torch

from autopar.cluster.model import Cluster
from autopar.cost import tp as tp_cost
from autopar.measure.loss import add_loss_to_tables, measure_loss
from autopar.cost.pipeline import stage_optimizer_s
from autopar.cost.profile import param_tensors_per_block
from autopar.measure.step import PER_TENSOR_PROBE, measure_optimizer, measure_optimizer_per_tensor
from autopar.cost.step import predicted_phases, tp_collective_phases
from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Stage


def _emulated(name, speed):
    return {"name": name, "emulate": "cpu", "speed": speed, "memory_GB": 4}


def _two():
    return Cluster.from_dict({"nodes": [{"devices": [{"device": _emulated("a", 1.0), "count": 1},
                                                     {"device": _emulated("b", 0.5), "count": 1}]}]})


def _costs(n=4, tensors=None, per_tensor=None):
    c = ModelCosts.synthetic({"a": [0.01] * n, "b": [0.02] * n})
    params = np.full(n, 1e6)
    params[-1] = 1e3                                                  # a small head
    return dataclasses.replace(c, params=params, optimizer_s_per_param={"a": 1e-8, "b": 2e-8},
                               param_tensors=None if tensors is None else np.asarray(tensors, float),
                               optimizer_s_per_tensor=dict(per_tensor or {}), _cache={})


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))


# -- the optimizer's per-tensor term ----------------------------------------------------------------
def test_per_tensor_term_moves_the_mean_rate_by_the_tensors_stepped():
    c = _costs(tensors=[6, 6, 6, 2], per_tensor={"a": 4e-5})
    n, k = float(c.params.sum()), float(c.param_tensors.sum())
    # the whole model at its own tensor count: the model-mean rate, as before
    assert c.optimizer_time("a", n, tensors=k) == pytest.approx(1e-8 * n)
    assert c.optimizer_time("a", n) == pytest.approx(1e-8 * n)               # None: the mean
    head = float(c.params[3])
    mean = head * k / n
    assert c.optimizer_time("a", head, tensors=2) == pytest.approx(1e-8 * head + 4e-5 * (2 - mean))
    assert c.optimizer_time("a", head, tensors=2) > c.optimizer_time("a", head)
    assert c.optimizer_time("a", head, flat=True, tensors=2) == pytest.approx(1e-8 * head)  # one buffer
    assert c.optimizer_time("b", head, tensors=2) == pytest.approx(2e-8 * head)   # no per-tensor rate
    assert _costs().optimizer_time("a", head, tensors=2) == pytest.approx(1e-8 * head)   # no counts


def test_pipeline_stage_and_its_phase_pay_their_own_tensors():
    from autopar.planner.pp import plan_pipeline

    cluster = _two()
    c = _costs(n=4, tensors=[6, 6, 6, 2], per_tensor={"a": 4e-5, "b": 8e-5})
    plan = plan_pipeline(c, cluster, 8, pp_layers=[3, 1], num_micro=2, schedule="1f1b")
    last = plan.stages[1]
    t = cluster.devices[last.groups[0][0]].spec.name
    want = c.optimizer_time(t, float(c.params[3]), tensors=2.0)
    assert stage_optimizer_s(c, cluster, last, 0) == pytest.approx(want)
    assert want != pytest.approx(c.optimizer_time(t, float(c.params[3])))
    phases = predicted_phases(plan, c, cluster)
    assert phases[last.groups[0][0]]["optimizer"] == pytest.approx(want)
    # a ZeRO-1 stage of two one-rank members steps its half as the data-parallel sync's flat shard
    st = Stage(0, 3, groups=((0,), (1,)), micro_batches=((2,), (2,)))
    p = float(c.params[:3].sum())
    assert stage_optimizer_s(c, cluster, st, 1) == pytest.approx(c.optimizer_time("b", p / 2, flat=True)
                                                                  + c.call_overhead("b"))


def test_per_tensor_rate_is_what_the_tensors_cost_beyond_one_flat_buffer(cache):
    shapes = [(64,)] * 16
    mean, per = measure_optimizer_per_tensor("adamw", shapes)
    assert mean == measure_optimizer("adamw", shapes)                 # the cached model-mean rate
    count, size = PER_TENSOR_PROBE                                   # the probe: small tensors vs one buffer
    many, one = measure_optimizer("adamw", [(size,)] * count), measure_optimizer("adamw", [(size * count,)])
    assert per == pytest.approx(max(0.0, (many - one) * size))
    assert measure_optimizer_per_tensor("adamw", [(64,)]) == (measure_optimizer("adamw", [(64,)]), 0.0)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 3, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(self.norm(x))


@pytest.fixture(scope="module")
def tiny():
    from autopar.passes.analyze import analyze

    torch.manual_seed(0)
    m = _Tiny()
    x = (torch.randn(4, 8),)
    return m, x, analyze(m, x)


def test_param_tensors_per_block_count_each_trainable_tensor_once(tiny):
    m, _, analysis = tiny
    got = param_tensors_per_block(analysis, len(analysis.stats))
    assert got.sum() == sum(1 for p in m.parameters() if p.requires_grad) == 7
    assert got[-1] >= 1                                               # the head's weight is in the last block


# -- the loss -----------------------------------------------------------------------------------------
def test_loss_is_timed_per_sample_batch_and_lands_on_the_last_block(tiny, cache):
    m, x, analysis = tiny
    y = torch.randint(0, 3, (4,))
    got = measure_loss(analysis, m, x, torch.nn.functional.cross_entropy, y, [1, 4])
    assert set(got) == {1, 4} and all(f >= 0 and b >= 0 for f, b in got.values())
    assert measure_loss(analysis, m, x, torch.nn.functional.cross_entropy, y, [1, 4]) == got   # cached
    assert measure_loss(analysis, m, x, None, y, [1]) == {}
    fwd = {"a": np.ones((2, 3)), "b": np.ones((2, 3))}
    bwd = {"a": np.ones((2, 3)), "b": np.ones((2, 3))}
    add_loss_to_tables(fwd, bwd, [1, 4], {1: (0.1, 0.2), 4: (0.3, 0.4)}, {"a": 1.0, "b": 0.5})
    np.testing.assert_allclose(fwd["a"], [[1, 1, 1.1], [1, 1, 1.3]])
    np.testing.assert_allclose(bwd["b"], [[1, 1, 1.4], [1, 1, 1.8]])


# -- sequence-parallel TP collectives -----------------------------------------------------------------
def _tp_costs(sp_supported, wgrad=None):
    c = ModelCosts.synthetic({"a": [0.01] * 3, "b": [0.02] * 3})
    return dataclasses.replace(c, tp_pairs=np.array([2.0, 2.0, 0.0]), tp_sp_supported=np.asarray(sp_supported, float),
                               tp_sp_covered=np.zeros(3), tp_wgrad_share=wgrad, _cache={})


@pytest.mark.parametrize("wgrad", [None, np.full((3, 2), 0.1)])
def test_tp_collective_phases_split_the_priced_collectives(wgrad):
    alpha, beta, x, types, shares = 1e-4, 1e-9, 4, ("a", "b"), (2, 1)
    for sp in (False, True):
        c = _tp_costs([1, 1, 0], wgrad)
        pad = tp_cost.sp_pad(shares) if sp else 1.0
        w = tp_cost.group_wgrad_s(c, types, shares, x)
        total = (tp_cost.tp_allreduce_block_s(c, alpha, beta, x, sp, pad)
                 + tp_cost.tp_backward_comm_s(c, alpha, beta, x, w, sp, pad)).sum()
        got = tp_collective_phases(c, alpha, beta, x, types, shares, sp)
        assert sum(got.values()) == pytest.approx(total)             # what kind_block_times prices
        if not sp:
            assert set(got) == {"all_reduce"}
        else:
            assert set(got) == {"reduce_scatter", "all_gather"}      # the pairless block has none
            if wgrad is None:                                        # nothing hidden: half each
                assert got["reduce_scatter"] == pytest.approx(got["all_gather"])
            else:                                                    # the overlap hides f's reduce-scatter
                assert got["reduce_scatter"] < got["all_gather"]


def test_sequence_parallel_tp_stage_predicts_its_scatter_and_gather():
    from autopar.ir.plan import Plan

    cluster = _two()
    c = _tp_costs([1, 1, 0])
    st = Stage(0, 3, groups=((0, 1),), micro_batches=((4, 4),), tp_shares=((2, 1),), sequence_parallel=True)
    plan = Plan.from_json(_plan_json(st))
    phases = predicted_phases(plan, c, cluster)
    for r in (0, 1):
        assert phases[r]["reduce_scatter"] > 0 and phases[r]["all_gather"] > 0
        assert "all_reduce" not in phases[r]
    plain = predicted_phases(Plan.from_json(_plan_json(dataclasses.replace(st, sequence_parallel=False))), c, cluster)
    assert plain[0]["all_reduce"] > 0 and "reduce_scatter" not in plain[0]


def _plan_json(stage):
    from autopar.planner.pp import plan_pipeline

    base = plan_pipeline(_tp_costs([1, 1, 0]), _two(), 8, pp_layers=[3], num_micro=2, schedule="1f1b")
    return dataclasses.replace(base, stages=(stage,)).to_json()
