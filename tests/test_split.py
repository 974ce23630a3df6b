"""Stage code generation (``passes.split``): stage graphs compose to the original forward for several
splits of fx- and export-captured zoo models, at batch sizes other than the example's; tied
parameters live in both stages that use them; values skipping a stage are passed along; non-tensor
values are recomputed, never sent; bad ranges and backwards edges raise ``SplitError``."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx
from torch import nn

from autopar.passes.split import SplitError, batched_values, flat_inputs, run_stages, split_stages


@functools.lru_cache(maxsize=None)
def _analysed(name: str):
    from autopar.models import build
    from autopar.passes.analyze import analyze

    case = build(name, seed=0)
    analysis = analyze(case.model, case.example_inputs)
    return case, analysis


def _splits(num_blocks: int):
    cuts = [[], [1], [num_blocks - 1], [2, 3], list(range(1, num_blocks))]
    out = []
    for c in cuts:
        edges = [0] + c + [num_blocks]
        out.append([(a, b) for a, b in zip(edges, edges[1:])])
    return out


def _loss(out):
    return out["loss"] if isinstance(out, dict) else out


@pytest.mark.parametrize("name", ["gpt-tiny", "hf-gpt-tiny", "llama-tiny", "hf-llama-tiny", "mlp-tiny",
                                  "bert-tiny", "vit-tiny", "resnet-tiny"])
def test_stages_compose_to_the_original_forward(name):
    case, analysis = _analysed(name)
    gm = analysis.captured.gm
    nb = len(analysis.blocks)
    for rows in (1, 5):
        inputs, _ = case.batch(rows, seed=3)
        flat = flat_inputs(gm, inputs)
        with torch.no_grad():
            ref = _loss(gm(*inputs))
            for ranges in _splits(nb):
                progs = split_stages(gm, ranges)
                assert [p.is_last for p in progs] == [False] * (len(ranges) - 1) + [True]
                got = _loss(run_stages(progs, flat))
                torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=f"{name} {ranges} rows={rows}")


def test_gradients_through_stage_programs_equal_the_original():
    case, analysis = _analysed("gpt-tiny")
    gm = analysis.captured.gm
    inputs, targets = case.batch(4, seed=1)
    params = dict(gm.named_parameters())
    ref_loss = case.loss_fn(gm(*inputs), targets)
    ref = torch.autograd.grad(ref_loss, list(params.values()))
    progs = split_stages(gm, [(0, 2), (2, 4), (4, 6)])
    loss = case.loss_fn(run_stages(progs, flat_inputs(gm, inputs)), targets)
    got = torch.autograd.grad(loss, list(params.values()))
    for (k, _), a, b in zip(params.items(), got, ref):
        torch.testing.assert_close(a, b, msg=k)


def test_tied_parameter_lives_in_both_stages_and_others_in_one():
    for name in ("gpt-tiny", "hf-gpt-tiny"):   # fx: two modules share it; export: one get_attr, two users
        case, analysis = _analysed(name)
        progs = split_stages(analysis.captured.gm, [(0, 2), (2, 4), (4, 6)])
        tied = case.model.wte.weight
        holders = [p.index for p in progs if any(t is tied for t in p.gm.parameters())]
        assert holders == [0, 2], name
        seen = {}
        for p in progs:
            for t in p.gm.parameters():
                if t is not tied:
                    assert id(t) not in seen, f"{name}: a parameter lives in stages {seen[id(t)]} and {p.index}"
                    seen[id(t)] = p.index
        # the stage modules share the model's parameter objects
        assert all(any(t is q for q in case.model.parameters()) for p in progs for t in p.gm.parameters())


def test_values_that_skip_a_stage_are_passed_along_and_graph_inputs_never_sent():
    case, analysis = _analysed("hf-gpt-tiny")    # the attention-mask bias is made in block 0, used by all
    progs = split_stages(analysis.captured.gm, [(0, 1), (1, 2), (2, 6)])
    assert progs[0].sent == ("add", "clamp")
    assert progs[1].received == ("add", "clamp") and "clamp" in progs[1].sent
    assert progs[2].received == progs[1].sent
    placeholder_names = {n.name for n in analysis.captured.gm.graph.nodes if n.op == "placeholder"}
    assert not placeholder_names & {v for p in progs for v in p.sent}
    assert 2 in progs[2].graph_inputs          # labels are read by the last stage itself
    # every crossing value is a tensor whose dim 0 is the batch
    flat = flat_inputs(analysis.captured.gm, case.batch(3, seed=0)[0])
    assert batched_values(analysis.captured.gm, flat, ["add", "clamp"]) == {"add": True, "clamp": True}


class _Toy(nn.Module):
    """Two blocks; block 1 reads x.size(0) and a table without a batch dim made in block 0."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.table = nn.Parameter(torch.randn(4))

    def forward(self, x):
        n = x.size(0)
        h = self.a(x)
        t = self.table * 2.0
        return (self.b(h) + t).reshape(n, -1).sum()


def _toy_gm(example):
    gm = fx.symbolic_trace(_Toy())
    from autopar.passes.analysis import annotate_pass

    annotate_pass(gm, (example,))
    for n in gm.graph.nodes:
        n.meta["autopar.block"] = 1 if (n.op == "call_module" and n.target == "b") or n.name in ("add", "reshape", "sum_1", "output") else 0
    return gm


def test_non_tensor_values_are_recomputed_and_unbatched_values_detected():
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    gm = _toy_gm(x)
    progs = split_stages(gm, [(0, 1), (1, 2)])
    assert set(progs[0].sent) == {"a", "mul"}                # h and the table: tensors only
    size_nodes = [n for n in progs[1].gm.graph.nodes if n.op == "call_method" and n.target == "size"]
    assert size_nodes, "x.size(0) must be recomputed in stage 1 from its own input"
    assert 0 in progs[1].graph_inputs
    assert batched_values(gm, [x], ["a", "mul"]) == {"a": True, "mul": False}
    for rows in (1, 3, 6):
        xs = torch.randn(rows, 4)
        torch.testing.assert_close(run_stages(progs, [xs]), gm(xs))


def test_bad_splits_raise_split_error():
    gm = _toy_gm(torch.randn(2, 4))
    with pytest.raises(SplitError, match="contiguous"):
        split_stages(gm, [(0, 1), (0, 2)])
    with pytest.raises(SplitError, match="cover"):
        split_stages(gm, [(0, 1)])
    with pytest.raises(SplitError, match="at least one"):
        split_stages(gm, [])
    # a value used before the stage that makes it (blocks out of execution order)
    for n in gm.graph.nodes:
        if n.op == "call_module" and n.target == "a":
            n.meta["autopar.block"] = 1
        elif n.op == "call_module" and n.target == "b":
            n.meta["autopar.block"] = 0
    with pytest.raises(SplitError, match="execution order"):
        split_stages(gm, [(0, 1), (1, 2)])
    plain = fx.symbolic_trace(_Toy())
    with pytest.raises(SplitError, match="autopar.block"):
        split_stages(plain, [(0, 1)])


def test_a_batch_size_baked_into_the_graph_is_a_clear_error():
    class Fixed(nn.Module):
        def forward(self, x):
            return x.reshape(2, 8).sum()

    m = Fixed()
    gm = fx.symbolic_trace(m)
    for n in gm.graph.nodes:
        n.meta["autopar.block"] = 0
        n.meta["autopar.tensor"] = True
    with pytest.raises(SplitError, match="batch size"):
        batched_values(gm, [torch.randn(2, 4)], ["reshape"])
