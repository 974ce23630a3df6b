"""Tensor-parallel vocabulary ends: an LM head sharded over its output features (its output gathered),
and a token embedding sharded over its rows (its lookups summed).

An LM head maps the hidden size to the vocabulary (4,096 to 128,256 in Llama 3 8B, 18,432 to 256,000 in
Nemotron-4): a wide Linear with no row Linear after it, so no pair (``passes.tp_match``) holds it, and it
ran whole on every TP rank. Megatron shards it over the vocabulary; so does this pass, with the output
gathered so that the loss (the user's function, outside the graph) sees the whole logits.

Terms
- head: a Linear on parameters (``passes.tp_nodes.linear_use``) that no pair holds, whose weight and
  bias nothing else reads (a tied head stays whole: its weight is the embedding's too), whose output
  features are at least ``HEAD_WIDTH`` times its input features (an LM head; not a classifier or
  a projection), and whose output reaches the graph's output through no other Linear (``find_tp_heads``).
- rewrite (``passes.tp.tp_rewrite``): the member keeps the rows ``unit_ranges(out_features, shares,
  granularity)`` of the weight and bias (a column); f (``CopyToGroup``) on its input sums the input's
  gradient over the group in backward; after it, ``GatherFromGroup`` all-gathers the members' pieces
  along the last dim (padded to the largest, uneven shares alike) in forward and takes this member's
  piece of the gradient in backward (every member computes the same gradient of the whole output).
  Unbound (a member run on its own, as f / g without their sums) it puts the member's piece in place
  and zeros elsewhere: the output keeps its whole shape.
- embedding: an ``nn.Embedding`` call or ``aten.embedding`` on a parameter whose weight nothing else
  reads (a tied embedding stays whole), with at least ``HEAD_WIDTH`` times more rows than features
  (a vocabulary: not a position table), and no ``max_norm`` (it would write the table in forward)
  (``find_tp_embeddings``). The member keeps its rows ``unit_ranges(rows, shares, granularity)``
  (``ShardedEmbedding``): a token outside them looks up zeros, so g (``ReduceFromGroup``) after it sums
  every member's lookups into the whole embedding (Megatron's vocabulary-parallel embedding); each
  member's rows get the gradients of their tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autopar.passes.tp_nodes import linear_use, param_read_counts

__all__ = ["HEAD_WIDTH", "find_tp_heads", "find_tp_embeddings", "embedding_use", "EmbeddingUse",
           "GatherFromGroup", "ShardedEmbedding", "bind_all_gather"]

HEAD_WIDTH = 4      # output features over input features a Linear needs to be sharded as a head

# ``all_gather(outputs, tensor)``: fills ``outputs`` (one tensor per member, in group order) with every
# member's ``tensor`` (``autopar.runtime.tp_comm.GroupAllGather``); None: no communication.
AllGather = Callable[[list, torch.Tensor], None]


def _reaches_output_alone(node: fx.Node, linears: set[fx.Node]) -> bool:
    """Whether the values made from ``node`` reach the graph's output and no other Linear."""
    seen, todo, out = {node}, [node], False
    while todo:
        for u in todo.pop().users:
            if u in seen:
                continue
            if u in linears:
                return False
            out |= u.op == "output"
            seen.add(u)
            todo.append(u)
    return out


def find_tp_heads(gm: fx.GraphModule, pairs, keep_whole: frozenset = frozenset()) -> tuple[str, ...]:
    """The node names of ``gm``'s heads (see the module docstring), in graph order; ``pairs``: the
    graph's ``find_tp_pairs`` (their Linears are never heads); ``keep_whole``: parameter names to leave
    whole (tied to a copy outside ``gm``: a pipeline stage's)."""
    held = {c for p in pairs for c in p.column_nodes} | {p.row_node for p in pairs}
    uses = {n: lin for n in gm.graph.nodes if (lin := linear_use(gm, n)) is not None}
    reads = param_read_counts(gm)
    out = []
    for n, lin in uses.items():
        if n.name in held or lin.out_features < HEAD_WIDTH * lin.in_features or lin.weight in keep_whole \
                or lin.bias in keep_whole:
            continue
        params = [gm.get_parameter(t) for t in (lin.weight, lin.bias) if t is not None]
        if any(reads.get(id(p), 0) != 1 for p in params):
            continue          # tied (read again elsewhere), or read through another module
        if _reaches_output_alone(n, set(uses) - {n}):
            out.append(n.name)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class EmbeddingUse:
    """A token embedding in the graph: an ``nn.Embedding`` call or ``aten.embedding`` on a parameter."""
    weight: str              # qualified name of the table
    num_embeddings: int
    embedding_dim: int
    padding_idx: int | None
    module: str | None       # call_module target, or None for the functional form


def embedding_use(gm: fx.GraphModule, node: fx.Node) -> EmbeddingUse | None:
    """The ``EmbeddingUse`` ``node`` is (a plain ``nn.Embedding`` call without ``max_norm``, or
    ``aten.embedding`` on a ``get_attr`` table), or None."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if type(mod) is not nn.Embedding or mod.max_norm is not None or mod.sparse or len(node.args) != 1 \
                or node.kwargs:
            return None
        return EmbeddingUse(f"{node.target}.weight", mod.num_embeddings, mod.embedding_dim, mod.padding_idx,
                            str(node.target))
    if node.op == "call_function" and node.target in (torch.ops.aten.embedding.default,) and not node.kwargs:
        w = node.args[0]
        if not (isinstance(w, fx.Node) and w.op == "get_attr") or any(bool(a) for a in node.args[3:]):
            return None             # scale_grad_by_freq / sparse: not sharded
        try:
            table = gm.get_parameter(str(w.target))
        except AttributeError:
            return None
        pad = int(node.args[2]) if len(node.args) > 2 and int(node.args[2]) >= 0 else None
        return EmbeddingUse(str(w.target), table.shape[0], table.shape[1], pad, None)
    return None


def find_tp_embeddings(gm: fx.GraphModule, keep_whole: frozenset = frozenset()) -> tuple[str, ...]:
    """The node names of ``gm``'s token embeddings TP shards (see the module docstring), in graph order;
    ``keep_whole`` as ``find_tp_heads``'."""
    reads = param_read_counts(gm)
    out = []
    for n in gm.graph.nodes:
        use = embedding_use(gm, n)
        if use is None or use.num_embeddings < HEAD_WIDTH * use.embedding_dim or use.weight in keep_whole:
            continue
        if reads.get(id(gm.get_parameter(use.weight)), 0) == 1:
            out.append(n.name)
    return tuple(out)


class ShardedEmbedding(nn.Module):
    """Rows ``[start, start + weight rows)`` of a token embedding: other tokens look up zeros (see the
    module docstring); ``padding_idx``: the whole table's, whose row gets no gradient."""

    def __init__(self, weight: torch.Tensor, start: int, padding_idx: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
        self.start = int(start)
        rows = weight.shape[0]
        self.padding_idx = padding_idx - self.start if padding_idx is not None and \
            self.start <= padding_idx < self.start + rows else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight,
                          padding_idx=self.padding_idx)
        return out * inside.unsqueeze(-1).to(out.dtype)

    def extra_repr(self) -> str:
        return f"rows={self.start}:{self.start + self.weight.shape[0]}, dim={self.weight.shape[1]}"


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, all_gather, sizes, index, order):
        a = sum(sizes[:index])
        ctx.piece = (a, sizes[index])
        if all_gather is None:     # a member run on its own: its piece in place, zeros elsewhere
            out = x.new_zeros((*x.shape[:-1], sum(sizes)))
            out[..., a:a + sizes[index]] = x
            return out
        most = max(sizes)
        padded = (x if x.shape[-1] == most else F.pad(x, (0, most - x.shape[-1]))).contiguous()
        outputs = [torch.empty_like(padded) for _ in sizes]
        all_gather(outputs, padded)
        pieces: list = [None] * len(sizes)
        for position, t in enumerate(outputs):     # group positions are sorted ranks: members' order
            pieces[order[position]] = t[..., :sizes[order[position]]]
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        a, k = ctx.piece
        return grad[..., a:a + k].contiguous(), None, None, None, None


class GatherFromGroup(nn.Module):
    """The members' pieces of a head's output, gathered along the last dim (see the module
    docstring); ``sizes``: each member's features, ``index``: this member's. The group position ->
    member map is learnt by one all-gather on first use (group ranks are sorted global ranks; a
    member may list them in another order)."""

    def __init__(self, sizes: tuple[int, ...], index: int, all_gather: AllGather | None = None):
        super().__init__()
        self.sizes, self.index, self.all_gather = tuple(int(s) for s in sizes), int(index), all_gather
        self._order: list[int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_gather is not None and self._order is None:
            me = torch.full((1,), float(self.index), dtype=torch.float32, device=x.device)
            out = [torch.empty_like(me) for _ in self.sizes]
            self.all_gather(out, me)
            self._order = [int(t.item()) for t in out]
        return _GatherFn.apply(x, self.all_gather, self.sizes, self.index, self._order)

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}, index={self.index}"


def bind_all_gather(local_gm: fx.GraphModule, all_gather: AllGather | None) -> None:
    """Make every head gather of a ``tp_rewrite`` result gather over the group with ``all_gather``."""
    for m in local_gm.modules():
        if isinstance(m, GatherFromGroup):
            m.all_gather, m._order = all_gather, None
