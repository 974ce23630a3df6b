"""Tensor-parallel rewrite: shard Linear pairs of a captured graph across an *uneven* group.

Each member of a tensor-parallel group owns a contiguous range of attention heads (or MLP hidden
features) proportional to its share, so devices of different speeds can sit in one group.

Terms
- column (column-parallel Linear): its output features are split over the group; each member computes
  its own range of them from the full input.
- row (row-parallel Linear): its input features are split the same way; each member multiplies its
  slice and the partial outputs are summed over the group (an all-reduce).
- pair: the columns that read one input, the row that consumes them, and the *region* between them
  (the nodes that carry sharded tensors: views into heads, attention, activations, rotary).
- part: a column's output may hold several tensors side by side (GPT's fused ``c_attn`` is
  ``[q | k | v]``: 3 parts, found from the ``chunk``/``split`` that follows it); each part is sliced alike.
- unit: the smallest piece a member may own. Attention: one head (the region splits the features into
  heads with a view; ``unit_features`` = head size). MLP: one hidden feature (``unit_features`` = 1),
  split in multiples of a granularity.
- shares: per group member, the number of heads it owns (``Stage.tp_shares``). A pair whose unit
  count differs from ``sum(shares)`` is split in the same proportion (largest remainder, in whole
  heads or in granules of MLP features).
- f / g: Megatron's conjugate operators. f (``CopyToGroup``) is identity forward, all-reduce backward,
  placed on the columns' input; g (``ReduceFromGroup``) is all-reduce forward, identity backward, placed
  on the row's output. The row's bias is added once, after g (it stays a replicated parameter).
- stride: while matching, each sharded tensor dim carries how many part features one index of that
  dim spans (1 on the Linear's feature dim, the head size on the heads dim after ``view``).

Graphs: ``torch.fx.symbolic_trace`` graphs (``nn.Linear`` module calls, Python ops and methods) and
``torch.export`` graphs (``aten.linear`` on ``get_attr`` weights, ATen views, permutes, splits), with
output shapes from ``passes.analysis`` (or ``meta["val"]``); models on the ``meta`` device work.

Anything the matcher does not recognise (an opaque leaf module, a custom op, an unknown pattern, a
parameter used twice such as a tied LM head, a graph without shapes) stays replicated: every rank
computes it in full. That is never an error.

``find_tp_pairs`` is the pure analysis (the planner's view); ``tp_rewrite`` applies it for one member
and records the sharded parameters in ``gm.meta["autopar.tp"]`` (a ``TPLayout``) so that engines can
gather full parameters and reduce gradients.
"""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch import nn

from autopar.errors import AutoparError
from autopar.passes.meta import BLOCK, COST, TP_LAYOUT
from autopar.passes.tp_head import GatherFromGroup, ShardedEmbedding, embedding_use, find_tp_embeddings, find_tp_heads
from autopar.passes.tp_match import LinearUse, TPPair, attr_value, find_tp_pairs, linear_use

__all__ = ["TPPair", "ParamShard", "TPLayout", "CopyToGroup", "ReduceFromGroup", "find_tp_pairs",
           "unit_ranges", "tp_rewrite", "assemble_full", "TP_META_KEY", "TPRewriteError", "AllReduce",
           "bind_all_reduce", "load_shards"]

TP_META_KEY = TP_LAYOUT   # gm.meta key of the TPLayout (passes.meta.TP_LAYOUT)


class TPRewriteError(AutoparError):
    """``tp_rewrite`` / ``unit_ranges`` were given shares or a rank index they cannot use (names the
    argument)."""


# --------------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True, slots=True)
class ParamShard:
    """One sharded parameter: the member's tensor is the concatenation, along ``dim``, of the runs
    ``ranges[member]`` (``(start, stop)`` along ``dim`` of the full tensor)."""
    local: str                    # qualified name in the rewritten module
    source: str                   # qualified name of the full parameter in the input module
    full_shape: tuple[int, ...]
    dim: int
    ranges: tuple[tuple[tuple[int, int], ...], ...]   # per member

    def local_numel(self, member: int) -> int:
        other = math.prod(s for d, s in enumerate(self.full_shape) if d != self.dim)
        return other * sum(b - a for a, b in self.ranges[member])


@dataclass(frozen=True, slots=True)
class TPLayout:
    shares: tuple[int, ...]
    rank_index: int
    pairs: tuple[TPPair, ...]
    params: tuple[ParamShard, ...]
    unit_ranges: tuple[tuple[tuple[int, int], ...], ...] = ()   # per pair: (start, stop) units per member
    heads: tuple[str, ...] = ()   # the heads sharded (``passes.tp_head``): their Linear nodes' names
    embeddings: tuple[str, ...] = ()   # the token embeddings sharded (``passes.tp_head``): their nodes' names


def assemble_full(shard: ParamShard, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The full parameter from every member's local tensor (``pieces[m]`` of member m)."""
    out = pieces[0].new_empty(shard.full_shape)
    for member, piece in enumerate(pieces):
        offset = 0
        for a, b in shard.ranges[member]:
            out.narrow(shard.dim, a, b - a).copy_(piece.narrow(shard.dim, offset, b - a))
            offset += b - a
    return out


# --------------------------------------------------------------------------------------------------
# Communication: Megatron's f and g


# ``all_reduce``: a function that sums a tensor in place over the member's group, bound by the engine
# that runs the module (``bind_all_reduce``); None: no communication (a group of one, or a module run
# on its own, e.g. to compare one member's output).
AllReduce = Callable[[torch.Tensor], None]


class _CopyToGroupFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, all_reduce):
        ctx.all_reduce = all_reduce
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if ctx.all_reduce is not None:
            ctx.all_reduce(grad)
        return grad, None


class _ReduceFromGroupFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, all_reduce):
        x = x.contiguous().clone()
        if all_reduce is not None:
            all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class CopyToGroup(nn.Module):
    """f: identity forward, all-reduce (sum) of the gradient over the group backward."""

    def __init__(self, all_reduce: AllReduce | None = None):
        super().__init__()
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CopyToGroupFn.apply(x, self.all_reduce)

    def backward_comm_async(self, grad: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """Start the backward all-reduce of ``grad`` (the caller hands it over: summed in place when
        contiguous); returns the tensor that holds the sum once the returned wait has been called
        (``passes.tp_overlap``). A bound all-reduce with a ``start`` method
        (``autopar.runtime.tp_comm.GroupAllReduce``) runs asynchronously; any other blocks here."""
        grad = grad.contiguous()
        if self.all_reduce is None:
            return grad, _no_wait
        start = getattr(self.all_reduce, "start", None)
        if start is None:
            self.all_reduce(grad)
            return grad, _no_wait
        return grad, start(grad)


def _no_wait() -> None:
    return None


class ReduceFromGroup(nn.Module):
    """g: all-reduce (sum) over the group forward, identity backward."""

    def __init__(self, all_reduce: AllReduce | None = None):
        super().__init__()
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromGroupFn.apply(x, self.all_reduce)


def bind_all_reduce(local_gm: fx.GraphModule, all_reduce: AllReduce | None) -> None:
    """Make every f / g of a ``tp_rewrite`` result sum over the group with ``all_reduce``."""
    for m in local_gm.modules():
        if isinstance(m, (CopyToGroup, ReduceFromGroup)):
            m.all_reduce = all_reduce


def load_shards(local_gm: fx.GraphModule, source_gm: fx.GraphModule) -> None:
    """Copy each sharded parameter of a ``tp_rewrite`` result from the full parameter of ``source_gm``
    it was cut from (e.g. after the full weights were made equal on every rank)."""
    layout = local_gm.meta[TP_LAYOUT]
    with torch.no_grad():
        for s in layout.params:
            full = source_gm.get_parameter(s.source)
            local_gm.get_parameter(s.local).copy_(
                torch.cat([full.narrow(s.dim, a, b - a) for a, b in s.ranges[layout.rank_index]], dim=s.dim))


# --------------------------------------------------------------------------------------------------
# Splitting units


def unit_ranges(num_units: int, shares: tuple[int, ...], granularity: int = 1) -> tuple[tuple[int, int], ...]:
    """Contiguous ``(start, stop)`` unit ranges per member, proportional to ``shares``.

    ``num_units == sum(shares)`` gives the shares exactly. Otherwise units are dealt in granules of
    ``granularity`` (the largest divisor of ``num_units`` not above it) by largest remainder, ties to
    the earlier member.
    """
    if not shares or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise TPRewriteError(f"shares: need non-negative counts with a positive sum, got {shares!r}")
    if num_units == sum(shares):
        counts = list(shares)
    else:
        g = max(d for d in range(1, max(1, granularity) + 1) if num_units % d == 0)
        granules = num_units // g
        total = sum(shares)
        exact = [granules * s / total for s in shares]
        counts = [int(math.floor(e)) for e in exact]
        left = granules - sum(counts)
        for i in sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))[:left]:
            counts[i] += 1
        counts = [c * g for c in counts]
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return tuple(out)


def _pair_units(pair: TPPair, shares: tuple[int, ...], granularity: int) -> tuple[tuple[int, int], ...]:
    return unit_ranges(pair.num_units, shares, 1 if pair.kind == "attention" else granularity)


# --------------------------------------------------------------------------------------------------
# The rewrite


def _set_literal(node: fx.Node, where: tuple, value: int) -> None:
    args = list(node.args)
    if where[0] == "arg":
        args[where[1]] = value
    else:
        seq = list(args[where[1]])
        seq[where[2]] = value
        args[where[1]] = type(node.args[where[1]])(seq)
    node.args = tuple(args)


def _set_module(gm: fx.GraphModule, target: str, mod: nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, mod)


def _empty_linear(in_features: int, out_features: int, bias: bool, like: torch.Tensor) -> nn.Linear:
    """A Linear without random initialisation (it draws nothing from the global RNG)."""
    return torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias,
                                    device=like.device, dtype=like.dtype)


def _install_linear(new: fx.GraphModule, node: fx.Node, lin: LinearUse, prefix: str, weight: torch.Tensor,
                    bias: torch.Tensor | None, like: torch.Tensor) -> tuple[str, ...]:
    """Make ``node`` of ``new`` use the local ``weight`` / ``bias`` (copies); the names they live under."""
    rg = like.requires_grad
    if lin.module is not None:   # a fresh nn.Linear replaces the (shared) module
        local = _empty_linear(weight.shape[1], weight.shape[0], bias is not None, like)
        with torch.no_grad():
            local.weight.copy_(weight)
            if bias is not None:
                local.bias.copy_(bias)
        local.requires_grad_(rg)
        _set_module(new, lin.module, local)
        return (f"{lin.module}.weight",) + ((f"{lin.module}.bias",) if bias is not None else ())
    names = []   # functional form: new top-level parameters, the get_attr reads retargeted
    for i, t in ((1, weight), (2, bias)):
        if t is None:
            continue
        name = f"{prefix}_{'weight' if i == 1 else 'bias'}"
        new.register_parameter(name, nn.Parameter(t.detach().clone(), requires_grad=rg))
        read = node.args[i]
        with node.graph.inserting_before(node):
            fresh = node.graph.get_attr(name)
        fresh.meta = dict(read.meta)
        node.replace_input_with(read, fresh)
        if not read.users:
            node.graph.erase_node(read)
        names.append(name)
    return tuple(names)


def _drop_unread_attrs(new: fx.GraphModule, gm: fx.GraphModule) -> None:
    """Remove the full tensors that retargeted reads left behind in ``new``'s own (unshared) modules."""
    read = {n.target for n in new.graph.nodes if n.op == "get_attr"}
    called = {n.target for n in new.graph.nodes if n.op == "call_module"}
    for name, _ in list(new.named_parameters(remove_duplicate=False)):
        owner_name, _, field_name = name.rpartition(".")
        if name in read or any(owner_name == c or owner_name.startswith(c + ".") for c in called):
            continue
        owner = new.get_submodule(owner_name) if owner_name else new
        try:
            shared = owner is (gm.get_submodule(owner_name) if owner_name else gm)
        except AttributeError:
            shared = False
        if not shared and hasattr(owner, field_name):
            delattr(owner, field_name)


def _rewrite_pair(new: fx.GraphModule, gm: fx.GraphModule, nodes: dict, orig: dict, k: int, pair: TPPair,
                  ranges, rank_index: int, all_reduce, shards: list) -> None:
    """Shard pair ``k`` in ``new`` for member ``rank_index`` (its unit ``ranges``): the literals it
    scales, its column Linears' output rows, its row Linear's input columns with g (the reduce) after
    it and the bias added once, f before the columns' input. Appends the ``ParamShard``s to ``shards``."""
    u0, u1 = ranges[rank_index]
    for name, where, value, stride in pair.literals:
        _set_literal(nodes[name], where, value * (u1 - u0) // pair.num_units)
    # columns: rows of each part (grouped-query k and v: fewer features per unit than q)
    for j, (cname, parts) in enumerate(zip(pair.column_nodes, pair.parts)):
        lin = linear_use(gm, orig[cname])
        cuf = pair.column_features(j)
        width = pair.num_units * cuf
        runs = tuple(tuple((p * width + a * cuf, p * width + b * cuf) for p in range(parts)) for a, b in ranges)
        w = attr_value(gm, lin.weight)
        bias = attr_value(gm, lin.bias) if lin.bias else None
        local_w = torch.cat([w.detach()[a:b] for a, b in runs[rank_index]])
        local_b = torch.cat([bias.detach()[a:b] for a, b in runs[rank_index]]) if bias is not None else None
        names = _install_linear(new, nodes[cname], lin, f"_tp{k}_c{j}", local_w, local_b, like=w)
        shards.append(ParamShard(names[0], lin.weight, tuple(w.shape), 0, runs))
        if bias is not None:
            shards.append(ParamShard(names[1], lin.bias, tuple(bias.shape), 0, runs))
    # row: input columns; bias added once after the reduce
    lin = linear_use(gm, orig[pair.row_node])
    uf = pair.unit_features
    runs = tuple(((a * uf, b * uf),) for a, b in ranges)
    a, b = runs[rank_index][0]
    w = attr_value(gm, lin.weight)
    names = _install_linear(new, nodes[pair.row_node], lin, f"_tp{k}_r", w.detach()[:, a:b], None, like=w)
    shards.append(ParamShard(names[0], lin.weight, tuple(w.shape), 1, runs))
    _reduce_after_row(new, gm, nodes[pair.row_node], lin, k, all_reduce)
    # f on the columns' input
    x = nodes[pair.input_node]
    f = _f_before(new, x, nodes[pair.column_nodes[0]], f"_tp_f{k}", all_reduce)
    for cname in pair.column_nodes:
        nodes[cname].replace_input_with(x, f)


def _reduce_after_row(new: fx.GraphModule, gm: fx.GraphModule, row: fx.Node, lin, k: int, all_reduce) -> None:
    """g after the row Linear ``row`` of pair ``k`` (``ReduceFromGroup``), then its bias (replicated:
    ``gm``'s Parameter, or the bias read the functional form had) added once; ``row``'s users read it."""
    graph = new.graph
    users = list(row.users)
    new.add_submodule(f"_tp_g{k}", ReduceFromGroup(all_reduce))
    with graph.inserting_after(row):
        out = graph.call_module(f"_tp_g{k}", (row,))
    out.meta = {key: v for key, v in row.meta.items() if key != COST}
    if lin.bias is not None:
        if lin.module is not None:
            bias_name = f"_tp{k}_r_bias"
            new.register_parameter(bias_name, attr_value(gm, lin.bias))   # replicated: gm's Parameter
            with graph.inserting_after(out):
                battr = graph.get_attr(bias_name)
            battr.meta = {BLOCK: row.meta[BLOCK]} if BLOCK in row.meta else {}
        else:
            battr = row.args[2]                       # the bias read, kept (replicated)
            row.args = row.args[:2]
        with graph.inserting_after(out if lin.module is None else battr):
            added = graph.call_function(operator.add, (out, battr))
        added.meta = dict(out.meta)
        out = added
    for u in users:
        u.replace_input_with(row, out)


def tp_rewrite(gm: fx.GraphModule, shares: tuple[int, ...], rank_index: int, *,
               all_reduce: AllReduce | None = None, granularity: int = 8,
               pairs: list[TPPair] | None = None, keep_whole: frozenset = frozenset()) -> fx.GraphModule:
    """The module that member ``rank_index`` of a tensor-parallel group with ``shares`` runs.

    A new GraphModule: sharded Linears are new modules holding slices (copies) of the weights; every
    other module and parameter is shared with ``gm`` (replicated). f / g sum over the group with
    ``all_reduce`` (None: no communication until ``bind_all_reduce`` binds one).
    ``result.meta["autopar.tp"]`` is the ``TPLayout``. ``gm`` is left unchanged. ``keep_whole``: names
    of parameters no LM head or token embedding may shard (tied to a copy in another stage).
    """
    shares = tuple(int(s) for s in shares)
    if not 0 <= rank_index < len(shares):
        raise TPRewriteError(f"rank_index: {rank_index} is not a member of a group of {len(shares)}")
    if pairs is None:
        pairs = find_tp_pairs(gm) if len(shares) > 1 else []
    graph = copy.deepcopy(gm.graph)
    new = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    new.meta.update(getattr(gm, "meta", {}))
    nodes = {n.name: n for n in graph.nodes}
    orig = {n.name: n for n in gm.graph.nodes}
    kept, shards, all_ranges = [], [], []
    for k, pair in enumerate(pairs):
        ranges = _pair_units(pair, shares, granularity)
        if any(b == a for a, b in ranges):
            continue  # a member would own nothing: keep the pair replicated
        kept.append(pair)
        all_ranges.append(ranges)
        _rewrite_pair(new, gm, nodes, orig, k, pair, ranges, rank_index, all_reduce, shards)
    heads = _shard_heads(new, gm, find_tp_heads(gm, pairs, keep_whole) if len(shares) > 1 else (), shares,
                         rank_index, granularity, all_reduce, shards)
    embeddings = _shard_embeddings(new, gm, find_tp_embeddings(gm, keep_whole) if len(shares) > 1 else (), shares,
                                   rank_index, granularity, all_reduce, shards)
    graph.lint()
    new.recompile()
    _drop_unread_attrs(new, gm)
    new.meta[TP_META_KEY] = TPLayout(shares=shares, rank_index=rank_index, pairs=tuple(kept),
                                     params=tuple(shards), unit_ranges=tuple(all_ranges), heads=heads,
                                     embeddings=embeddings)
    return new


def _rows_of(new: fx.GraphModule, gm: fx.GraphModule, names: tuple[str, ...], rows, shares: tuple[int, ...],
             granularity: int):
    """``(k, node of new, node of gm, row ranges per member)`` of each named vocabulary end whose
    ``rows(node of gm)`` every member gets some of (else it stays whole)."""
    nodes = {n.name: n for n in new.graph.nodes}
    orig = {n.name: n for n in gm.graph.nodes}
    for k, name in enumerate(names):
        ranges = unit_ranges(rows(orig[name]), shares, granularity)
        if all(b > a for a, b in ranges):
            yield k, nodes[name], orig[name], ranges


def _f_before(new: fx.GraphModule, x: fx.Node, first: fx.Node, target: str, all_reduce: AllReduce | None) -> fx.Node:
    """f (``CopyToGroup`` at ``target``) on ``x``, put right before ``first`` and in its block; the
    caller points the Linears that read ``x`` at it."""
    new.add_submodule(target, CopyToGroup(all_reduce))
    with new.graph.inserting_before(first):
        f = new.graph.call_module(target, (x,))
    f.meta = {key: v for key, v in x.meta.items() if key != COST}
    if BLOCK in first.meta:
        f.meta[BLOCK] = first.meta[BLOCK]
    return f


def _call_after(new: fx.GraphModule, node: fx.Node, target: str, module: nn.Module) -> fx.Node:
    """``module`` (added to ``new`` at ``target``) called on ``node``'s output right after it, in place
    of that output for every user of ``node``; the call keeps ``node``'s annotations but its cost."""
    users = list(node.users)
    new.add_submodule(target, module)
    with new.graph.inserting_after(node):
        out = new.graph.call_module(target, (node,))
    out.meta = {key: v for key, v in node.meta.items() if key != COST}
    for u in users:
        u.replace_input_with(node, out)
    return out


def _shard_embeddings(new: fx.GraphModule, gm: fx.GraphModule, names: tuple[str, ...], shares: tuple[int, ...],
                      rank_index: int, granularity: int, all_reduce: AllReduce | None,
                      shards: list) -> tuple[str, ...]:
    """Shard each token embedding of ``new`` (``passes.tp_head``): a ``ShardedEmbedding`` of its rows,
    g after it; appends the ``ParamShard``s to ``shards``; the embeddings sharded."""
    graph = new.graph
    done = []
    for k, node, source, ranges in _rows_of(new, gm, names, lambda n: embedding_use(gm, n).num_embeddings,
                                            shares, granularity):
        use = embedding_use(gm, source)
        a, b = ranges[rank_index]
        w = gm.get_parameter(use.weight)
        mod = ShardedEmbedding(w[a:b], a, use.padding_idx)
        if use.module is not None:
            _set_module(new, use.module, mod)
            call, local = node, f"{use.module}.weight"
        else:
            new.add_submodule(f"_tpe{k}", mod)
            with graph.inserting_before(node):
                call = graph.call_module(f"_tpe{k}", (node.args[1],))
            call.meta = {key: v for key, v in node.meta.items() if key != COST}
            read = node.args[0]
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            if not read.users:
                graph.erase_node(read)
            local = f"_tpe{k}.weight"
        shards.append(ParamShard(local, use.weight, tuple(w.shape), 0, tuple(((x, y),) for x, y in ranges)))
        _call_after(new, call, f"_tpe_g{k}", ReduceFromGroup(all_reduce))
        done.append(source.name)
    return tuple(done)


def _shard_heads(new: fx.GraphModule, gm: fx.GraphModule, heads: tuple[str, ...], shares: tuple[int, ...],
                 rank_index: int, granularity: int, all_reduce: AllReduce | None,
                 shards: list) -> tuple[str, ...]:
    """Shard each head of ``new`` (``passes.tp_head``): its rows of the weight and bias, f on its input,
    the gather after it; appends the ``ParamShard``s to ``shards``; the heads sharded."""
    done = []
    for k, node, source, ranges in _rows_of(new, gm, heads, lambda n: linear_use(gm, n).out_features,
                                            shares, granularity):
        lin = linear_use(gm, source)
        runs = tuple(((a, b),) for a, b in ranges)
        a, b = ranges[rank_index]
        w = attr_value(gm, lin.weight)
        bias = attr_value(gm, lin.bias) if lin.bias else None
        names = _install_linear(new, node, lin, f"_tph{k}", w.detach()[a:b],
                                bias.detach()[a:b] if bias is not None else None, like=w)
        shards.append(ParamShard(names[0], lin.weight, tuple(w.shape), 0, runs))
        if bias is not None:
            shards.append(ParamShard(names[1], lin.bias, tuple(bias.shape), 0, runs))
        x = node.args[0]
        node.replace_input_with(x, _f_before(new, x, node, f"_tph_f{k}", all_reduce))
        _call_after(new, node, f"_tph_gather{k}", GatherFromGroup(tuple(b - a for a, b in ranges), rank_index))
        done.append(source.name)
    return tuple(done)
