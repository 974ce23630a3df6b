"""Model blocks the benchmarks' own models share (no path set-up: importable from a rank process)."""

import torch
from torch import nn

__all__ = ["GluBlock"]


class GluBlock(nn.Module):
    """Pre-norm residual SwiGLU feed-forward block: x + down(silu(gate(norm x)) * up(norm x))."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
