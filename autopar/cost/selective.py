"""Selective recomputation (Megatron's, ``Pin(recompute="selective")``): backward runs each block's
attention cores (scaled dot-product attention) again and keeps everything else.

Pricing
- time: each block's backward gains the forward of its attention cores, that forward's share of the
  block's forward FLOPs (``ModelCosts.attn_fwd_flops`` over ``fwd_flops``) times the block's forward
  seconds (``attention_recompute_costs``: tables whose backward carries it, so every planner prices it);
- memory: unchanged. The analysis prices attention as the training kernels run it (flash and
  memory-efficient attention keep q, k, v, the output and one log-sum-exp per query row, not the
  T x T probabilities), so recomputing the core frees only that log-sum-exp, which is not priced. This
  is why selective recomputation pays on the math attention of 2022 and hardly at all with flash
  attention, whose backward already recomputes the probabilities.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from autopar.errors import PlanError
from autopar.ir.costs import ModelCosts

__all__ = ["attention_share", "attention_recompute_costs"]


def attention_share(costs: ModelCosts) -> np.ndarray | None:
    """Per block, the attention cores' share of its forward FLOPs (None: the costs do not say)."""
    if costs.attn_fwd_flops is None:
        return None
    fwd = np.asarray(costs.fwd_flops, float)
    return np.divide(costs.attn_fwd_flops, fwd, out=np.zeros_like(fwd), where=fwd > 0)


def attention_recompute_costs(costs: ModelCosts) -> ModelCosts:
    """``costs`` whose every block's backward also reruns its attention cores' forward (see the module
    docstring); ``PlanError`` when the model has no attention core or the costs do not count it."""
    share = attention_share(costs)
    if share is None or not share.any():
        raise PlanError("pin.recompute: 'selective' recomputes attention cores (scaled dot-product "
                        "attention), but the model's cost tables count none; pin recompute=True or False")
    bwd = {t: np.asarray(table, float) + np.asarray(costs.fwd_table[t], float) * share[None, :]
           for t, table in costs.bwd_table.items()}
    return dataclasses.replace(costs, bwd_table=bwd, _cache={})
