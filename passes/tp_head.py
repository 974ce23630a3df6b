"""Tensor-parallel heads: a lone column Linear sharded over its output features, its output gathered.

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
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autopar.passes.tp_nodes import linear_use

__all__ = ["HEAD_WIDTH", "find_tp_heads", "GatherFromGroup", "bind_all_gather"]

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


def find_tp_heads(gm: fx.GraphModule, pairs) -> tuple[str, ...]:
    """The node names of ``gm``'s heads (see the module docstring), in graph order; ``pairs``: the
    graph's ``find_tp_pairs`` (their Linears are never heads)."""
    held = {c for p in pairs for c in p.column_nodes} | {p.row_node for p in pairs}
    uses = {n: lin for n in gm.graph.nodes if (lin := linear_use(gm, n)) is not None}
    reads: dict[int, int] = {}      # id(parameter) -> nodes reading it (get_attr, or a module call)
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            try:
                obj = gm.get_parameter(str(n.target))
            except AttributeError:
                continue
            reads[id(obj)] = reads.get(id(obj), 0) + 1
        elif n.op == "call_module":
            for p in gm.get_submodule(str(n.target)).parameters():
                reads[id(p)] = reads.get(id(p), 0) + 1
    out = []
    for n, lin in uses.items():
        if n.name in held or lin.out_features < HEAD_WIDTH * lin.in_features:
            continue
        params = [gm.get_parameter(t) for t in (lin.weight, lin.bias) if t is not None]
        if any(reads.get(id(p), 0) != 1 for p in params):
            continue          # tied (read again elsewhere), or read through another module
        if _reaches_output_alone(n, set(uses) - {n}):
            out.append(n.name)
    return tuple(out)


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
