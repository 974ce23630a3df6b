"""Cost terms of issue 12's accuracy work (autopar.cost.step, autopar.cost.pipeline, autopar.cost.profile):
the block tables' totals come from the unhooked graph, the optimizer rate is timed with the ranks that
step at once, a pipeline step ends with its loss all-reduce, and the predicted phases lay out what the
recorder measures (a dp stage's exposed all-reduce, a pipeline's tied and loss all-reduces). Pure or
in-process; no timing is asserted."""

import dataclasses
import itertools

import pytest
import torch

from autopar.cluster.model import Cluster
from autopar.cost import comm
from autopar.measure.cache import load_json, measure_cache_path
from autopar.cost.pipeline import pipeline_loss_allreduce_s, tied_allreduces_s
from autopar.measure.blocks import _in_situ
from autopar.cost.step import _hidden_allreduce_s, predicted_phases
from autopar.measure.step import measure_optimizer, step_concurrency
from autopar.ir.costs import ModelCosts
from autopar.planner.dp import plan_dp
from autopar.planner.pp import plan_pipeline


def _emulated(name, speed):
    return {"name": name, "emulate": "cpu", "speed": speed, "memory_GB": 4}


def _three():
    return Cluster.from_dict({"nodes": [{"devices": [{"device": _emulated("a", 1.0), "count": 2},
                                                     {"device": _emulated("b", 0.5), "count": 1}]}]})


def _costs(n=8, tied=()):
    c = ModelCosts.synthetic({"a": [0.01] * n, "b": [0.02] * n})
    return dataclasses.replace(c, tied_groups=tied, _cache={})


class _Tick:
    """A clock that advances one tick per read: a run's total is how many reads it made."""

    def __init__(self):
        self.t = itertools.count()

    def __call__(self):
        return float(next(self.t))


def test_rows_add_up_to_the_unhooked_graphs_totals():
    from torch.fx.passes.split_module import split_module

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    m = Two()
    gm = torch.fx.symbolic_trace(m)
    for node in gm.graph.nodes:
        node.meta["block"] = 0 if node.name in ("x", "a", "relu") else 1
    split = split_module(gm, m, lambda node: node.meta["block"], keep_original_order=True)
    subs = {int(k.split("_")[1]): v for k, v in split.named_children() if k.startswith("submod_")}
    x = (torch.randn(3, 4),)
    # Hooked runs read the clock at every block boundary (several ticks per forward / backward); the
    # unhooked whole graph reads it at its start, end of forward and end of backward: one tick each.
    res = _in_situ(split, subs, 2, x, 3, lambda: None, _Tick(), "min", whole=gm)
    assert res[0].sum() == pytest.approx(1.0) and res[1].sum() == pytest.approx(1.0)
    assert (res > 0).all()                                     # the split between blocks: the hooks'
    hooked = _in_situ(split, subs, 2, x, 3, lambda: None, _Tick(), "min")
    assert hooked[0].sum() > 1.0                               # without ``whole``: the hooked totals
    assert all(p.grad is None for p in m.parameters()) and all(p.grad is None for p in gm.parameters())


def test_optimizer_rate_with_ranks_stepping_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    alone = measure_optimizer("adamw", [(256, 64)], repeats=2)
    both = measure_optimizer("adamw", [(256, 64)], repeats=2, concurrent=2)
    assert alone > 0 and both > 0
    assert measure_optimizer("adamw", [(256, 64)], repeats=2, concurrent=2) == both     # its own cache entry
    keys = list(load_json(measure_cache_path()))
    assert any(k.endswith("|c2") for k in keys) and any(not k.endswith("|c2") for k in keys)
    with pytest.raises(ValueError, match="concurrent"):
        measure_optimizer("adamw", [(4,)], concurrent=0, use_cache=False)


def test_step_concurrency_counts_cpu_ranks_sharing_a_machine(monkeypatch):
    import autopar.measure.step as step

    monkeypatch.setattr(step, "machine_cores", lambda: 2)
    assert step_concurrency(_three()) == 2                     # 3 emulated ranks on 2 cores
    monkeypatch.setattr(step, "machine_cores", lambda: 8)
    assert step_concurrency(_three()) == 3
    apart = Cluster.from_dict({"nodes": [{"device": _emulated("a", 1.0), "count": 1},
                                         {"device": _emulated("a", 1.0), "count": 1}]})
    assert step_concurrency(apart) == 1                        # one rank per node
    gpus = Cluster.from_dict({"nodes": [{"device": "H100-80GB", "count": 4}]})
    assert step_concurrency(gpus) == 1


def test_pipeline_step_and_phases_hold_the_loss_and_tied_all_reduces():
    cluster = _three()
    c = _costs(tied=((0, 7),))
    plan = plan_pipeline(c, cluster, 24, pp_layers=[3, 3, 2], num_micro=4, schedule="1f1b")
    loss = pipeline_loss_allreduce_s(plan, cluster)
    assert loss == pytest.approx(comm.loss_allreduce_s(cluster, [0, 1, 2])) and loss > 0
    tied = tied_allreduces_s(plan, c, cluster)
    assert set(tied) == {0, 2} and tied[0] == tied[2] > 0      # the first and last stages hold the group
    phases = predicted_phases(plan, c, cluster)
    for r, d in phases.items():
        assert d["all_reduce"] == pytest.approx(loss + tied.get(r, 0.0))
        assert sum(d.values()) == pytest.approx(plan.predicted.step_time_s)   # wait is the rest


def test_dp_phase_prices_the_exposed_all_reduce_as_the_planner_does():
    cluster = _three()
    c = _costs(n=8)
    plan = plan_dp(c, cluster, 24, strategy="uniform-dp", zero_stage=0)
    st = plan.stages[0]
    dar = comm.dp_allreduces(c, cluster, [g[0] for g in st.groups], 0)
    hidden = _hidden_allreduce_s(c, cluster, st, dar)
    assert dar.buckets > 1 and 0 < hidden <= dar.grad_s - dar.last_bucket_s
    phases = predicted_phases(plan, c, cluster)
    for d in phases.values():
        assert d["all_reduce"] == pytest.approx(dar.total_s - hidden)
    # the planner's step holds the same exposed part: compute + exposed comm + optimizer
    assert plan.predicted.breakdown["comm_s"] == pytest.approx(dar.total_s - hidden)
    assert _hidden_allreduce_s(c, cluster, st, comm.DpAllReduces()) == 0.0      # nothing to hide


def test_call_overhead_needs_a_gap():
    from autopar.measure.step import measure_call_overhead

    with pytest.raises(ValueError, match="gap_s"):
        measure_call_overhead(None, (), gap_s=0.0, use_cache=False)
