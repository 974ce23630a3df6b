"""The shortcuts of a cold analysis keep its results exact: repeated blocks copied from one interpreted
block (``passes.repeats``) give the annotations of a full interpretation, node for node; blocks that
differ in a literal are not taken for repeats; a model built on meta imports no ``torch._dynamo``."""

import subprocess
import sys

import pytest
import torch
from torch import nn

import autopar.models as zoo
from autopar.passes.analysis import annotate_pass
from autopar.passes.blocks import assign_blocks_pass, block_stats
from autopar.passes.capture import capture
from autopar.passes.meta import ATTR_BYTES, COST, TENSOR
from autopar.passes.repeats import repeated_segments


def _annotated(model, inputs, copy_repeats):
    gm = capture(model, inputs).gm
    annotate_pass(gm, inputs, copy_repeats=copy_repeats)
    blocks = assign_blocks_pass(gm)
    nodes = [(n.name, n.meta.get(TENSOR), n.meta.get(COST), n.meta.get(ATTR_BYTES)) for n in gm.graph.nodes]
    return gm, nodes, blocks, block_stats(gm, blocks)


@pytest.mark.parametrize("name,device", [("llama-tiny", "cpu"), ("gpt-tiny", "cpu"), ("llama-tiny", "meta"),
                                         pytest.param("hf-llama-tiny", "cpu", marks=pytest.mark.slow)])
def test_copied_blocks_equal_a_full_interpretation(name, device):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    case = zoo.build(name, device=device)
    gm, fast, blocks, stats = _annotated(case.model, case.example_inputs, True)
    _, full, blocks_full, stats_full = _annotated(case.model, case.example_inputs, False)
    assert len(repeated_segments(gm)) > 0      # the shortcut was taken: its layers repeat
    assert fast == full
    assert blocks == blocks_full and stats == stats_full


class _Layer(nn.Module):
    def __init__(self, width, k):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.k = k

    def forward(self, x):
        return x + self.fc(x) * self.k   # k is a literal of the graph


class _Net(nn.Module):
    def __init__(self, ks):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(8, k) for k in ks)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_blocks_differing_in_a_literal_are_not_repeats():
    model = _Net([1, 1, 2, 1.0])    # 1.0 == 1 in Python, but it is another literal
    gm = capture(model, (torch.randn(2, 8),)).gm
    segs = repeated_segments(gm)
    assert sorted({segs[n][0].nodes[0].name for n in segs}) == ["layers_0_fc", "layers_1_fc"]   # layers 0, 1
    _, fast, _, _ = _annotated(model, (torch.randn(2, 8),), True)
    _, full, _, _ = _annotated(model, (torch.randn(2, 8),), False)
    assert fast == full


@pytest.mark.slow   # a fresh interpreter (about 3 s, mostly importing torch)
def test_a_meta_build_imports_no_dynamo():
    code = ("import sys, autopar.models as z; c = z.build('llama-140b', device='meta'); "
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'triton', 'sympy')))[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_tp_pairs_are_found_again_after_the_graph_changes():
    import copy

    import torch.fx as fx

    from autopar.passes.analyze import analyze
    from autopar.passes.tp_match import find_tp_pairs

    case = zoo.build("llama-tiny")
    gm = analyze(case.model, case.example_inputs).captured.gm
    pairs = find_tp_pairs(gm)
    assert find_tp_pairs(gm) == pairs and len(pairs) == 2 * case.config.num_layers
    fresh = lambda: find_tp_pairs(fx.GraphModule(gm, copy.deepcopy(gm.graph)))   # noqa: E731 - no answer kept
    # a column output of a width no longer in heads, then a row Linear swapped for another module
    col = next(n for n in gm.graph.nodes if n.name == pairs[0].column_nodes[0])
    col.meta[TENSOR] = type(col.meta[TENSOR])((*col.meta[TENSOR].shape[:-1], 7), col.meta[TENSOR].dtype)
    assert find_tp_pairs(gm) == fresh() != pairs
    setattr(gm.get_submodule(pairs[-1].row.rpartition(".")[0]), pairs[-1].row.rpartition(".")[2], nn.Identity())
    assert find_tp_pairs(gm) == fresh() and len(find_tp_pairs(gm)) < len(pairs) - 1
