"""Sequence parallelism (Megatron-SP) on top of the tensor-parallel rewrite (``passes.tp``).

Without it, every rank of a tensor-parallel group computes the ops outside the column/row pairs in
full: the norms, residual adds and the row biases of every block. With it, those *token-wise* ops run
on a slice of the sequence on each rank, and the pairs' collectives change shape (same bytes):

- g (the row's all-reduce) becomes a reduce-scatter along the sequence (backward: all-gather);
- f (the columns' identity) becomes an all-gather along the sequence (backward: reduce-scatter);
- a full tensor entering the sequence-sharded region (the embedding's output, a residual from a block
  without SP) is *scattered*: each rank takes its slice (backward: all-gather of the gradient);
- a sequence-sharded tensor leaving it for anything not token-wise (the head, the loss, a
  ``cumsum``, the stage's output) is *gathered* (backward: each rank keeps its slice of the gradient,
  which the replicated code downstream computed identically on every rank);
- a replicated tensor the region reads broadcast along the sequence (a norm's weight, a row's bias)
  gets a *partial* gradient on each rank (its tokens only): ``SumGradOverGroup`` sums that gradient
  over the group in backward (once per micro-step, inside autograd), so engines need no extra
  reduction and every rank holds the full gradient of the replicated parameters, as without SP;
- a probe of the sequence size (``x.size(1)`` feeding the attention's views) reads the full length.

Terms
- sequence dim: dim 1 of the residual stream ``[batch, seq, features]`` (3-D tensors only).
- shard: member i of a group with ``shares`` owns the tokens ``unit_ranges(S, shares)[i]`` of a
  sequence of length S (largest remainder, as heads are split), so devices of different speeds hold
  tokens in proportion to their heads. Collectives need equal sizes: each shard is padded to the
  largest and cut after the all-gather / reduce-scatter.
- token-wise op: elementwise unary / binary ops (broadcast operands must not vary along the
  sequence, or are scattered), ``mean`` / ``sum`` / ``amax`` over the last dim, LayerNorm / RMSNorm
  over the last dim (modules, ``F.layer_norm`` / ``F.rms_norm``, ATen), dropout with ``p == 0``,
  dtype casts. Anything else is not, and the tensor it reads is gathered first.
- SP block: a block (``passes.blocks``) with at least one TP pair in which no op between the pairs
  needs a gathered sequence (``sp_block_analysis``). In other blocks nothing changes (never an error);
  their borders with SP blocks scatter / gather.

``sp_block_analysis`` / ``sp_supported_blocks`` are pure (the planner's view, on a captured graph
with shapes and blocks); ``sp_rewrite`` applies SP to a ``tp_rewrite`` result for one member, and
``bind_sp_collectives`` binds the modules' collectives (the runtime does, per process group).
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autopar.passes.meta import BLOCK, COST
from autopar.passes.tp import CopyToGroup, ReduceFromGroup
from autopar.passes.tp_sp_comm import (
    SEQ_DIM, SeqContext, SeqGather, SeqGatherToGroup, SeqLength, SeqReduceScatter, SeqScatter, SumGradOverGroup,
    bind_sp_collectives, seq_ranges,
)
from autopar.passes.tp_match import attr_value, find_tp_pairs, node_shape

__all__ = ["SPAnalysis", "SPLayout", "SP_META_KEY", "SEQ_DIM", "sp_block_analysis", "sp_supported_blocks",
           "sp_rewrite", "bind_sp_collectives", "seq_ranges", "SeqContext", "SeqScatter", "SeqGather",
           "SeqGatherToGroup", "SeqReduceScatter", "SumGradOverGroup", "SeqLength"]

SP_META_KEY = "autopar.tp_sp"   # gm.meta key of the SPLayout of an sp_rewrite result


# --------------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True, slots=True)
class SPAnalysis:
    """Per block (index = block): whether SP applies (``supported``), and the share of the block's
    forward FLOPs (``replicated_flop_share``) and activation bytes (``replicated_act_share``, the
    memory-bound norms and adds) that every rank of a TP group still computes in full with SP on (what
    neither the pairs nor the sequence-sharded region cover: e.g. the first norm of the first layer,
    which reads the embedding before any reduce-scatter). Without SP that share is every non-pair op;
    a block without pairs has share 1 (0 FLOPs: share 0). ``replicated_flop_share_no_sp`` gives the
    same figure without SP, for comparison."""
    supported: np.ndarray                    # bool, one per block
    replicated_flop_share: np.ndarray        # float in [0, 1]
    replicated_act_share: np.ndarray
    replicated_flop_share_no_sp: np.ndarray


@dataclass(frozen=True, slots=True)
class SPLayout:
    """What ``sp_rewrite`` did to one member's module (``gm.meta[SP_META_KEY]``)."""
    shares: tuple[int, ...]
    rank_index: int
    blocks: tuple[int, ...]                  # the blocks that run sequence-parallel
    sharded_nodes: tuple[str, ...]           # nodes computing on the local sequence shard
    summed_inputs: tuple[str, ...]           # replicated tensors whose gradient is summed over the group
    # parameters (qualified names) whose partial gradients the engine sums over the group once per step
    # (``sp_rewrite(defer_param_grads=True)``); the others are summed inside backward
    deferred_params: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------------
# Token-wise ops

_UNARY_MODULES = (nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.Mish, nn.LeakyReLU, nn.ELU)
_UNARY_FUNCS = {F.gelu, F.silu, F.relu, F.mish, F.leaky_relu, F.elu, torch.tanh, torch.sigmoid, torch.exp,
                torch.relu, operator.neg, torch.neg, torch.square, torch.rsqrt, torch.sqrt, torch.abs}
_UNARY_METHODS = {"contiguous", "float", "half", "bfloat16", "double", "to", "type_as", "clone", "neg", "exp",
                  "tanh", "sigmoid", "relu", "sqrt", "rsqrt", "square", "type", "abs"}
_BINARY_FUNCS = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul,
                 torch.div, torch.where, torch.masked_fill, operator.pow, torch.pow}
_BINARY_METHODS = {"add", "sub", "mul", "div", "masked_fill", "pow", "__add__", "__mul__", "__radd__",
                   "__rmul__"}
_REDUCE_FUNCS = {torch.mean, torch.sum, torch.amax}
_REDUCE_METHODS = {"mean", "sum", "amax"}
_ATEN = {
    **dict.fromkeys(("gelu", "silu", "relu", "tanh", "sigmoid", "exp", "neg", "contiguous", "clone", "_to_copy",
                     "to", "alias", "type_as", "rsqrt", "sqrt", "square", "abs"), "unary"),
    **dict.fromkeys(("add", "sub", "mul", "div", "masked_fill", "where", "pow"), "binary"),
    **dict.fromkeys(("mean", "sum", "amax"), "reduce"),
    "layer_norm": "layer_norm", "native_layer_norm": None, "rms_norm": "rms_norm", "dropout": "dropout",
}
_PROBE_ATTRS = {"dtype", "device", "ndim", "is_cuda", "requires_grad"}


def _shape(node: Any, gm: fx.GraphModule | None = None) -> tuple[int, ...] | None:
    """The recorded output shape of a node (a ``get_attr``: its tensor's), None if not a tensor."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr" and gm is not None:
        try:
            t = attr_value(gm, node.target)
        except AttributeError:
            t = None
        return tuple(t.shape) if isinstance(t, torch.Tensor) else None
    return node_shape(node)


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _kind(gm: fx.GraphModule, n: fx.Node) -> str | None:
    """"unary" | "binary" | "reduce" | "layer_norm" | "rms_norm" | "dropout" | "norm_module" | "probe"
    | "size" | None (not token-wise)."""
    t = n.target
    if n.op == "call_method":
        if t == "size":
            return "size"
        if t == "dim":
            return "probe"
        if t in _UNARY_METHODS:
            return "unary"
        if t in _BINARY_METHODS:
            return "binary"
        return "reduce" if t in _REDUCE_METHODS else None
    if n.op == "call_module":
        mod = gm.get_submodule(t)
        if isinstance(mod, _UNARY_MODULES):
            return "unary"
        if isinstance(mod, nn.Dropout):
            return "unary" if mod.p == 0 else None
        if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) and len(mod.normalized_shape) == 1 and not n.kwargs:
            return "norm_module"
        return None
    if n.op != "call_function":
        return None
    if t is getattr:
        return "probe" if len(n.args) == 2 and n.args[1] in _PROBE_ATTRS else None
    if isinstance(t, torch._ops.OpOverload):
        if t.namespace != "aten":
            return None
        name = t.__name__.split(".")[0]
        if name == "sym_size":
            return "size"
        if name == "_assert_tensor_metadata":   # torch.export's dtype / device checks
            return "probe" if n.kwargs.get("size") is None and n.kwargs.get("stride") is None else None
        return _ATEN.get(name)
    try:
        if t in _UNARY_FUNCS:
            return "unary"
        if t in _BINARY_FUNCS:
            return "binary"
        if t in _REDUCE_FUNCS:
            return "reduce"
        if t is F.layer_norm:
            return "layer_norm"
        if t is getattr(F, "rms_norm", None):
            return "rms_norm"
        if t is F.dropout:
            return "dropout"
    except TypeError:
        return None
    return None


def _side_dim(side_shape: tuple[int, ...], out_ndim: int, dim: int) -> int | None:
    """The dim of a broadcast operand aligned with output dim ``dim`` (None: the operand lacks it)."""
    k = dim - (out_ndim - len(side_shape))
    return k if k >= 0 else None


def _token_wise(gm: fx.GraphModule, n: fx.Node, sp: dict[fx.Node, int], kind: str | None,
                seq: int) -> tuple[int, list[fx.Node], list[fx.Node]] | None:
    """If ``n`` (reading at least one shard) is token-wise: (its output's sequence dim, the full operands
    to scatter, the broadcast operands whose gradient must be summed); else None."""
    out = _shape(n)
    if kind is None or out is None or len(out) < 2:
        return None
    tensors = [a for a in n.all_input_nodes if a in sp or _shape(a, gm) is not None]
    first = n.args[0] if n.args else None
    if kind in ("unary", "dropout", "reduce", "layer_norm", "rms_norm", "norm_module"):
        if first not in sp:
            return None
        dim = sp[first]
        if kind == "dropout":
            p, training = _arg(n, 1, "p", 0.5), _arg(n, 2, "training", True)
            if not (p == 0 or training is False):
                return None
        if kind == "reduce":
            d = _arg(n, 1, "dim")
            ds = d if isinstance(d, (list, tuple)) else [d]
            nd = len(_shape(first))
            if d is None or any(not isinstance(x, int) or x % nd != nd - 1 for x in ds) or dim == nd - 1:
                return None
        if kind in ("layer_norm", "rms_norm"):
            shape = _arg(n, 1, "normalized_shape")
            if not isinstance(shape, (list, tuple)) or len(shape) != 1:
                return None
        if dim >= len(out):
            return None
        sides = [a for a in tensors if a is not first]
        if kind == "unary" and any(a in sp for a in sides) and n.target not in ("type_as",):
            return None
        summed = [a for a in sides if a not in sp]
        if any((s := _shape(a, gm)) is not None and len(s) > 1 for a in summed):
            return None   # a norm's weight is 1-D; anything else reading more is not recognised
        return dim, [], summed
    if kind == "binary":
        dims = {len(out) - len(_shape(a, gm) or out) + sp[a] for a in tensors if a in sp}
        if len(dims) != 1:
            return None
        dim = dims.pop()
        scatter, summed = [], []
        for a in tensors:
            if a in sp:
                continue
            s = _shape(a, gm)
            k = _side_dim(s, len(out), dim) if s is not None else None
            if k is None or s[k] == 1:
                summed.append(a)
            elif s[k] == seq and len(s) == len(out):
                scatter.append(a)
            else:
                return None
        return dim, scatter, summed
    return None


# --------------------------------------------------------------------------------------------------
# Propagation (shared by the analysis and the rewrite)


@dataclass
class _Flow:
    sp: dict[fx.Node, int]                 # node -> sequence dim of its (local) output
    scatter: dict[fx.Node, set[fx.Node]]   # full tensor -> SP users reading it scattered
    summed: dict[fx.Node, set[fx.Node]]    # broadcast tensor -> SP users (gradient summed)
    to_f: set[fx.Node]                     # f positions (columns' input) fed by a shard
    lengths: dict[fx.Node, fx.Node]        # size(seq) probes of a shard
    leaks: dict[fx.Node, set[fx.Node]]     # shard -> users needing the gathered tensor
    leak_blocks: set[int]
    entries: set[fx.Node]                  # full tensors whose token-wise users read them scattered


def _flow(gm: fx.GraphModule, seeds: set[fx.Node], f_users: Callable[[fx.Node], bool], excluded: set[fx.Node],
          allowed: Callable[[fx.Node], bool], min_seq: int) -> _Flow:
    """Propagate "sharded along the sequence" from the ``seeds`` (row outputs) through token-wise ops.
    A full tensor that the region reads (the embedding's output, a stage's input) then becomes an
    entry: scattered once, its token-wise users in allowed blocks run on the shard too (the first norm
    of a stage, as Megatron scatters the embedding), while its other users keep the full tensor."""
    entries: set[fx.Node] = set()
    for _ in range(4):
        fl = _flow_once(gm, seeds, entries, f_users, excluded, allowed, min_seq)
        more = {a for a in fl.scatter if a not in entries}
        if not more:
            return fl
        entries |= more
    return fl


def _flow_once(gm: fx.GraphModule, seeds: set[fx.Node], entries: set[fx.Node], f_users: Callable[[fx.Node], bool],
               excluded: set[fx.Node], allowed: Callable[[fx.Node], bool], min_seq: int) -> _Flow:
    fl = _Flow({}, {}, {}, set(), {}, {}, set(), set())
    for n in gm.graph.nodes:
        if n in entries:
            fl.sp[n] = SEQ_DIM
            fl.entries.add(n)
            continue
        if n in seeds:
            s = _shape(n)
            if s is not None and len(s) == 3 and s[SEQ_DIM] >= max(2, min_seq) and allowed(n):
                fl.sp[n] = SEQ_DIM
            continue
        if n in excluded or n.op in ("output", "placeholder", "get_attr") or not allowed(n):
            continue
        if not any(a in fl.sp for a in n.all_input_nodes):
            continue
        first = next(a for a in n.all_input_nodes if a in fl.sp)
        seq = _shape(first)[fl.sp[first]] if _shape(first) is not None else -1
        got = _token_wise(gm, n, fl.sp, _kind(gm, n), seq)
        if got is None:
            continue
        dim, scatter, summed = got
        fl.sp[n] = dim
        for a in scatter:
            fl.scatter.setdefault(a, set()).add(n)
        for a in summed:
            fl.summed.setdefault(a, set()).add(n)
    for x, dim in fl.sp.items():
        if x in fl.entries:
            continue        # full: its other users read it as they did
        for u in x.users:
            if u in fl.sp and u not in fl.entries:     # an entry computes in full: it reads the gathered x
                continue
            kind = _kind(gm, u) if u.op != "output" else None
            if f_users(u):
                fl.to_f.add(u)
            elif kind == "probe":
                continue
            elif kind == "size" and _arg(u, 1, "dim") is not None and isinstance(_arg(u, 1, "dim"), int) \
                    and _arg(u, 1, "dim") % len(_shape(x)) != dim:
                continue
            elif kind == "size" and isinstance(_arg(u, 1, "dim"), int):
                fl.lengths[u] = x
            else:
                fl.leaks.setdefault(x, set()).add(u)
                if BLOCK in u.meta:
                    fl.leak_blocks.add(int(u.meta[BLOCK]))
    return fl


def _block_of(n: fx.Node) -> int | None:
    b = n.meta.get(BLOCK)
    return int(b) if b is not None else None


_ANALYSED: "weakref.WeakKeyDictionary[fx.GraphModule, tuple]" = weakref.WeakKeyDictionary()


def sp_block_analysis(gm: fx.GraphModule, num_blocks: int) -> SPAnalysis:
    """Which blocks of a captured graph (shapes from ``passes.analysis``, blocks from ``passes.blocks``)
    can run sequence-parallel under tensor parallelism, and what each keeps replicated (``SPAnalysis``).
    Pure; the answer is kept with ``gm`` while its graph has the same nodes."""
    key = (id(gm.graph), len(gm.graph.nodes), num_blocks)
    got = _ANALYSED.get(gm)
    if got is not None and got[0] == key:
        return got[1]
    pairs = find_tp_pairs(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    rows = {nodes[p.row_node] for p in pairs}
    columns = {nodes[c] for p in pairs for c in p.column_nodes}
    inside = {nodes[r] for p in pairs for r in p.region} | rows | columns
    pair_blocks = {_block_of(r) for r in rows} - {None}
    fl = _flow(gm, rows, lambda u: u in columns, inside, lambda n: True, 2)
    supported = np.zeros(num_blocks, dtype=bool)
    for b in pair_blocks:
        if 0 <= b < num_blocks and b not in fl.leak_blocks:
            supported[b] = True
    # the shares, with only the supported blocks sequence-parallel (as the rewrite does)
    fl = _flow(gm, rows, lambda u: u in columns, inside, lambda n: _in(supported, _block_of(n)), 2)
    flops, acts = np.zeros(num_blocks), np.zeros(num_blocks)
    rep_sp, rep_act, rep_tp = np.zeros(num_blocks), np.zeros(num_blocks), np.zeros(num_blocks)
    for n in gm.graph.nodes:
        b, cost = _block_of(n), n.meta.get(COST)
        if b is None or cost is None or not 0 <= b < num_blocks:
            continue
        fl_n = float(cost.fwd_flops)
        act = float(cost.act_bytes)
        flops[b] += fl_n
        acts[b] += act
        if n in inside:
            continue
        rep_tp[b] += fl_n
        if n not in fl.sp or n in fl.entries:
            rep_sp[b] += fl_n
            rep_act[b] += act
    out = SPAnalysis(supported=supported, replicated_flop_share=_share(rep_sp, flops),
                     replicated_act_share=_share(rep_act, acts), replicated_flop_share_no_sp=_share(rep_tp, flops))
    _ANALYSED[gm] = (key, out)
    return out


def _in(mask: np.ndarray, b: int | None) -> bool:
    return b is not None and 0 <= b < len(mask) and bool(mask[b])


def _share(part: np.ndarray, total: np.ndarray) -> np.ndarray:
    return np.divide(part, total, out=np.zeros_like(part), where=total > 0)


def sp_supported_blocks(gm: fx.GraphModule, num_blocks: int) -> np.ndarray:
    """Bool per block: True where the block has a TP pair and its token-wise ops between pairs can run
    on a sequence shard (``sp_block_analysis(gm, num_blocks).supported``)."""
    return sp_block_analysis(gm, num_blocks).supported.copy()


# --------------------------------------------------------------------------------------------------
# The rewrite


def _seq_len(local: fx.GraphModule, x: fx.Node, dim: int = SEQ_DIM) -> int:
    """The stream of ``x``: its full length along ``dim`` in the analysed graph (0 where unknown)."""
    shape = _shape(x, local)
    return int(shape[dim]) if shape is not None and len(shape) > dim else 0


class _Inserter:
    """Adds numbered SP modules to ``local`` and calls them after a node (``_sp_<kind><n>``)."""

    def __init__(self, local: fx.GraphModule):
        self.local, self.count = local, 0

    def name(self) -> str:
        self.count += 1
        return str(self.count - 1)

    def __call__(self, kind: str, module: nn.Module, arg: fx.Node, after: fx.Node, meta_from: fx.Node) -> fx.Node:
        name = f"_sp_{kind}{self.name()}"
        self.local.add_submodule(name, module)
        with self.local.graph.inserting_after(after):
            node = self.local.graph.call_module(name, (arg,))
        node.meta = {k: v for k, v in meta_from.meta.items() if k != COST}
        return node


def _rewrite_flow(local: fx.GraphModule, fl, ctx: SeqContext, gs: set) -> list[str]:
    """Rewrite ``local`` along the sequence-parallel flow ``fl``: g -> reduce-scatter, f -> all-gather,
    scatters where the region is entered, gradient sums, length probes, gathers where a value leaks,
    norm modules made functional. Returns the names whose gradients are summed over the group."""
    graph = local.graph
    add = _Inserter(local)
    for g in gs & set(fl.sp):     # g -> reduce-scatter
        local.add_submodule(g.target, SeqReduceScatter(ctx, SEQ_DIM, _seq_len(local, g)))
    for f in fl.to_f:              # f -> all-gather to the group
        local.add_submodule(f.target, SeqGatherToGroup(ctx, SEQ_DIM, _seq_len(local, f.args[0])))
    scattered = {a: {u for u in a.users if u in fl.sp} for a in fl.entries}
    for a, users in fl.scatter.items():
        scattered.setdefault(a, set()).update(users)
    for a, users in scattered.items():
        if not users:
            continue
        s = add("scatter", SeqScatter(ctx, SEQ_DIM, _seq_len(local, a)), a, a, a)
        for u in users:
            u.replace_input_with(a, s)
    summed_names = []
    for a, users in fl.summed.items():
        s = add("sum", SumGradOverGroup(ctx), a, a, a)
        summed_names.append(a.name)
        for u in users:
            u.replace_input_with(a, s)
    for probe, x in fl.lengths.items():
        with graph.inserting_before(probe):
            name = f"_sp_len{add.name()}"
            local.add_submodule(name, SeqLength(ctx, fl.sp[x], _seq_len(local, x, fl.sp[x])))
            node = graph.call_module(name, (x,))
        probe.replace_all_uses_with(node)
        graph.erase_node(probe)
    for x, users in fl.leaks.items():
        gnode = add("gather", SeqGather(ctx, fl.sp[x], _seq_len(local, x, fl.sp[x])), x, x, x)
        for u in users:
            u.replace_input_with(x, gnode)
    for n in list(fl.sp):          # norm modules -> functional, so their weights' gradients are summed
        if n.op == "call_module" and _kind(local, n) == "norm_module":
            summed_names += _functional_norm(local, n, ctx, add)
    return summed_names


def sp_rewrite(local: fx.GraphModule, shares: tuple[int, ...], rank_index: int,
               supported: np.ndarray | None = None, *, defer_param_grads: bool = False) -> fx.GraphModule:
    """Sequence parallelism on a ``passes.tp.tp_rewrite`` result ``local`` (member ``rank_index`` of
    a group with ``shares``), in place; returns it. ``supported``: the SP blocks (default: the
    analysis of ``local`` itself). Blocks without SP, a group of one and sequences shorter than the
    group are left as they are (never an error). ``local.meta[SP_META_KEY]`` is the ``SPLayout``;
    the SP modules communicate once ``bind_sp_collectives`` binds them. ``defer_param_grads``: a
    parameter that only the sequence-sharded region reads keeps its partial gradient through backward
    (``SPLayout.deferred_params``), for an engine that sums them over the group once per step (one
    all-reduce instead of one per parameter and micro-step)."""
    shares = tuple(int(s) for s in shares)
    graph = local.graph
    fs = {n for n in graph.nodes if n.op == "call_module" and isinstance(local.get_submodule(n.target), CopyToGroup)}
    gs = {n for n in graph.nodes
          if n.op == "call_module" and isinstance(local.get_submodule(n.target), ReduceFromGroup)}
    if len(shares) < 2 or not gs:
        local.meta[SP_META_KEY] = SPLayout(shares, rank_index, (), (), ())
        return local
    layout = local.meta.get("autopar.tp")
    nodes = {n.name: n for n in graph.nodes}
    inside = set(fs) | set(gs)
    for p in getattr(layout, "pairs", ()):
        inside |= {nodes[r] for r in (*p.region, *p.column_nodes, p.row_node) if r in nodes}
    if supported is None:
        fl = _flow(local, gs, lambda u: u in fs, inside, lambda n: True, len(shares))
        blocks = {_block_of(g) for g in gs} - {None} - fl.leak_blocks
        nb = max(blocks, default=-1) + 1
        supported = np.array([b in blocks for b in range(nb)], dtype=bool)
    fl = _flow(local, gs, lambda u: u in fs, inside, lambda n: _in(supported, _block_of(n)), len(shares))
    if not fl.sp:
        local.meta[SP_META_KEY] = SPLayout(shares, rank_index, (), (), ())
        return local
    ctx = SeqContext(shares, rank_index)
    summed_names = _rewrite_flow(local, fl, ctx, gs)
    deferred = _defer(local) if defer_param_grads else ()
    graph.lint()
    local.recompile()
    local.meta[SP_META_KEY] = SPLayout(
        shares, rank_index, tuple(int(b) for b in np.flatnonzero(supported)),
        tuple(n.name for n in fl.sp if n not in fl.entries), tuple(summed_names), deferred)
    return local


def _defer(local: fx.GraphModule) -> tuple[str, ...]:
    """Mark deferred the ``SumGradOverGroup`` modules on parameters that nothing else reads (every read
    of the parameter is a ``get_attr`` whose users are all such modules; no module call uses it)."""
    reads: dict[int, list[fx.Node]] = {}
    names: dict[int, str] = {}
    for n in local.graph.nodes:
        if n.op == "call_module":
            for p in local.get_submodule(n.target).parameters():
                reads.setdefault(id(p), []).append(n)
        elif n.op == "get_attr":
            t = attr_value(local, n.target)
            if isinstance(t, nn.Parameter):
                reads.setdefault(id(t), []).append(n)
                names.setdefault(id(t), str(n.target))

    def wrapper(u: fx.Node) -> bool:
        return u.op == "call_module" and isinstance(local.get_submodule(u.target), SumGradOverGroup)

    out = []
    for key, nodes in reads.items():
        if key not in names or not all(n.op == "get_attr" and n.users and all(wrapper(u) for u in n.users)
                                       for n in nodes):
            continue
        for n in nodes:
            for u in n.users:
                local.get_submodule(u.target).deferred = True
        out.append(names[key])
    return tuple(out)


def _functional_norm(local: fx.GraphModule, n: fx.Node, ctx: SeqContext, add) -> list[str]:
    """Replace a LayerNorm / RMSNorm module call on a shard by ``F.layer_norm`` / ``F.rms_norm`` whose
    affine parameters pass through ``SumGradOverGroup``."""
    mod = local.get_submodule(n.target)
    graph = local.graph
    names, reads = [], []
    for attr in ("weight", "bias"):
        p = getattr(mod, attr, None)
        if p is None:
            reads.append(None)
            continue
        with graph.inserting_before(n):
            read = graph.get_attr(f"{n.target}.{attr}")
        read.meta = {BLOCK: n.meta[BLOCK]} if BLOCK in n.meta else {}
        reads.append(add("sum", SumGradOverGroup(ctx), read, read, read))
        names.append(read.name)
    x = n.args[0]
    shape = tuple(mod.normalized_shape)
    with graph.inserting_before(n):
        if isinstance(mod, nn.LayerNorm):
            new = graph.call_function(F.layer_norm, (x, shape, reads[0], reads[1], mod.eps))
        else:
            new = graph.call_function(F.rms_norm, (x, shape, reads[0], mod.eps))
    new.meta = dict(n.meta)
    n.replace_all_uses_with(new)
    graph.erase_node(n)
    return names

