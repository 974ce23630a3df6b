"""Mixture-of-experts graphs in the analysis: routing ops (an in-place normalisation of top-k weights,
a histogram's integer cumulative sum) analyse, and grouped expert products are counted by their
formula (``autopar.passes.flop_formulas``), checked against a per-group count."""

from __future__ import annotations

import random

import torch
from torch import nn

from autopar.passes.analyze import analyze
from autopar.passes.flop_formulas import grouped_mm_flops
from autopar.passes.meta import COST


def _per_group(kind: str, sizes: list[int], m: int, k: int, n: int) -> tuple[tuple, tuple, tuple, int]:
    """(a shape, b shape, out shape, FLOPs summed group by group) of one grouped product whose groups
    have ``sizes`` along the dimension ``kind`` cuts."""
    g = len(sizes)
    if kind == "rows":         # a 2-D, b 3-D: groups of a's rows
        return (sum(sizes), k), (g, k, n), (sum(sizes), n), sum(2 * s * k * n for s in sizes)
    if kind == "cols":         # a 3-D, b 2-D: groups of b's columns
        return (g, m, k), (k, sum(sizes)), (m, sum(sizes)), sum(2 * m * k * s for s in sizes)
    if kind == "inner":        # both 2-D: groups of the contracted dimension
        return (m, sum(sizes)), (sum(sizes), n), (g, m, n), sum(2 * m * s * n for s in sizes)
    return (g, m, k), (g, k, n), (g, m, n), g * 2 * m * k * n      # both 3-D: a batch of products


def test_grouped_product_formula_matches_the_per_group_count():
    rng = random.Random(0)
    for _ in range(200):
        kind = rng.choice(["rows", "cols", "inner", "batch"])
        sizes = [rng.randint(0, 9) for _ in range(rng.randint(1, 6))]
        m, k, n = (rng.randint(1, 12) for _ in range(3))
        a, b, out, want = _per_group(kind, sizes, m, k, n)
        meta = [torch.empty(s, device="meta") for s in (a, b, out)]
        assert grouped_mm_flops("_grouped_mm", (meta[0], meta[1]), meta[2]) == want, (kind, sizes, m, k, n)


def test_a_library_backward_op_counts_both_gradients():
    a, b = torch.empty(48, 16, device="meta"), torch.empty(4, 16, 32, device="meta")
    assert grouped_mm_flops("transformers::grouped_mm_fallback_backward", (a, b), None) == 2 * (2 * 48 * 16 * 32)


class _Experts(nn.Module):
    """One grouped product over 4 experts (bf16: the kernel's meta function takes no other dtype)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter((torch.randn(4, 32, 64) * 0.1).bfloat16())

    def forward(self, x):
        offs = torch.tensor([8, 16, 24, 32], dtype=torch.int32)
        return torch._grouped_mm(x, self.w, offs=offs)


def test_a_grouped_product_is_counted_forward_and_backward():
    analysis = analyze(_Experts(), (torch.randn(32, 32).bfloat16(),))
    costs = [n.meta[COST] for n in analysis.captured.gm.graph.nodes
             if "grouped_mm" in str(n.target) and COST in n.meta]
    assert len(costs) == 1
    assert costs[0].fwd_flops == 2 * 32 * 32 * 64
    assert costs[0].bwd_flops == 2 * costs[0].fwd_flops


class _Router(nn.Module):
    """Mixtral's and Qwen2-MoE's routing: top-k weights normalised in place, and the offsets of a
    grouped product from a histogram's integer cumulative sum."""

    def __init__(self, experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(16, experts, bias=False)
        self.proj = nn.Linear(16, 16)
        self.experts = experts

    def forward(self, x):
        weights, chosen = self.gate(x).softmax(-1).topk(2, dim=-1)
        weights /= weights.sum(-1, keepdim=True)
        counts = torch.histc(chosen.float(), bins=self.experts, min=0, max=self.experts - 1)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return self.proj(x) * weights.sum(-1, keepdim=True) + offsets[-1].float() * 0


def test_routing_ops_analyse():
    model = _Router()
    x = torch.randn(8, 16)
    analysis = analyze(model, (x,))
    assert analysis.fwd_flops >= 2 * 8 * 16 * 16          # the projection at least
    assert torch.allclose(model(x), model(x))             # the model itself left as it was
