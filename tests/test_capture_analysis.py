"""Capture and analysis on the model zoo: exact parameter counts, FLOPs vs the analytic count, blocks,
meta-device analysis of llama-140b, third-party models through the export fallback, clear errors."""

import pytest
import torch
import torch.fx as fx
from torch import nn

import autopar.models as zoo
from autopar.passes.analyze import analyze
from autopar.passes.capture import CaptureError, capture

TINY = ["gpt-tiny", "llama-tiny", "bert-tiny", "vit-tiny", "resnet-tiny", "mlp-tiny", "hf-gpt-tiny", "hf-llama-tiny"]
BIG = ["gpt2-small", "gpt2-xl", "llama-7b", "bert-large", "vit-base", "resnet50", "mlp"]


@pytest.mark.parametrize("name", TINY + [pytest.param(n, marks=pytest.mark.slow) for n in BIG])
def test_every_zoo_model_captures_and_analyses(name):
    case = zoo.build(name, device="cpu" if name in TINY else "meta")
    a = analyze(case.model, case.example_inputs)
    assert a.method == ("export" if name.startswith("hf-") else "fx")
    assert a.total_params == case.num_params_expected == sum(p.numel() for p in case.model.parameters())
    assert len(a.blocks) >= 3 and a.blocks[0].name == "embed" and a.blocks[-1].name == "head"
    # Identical layers share one structural hash: embed + one layer kind + head (resnet's stages differ).
    if name not in ("resnet-tiny", "resnet50"):
        assert len(a.distinct_blocks()) == 3
    for s in a.stats:
        assert s.fwd_flops >= 0 and s.saved_bytes >= 0
    assert all(s.bwd_flops > 0 for s in a.stats[1:-1])


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"] + [pytest.param(n, marks=pytest.mark.slow)
                                                            for n in ("gpt2-small", "gpt2-xl", "llama-7b")])
def test_forward_flops_match_the_analytic_count(name):
    case = zoo.build(name, device="cpu" if "tiny" in name else "meta")
    a = analyze(case.model, case.example_inputs)
    per_sample = a.fwd_flops / a.batch_size
    assert abs(per_sample / case.fwd_flops_per_sample_expected - 1) < 0.05


def test_backward_is_about_twice_forward_on_matmuls():
    case = zoo.build("gpt2-small", device="meta")
    a = analyze(case.model, case.example_inputs)
    layer = a.stats[1]
    assert 1.8 < layer.bwd_flops / layer.fwd_flops < 2.3


@pytest.mark.slow   # analyses a 145B-parameter graph on meta
def test_llama_140b_on_meta_allocates_nothing():
    case = zoo.build("llama-140b", device="meta")
    a = analyze(case.model, case.example_inputs)
    assert a.total_params == case.num_params_expected
    assert len(a.blocks) == 82 and len(a.distinct_blocks()) == 3
    assert all(p.is_meta for p in case.model.parameters())


def test_tied_embedding_is_reported():
    case = zoo.build("gpt-tiny")
    a = analyze(case.model, case.example_inputs)
    assert a.tied_groups == ((0, len(a.blocks) - 1),)


def test_cut_bytes_are_the_hidden_state_between_layers():
    case = zoo.build("gpt-tiny")
    a = analyze(case.model, case.example_inputs)
    cfg = case.config
    b = a.batch_size
    assert a.stats[1].cut_bytes == b * cfg.seq_len * cfg.hidden_size * 4


@pytest.mark.parametrize("name", ["hf-gpt-tiny", "hf-llama-tiny"])
def test_third_party_models_defeat_fx_and_come_through_export(name):
    case = zoo.build(name)
    with pytest.raises(Exception):
        fx.symbolic_trace(case.model)
    c = capture(case.model, case.example_inputs)
    assert c.method == "export" and c.fx_error
    assert not c.batch_static
    # The captured graph computes the same loss, also at another batch size.
    inputs, _ = case.batch(3, seed=1)
    ref = case.model(*inputs)["loss"]
    got = c.gm(*inputs)
    got = got["loss"] if isinstance(got, dict) else got[0]
    torch.testing.assert_close(got, ref)


def test_a_batch_1_example_keeps_the_batch_dimension_dynamic():
    """torch.export fixes a dimension of size 1: capture exports a batch-1 example at two rows, so the
    graph runs every batch size (the cost tables', the plan's micro-batches)."""
    case = zoo.build("hf-gpt-tiny")
    one = tuple(t[:1] for t in case.example_inputs)
    c = capture(case.model, one)
    assert c.method == "export" and not c.batch_static
    inputs, _ = case.batch(3, seed=1)
    ref = case.model(*inputs)["loss"]
    got = c.gm(*inputs)
    torch.testing.assert_close(got["loss"] if isinstance(got, dict) else got[0], ref)
    assert analyze(case.model, one).batch_size == 1


class _StaticBatch(nn.Module):
    """A model whose batch dimension is really static: plain fx fails on its shape check, and export
    specialises the batch to the 4 rows its view names."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.table = nn.Parameter(torch.zeros(4, 8))

    def forward(self, x):
        if x.shape[0] > 0:
            x = self.lin(x)
        return x.view(4, 8) + self.table


def test_a_static_batch_is_one_clear_error():
    model = _StaticBatch()
    c = capture(model, (torch.randn(4, 8),))
    assert c.method == "export" and c.batch_static and c.static_reason
    with pytest.raises(CaptureError, match=r"batch dimension is static under torch.export .*symbolic"):
        analyze(model, (torch.randn(4, 8),))


def test_module_paths_are_kept():
    from autopar.passes.capture import module_path

    case = zoo.build("hf-gpt-tiny")
    c = capture(case.model, case.example_inputs)
    paths = {module_path(n) for n in c.gm.graph.nodes}
    assert any(p.startswith("layers.0") for p in paths) and any(p.startswith("layers.1") for p in paths)


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # depends on tensor values: neither fx nor export can capture it
            return self.lin(x)
        return x


def test_uncapturable_model_names_the_line():
    with pytest.raises(CaptureError) as ei:
        capture(_Untraceable(), (torch.randn(2, 4),))
    msg = str(ei.value)
    assert "_Untraceable" in msg and "x.sum() > 0" in msg and "test_capture_analysis.py" in msg


def test_flat_graph_falls_back_to_top_level_modules():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    a = analyze(model, (torch.randn(3, 8),))
    # nn.Sequential children are named 0, 1, 2: they are the blocks.
    assert [b.name for b in a.blocks][-3:] == ["0", "1", "2"] or len(a.blocks) >= 3
    assert a.total_params == sum(p.numel() for p in model.parameters())


def test_an_example_that_is_a_view_leaves_no_guard_on_its_base():
    """``ids[:, :-1]`` as the example: export would guard its base's shape, which a micro-batch or a
    fresh tensor fails; capture exports a copy."""
    case = zoo.build("hf-gpt-tiny")
    wide = torch.cat([case.example_inputs[0], case.example_inputs[0][:, :1]], dim=1)
    view = (wide[:, :-1],) + tuple(case.example_inputs[1:])
    assert view[0]._base is not None
    c = capture(case.model, view)
    assert c.method == "export" and not c.batch_static
    fresh = tuple(t[:3].clone() for t in case.batch(3, seed=1)[0])
    c.gm(*fresh)
