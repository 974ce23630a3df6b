"""The analysis orchestrator: capture -> annotate -> blocks -> per-block statistics.

``analyze(model, example_inputs)`` runs the passes in order and returns an ``Analysis``: the captured
graph (annotated in place), the blocks and their statistics at the example's batch size, and the
blocks that share parameters. Everything per sample is the example's figure divided by its batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autopar.ir.pauses import gc_paused
from autopar.passes.analysis import annotate_pass
from autopar.passes.analysis_cache import annotate_cached
from autopar.passes.blocks import Block, BlockStats, assign_blocks_pass, block_stats
from autopar.passes.capture import CaptureError, Captured, capture

__all__ = ["Analysis", "analyze"]


@dataclass(frozen=True)
class Analysis:
    captured: Captured
    batch_size: int
    blocks: tuple[Block, ...]
    stats: tuple[BlockStats, ...]
    tied_groups: tuple[tuple[int, ...], ...]

    @property
    def method(self) -> str:
        return self.captured.method

    @property
    def total_params(self) -> int:
        return sum(s.params for s in self.stats)

    @property
    def fwd_flops(self) -> float:
        return sum(s.fwd_flops for s in self.stats)

    def distinct_blocks(self) -> dict[str, list[int]]:
        """struct_hash -> indices of the blocks with that structure."""
        out: dict[str, list[int]] = {}
        for s in self.stats:
            out.setdefault(s.struct_hash, []).append(s.index)
        return out


def _batch_size(example_inputs: tuple) -> int:
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise CaptureError("example_inputs: need at least one tensor with a batch dimension (dim 0)")


def analyze(model: nn.Module, example_inputs: tuple, *, method: str = "auto", lazy_code: bool = False,
            replay_repeats: bool = False, cache_dir=None) -> Analysis:
    """``lazy_code``, ``replay_repeats``: the captured module generates its Python code when first run,
    and repeated module calls are traced once (``capture``; the same graph, for an analysis that plans,
    not one the runtime runs). ``cache_dir``: annotations are read from and written to this folder
    (``passes.analysis_cache``; the same annotations, value for value)."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    with gc_paused():
        captured = capture(model, example_inputs, method=method, lazy_code=lazy_code,
                           replay_repeats=replay_repeats)
        if captured.batch_static:
            raise CaptureError(
                f"model: {type(model).__name__}'s batch dimension is static under torch.export "
                f"({captured.static_reason}); autopar runs it at other batch sizes (its cost tables and "
                "the plan's micro-batches). Make the batch dimension symbolic: no Python int taken from "
                "an input's size(0) in control flow or in a reshape, e.g. use -1 there")
        if cache_dir is None:
            annotate_pass(captured.gm, example_inputs)
        else:
            annotate_cached(captured.gm, example_inputs, cache_dir)
        blocks = assign_blocks_pass(captured.gm)
        stats, tied = block_stats(captured.gm, blocks)
    return Analysis(captured=captured, batch_size=_batch_size(example_inputs), blocks=blocks, stats=stats,
                    tied_groups=tied)
