"""The planning front's shortcuts keep the analysis exact: a captured module that generates its code
lazily (``capture(lazy_code=True)``) and annotations read from the analysis cache
(``passes.analysis_cache``) give, field by field and type by type, the analysis of the reference path
(eager code, every node interpreted, no cache), and the same cost tables."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from torch import nn

import autopar.models as zoo
from autopar.ir.cache_files import CacheFileWarning
from autopar.passes import analysis_cache
from autopar.passes.analyze import analyze
from autopar.passes.capture import capture
from autopar.passes.meta import ATTR_BYTES, COST, TENSOR


def _exact(x):
    """``x`` with every value tagged by its type, so that 0 and 0.0 (or a tuple and a list) differ."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, tuple((f.name, _exact(getattr(x, f.name))) for f in dataclasses.fields(x)))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_exact(v) for v in x))
    return (type(x).__name__, x)


def _rows(a):
    return [(n.name, n.op, _exact(n.meta.get(TENSOR)), _exact(n.meta.get(COST)), _exact(n.meta.get(ATTR_BYTES)))
            for n in a.captured.gm.graph.nodes]


def _same_analysis(a, b):
    assert _rows(a) == _rows(b)
    assert _exact(a.blocks) == _exact(b.blocks)
    assert _exact(a.stats) == _exact(b.stats)
    assert a.tied_groups == b.tied_groups and a.batch_size == b.batch_size and a.method == b.method
    assert a.captured.gm.code == b.captured.gm.code     # the lazy module generates the same code


@pytest.mark.parametrize("name,device", [("llama-tiny", "meta"), ("gpt-tiny", "cpu"), ("resnet-tiny", "cpu"),
                                         pytest.param("hf-llama-tiny", "cpu", marks=pytest.mark.slow)])
def test_lazy_cached_analysis_equals_the_reference(tmp_path, name, device):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    case = zoo.build(name, device=device)
    ref = analyze(case.model, case.example_inputs)
    cold = analyze(case.model, case.example_inputs, lazy_code=True, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1          # written
    warm = analyze(case.model, case.example_inputs, lazy_code=True, cache_dir=tmp_path)
    _same_analysis(ref, cold)
    _same_analysis(ref, warm)


def test_cost_tables_from_a_cached_analysis_are_the_same(tmp_path):
    from autopar.api import prepare
    from autopar.cluster.model import load

    case = zoo.build("llama-tiny", device="meta")
    cluster = load("demo")
    ref = prepare(case.model, cluster, case.example_inputs, measure=False,
                  analysis=analyze(case.model, case.example_inputs))
    analyze(case.model, case.example_inputs, cache_dir=tmp_path)
    warm = prepare(case.model, cluster, case.example_inputs, measure=False,
                   analysis=analyze(case.model, case.example_inputs, lazy_code=True, cache_dir=tmp_path))
    for f in dataclasses.fields(ref.costs):
        x, y = getattr(ref.costs, f.name), getattr(warm.costs, f.name)
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), f.name
        elif isinstance(x, dict):
            assert x.keys() == y.keys() and all(np.array_equal(np.asarray(x[k]), np.asarray(y[k])) for k in x), f.name
        else:
            assert x == y, f.name


def test_a_hit_interprets_nothing(tmp_path, monkeypatch):
    """A cache hit annotates without the interpreter (and so without ``FakeTensorMode`` and its
    ``torch._dynamo`` import)."""
    import autopar.passes.analysis as analysis

    case = zoo.build("gpt-tiny", device="cpu")
    ref = analyze(case.model, case.example_inputs, cache_dir=tmp_path)

    def refuse(*a, **k):
        raise AssertionError("interpreted on a cache hit")

    monkeypatch.setattr(analysis, "annotate_pass", refuse)
    _same_analysis(ref, analyze(case.model, case.example_inputs, cache_dir=tmp_path))


class _Net(nn.Module):
    def __init__(self, k=2.0, width=8, dtype=torch.float32):
        super().__init__()
        self.fc = nn.Linear(width, width, dtype=dtype)
        self.k = k

    def forward(self, x):
        return (self.fc(x) * self.k).sum()


def _key(model, x):
    return analysis_cache.annotation_key(capture(model, (x,)).gm, (x,))


def test_the_key_follows_what_the_annotations_read():
    x = torch.randn(2, 8)
    base = _key(_Net(), x)
    assert base is not None and base == _key(_Net(), torch.randn(2, 8))          # values are not read
    assert _key(_Net(k=2), x) != base                                              # a literal (2 is not 2.0)
    assert _key(_Net(), torch.randn(3, 8)) != base                                 # an input shape
    assert _key(_Net(), x.to(torch.float64)) != base                               # an input dtype
    assert _key(_Net(dtype=torch.float64), x.to(torch.float64)) != _key(_Net(), x.to(torch.float64))  # a weight's
    frozen = _Net()
    frozen.fc.weight.requires_grad_(False)
    assert _key(frozen, x) != base                                                 # a grad flag


def test_a_stale_or_broken_entry_is_a_miss(tmp_path):
    case = zoo.build("mlp-tiny", device="cpu")
    ref = analyze(case.model, case.example_inputs, cache_dir=tmp_path)
    (entry,) = tmp_path.glob("*.json")
    data = json.loads(entry.read_text())
    data["nodes"][1][0] = "renamed"                      # names that do not match the graph
    entry.write_text(json.dumps(data))
    _same_analysis(ref, analyze(case.model, case.example_inputs, cache_dir=tmp_path))
    entry.write_text("{not json")
    with pytest.warns(CacheFileWarning, match="not JSON"):
        _same_analysis(ref, analyze(case.model, case.example_inputs, cache_dir=tmp_path))
    assert json.loads(entry.read_text())["key"] == data["key"]   # rewritten whole
    good = json.loads(entry.read_text())
    bad = json.loads(entry.read_text())
    row = next(r for r in bad["nodes"] if r[1] is not None)
    row[1][1] = "manual_seed"                            # a torch attribute that is no dtype
    entry.write_text(json.dumps(bad))
    _same_analysis(ref, analyze(case.model, case.example_inputs, cache_dir=tmp_path))
    assert json.loads(entry.read_text()) == good
    victim = tmp_path.parent / "victim.txt"              # a link planted at the entry's name: replaced
    victim.write_text("keep")
    entry.unlink()
    entry.symlink_to(victim)
    with pytest.warns(CacheFileWarning, match="cannot be opened"):
        _same_analysis(ref, analyze(case.model, case.example_inputs, cache_dir=tmp_path))
    assert victim.read_text() == "keep" and not entry.is_symlink()


def test_a_lazy_module_runs_as_the_eager_one():
    case = zoo.build("gpt-tiny", device="cpu")
    eager = capture(case.model, case.example_inputs).gm
    lazy = capture(case.model, case.example_inputs, lazy_code=True).gm
    torch.testing.assert_close(lazy(*case.example_inputs), eager(*case.example_inputs), rtol=0, atol=0)


# -- repeated module calls traced once (passes.tracer) --------------------------------------------------
def _graph(gm):
    """Everything of a traced graph: each node's name, op, target, arguments, type and metadata, and the
    code generated from it."""
    return [(n.name, n.op, n.target, repr(n.args), repr(n.kwargs), n.type, repr(dict(n.meta)))
            for n in gm.graph.nodes], gm.code


def _same_trace(model, inputs) -> int:
    """Asserts the replayed trace equals the stock one; returns how many module calls it copied."""
    from autopar.passes.tracer import Tracer

    stock = capture(model, inputs)
    fast = capture(model, inputs, lazy_code=True, replay_repeats=True)
    assert stock.method == fast.method == "fx"
    assert _graph(fast.gm) == _graph(stock.gm)
    tracer = Tracer(replay=True)
    tracer.trace(model)
    torch.testing.assert_close(fast.gm(*inputs), stock.gm(*inputs), rtol=0, atol=0) \
        if not any(p.is_meta for p in model.parameters()) else None
    return tracer.replayed


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny", "bert-tiny", "vit-tiny", "resnet-tiny", "llama-7b"])
def test_a_replayed_trace_equals_the_stock_one(name):
    case = zoo.build(name, device="meta")
    copied = _same_trace(case.model, case.example_inputs)
    assert copied > 0 or name == "resnet-tiny"     # the shortcut was taken (resnet's blocks differ in shape)


class _Scaled(nn.Module):
    def __init__(self, width, k, gate=False, table=None):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.k, self.gate = k, gate
        if table is not None:
            self.table = table            # a plain tensor attribute (fx makes it a get_attr)

    def forward(self, x, scale=1.0):
        y = self.fc(x) * self.k * scale
        if self.gate:                      # Python control flow on the module's state
            y = torch.sigmoid(y)
        if hasattr(self, "table"):
            y = y + self.table
        return x + y


class _Stack(nn.Module):
    def __init__(self, layers, twice=(), nested=None, shared=None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.twice = set(twice)
        self.nested = nested
        self.shared = shared

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i in self.twice:
                x = layer(x, scale=0.5)    # called again: its nodes name the second call "@1"
        if self.nested is not None:
            x = self.nested(x)
        if self.shared is not None:
            x = self.shared(x) + self.layers[0].fc(x)
        return x.sum()


@pytest.mark.parametrize("build,copied", [
    (lambda: _Stack([_Scaled(8, 2.0) for _ in range(4)]), 3),
    (lambda: _Stack([_Scaled(8, 2.0), _Scaled(8, 3.0), _Scaled(8, 2.0), _Scaled(8, 2.0, gate=True)]), 1),
    (lambda: _Stack([_Scaled(8, 2.0) for _ in range(3)], twice=(0, 2)), 2),     # first calls; the second are traced
    (lambda: _Stack([_Scaled(8, 2.0) for _ in range(3)], nested=nn.Sequential(_Scaled(8, 2.0), _Scaled(8, 2.0))), 4),
    (lambda: (lambda t: _Stack([_Scaled(8, 2.0, table=t) for _ in range(3)]))(torch.ones(8)), 0),  # one shared tensor
    (lambda: _Stack([_Scaled(8, 2.0, table=torch.ones(8)) for _ in range(3)]), 0),   # own tensors: by identity
    (lambda: (lambda s: _Stack([s, _Scaled(8, 2.0), s], shared=s))(_Scaled(8, 2.0)), 1),        # one module twice
], ids=["same", "state differs", "called twice", "nested", "shared tensor", "own tensors", "shared module"])
def test_replay_keeps_the_stock_graph_where_calls_differ(build, copied):
    torch.manual_seed(0)
    model = build()
    assert _same_trace(model, (torch.randn(2, 8),)) == copied
