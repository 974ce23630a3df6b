"""Selective recomputation in the graph (``Stage.recompute_attention``, Megatron's selective
recomputation): every scaled dot-product attention call runs under ``torch.utils.checkpoint``, so
autograd keeps its inputs (q, k, v: saved by their producers anyway) and backward runs the attention
again, keeping nothing the attention computes inside.

The calls recognised: ``F.scaled_dot_product_attention`` (fx-traced models) and
``aten.scaled_dot_product_attention`` (torch.export graphs). Each is replaced by a function of the same
signature (``checkpointed_attention``, ``checkpointed_aten_attention``) that the tensor-parallel matcher reads as
the attention it wraps, so the pass may run before or after the TP rewrite. Dropout inside the
attention is replayed exactly (the checkpoint restores the RNG state), so a run with and without the
pass gives the same numbers.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpointed_attention", "checkpointed_aten_attention", "checkpoint_attention", "attention_calls"]


def checkpointed_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
    """``F.scaled_dot_product_attention`` recomputed in backward."""
    return checkpoint(F.scaled_dot_product_attention, query, key, value, attn_mask, dropout_p, is_causal,
                      scale=scale, enable_gqa=enable_gqa, use_reentrant=False)


def checkpointed_aten_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                           enable_gqa=False):
    """``aten.scaled_dot_product_attention`` recomputed in backward."""
    return checkpoint(torch.ops.aten.scaled_dot_product_attention.default, query, key, value, attn_mask,
                      dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa, use_reentrant=False)


_WRAPPED = {F.scaled_dot_product_attention: checkpointed_attention,
            torch.ops.aten.scaled_dot_product_attention.default: checkpointed_aten_attention}


def attention_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """The attention calls of ``gm`` that ``checkpoint_attention`` wraps."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _WRAPPED]


def checkpoint_attention(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its modules and parameters) whose attention calls recompute in
    backward; ``gm`` is unchanged. A graph without any is returned as a copy too."""
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _WRAPPED:
            node.target = _WRAPPED[node.target]
    out = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    out.meta.update(getattr(gm, "meta", {}))
    return out
